// Row sums of the rollout mismatch statistics on CPUs: one pass over a [rows, width]
// batch of float32 or bfloat16 log-probabilities, every row's sums kept in registers.
//
// The element-wise arithmetic is that of `row_sums` in rows.py, in float32; every sum
// is a float64 sum of float32 values, every moment product a float64 product. The output
// holds one row of `kSlots` doubles per batch row, named by `kColumns` (`ROW_FIELDS` in
// rows.py). Built with the package (setup.py), once per vector width; no other dependency.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <algorithm>
#include <memory>
#include <new>
#include <thread>
#include <utility>
#include <vector>

// Tokens per step: one float32 vector as wide as the CPU's (512, 256 or 128 bits). GCC
// does the comparisons and selects of a vector wider than the hardware's one lane at a
// time, which made the whole pass 7x slower with AVX2. The package is built once per
// width (ROLLOUT_LANES 16, 8 and 4, setup.py), and `rollout_cpu_lanes` tells which of
// them the CPU runs.
#if !defined(ROLLOUT_LANES)
#if defined(__AVX512F__)
#define ROLLOUT_LANES 16
#elif defined(__AVX2__)
#define ROLLOUT_LANES 8
#else
#define ROLLOUT_LANES 4
#endif
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace {

// The columns of the output, each with the accumulator it comes from: the loader reads
// the names (`rollout_row_column`) and checks them against `ROW_FIELDS` in rows.py.
#define ROLLOUT_ROW_COLUMNS(X)                                                           \
  X("count", count) X("nonfinite", nonfinite) X("max_actor_log_prob", max_a)            \
  X("max_rollout_log_prob", max_b) X("sum_actor_log_prob", sum_a)                         \
  X("sum_rollout_log_prob", sum_b) X("prob_actor", pa) X("prob_rollout", pb)              \
  X("prob_diff", diff) X("prob_actor*prob_actor", pa2) X("prob_rollout*prob_rollout", pb2) \
  X("prob_actor*prob_rollout", papb) X("prob_diff*prob_diff", diff2)                      \
  X("max_prob_diff", max_diff) X("max_log_ratio", max_r) X("max_neg_log_ratio", max_neg_r) \
  X("log_diff", abs_r) X("log_diff*log_diff", r2) X("log_ratio", r) X("kl_k3", k3)         \
  X("mult_error_m1", mult) X("ratio_m1", rm1) X("ratio_sq_m1", rsqm1) X("ratio", ratio)    \
  X("ratio_sq", ratio2) X("ratio_high", high) X("ratio_low", low)                         \
  X("zero_rollout_log_prob", zero_b) X("zero_rollout_log_prob_run", zero_run)            \
  X("masked_actor_log_prob", masked_actor) X("neighbour_pairs", pairs)                     \
  X("sum_actor_log_prob_sq", aa) X("sum_rollout_log_prob_sq", bb)                         \
  X("sum_actor_x_rollout", ab) X("sum_actor_x_next_rollout", ab_next)                     \
  X("sum_next_actor_x_rollout", ab_prev) X("plus_actor", plus_a)                          \
  X("plus_actor_sq", plus_a2) X("plus_rollout", plus_b) X("plus_rollout_sq", plus_b2)       \
  X("minus_actor", minus_a) X("minus_actor_sq", minus_a2) X("minus_rollout", minus_b)       \
  X("minus_rollout_sq", minus_b2)

#define ROLLOUT_ROW_NAME(name, member) name,
constexpr const char* kColumns[] = {ROLLOUT_ROW_COLUMNS(ROLLOUT_ROW_NAME)};
#undef ROLLOUT_ROW_NAME
constexpr int kSlots = sizeof kColumns / sizeof kColumns[0];
#define ROLLOUT_COLUMN_ENUM(name, member) c_##member,
enum Column { ROLLOUT_ROW_COLUMNS(ROLLOUT_COLUMN_ENUM) };
#undef ROLLOUT_COLUMN_ENUM
constexpr int kLanes = ROLLOUT_LANES;
static_assert(kLanes == 4 || kLanes == 8 || kLanes == 16, "4, 8 or 16 lanes");
typedef float f32 __attribute__((vector_size(4 * kLanes)));
typedef int32_t i32 __attribute__((vector_size(4 * kLanes)));
typedef uint32_t u32 __attribute__((vector_size(4 * kLanes)));
typedef double f64 __attribute__((vector_size(4 * kLanes)));  // the lower or upper half

constexpr float kInf = INFINITY;
constexpr float kLogProbFloor = -20.0f;
constexpr float kRatioMin = 2.061153622438558e-09f;  // e^-20
constexpr float kRatioMax = 485165195.4097903f;      // e^20
constexpr float kLog2E = 1.4426950408889634f;
// A rollout log-prob of exactly 0 counts as padding where the trainer's is below this: no
// rounding turns a probability under e^-1 into 1.
constexpr float kPaddingActor = -1.0f;

template <typename T>
inline T splat(typename std::remove_reference<decltype(T{}[0])>::type value) {
  return T{} + value;
}

// Shuffles by a map of lane numbers: `Map::at(i)` for the i-th lane of the result, where
// lanes 0 ... n - 1 are those of `x` and n ... 2 n - 1 those of `y`.
template <typename Map, int... I, typename T>
inline auto shuffle(T x, T y, std::integer_sequence<int, I...>) {
  return __builtin_shufflevector(x, y, Map::at(I)...);
}

template <typename T>
constexpr int lanes_of = sizeof(T) / sizeof(T{}[0]);

// Lanes h n/2 ... (h + 1) n/2 - 1 of a vector of n lanes: its lower (h = 0) or upper half.
template <int kHalf, int kCount>
struct HalfMap {
  static constexpr int at(int i) { return kHalf * kCount / 2 + i; }
};

template <int kHalf, typename T>
inline auto half(T x) {
  constexpr int n = lanes_of<T>;
  return shuffle<HalfMap<kHalf, n>>(x, x, std::make_integer_sequence<int, n / 2>{});
}

// Lanes of x and y in turns: x_0 y_0 x_1 y_1 ... from the lower (h = 0) or upper half.
template <int kHalf, int kCount>
struct InterleaveMap {
  static constexpr int at(int i) { return kHalf * kCount / 2 + i / 2 + (i % 2) * kCount; }
};

template <int kHalf, typename T>
inline T interleave(T x, T y) {
  constexpr int n = lanes_of<T>;
  return shuffle<InterleaveMap<kHalf, n>>(x, y, std::make_integer_sequence<int, n>{});
}

// Calls f(std::integral_constant<int, lane>) for every lane, in order, unrolled.
template <typename F, int... I>
__attribute__((always_inline)) inline void for_each_lane(F&& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}

template <typename F>
__attribute__((always_inline)) inline void for_each_lane(F&& f) {
  for_each_lane(f, std::make_integer_sequence<int, kLanes>{});
}

template <int... I>
inline i32 lane_numbers(std::integer_sequence<int, I...>) {
  return i32{I...};
}

// 0, 1, ..., kLanes - 1.
inline i32 lane_numbers() { return lane_numbers(std::make_integer_sequence<int, kLanes>{}); }

inline f32 floats_of(const float* values) {
  f32 out;
  std::memcpy(&out, values, sizeof out);
  return out;
}

inline f32 floats_of(const uint16_t* bfloat16) {
  typedef uint16_t u16 __attribute__((vector_size(2 * kLanes)));
  u16 bits;
  std::memcpy(&bits, bfloat16, sizeof bits);
  return reinterpret_cast<f32>(__builtin_convertvector(bits, u32) << 16);
}

inline i32 nonzero(const uint8_t* values) {  // -1 where non-zero, 0 elsewhere
#if (defined(__AVX512F__) && ROLLOUT_LANES == 16) || (defined(__AVX2__) && ROLLOUT_LANES == 8)
  // GCC widens the flags one at a time: the bytes are compared, then widened at once.
#if ROLLOUT_LANES == 16
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(values));
  const __m128i zero = _mm_cmpeq_epi8(raw, _mm_setzero_si128());  // -1 where zero
  return ~reinterpret_cast<i32>(_mm512_cvtepi8_epi32(zero));
#else
  const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(values));  // 8 bytes
  const __m128i zero = _mm_cmpeq_epi8(raw, _mm_setzero_si128());
  return ~reinterpret_cast<i32>(_mm256_cvtepi8_epi32(zero));
#endif
#elif defined(__SSE4_1__) && ROLLOUT_LANES == 4
  int32_t word;
  std::memcpy(&word, values, sizeof word);
  const __m128i zero = _mm_cmpeq_epi8(_mm_cvtsi32_si128(word), _mm_setzero_si128());
  return ~reinterpret_cast<i32>(_mm_cvtepi8_epi32(zero));
#else
  typedef uint8_t u8 __attribute__((vector_size(kLanes)));
  u8 raw;
  std::memcpy(&raw, values, sizeof raw);
  return __builtin_convertvector(raw != 0, i32);
#endif
}

#if defined(__AVX512F__) && ROLLOUT_LANES == 16
// GCC widens 8 floats to 8 doubles in 128-bit pieces; one instruction does it.
inline f64 lower(f32 x) {
  return reinterpret_cast<f64>(_mm512_cvtps_pd(_mm512_castps512_ps256(reinterpret_cast<__m512>(x))));
}

inline f64 upper(f32 x) {
  const __m512d halves = _mm512_castps_pd(reinterpret_cast<__m512>(x));
  return reinterpret_cast<f64>(_mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(halves, 1))));
}
#elif defined(__AVX__) && ROLLOUT_LANES == 8
// GCC widens 4 floats to 4 doubles two at a time and joins the halves; one instruction
// does it.
inline f64 lower(f32 x) {
  return reinterpret_cast<f64>(_mm256_cvtps_pd(_mm256_castps256_ps128(reinterpret_cast<__m256>(x))));
}

inline f64 upper(f32 x) {
  return reinterpret_cast<f64>(_mm256_cvtps_pd(_mm256_extractf128_ps(reinterpret_cast<__m256>(x), 1)));
}
#elif defined(__SSE2__) && ROLLOUT_LANES == 4  // GCC widens 2 floats one at a time
inline f64 lower(f32 x) { return reinterpret_cast<f64>(_mm_cvtps_pd(reinterpret_cast<__m128>(x))); }

inline f64 upper(f32 x) {
  const __m128 floats = reinterpret_cast<__m128>(x);
  return reinterpret_cast<f64>(_mm_cvtps_pd(_mm_movehl_ps(floats, floats)));
}
#else
inline f64 lower(f32 x) { return __builtin_convertvector(half<0>(x), f64); }

inline f64 upper(f32 x) { return __builtin_convertvector(half<1>(x), f64); }
#endif

// A float64 sum over the lanes, kept in half as many float64 lanes: the two halves of a
// vector are added together first (a float64 sum in another order), so a running sum is
// one register, or one load and store where registers run out.
struct Sum {
  f64 value{};
  void add(f32 x) { value += lower(x) + upper(x); }
  // Products of float32 values are exact in float64.
  void add_product(f32 x, f32 y) { value += lower(x) * lower(y) + upper(x) * upper(y); }
  // So are their differences, at log-probs' magnitudes.
  void add_difference(f32 x, f32 y) { value += (lower(x) - lower(y)) + (upper(x) - upper(y)); }
  void merge(const Sum& other) { value += other.value; }
  double total() const {
    double out = 0;
    for (int k = 0; k < kLanes / 2; ++k) out += value[k];
    return out;
  }
};

struct Max {
  f32 value = splat<f32>(-kInf);
  void add(f32 x) { value = x > value ? x : value; }
  void merge(const Max& other) { add(other.value); }
  double total() const {
    float out = -kInf;
    for (int k = 0; k < kLanes; ++k) out = value[k] > out ? value[k] : out;
    return out;
  }
};

struct Count {
  i32 value{};
  void add(i32 flags) { value -= flags; }  // flags are -1 or 0
  void merge(const Count& other) { value += other.value; }
  double total() const {
    int64_t out = 0;
    for (int k = 0; k < kLanes; ++k) out += value[k];
    return static_cast<double>(out);
  }
};

inline f32 select(i32 flags, f32 yes, f32 no) { return flags ? yes : no; }

// Each lane's left neighbour: the last lane of `before`, then the lanes of `x` but its last.
struct ShiftedMap {
  static constexpr int at(int i) { return kLanes - 1 + i; }
};

template <typename T>
inline T shifted(T before, T x) {
  return shuffle<ShiftedMap>(before, x, std::make_integer_sequence<int, kLanes>{});
}

// e^x as 2^n * 2^f with n = round(x log2 e), |f| <= 1/2, 2^f by its Taylor series to
// f^7 (truncation below 1e-8 relative). Rounding x log2 e costs |x| * 6e-8 relative, as
// in the compiled path. The series is that of 2 * 2^f (each coefficient doubled, which
// is exact) times 2^(n - 1): 2^128 would not fit in the exponent, so e^x stays finite up
// to float32's own limit, about 88.72, and overflows to +inf above it. For x >= -87
// (log-probs are floored at -20).
inline f32 exp(f32 x) {
  f32 t = x * kLog2E;
  t = t < 128.0f ? t : splat<f32>(128.0f);
  const f32 n = (t + 12582912.0f) - 12582912.0f;  // round to nearest: 1.5 * 2^23
  const f32 f = t - n;
  f32 p = splat<f32>(3.0505467608119676e-05f);  // 2 ln2^7 / 7!, then down to 2 ln2^0 / 0!
  p = p * f + 3.0807060786763212e-04f;
  p = p * f + 2.6667116292856882e-03f;
  p = p * f + 1.9236258215256954e-02f;
  p = p * f + 1.1100821732964315e-01f;
  p = p * f + 4.804530139182014e-01f;
  p = p * f + 1.3862943611198906e+00f;
  p = p * f + 2.0f;
  const i32 exponent = (__builtin_convertvector(n, i32) + 126) << 23;
  return p * reinterpret_cast<f32>(exponent);
}

// rho = e^r clamped to [e^-20, e^20], from grown = e^|r|.
inline f32 far_ratio(f32 r, f32 grown) {
  f32 ratio = select(r < 0.0f, 1.0f / grown, grown);
  ratio = ratio < kRatioMin ? splat<f32>(kRatioMin) : ratio;
  return ratio > kRatioMax ? splat<f32>(kRatioMax) : ratio;
}

// x clamped to [low, high] in each lane (GCC turns the compares of its vector types into
// compares and blends: two instructions where a max or a min is one).
inline i32 clamp(i32 x, int low, int high) {
#if defined(__AVX512F__) && ROLLOUT_LANES == 16
  const __m512i above = _mm512_max_epi32(reinterpret_cast<__m512i>(x), _mm512_set1_epi32(low));
  return reinterpret_cast<i32>(_mm512_min_epi32(above, _mm512_set1_epi32(high)));
#elif defined(__AVX2__) && ROLLOUT_LANES == 8
  const __m256i above = _mm256_max_epi32(reinterpret_cast<__m256i>(x), _mm256_set1_epi32(low));
  return reinterpret_cast<i32>(_mm256_min_epi32(above, _mm256_set1_epi32(high)));
#elif defined(__SSE4_1__) && ROLLOUT_LANES == 4
  const __m128i above = _mm_max_epi32(reinterpret_cast<__m128i>(x), _mm_set1_epi32(low));
  return reinterpret_cast<i32>(_mm_min_epi32(above, _mm_set1_epi32(high)));
#else
  x = x < low ? splat<i32>(low) : x;
  return x > high ? splat<i32>(high) : x;
#endif
}

// Whether any lane is set.
inline bool any(i32 flags) {
#if defined(__AVX512DQ__) && ROLLOUT_LANES == 16
  return _mm512_movepi32_mask(reinterpret_cast<__m512i>(flags)) != 0;
#elif defined(__AVX__) && ROLLOUT_LANES == 8
  return _mm256_movemask_ps(reinterpret_cast<__m256>(flags)) != 0;
#elif defined(__SSE__) && ROLLOUT_LANES == 4
  return _mm_movemask_ps(reinterpret_cast<__m128>(flags)) != 0;
#else
  int32_t out = 0;
  for (int k = 0; k < kLanes; ++k) out |= flags[k];
  return out != 0;
#endif
}

// (e^x - 1 - x) / x^2 for |x| < 1/2: the series of `exp_tail` (tokens.py) to x^8 / 8!.
inline f32 exp_tail(f32 x) {
  f32 tail = splat<f32>(2.48015873015873e-05f);
  tail = tail * x + 0.0001984126984126984f;
  tail = tail * x + 0.001388888888888889f;
  tail = tail * x + 0.008333333333333333f;
  tail = tail * x + 0.041666666666666664f;
  tail = tail * x + 0.16666666666666666f;
  tail = tail * x + 0.5f;
  return tail;
}

// The absolute value. With 8 or 4 lanes, the sign bit cleared: one AND, where a compare,
// a negation and a select took AVX2 three or four instructions (-0.0 becomes +0.0, which
// compares and adds as it does). AVX-512's masks make the select cheap, and there the AND
// made the defaults' pass 1.01x to 1.02x as long.
#if ROLLOUT_LANES == 16
inline f32 abs(f32 x) { return x < 0.0f ? -x : x; }
#else
inline f32 abs(f32 x) { return reinterpret_cast<f32>(reinterpret_cast<i32>(x) & 0x7fffffff); }
#endif

// Rollout log-probs of 0 where padding puts them (`zero_run` in rows.py): right after
// another of the row, or the row's last counting token.
struct ZeroRun {
  Count after;
  i32 tail_counting{}, tail_lone{};  // the last vector with a counting token
  // zero: the lanes of zeros; before: those whose left neighbour is one.
  void add(i32 zero, i32 before, i32 counting) {
    after.add(zero & before);
    if (any(counting)) {
      tail_counting = counting;
      tail_lone = zero & ~before;
    }
  }
  double total() const {
    int last = -1;
    for (int k = 0; k < kLanes; ++k) last = tail_counting[k] ? k : last;
    return after.total() + (last >= 0 && tail_lone[last] ? 1.0 : 0.0);
  }
};

struct Options {
  float ratio_high_m1;  // rho > C counts as high: rho - 1 > C - 1
  float ratio_low_m1;   // rho < 1/C counts as low: rho - 1 < 1/C - 1
};

// One vector's values that the extras take: r, |pa - pb| and the counting lanes, and with
// the profile a, b and k3 too.
struct Last {
  f32 r{}, diff{};
  i32 counting{};
  f32 a{}, b{}, k3{};
};

// A vector's log-probs as the sums take them: floored at -20, and 0 where the token does
// not count (masked out, or a log-prob not finite).
struct Tokens {
  f32 a, b;
  i32 counting, finite;
  i32 masked_actor;  // a trainer's -inf where the rollout's is finite and not a dummy 0
};

__attribute__((always_inline)) inline Tokens tokens_of(f32 a, f32 b, i32 masked) {
  const f32 minus_inf = splat<f32>(-kInf);
  const f32 floor = splat<f32>(kLogProbFloor);
  const f32 zero = splat<f32>(0.0f);
  const i32 masked_actor = (a == minus_inf) & (b > minus_inf) & (b != 0.0f);
  a = floor > a ? floor : a;  // NaN stays NaN
  b = floor > b ? floor : b;
  const i32 finite = (a < kInf) & (b < kInf);
  const i32 counting = masked & finite;
  return {select(counting, a, zero), select(counting, b, zero), counting, finite, masked_actor};
}

// Where a row's sums of the inputs are taken: not at all, in the statistics' loop, or in
// a loop of their own over each block of the row.
enum Inputs { kNoInputs, kInline, kApart };

// The running sums of one row.
struct RowSums {
  Count count, nonfinite, high, low, zero_b, masked_actor, pairs;
  ZeroRun zero_run;
  Max max_a, max_b, max_diff, max_r, max_neg_r;
  Sum sum_a, sum_b, pa, pb, diff, pa2, pb2, papb, diff2, abs_r, r2, r, k3, mult, rm1, rsqm1;
  Sum ratio, ratio2, aa, bb, ab, ab_next, ab_prev;
  // Each side's moments over the neighbouring pairs, summed directly: totals less the
  // tokens without a neighbour would lose the small log-probs' squares beside -20's.
  Sum plus_a, plus_a2, plus_b, plus_b2, minus_a, minus_a2, minus_b, minus_b2;
  // The previous vector's a, b and counting lanes, for the pairs of neighbouring tokens.
  f32 prev_a{}, prev_b{};
  i32 prev_counting{}, prev_zero{};
  // The last vector's values, for the extras.
  Last last;

  // kWithInputs: false for a vector's lanes of one run (`add_runs`), whose inputs' sums
  // are taken once for all its lanes.
  template <bool kCatalog, int kInputs, bool kProfile, bool kWithInputs = true>
  __attribute__((always_inline)) void add(f32 a_in, f32 b_in, i32 masked,
                                          const Options& options) {
    const f32 minus_inf = splat<f32>(-kInf);
    const f32 zero = splat<f32>(0.0f);
    const Tokens t = tokens_of(a_in, b_in, masked);
    const f32 a = t.a, b = t.b;
    const i32 counting = t.counting;
    count.add(counting);
    nonfinite.add(masked & ~t.finite);
    const f32 r_ = a - b;
    const i32 near = abs(r_) < 0.5f;
    const f32 curvature = r_ * r_ * exp_tail(r_);  // e^r - 1 - r
    const f32 pb_ = exp(b);
    // Near r = 0, pa = pb e^r (the value of `row_sums` in rows.py to float32 rounding): a second
    // exponential only for vectors with a token farther out.
    const f32 pa_near = pb_ * (1.0f + (r_ + curvature));
    const bool some_far = any(~near);
    const f32 pa_ = some_far ? select(near, pa_near, exp(a)) : pa_near;
    const f32 diff_ = abs(select(near, pb_ * (r_ + curvature), pa_ - pb_));
    if constexpr (kProfile) {
      last.a = a;
      last.b = b;
    }
    last.r = r_;
    last.diff = diff_;
    last.counting = counting;
    // sum(r) from the float64 differences: a float32 r rounds (by up to 1e-6 at |r| = 20),
    // and a difference of the two sides' sums cancels.
    if constexpr (kCatalog || kInputs != kNoInputs) r.add_difference(a, b);
    max_a.add(select(counting, a, minus_inf));
    max_b.add(select(counting, b, minus_inf));
    max_diff.add(select(counting, diff_, minus_inf));
    if constexpr (kInputs == kInline && kWithInputs) add_inputs(t);
    const f32 wide_pa = select(counting, pa_, zero);
    const f32 wide_pb = select(counting, pb_, zero);
    const f32 wide_diff = select(counting, diff_, zero);
    pa.add(wide_pa);
    pb.add(wide_pb);
    diff.add(wide_diff);
    pa2.add_product(wide_pa, wide_pa);
    pb2.add_product(wide_pb, wide_pb);
    papb.add_product(wide_pa, wide_pb);
    diff2.add_product(wide_diff, wide_diff);
    if constexpr (kCatalog) {
      max_r.add(select(counting, r_, minus_inf));
      max_neg_r.add(select(counting, -r_, minus_inf));
      const f32 abs_r_ = abs(r_);
      abs_r.add(abs_r_);
      r2.add_product(abs_r_, abs_r_);
      // Near r = 0: rho from the series, and e^|r| - 1 from the series at |r| (the
      // values of `row_sums` to float32 rounding). Farther out both from e^|r|, in log
      // space: finite wherever r is, however large the log-probs (pa and pb overflow
      // above 88 nats). Only for vectors with such a token.
      f32 far = splat<f32>(1.0f);
      f32 mult_ = abs_r_ + abs_r_ * abs_r_ * exp_tail(abs_r_);
      if (some_far) {
        const f32 grown = exp(abs_r_);
        far = far_ratio(r_, grown);
        mult_ = select(near, mult_, grown - 1.0f);
      }
      const f32 ratio_ = select(near, 1.0f + (r_ + curvature), far);
      const f32 ratio_m1 = select(near, r_ + curvature, far - 1.0f);
      const f32 k3_ = select(near, curvature, ratio_m1 - r_);
      if constexpr (kProfile) last.k3 = k3_;
      k3.add(k3_);
      mult.add(mult_);
      rm1.add(ratio_m1);
      rsqm1.add(ratio_m1 * (ratio_m1 + 2.0f));
      ratio.add(select(counting, ratio_, zero));
      ratio2.add(select(counting, ratio_ * ratio_, zero));
      high.add(counting & (ratio_m1 > options.ratio_high_m1));
      low.add(counting & (ratio_m1 < options.ratio_low_m1));
    } else if constexpr (kProfile) {  // k3 as above
      f32 far = splat<f32>(1.0f);
      if (some_far) far = far_ratio(r_, exp(abs(r_)));
      const f32 ratio_m1 = select(near, r_ + curvature, far - 1.0f);
      last.k3 = select(near, curvature, ratio_m1 - r_);
    }
  }

  // The columns of `kDefaultColumns` alone (those of a segment's default metrics), each
  // as `add` computes it.
  __attribute__((always_inline)) void add_defaults(f32 a_in, f32 b_in, i32 masked,
                                                   const Options& options) {
    const f32 minus_inf = splat<f32>(-kInf);
    const f32 zero = splat<f32>(0.0f);
    const Tokens t = tokens_of(a_in, b_in, masked);
    const f32 a = t.a, b = t.b;
    const i32 counting = t.counting;
    count.add(counting);
    nonfinite.add(masked & ~t.finite);
    const f32 r_ = a - b;
    const i32 near = abs(r_) < 0.5f;
    const f32 curvature = r_ * r_ * exp_tail(r_);
    const f32 pb_ = exp(b);
    f32 diff_ = pb_ * (r_ + curvature);
    f32 far = splat<f32>(1.0f);
    const f32 abs_r_ = abs(r_);
    if (any(~near)) {
      diff_ = select(near, diff_, exp(a) - pb_);
      far = far_ratio(r_, exp(abs_r_));
    }
    diff_ = abs(diff_);
    r.add_difference(a, b);
    max_a.add(select(counting, a, minus_inf));
    max_b.add(select(counting, b, minus_inf));
    max_diff.add(select(counting, diff_, minus_inf));
    diff.add(select(counting, diff_, zero));
    abs_r.add(abs_r_);
    const f32 ratio_m1 = select(near, r_ + curvature, far - 1.0f);
    k3.add(select(near, curvature, ratio_m1 - r_));
    high.add(counting & (ratio_m1 > options.ratio_high_m1));
    low.add(counting & (ratio_m1 < options.ratio_low_m1));
  }

  // The sums of the inputs: in the statistics' loop (`kInline`), or in a loop of their own
  // over the same block of the row (`kApart`).
  __attribute__((always_inline)) void add_inputs(const Tokens& t) {
    const f32 zero = splat<f32>(0.0f);
    const f32 a = t.a, b = t.b;
    const i32 counting = t.counting;
    sum_a.add(a);
    sum_b.add(b);
    // The moments of the log-probs at lags -1, 0 and +1 along the row (a and b are zero
    // where a token does not count, so their products are too).
    aa.add_product(a, a);
    bb.add_product(b, b);
    ab.add_product(a, b);
    const f32 a_before = shifted(prev_a, a), b_before = shifted(prev_b, b);
    const i32 pair = shifted(prev_counting, counting) & counting;
    pairs.add(pair);
    ab_next.add_product(a_before, b);  // a_t b_(t+1)
    ab_prev.add_product(a, b_before);  // a_(t+1) b_t
    // The sides of the pairs (t, t + 1): a_t and b_(t+1) at lag +1, a_(t+1) and b_t at -1.
    const f32 plus_a_ = select(pair, a_before, zero), plus_b_ = select(pair, b, zero);
    const f32 minus_a_ = select(pair, a, zero), minus_b_ = select(pair, b_before, zero);
    plus_a.add(plus_a_);
    plus_a2.add_product(plus_a_, plus_a_);
    plus_b.add(plus_b_);
    plus_b2.add_product(plus_b_, plus_b_);
    minus_a.add(minus_a_);
    minus_a2.add_product(minus_a_, minus_a_);
    minus_b.add(minus_b_);
    minus_b2.add_product(minus_b_, minus_b_);
    const i32 zeros = counting & (b == 0.0f) & (a < kPaddingActor);
    zero_b.add(zeros);
    masked_actor.add(counting & t.masked_actor);
    zero_run.add(zeros, shifted(prev_zero, zeros), counting);
    prev_a = a;
    prev_b = b;
    prev_counting = counting;
    prev_zero = zeros;
  }

  void write(double* out) const {
#define ROLLOUT_ROW_VALUE(name, member) member.total(),
    const double values[kSlots] = {ROLLOUT_ROW_COLUMNS(ROLLOUT_ROW_VALUE)};
#undef ROLLOUT_ROW_VALUE
    std::memcpy(out, values, sizeof values);
  }
};

// ------------------------------------------------------------------ the extras
// Histograms with fixed quarter-octave bins (`QuarterOctaveBins` in bins.py), read off
// each float32 value's bits, the k tokens of each row with the largest |r|, and the
// profile (profile.py).
constexpr int kMaxWorst = 64;        // the largest k served here
// Copies of the histograms' bins: lanes l and l + 8 share one. Increments of different lanes
// rarely wait on each other, and the copies of a thread (10 KB) stay in the L1 cache
// beside the profile's counts; a copy a lane (20 KB) made the histograms slower.
constexpr int kCopies = kLanes < 8 ? kLanes : 8;
constexpr int kMoments = 8;          // per row: max r, max -r, max d, max -d, sums, squares

struct ExtrasRequest {
  int ratio_low, ratio_octaves;  // signed bins of r: 2 * (4 * octaves + 1) + 1 of them
  int diff_low, diff_octaves;    // unsigned bins of |pa - pb|: 4 * octaves + 2 of them
  int histograms;                // 0: no histograms
  int k;                         // worst tokens kept per row (0 ... kMaxWorst)
  int profile;                   // 0: no profile; 1: the profile block in `bins` and in the
                                 // packed extras; 2: in `bins`, and added into the packed
                                 // extras' block (a window's profile so far)
  double* rows;                  // [rows, kMoments + 2 k]: moments, then (|r|, position) pairs
  double* bins;                  // [ratio bins + diff bins] summed over the rows, then the
                                 // profile block (kProfileSize)
};

inline int ratio_bins(const ExtrasRequest& x) { return 2 * (4 * x.ratio_octaves + 1) + 1; }
inline int diff_bins(const ExtrasRequest& x) { return 4 * x.diff_octaves + 2; }
// Whether the histograms' slots of every copy fit the 16-bit fields of `add_bins`.
inline bool bins_fit(const ExtrasRequest& x) {
  return x.ratio_octaves >= 0 && x.diff_octaves >= 0 &&
         int64_t{kCopies} * (ratio_bins(x) + diff_bins(x)) <= (int64_t{1} << 16);
}
inline double* profile_block(const ExtrasRequest& x) {
  return x.bins + (x.histograms ? ratio_bins(x) + diff_bins(x) : 0);
}

// The bin of each value, as `QuarterOctaveBins.index` computes it for float32.
inline i32 signed_bin(f32 x, int low, int octaves) {
  const int top = 4 * octaves;
  const i32 bits = reinterpret_cast<i32>(x);
  const i32 negative = bits < 0;  // -1 where negative
  // For x < 0 the bins close on the other side: one ulp less turns "<=" into "<".
  const i32 steps = ((bits & 0x7fffffff) + negative) >> 21;
  const i32 side = clamp(steps - ((127 + low) << 2), -1, top) + 1;
  return (negative ? -side : side) + (top + 1);
}

// The bin of each value, as unsigned `LogBins.index` with 2^kBits steps per octave
// computes it for float32: the exponent and the leading kBits mantissa bits. A negative
// value (-0.0 too) has the sign bit set: a negative int, clamped to bin 0.
template <int kBits>
inline i32 log_bin(f32 x, int low, int octaves) {
  const int top = octaves << kBits;
  const i32 bin = (reinterpret_cast<i32>(x) >> (23 - kBits)) - ((127 + low) << kBits);
  return clamp(bin, -1, top) + 1;
}

inline i32 unsigned_bin(f32 x, int low, int octaves) { return log_bin<2>(x, low, octaves); }

// ------------------------------------------------------------------ the profile
// The profile block (`profile_blocks` in profile.py): fine bins of d = |pa - pb| and of
// |r| (`QUANTILE_BINS`), tokens and sums of d and k3 by position bucket, tokens and sums of
// d and |r| by probability bucket, joint counts over the bins of (-a, -b) (`JOINT_BINS`),
// the maxima of d and |r|, and the width. The loader checks the parts and the constants
// against profile.py by name.
constexpr int kFineBits = 5;  // 32 bins per octave
constexpr int kDiffLow = -27, kDiffOctaves = 28;
constexpr int kLogLow = -27, kLogOctaves = 32;
constexpr int kJointBits = 2, kJointLow = -10, kJointOctaves = 15;
constexpr int kPositionBuckets = 24;     // column 0, then [2^(i-1), 2^i), the last open
constexpr int kProbabilityBuckets = 29;  // slot 28 - floor(-a log2 e)
constexpr int kDiffBins = (kDiffOctaves << kFineBits) + 2;
constexpr int kLogBins = (kLogOctaves << kFineBits) + 2;
constexpr int kJointSide = (kJointOctaves << kJointBits) + 2;
constexpr int kJointCells = kJointSide * kJointSide;
// The parts of the block in its order: id, the stem of the slots' names, their number.
#define ROLLOUT_PROFILE_PARTS(X)                                                            \
  X(p_diff_bins, "probs_diff_bins", kDiffBins) X(p_log_bins, "log_diff_bins", kLogBins)      \
  X(p_position_tokens, "position_tokens", kPositionBuckets)                                 \
  X(p_probability_tokens, "probability_tokens", kProbabilityBuckets)                        \
  X(p_joint, "joint", kJointCells) X(p_position_diff, "position_probs_diff", kPositionBuckets) \
  X(p_position_k3, "position_kl_k3", kPositionBuckets)                                      \
  X(p_probability_diff, "probability_probs_diff", kProbabilityBuckets)                      \
  X(p_probability_log, "probability_log_diff", kProbabilityBuckets)                         \
  X(p_diff_max, "probs_diff_max", 1) X(p_log_max, "log_diff_max", 1) X(p_width, "width", 1)
// The constants the loader compares with profile.py.
#define ROLLOUT_PROFILE_CONSTANTS(X)                                                         \
  X("probs_diff.low", kDiffLow) X("probs_diff.octaves", kDiffOctaves)                         \
  X("probs_diff.steps", 1 << kFineBits) X("probs_diff.signed", 0) X("log_diff.low", kLogLow)  \
  X("log_diff.octaves", kLogOctaves) X("log_diff.steps", 1 << kFineBits)                     \
  X("log_diff.signed", 0) X("joint.low", kJointLow) X("joint.octaves", kJointOctaves)        \
  X("joint.steps", 1 << kJointBits) X("joint.signed", 0)                                     \
  X("position_buckets", kPositionBuckets) X("probability_buckets", kProbabilityBuckets)       \
  X("log2_e", kLog2E) X("size", kProfileSize)

#define ROLLOUT_PART_ENUM(id, name, size) id,
#define ROLLOUT_PART_SIZE(id, name, size) size,
enum ProfilePart { ROLLOUT_PROFILE_PARTS(ROLLOUT_PART_ENUM) kProfileParts };
constexpr int kPartSizes[] = {ROLLOUT_PROFILE_PARTS(ROLLOUT_PART_SIZE)};
#undef ROLLOUT_PART_ENUM
#undef ROLLOUT_PART_SIZE

constexpr int part_at(int part) {
  int at = 0;
  for (int i = 0; i < part; ++i) at += kPartSizes[i];
  return at;
}
constexpr int kProfileSize = part_at(kProfileParts);
static_assert(part_at(p_log_bins) == kDiffBins, "the two fine histograms are adjacent");
// The position bucket of column c: 0, then [2^(i-1), 2^i) is bucket i.
constexpr int position_bucket_of(int64_t column) {
  return column == 0 ? 0 : 64 - __builtin_clzll(static_cast<uint64_t>(column));
}
static_assert(position_bucket_of(kLanes - 1) < kPositionBuckets - 1,
              "the first vector of a row spans buckets of their own");

// The fine bins of r by sign, from which the fine bins of |r| and the histogram's bins of
// r are both added up (`write_fine_log_bins`, `write_coarse_bins`). For r >= +0, the fine
// bins of |r|. For r <= -0, the bins of the magnitude less one ulp (the histogram's bins
// of a negative r close on the other side), from one step lower, each twice: off and on
// an edge of the fine bins of |r| (on one, the bin of |r| is one higher).
constexpr int kNegativeBins = kLogBins + 1;
constexpr int kSignedBins = kLogBins + 2 * kNegativeBins;
// Whole-number counts a thread keeps in int32, `copies` interleaved copies of each
// ([slot][copy]) so that neighbouring lanes that hit the same slot do not wait on each
// other: the fine bins of d, then the signed fine bins of r, then the joint cells.
constexpr int kCounted = kDiffBins + kSignedBins + kJointCells;
constexpr int kJointCounted = kDiffBins + kSignedBins;

// The signed fine bin of each r (see kSignedBins).
inline i32 signed_fine_bin(f32 r) {
  constexpr int kShift = 23 - kFineBits, kTop = kLogOctaves << kFineBits;
  const i32 bits = reinterpret_cast<i32>(r);
  const i32 negative = bits < 0;
  const i32 magnitude = bits & 0x7fffffff;
  // For r < 0 the magnitude one ulp less: -1 for -0.0, shifted to -1 too.
  const i32 below = negative ? magnitude - 1 : bits;
  const i32 steps = (below >> kShift) - ((127 + kLogLow) << kFineBits);
  const i32 up = clamp(steps, -1, kTop);
  const i32 down = clamp(steps, -2, kTop);
  const i32 on_edge = (magnitude & ((1 << kShift) - 1)) == 0;  // -1 on an edge
  return negative ? kLogBins + 2 * (down + 2) - on_edge : up + 1;
}
// The four values of each lane widened to float64, lanes 0, 1, ... in order, four
// doubles a lane, in 8 vectors of kLanes / 2 doubles: a 4 x kLanes transpose.
inline void lane_quads(f32 w, f32 x, f32 y, f32 z, f64 quads[8]) {
#if defined(__AVX__) && ROLLOUT_LANES == 8
  // Within each 128-bit half: lanes k and k + 4 in one vector, widened half by half (GCC
  // moved the lanes across the halves, with twice as many shuffles).
  const __m256 wx[2] = {_mm256_unpacklo_ps(reinterpret_cast<__m256>(w), reinterpret_cast<__m256>(x)),
                        _mm256_unpackhi_ps(reinterpret_cast<__m256>(w), reinterpret_cast<__m256>(x))};
  const __m256 yz[2] = {_mm256_unpacklo_ps(reinterpret_cast<__m256>(y), reinterpret_cast<__m256>(z)),
                        _mm256_unpackhi_ps(reinterpret_cast<__m256>(y), reinterpret_cast<__m256>(z))};
  for (int k = 0; k < 4; ++k) {
    const __m256d pairs = _mm256_castps_pd(wx[k / 2]), others = _mm256_castps_pd(yz[k / 2]);
    const __m256 both = _mm256_castpd_ps(k % 2 ? _mm256_unpackhi_pd(pairs, others)
                                               : _mm256_unpacklo_pd(pairs, others));
    quads[k] = reinterpret_cast<f64>(_mm256_cvtps_pd(_mm256_castps256_ps128(both)));
    quads[k + 4] = reinterpret_cast<f64>(_mm256_cvtps_pd(_mm256_extractf128_ps(both, 1)));
  }
#else
  const f32 wx[2] = {interleave<0>(w, x), interleave<1>(w, x)};
  const f32 yz[2] = {interleave<0>(y, z), interleave<1>(y, z)};
  for (int half = 0; half < 2; ++half) {
    // Pairs of floats moved as one 64-bit element each.
    const f64 pairs = reinterpret_cast<f64>(wx[half]);
    const f64 others = reinterpret_cast<f64>(yz[half]);
    const f32 low = reinterpret_cast<f32>(interleave<0>(pairs, others));
    const f32 high = reinterpret_cast<f32>(interleave<1>(pairs, others));
    quads[4 * half] = lower(low);
    quads[4 * half + 1] = upper(low);
    quads[4 * half + 2] = lower(high);
    quads[4 * half + 3] = upper(high);
  }
#endif
}

// Per lane, float64 sums by probability bucket ([bucket][lane][tokens, d, |r|, k3]: one
// 256-bit add per token; k3 is not read), added into the sums of the block of rows at its
// end.
constexpr int kLaneSums = kProbabilityBuckets * kLanes * 4;
typedef double f64x4 __attribute__((vector_size(32)));
// Adds the four doubles of lane kLane, of the doubles of all lanes in order, to `sums`.
template <int kLane>
__attribute__((always_inline)) inline void add_quad(double* sums, const f64* quads) {
  constexpr int per = kLanes / 2, at = 4 * kLane;  // doubles a vector, the lane's first
  if constexpr (per >= 4) {
    constexpr int o = at % per;
    f64x4 total;
    std::memcpy(&total, sums, sizeof total);
    total += __builtin_shufflevector(quads[at / per], quads[at / per], o, o + 1, o + 2, o + 3);
    std::memcpy(sums, &total, sizeof total);
  } else {  // two vectors of two doubles
    for (int k = 0; k < 2; ++k) {
      f64 total;
      std::memcpy(&total, sums + 2 * k, sizeof total);
      total += quads[at / per + k];
      std::memcpy(sums + 2 * k, &total, sizeof total);
    }
  }
}
// A lane's slots (with up to 4 copies) and its lane sums, as 16-bit fields of one word.
static_assert((kCounted << 2) <= (1 << 16) && kLaneSums <= (1 << 16), "slots fit 16 bits");
// The float64 sums of a block of rows, added up in the order of the blocks: the result
// depends on the rows alone, not on which thread took them.
enum BlockSlot {
  b_position_tokens = 0,
  b_position_diff = b_position_tokens + kPositionBuckets,
  b_position_k3 = b_position_diff + kPositionBuckets,
  b_probability_tokens = b_position_k3 + kPositionBuckets,
  b_probability_diff = b_probability_tokens + kProbabilityBuckets,
  b_probability_log = b_probability_diff + kProbabilityBuckets,
  kBlockSlots = b_probability_log + kProbabilityBuckets
};
// Blocks of at least 4096 tokens, at most 64 of them (a pass with the profile takes at
// most 64 threads): the end of each adds up and clears the lanes' sums of every
// probability bucket (14.8 KB with 16 lanes); 256 blocks took 1.02x the time of 64 at
// 256x4096.
constexpr int64_t kMaxProfileBlocks = 64;
constexpr int64_t kTokensPerProfileBlock = 4096;

// Whether the histograms' bins are unions of the profile's fine bins (2^(kFineBits - 2)
// fine bins each, those below and above the range included), as they are when they lie
// within the fine bins' range: the pass then counts the fine bins alone, and the
// histograms' are added up from them (`write_coarse_bins`).
inline bool coarse_from_fine(const ExtrasRequest& x) {
  return x.histograms && x.profile && x.ratio_octaves >= 0 && x.ratio_low >= kLogLow &&
         x.ratio_low + x.ratio_octaves <= kLogLow + kLogOctaves && x.diff_octaves >= 0 &&
         x.diff_low >= kDiffLow && x.diff_low + x.diff_octaves <= kDiffLow + kDiffOctaves;
}

// The total of elements [begin, end) of `values`, clipped to [0, count).
inline int64_t range_total(const int64_t* values, int count, int begin, int end) {
  int64_t total = 0;
  for (int i = std::max(begin, 0); i < std::min(end, count); ++i) total += values[i];
  return total;
}

// Adds fine counts into the sides of coarse bins (0 below 2^low, then 1 ... 4 octaves + 1):
// element i of `fine` counts the values whose fine steps above 2^fine_low are first + i
// (-1 and below: below it), whose coarse steps are those shifted right, less the coarse
// steps between the two lowest edges; below and above the coarse range, clamped. Each
// side adds up a run of elements: no slot is added to twice in a row.
void add_sides(const int64_t* fine, int count, int first, int low, int octaves, int fine_low,
               int64_t* sides) {
  constexpr int kShift = kFineBits - 2;
  const int below = (4 * (low - fine_low)) << kShift;  // fine steps below 2^low
  const int top = 4 * octaves;
  sides[0] += range_total(fine, count, 0, below - first);
  for (int side = 1; side <= top; ++side) {
    const int begin = below + ((side - 1) << kShift) - first;
    sides[side] += range_total(fine, count, begin, begin + (1 << kShift));
  }
  sides[top + 1] += range_total(fine, count, below + (top << kShift) - first, count);
}

// The histograms' bins (`bins`: those of r, then those of d) from the totals of the fine
// counts ([kCounted]: the fine bins of d, then the signed ones of r).
void write_coarse_bins(const ExtrasRequest& x, const int64_t* totals, double* bins) {
  constexpr int kSides = 4 * kLogOctaves + 2;
  int64_t positive[kSides] = {}, negative[kSides] = {};
  const int64_t* signed_bins = totals + kDiffBins;
  // r >= +0: fine bin b holds steps b - 1; r <= -0: both bins of magnitude steps n - 2,
  // one ulp less, at 2 n and 2 n + 1.
  add_sides(signed_bins, kLogBins, -1, x.ratio_low, x.ratio_octaves, kLogLow, positive);
  int64_t pairs[kNegativeBins];
  for (int n = 0; n < kNegativeBins; ++n) {
    pairs[n] = signed_bins[kLogBins + 2 * n] + signed_bins[kLogBins + 2 * n + 1];
  }
  add_sides(pairs, kNegativeBins, -2, x.ratio_low, x.ratio_octaves, kLogLow, negative);
  const int center = 4 * x.ratio_octaves + 1;  // the bin of r in [-2^low, 2^low)
  for (int bin = 0; bin < ratio_bins(x); ++bin) {
    const int64_t count = bin < center ? negative[center - bin]
                          : bin > center ? positive[bin - center]
                                         : positive[0] + negative[0];
    bins[bin] = static_cast<double>(count);
  }
  int64_t diff[4 * kDiffOctaves + 2] = {};
  add_sides(totals, kDiffBins, -1, x.diff_low, x.diff_octaves, kDiffLow, diff);
  for (int bin = 0; bin < diff_bins(x); ++bin) {
    bins[ratio_bins(x) + bin] = static_cast<double>(diff[bin]);
  }
}

// The fine bins of |r| from the signed ones. For r <= -0 at magnitude steps n - 2 (one ulp
// less), fine bin n - 1 off an edge and n on one, clamped: bin k in 1 ... top holds
// (k + 1, off) and (k, on); bin 0 holds (0, both) and (1, off); bin top + 1 holds
// (top + 2, both) and (top + 1, on).
void write_fine_log_bins(const int64_t* signed_bins, double* out) {
  constexpr int kTop = kLogBins - 2;
  const int64_t* positive = signed_bins;
  const auto negative = [&](int n, int edge) { return signed_bins[kLogBins + 2 * n + edge]; };
  for (int bin = 1; bin <= kTop; ++bin) {
    out[bin] = static_cast<double>(positive[bin] + negative(bin + 1, 0) + negative(bin, 1));
  }
  out[0] = static_cast<double>(positive[0] + negative(0, 0) + negative(0, 1) + negative(1, 0));
  out[kTop + 1] = static_cast<double>(positive[kTop + 1] + negative(kTop + 2, 0) +
                                      negative(kTop + 2, 1) + negative(kTop + 1, 1));
}

// Blocks of rows (whose float64 sums are kept apart): fewer for few tokens, where adding
// them up would cost more than the tokens, one per row at most.
inline int64_t profile_blocks(int64_t rows, int64_t width) {
  const int64_t by_tokens = std::max<int64_t>(1, rows * width / kTokensPerProfileBlock);
  return std::max<int64_t>(1, std::min({rows, by_tokens, kMaxProfileBlocks}));
}

// log2 of the copies of the counts of a thread that takes `tokens`: one copy (31 KB) below
// 2^16 tokens, where zeroing and adding up copies would cost more than the waits they
// spare, two from 2^16 on, four (125 KB, within the L2 cache) from 2^18 on; more copies
// cost more cache than they spare waits.
inline int profile_copy_bits(int64_t tokens) {
  int bits = 0;
  while (bits < 2 && tokens >= (int64_t{1} << (16 + 2 * bits))) ++bits;
  return bits;
}

// What a thread accumulates of the profile over its rows.
struct ProfileTables {
  int32_t* counts;  // [kCounted][copies]
  int copy_bits;
  i32 copy_lane;  // the copy of each lane
  double* lanes;  // [kLaneSums]
  double* block;  // the current block's [kBlockSlots]
  float diff_max = -kInf, log_max = -kInf;
  int64_t idle = 0;  // tokens that do not count, counted in the slots of zeros

  // At the end of a block: its lanes' sums added in (lane by lane, a lane's four sums in
  // vectors as wide as `add_quad`'s), then cleared.
  void end_block() {
    constexpr int kWide = kLanes / 2 < 4 ? kLanes / 2 : 4;
    typedef double Part __attribute__((vector_size(kWide * sizeof(double))));
    for (int slot = 0; slot < kProbabilityBuckets; ++slot) {
      double* sums = lanes + slot * kLanes * 4;
      Part totals[4 / kWide] = {};
      for (int lane = 0; lane < kLanes; ++lane) {
        for (int k = 0; k < 4 / kWide; ++k) {
          Part quad;
          std::memcpy(&quad, sums + 4 * lane + kWide * k, sizeof quad);
          totals[k] += quad;
        }
      }
      std::memset(sums, 0, kLanes * 4 * sizeof(double));
      for (int kind = 0; kind < 3; ++kind) {
        block[b_probability_tokens + kind * kProbabilityBuckets + slot] +=
            totals[kind / kWide][kind % kWide];
      }
    }
  }
};

// The extras of one row; `counts` are the bins of the part of the rows a thread takes.
struct RowExtras {
  const ExtrasRequest& request;
  int32_t* counts;  // kCopies copies of [ratio bins + diff bins]
  ProfileTables* profile;
  Max r_max, r_neg_max, d_max, d_neg_max;
  Sum r_sum, r_sq, d_sum, d_sq;
  // The profile: maxima of d and |r|, and the sums of the current position bucket.
  Max profile_d_max, profile_r_max;
  Count idle;
  Count bins_idle;  // tokens that do not count, counted in the histograms' bins of zeros
  // The current position bucket's sums of the lanes' (tokens, d, |r|, k3): the even and
  // the odd vectors of `add_profile`'s quads added up apart (with 4 lanes, those hold a
  // lane's first two sums and its last two).
  f64 position_quads[2] = {};
  int position_bucket = -1;
  float keys[kMaxWorst];
  int64_t positions[kMaxWorst];
  int filled = 0;
  // A token enters with |r| above it: the k-th largest |r| of the thread's earlier rows
  // (-1 while they hold fewer than k counting tokens), then of this row's candidates.
  float threshold;

  bool fine_only;  // the histograms' bins come from the profile's fine bins
  i32 copy_offsets;  // where each lane's copy of the bins starts, in both 16-bit fields

  RowExtras(const ExtrasRequest& request_, int32_t* counts_, ProfileTables* profile_,
            float floor)
      : request(request_), counts(counts_), profile(profile_), threshold(floor),
        fine_only(profile_ && coarse_from_fine(request_)),
        copy_offsets((lane_numbers() & (kCopies - 1)) *
                     ((ratio_bins(request_) + diff_bins(request_)) * 0x10001)) {}

  // One vector that holds a counting token (`PendingExtras` passes over the others).
  template <bool kCatalog, bool kProfile>
  __attribute__((always_inline)) void add(const Last& s, int64_t position) {
    const f32 r = s.r, d = s.diff;
    const i32 counting = s.counting;
    const f32 minus_inf = splat<f32>(-kInf);
    const f32 zero = splat<f32>(0.0f);
    if (request.histograms) {
      d_neg_max.add(select(counting, -d, minus_inf));
      r_sum.add(r);  // zero where not counting: a float32 r, as the torch path sums it
      if constexpr (!kCatalog) {  // else the row's own sums hold them (`write`)
        r_max.add(select(counting, r, minus_inf));
        r_neg_max.add(select(counting, -r, minus_inf));
        d_max.add(select(counting, d, minus_inf));
        r_sq.add_product(r, r);
        const f32 wide_d = select(counting, d, zero);
        d_sum.add(wide_d);
        d_sq.add_product(wide_d, wide_d);
      }
      // With the profile, the bins are added up from its fine bins at the end.
      if (!(kProfile && fine_only)) add_bins(counting, r, d);
    }
    if constexpr (kProfile) add_profile(s, position);
    if (request.k) {
      const f32 key = select(counting, abs(r), splat<f32>(-1.0f));
      if (any(key > threshold)) {
        for (int lane = 0; lane < kLanes; ++lane) {
          if (key[lane] > threshold) insert(key[lane], position + lane);
        }
      }
    }
  }

  // The histograms' bins of one vector. A token that does not count (r = d = +0) is
  // counted in the bins of zeros too, and taken off at the end of the row (`write`): one
  // increment a value, no weight to read. A vector without a counting token adds nothing.
  // Both slots of a lane (its copy's offset included) are 16-bit fields of one word: one
  // load a lane, two increments from one base.
  __attribute__((always_inline)) void add_bins(i32 counting, f32 r, f32 d) {
    if (!any(counting)) return;
    bins_idle.add(~counting);
    const i32 r_bin = signed_bin(r, request.ratio_low, request.ratio_octaves);
    const i32 d_bin = unsigned_bin(d, request.diff_low, request.diff_octaves) + ratio_bins(request);
    alignas(64) uint32_t words[kLanes];
    const i32 both = (r_bin | (d_bin << 16)) + copy_offsets;
    std::memcpy(words, &both, sizeof words);
    for_each_lane([&](auto lane) __attribute__((always_inline)) {
      const uint32_t word = words[decltype(lane)::value];
      ++counts[word & 0xffff];
      ++counts[word >> 16];
    });
  }

  // One vector of the profile. Where a token does not count, a = b = r = d = k3 = 0: it
  // adds 0 to every sum, and 1 to the counts of the slots of zeros, which `idle` counts to
  // take off at the end. A vector without a counting token adds nothing at all; the test
  // stays although `PendingExtras` passes over such vectors: without it, GCC's code made
  // the defaults' pass 1.06x to 1.19x as long.
  __attribute__((always_inline)) void add_profile(const Last& s, int64_t position) {
    const i32 counting = s.counting;
    if (!any(counting)) return;
    idle.add(~counting);
    const f32 a = s.a, b = s.b, d = s.diff, k3 = s.k3;
    const f32 abs_r = abs(s.r);
    const i32 ones = counting & 1;
    const f32 minus_inf = splat<f32>(-kInf);
    ProfileTables& t = *profile;
    profile_d_max.add(select(counting, d, minus_inf));
    profile_r_max.add(select(counting, abs_r, minus_inf));
    // floor(-a log2 e) in float32, as torch computes it, clamped to the buckets first
    // (truncation is the floor there).
    f32 scaled = -a * kLog2E;
    scaled = scaled < 0.0f ? splat<f32>(0.0f) : scaled;
    const f32 top = splat<f32>(kProbabilityBuckets - 1);
    scaled = scaled > top ? top : scaled;
    const i32 slot = (kProbabilityBuckets - 1) - __builtin_convertvector(scaled, i32);
    const i32 lane_at = (slot * kLanes + lane_numbers()) * 4;
    const int shift = t.copy_bits;
    const i32 diff_at = (log_bin<kFineBits>(d, kDiffLow, kDiffOctaves) << shift) + t.copy_lane;
    const i32 log_at = ((signed_fine_bin(s.r) + kDiffBins) << shift) + t.copy_lane;
    const i32 joint = log_bin<kJointBits>(-a, kJointLow, kJointOctaves) * kJointSide +
                      log_bin<kJointBits>(-b, kJointLow, kJointOctaves);
    const i32 joint_at = ((joint + kJointCounted) << shift) + t.copy_lane;
    // (tokens, d, |r|, k3) of each lane as four doubles. The probability buckets add the
    // first three, the position bucket all but |r|.
    f64 quads[8];
    lane_quads(__builtin_convertvector(ones, f32), d, abs_r, k3, quads);
    // Past the first vector all lanes share a bucket: [2^(i-1), 2^i) holds whole vectors.
    if (position >= kLanes) {
      const int bucket = std::min(position_bucket_of(position), kPositionBuckets - 1);
      if (bucket != position_bucket) {
        end_position();
        position_bucket = bucket;
      }
      position_quads[0] += (quads[0] + quads[2]) + (quads[4] + quads[6]);
      position_quads[1] += (quads[1] + quads[3]) + (quads[5] + quads[7]);
    } else {
      for (int lane = 0; lane < kLanes; ++lane) {
        const int bucket = position_bucket_of(lane);
        t.block[b_position_tokens + bucket] += ones[lane];
        t.block[b_position_diff + bucket] += d[lane];
        t.block[b_position_k3 + bucket] += k3[lane];
      }
    }
    // The four slots of each lane as 16-bit fields. With 16 lanes, those of a lane form one
    // 64-bit word: one load a lane, the fields taken apart in registers. With 8 or 4 lanes,
    // each field is loaded on its own, with fewer instructions a lane: the defaults' pass
    // takes 0.94x the time of the words' with 8 lanes, where the fields took 1.03x with 16.
    const i32 counted_at = diff_at | (log_at << 16), summed_at = joint_at | (lane_at << 16);
    int32_t* counted = t.counts;
    double* lanes = t.lanes;
    if constexpr (kLanes == 16) {
      alignas(64) uint64_t slots[kLanes];
      const i32 words[2] = {interleave<0>(counted_at, summed_at),
                            interleave<1>(counted_at, summed_at)};
      std::memcpy(slots, words, sizeof slots);
      for_each_lane([&](auto lane) __attribute__((always_inline)) {
        const uint64_t word = slots[lane];
        ++counted[word & 0xffff];
        ++counted[(word >> 16) & 0xffff];
        ++counted[(word >> 32) & 0xffff];
        add_quad<decltype(lane)::value>(lanes + (word >> 48), quads);
      });
    } else {
      alignas(32) uint16_t fields[2][2 * kLanes];  // [counted, summed][lane][low, high]
      std::memcpy(fields[0], &counted_at, sizeof counted_at);
      std::memcpy(fields[1], &summed_at, sizeof summed_at);
      for_each_lane([&](auto lane) __attribute__((always_inline)) {
        constexpr int at = 2 * decltype(lane)::value;
        ++counted[fields[0][at]];
        ++counted[fields[0][at + 1]];
        ++counted[fields[1][at]];
        add_quad<decltype(lane)::value>(lanes + fields[1][at + 1], quads);
      });
    }
  }

  // The sums of the current position bucket into the block's.
  void end_position() {
    if (position_bucket < 0) return;
    double* block = profile->block;
    double sums[kLanes];  // whole quads, one after the other
    std::memcpy(sums, position_quads, sizeof sums);
    double tokens = 0, diff = 0, k3 = 0;
    for (int at = 0; at < kLanes; at += 4) {
      tokens += sums[at];
      diff += sums[at + 1];
      k3 += sums[at + 3];
    }
    block[b_position_tokens + position_bucket] += tokens;
    block[b_position_diff + position_bucket] += diff;
    block[b_position_k3 + position_bucket] += k3;
    position_quads[0] = position_quads[1] = f64{};
  }

  void insert(float key, int64_t position) {
    if (filled < request.k) {
      keys[filled] = key;
      positions[filled++] = position;
      if (filled < request.k) return;
    } else {
      // Out goes the smallest key, of equal ones the later token: the earlier one wins a tie.
      int smallest = 0;
      for (int i = 1; i < filled; ++i) {
        const bool less = keys[i] < keys[smallest] ||
                          (keys[i] == keys[smallest] && positions[i] > positions[smallest]);
        smallest = less ? i : smallest;
      }
      keys[smallest] = key;
      positions[smallest] = position;
    }
    threshold = keys[0];
    for (int i = 1; i < filled; ++i) threshold = keys[i] < threshold ? keys[i] : threshold;
  }

  // The row's moments and candidates into `out`, its profile into the thread's tables.
  // `columns`: the row's sums when they hold the catalog, whose maxima of r, -r and
  // |pa - pb| and sums of r^2, |pa - pb| and its square are the same values.
  void write(double* out, const double* columns) {
    double moments[kMoments] = {r_max.total(), r_neg_max.total(), d_max.total(),
                                d_neg_max.total(), r_sum.total(), r_sq.total(),
                                d_sum.total(), d_sq.total()};
    if (columns) {
      moments[0] = columns[c_max_r];
      moments[1] = columns[c_max_neg_r];
      moments[2] = columns[c_max_diff];
      moments[5] = columns[c_r2];
      moments[6] = columns[c_diff];
      moments[7] = columns[c_diff2];
    }
    std::memcpy(out, moments, sizeof moments);
    if (const int32_t idle_tokens = static_cast<int32_t>(bins_idle.total())) {
      const f32 zero = splat<f32>(0.0f);  // the lanes of tokens that do not count
      counts[signed_bin(zero, request.ratio_low, request.ratio_octaves)[0]] -= idle_tokens;
      counts[unsigned_bin(zero, request.diff_low, request.diff_octaves)[0] +
             ratio_bins(request)] -= idle_tokens;
    }
    for (int i = 0; i < request.k; ++i) {
      out[kMoments + 2 * i] = i < filled ? keys[i] : -kInf;
      out[kMoments + 2 * i + 1] = i < filled ? static_cast<double>(positions[i]) : -1.0;
    }
    if (profile) {
      end_position();
      profile->idle += static_cast<int64_t>(idle.total());
      profile->diff_max = std::max<float>(profile->diff_max, profile_d_max.total());
      profile->log_max = std::max<float>(profile->log_max, profile_r_max.total());
    }
  }
};

// The k largest |r| among the candidates of a thread's rows so far. A row's candidates need
// only beat the k-th of them: each of the thread's k worst tokens still enters its row's
// candidates (fewer than k tokens before it have a larger |r|, and an equal one comes
// first), and stays there, but a row no longer takes its own k tokens whatever they are.
struct WorstSoFar {
  int k;
  float keys[kMaxWorst];
  int filled = 0;
  float floor = -1.0f;  // below any |r|: every counting token enters while fewer than k

  void add(const float* candidates, int count) {
    for (int c = 0; c < count; ++c) {
      if (filled < k) {
        keys[filled++] = candidates[c];
        continue;
      }
      int smallest = 0;
      for (int i = 1; i < k; ++i) smallest = keys[i] < keys[smallest] ? i : smallest;
      keys[smallest] = std::max(keys[smallest], candidates[c]);
    }
    if (filled == k && k > 0) floor = *std::min_element(keys, keys + k);
  }
};

constexpr int64_t kBlock = 512;  // tokens widened at a time: the mask, bfloat16 log-probs

// A hint to load the cache line `bytes` past `x`. Nothing is read, so the address may lie
// past the end of the row; it is computed as an integer for that reason.
inline void prefetch_ahead(const void* x, int64_t bytes) {
  __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(x) + bytes));
}

// The bytes of one log-prob: float32 (kind 0) or bfloat16 (kind 1).
inline int64_t log_prob_size(int log_prob_kind) { return log_prob_kind == 0 ? 4 : 2; }

// A bfloat16 value as float32 (exact: the same bits, 16 zeros below).
inline float widened(uint16_t bfloat16) {
  const uint32_t bits = static_cast<uint32_t>(bfloat16) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}
inline float widened(float value) { return value; }

// `count` bfloat16 values as float32. The loop reads float32 only, so it is compiled once,
// not once per input type (half the build time).
inline void widen_bfloat16(const uint16_t* values, int64_t count, float* out) {
  int64_t j = 0;
  for (; j + kLanes <= count; j += kLanes) {
    prefetch_ahead(values + j, 2048);
    const f32 wide = floats_of(values + j);
    std::memcpy(out + j, &wide, sizeof wide);
  }
  for (; j < count; ++j) out[j] = widened(values[j]);
}

// Vectors whose extras wait for the statistics of the next ones: the two halves of the work
// then each have the registers to themselves. With 4, the profile costs 25-40% less than
// when each vector's extras follow its statistics (bench_update_parts.py); 32 costs more.
constexpr int kPending = 4;

// The extras of a row's vectors, kPending at a time, in the order of the positions. A
// vector without a counting token adds nothing to them (its r, d, a and b are +0, it adds
// -inf to every maximum, it has no candidate), so it does not wait: the padding after a
// response costs the extras nothing (with right-padded rows, the defaults' pass 0.97x to
// 0.98x with 8 lanes and 0.95x to 0.99x with 16; `compare_kernel_builds.py`).
template <bool kCatalog, bool kProfile>
struct PendingExtras {
  RowExtras* extras;
  Last values[kPending];
  int64_t positions[kPending];
  int waiting = 0;

  __attribute__((always_inline)) void add(const Last& last, int64_t position) {
    if (!any(last.counting)) return;
    positions[waiting] = position;
    values[waiting++] = last;
    if (waiting == kPending) flush();
  }

  __attribute__((always_inline)) void flush() {
    for (int i = 0; i < waiting; ++i) {
      extras->add<kCatalog, kProfile>(values[i], positions[i]);
    }
    waiting = 0;
  }
};

// The bytes of a mask value by `mask_kind`: bool or uint8, int32, int64, float32.
constexpr int64_t kMaskBytes[] = {1, 4, 8, 4};

// Whether each of `count` mask values is non-zero, as bytes.
template <typename Mask>
void mask_bytes(const void* mask, int64_t count, uint8_t* bytes) {
  const Mask* values = static_cast<const Mask*>(mask);
  for (int64_t j = 0; j < count; ++j) bytes[j] = values[j] != 0;
}

// The `count` values of a mask of `mask_kind` as bytes, 0 or not: a bool or uint8 mask as it
// is, another written into `bytes`.
inline const uint8_t* counted_bytes(const char* mask, int mask_kind, int64_t count,
                                    uint8_t* bytes) {
  switch (mask_kind) {
    case 0: return reinterpret_cast<const uint8_t*>(mask);
    case 1: mask_bytes<int32_t>(mask, count, bytes); break;
    case 2: mask_bytes<int64_t>(mask, count, bytes); break;
    default: mask_bytes<float>(mask, count, bytes); break;
  }
  return bytes;
}

// ------------------------------------------------------------------ the segments
// A batch's segment labels (`SegmentWindow` in segments.py: [rows] or [rows, width], int32
// or int64) split each row into runs of equal label. The pass keeps the running sums of
// the token-level columns for the run it is in rather than for the whole row: at the end
// of a run they are added into its segment's sums and, before the row's last run, into the
// row's own, and start again; a vector across the end of a run is added once for the lanes
// of each run. A row's sums are then its runs' added up, in float64. A row whose runs are
// short (fewer than `kBucketedRun` tokens on average: a label drawn for each token, the
// expert each token was routed to) is read as if it had no labels; then its counted
// tokens are put in their segments' buckets, each read for the segments alone when it is
// full and at the end of the block of rows: for the columns the segments need
// (`SegmentLabels::columns`), those of a segment's default metrics in fewer operations.
// Each block of rows keeps each segment's sums apart; the blocks' sums of each segment are
// added up in their order, so the result does not depend on the threads.
constexpr int kMaxSegments = 1 << 16;  // the most segments served here (the package's: 256)

// The fewest tokens a row's runs hold on average where the pass follows them. Each end of
// a run costs about a vector's arithmetic (its lanes added apart, its sums put away); a
// row of buckets costs about 1.5 ns a counted token to fill them and as much to read them,
// whatever its runs. At 64x2048 with 16 labels (EPYC, one thread, the defaults), the
// update takes 1.8x its time without labels in runs of 24 tokens, 1.5x to 1.6x in runs
// of 32 to 40 and 1.35x to 1.4x in runs of 48; with buckets, 1.4x to 1.5x in runs of any
// length: the two meet at about 48 tokens.
constexpr int64_t kBucketedRun = 48;

// The tokens a segment's bucket holds: read when full, and at the end of each block. Each
// bucket starts 3 vectors past a multiple of 4 KiB from the one before: the stores into
// them and the loads of the row do not alias in the low 12 bits of their addresses.
constexpr int64_t kBucket = 256;
static_assert(kBucket % kLanes == 0, "buckets of whole vectors");
constexpr int64_t kBucketStride = kBucket + 3 * kLanes;

struct SegmentLabels {
  const void* values;
  int kind;        // 1: int32, 2: int64
  bool per_token;  // [rows, width], else [rows]
  int segments;    // S: a label outside [0, S) is segment S, the other one
  int64_t width;
  uint64_t columns;  // bit c: the segments need column c

  int segment_of(int64_t label) const {
    return label >= 0 && label < segments ? static_cast<int>(label) : segments;
  }
  // The label at `index` of the labels.
  int64_t label(int64_t index) const {
    return kind == 1 ? static_cast<const int32_t*>(values)[index]
                     : static_cast<const int64_t*>(values)[index];
  }
  // The segment of the token at `position` of `row`.
  int segment_at(int64_t row, int64_t position) const {
    return segment_of(label(per_token ? row * width + position : row));
  }
};

// The end of the run of equal labels that starts at `from`: 32 labels compared at a time
// (one vector loop), the last few one by one.
template <typename T>
inline int64_t run_end(const T* labels, int64_t from, int64_t width) {
  constexpr int64_t kStep = 32;
  const T value = labels[from];
  int64_t t = from + 1;
  for (; t + kStep <= width; t += kStep) {
    T differs = 0;
    for (int64_t k = 0; k < kStep; ++k) differs |= labels[t + k] ^ value;
    if (differs) break;
  }
  while (t < width && labels[t] == value) ++t;
  return t;
}

// Whether a row's runs hold fewer than `kBucketedRun` tokens on average: the places where its
// label changes (its runs less one) counted in a vector loop, a stretch at a time, until
// they are too many.
template <typename T>
inline bool short_runs(const T* labels, int64_t width) {
  constexpr int64_t kStretch = 256;
  int64_t changes = 0;
  for (int64_t start = 1; start < width; start += kStretch) {
    const int64_t stop = std::min(width, start + kStretch);
    for (int64_t t = start; t < stop; ++t) changes += labels[t] != labels[t - 1];
    if ((changes + 1) * kBucketedRun > width) return true;
  }
  return false;
}

// A run of a row: where it ends, and its segment.
struct Run {
  int64_t end;
  int segment;
};

// The running sums of the token-level columns (those of `kSegmentGroups` and the counts
// and largest log-probs): a segment's, or a row's runs' so far.
#define ROLLOUT_SEGMENT_SUMS(X)                                                              \
  X(count) X(nonfinite) X(high) X(low) X(max_a) X(max_b) X(max_diff) X(max_r) X(max_neg_r)   \
  X(pa) X(pb) X(diff) X(pa2) X(pb2) X(papb) X(diff2) X(abs_r) X(r2) X(r) X(k3) X(mult) X(rm1) \
  X(rsqm1) X(ratio) X(ratio2)

struct SegmentSums {
#define ROLLOUT_MEMBER(member) decltype(RowSums::member) member;
  ROLLOUT_SEGMENT_SUMS(ROLLOUT_MEMBER)
#undef ROLLOUT_MEMBER

  void add(const RowSums& sums) {
#define ROLLOUT_MERGE(member) member.merge(sums.member);
    ROLLOUT_SEGMENT_SUMS(ROLLOUT_MERGE)
#undef ROLLOUT_MERGE
  }
  void keep(const RowSums& sums) {
#define ROLLOUT_COPY(member) member = sums.member;
    ROLLOUT_SEGMENT_SUMS(ROLLOUT_COPY)
#undef ROLLOUT_COPY
  }
  void add_to(RowSums& sums) const {
#define ROLLOUT_MERGE(member) sums.member.merge(member);
    ROLLOUT_SEGMENT_SUMS(ROLLOUT_MERGE)
#undef ROLLOUT_MERGE
  }
  void add(const SegmentSums& other) {
#define ROLLOUT_MERGE(member) member.merge(other.member);
    ROLLOUT_SEGMENT_SUMS(ROLLOUT_MERGE)
#undef ROLLOUT_MERGE
  }
  static void clear(RowSums& sums) {
#define ROLLOUT_CLEAR(member) sums.member = decltype(RowSums::member){};
    ROLLOUT_SEGMENT_SUMS(ROLLOUT_CLEAR)
#undef ROLLOUT_CLEAR
  }
};

// Each block's sums of each segment: memory for every block and segment (only those of a
// segment the block has are written, and touched), which each segment adds up in the order
// of the blocks at the end.
struct BlockSums {
  int64_t blocks;
  int per_block;
  SegmentSums* sums;  // [blocks][per_block], uninitialised
  std::vector<char> kept;  // whether a block has a segment's sums

  BlockSums(int64_t blocks_, int per_block_)
      : blocks(blocks_), per_block(per_block_),
        sums(static_cast<SegmentSums*>(::operator new(
            sizeof(SegmentSums) * blocks_ * per_block_, std::align_val_t{alignof(SegmentSums)}))),
        kept(blocks_ * per_block_, 0) {}
  ~BlockSums() { ::operator delete(sums, std::align_val_t{alignof(SegmentSums)}); }
  BlockSums(const BlockSums&) = delete;
  BlockSums& operator=(const BlockSums&) = delete;

  // Each segment's rows of sums ([per_block][kSlots]): its blocks' added up in their order.
  void write(double* rows) const {
    for (int segment = 0; segment < per_block; ++segment) {
      SegmentSums total;
      for (int64_t block = 0; block < blocks; ++block) {
        if (kept[block * per_block + segment]) total.add(sums[block * per_block + segment]);
      }
      RowSums row;
      total.add_to(row);
      row.write(rows + segment * kSlots);
    }
  }
};

// What a part of the pass keeps of the segments: the runs of the row it is in, the
// running sums of each segment over the current block of rows (the block's in `BlockSums`;
// `seen`: whether a run added into them) and the sums of the current row's runs before the
// one it is in.
struct SegmentTables {
  const SegmentLabels& labels;
  std::vector<Run> runs;
  SegmentSums* sums = nullptr;
  char* seen = nullptr;
  SegmentSums before;
  bool split = false;   // whether `before` holds a run of the row
  bool bucketed = false;  // whether the row's runs are too short: its tokens go to buckets
  // A bucketed row's labels and their size: loaded into the caches while the row is read,
  // which they are read after (null: none).
  const char* labels_ahead = nullptr;
  int64_t label_bytes = 0;
  // The buckets of the rows whose runs are too short: each segment's counted tokens of
  // the block not read yet ([segments + 1][kBucket] log-probs, `filled` of each), and a
  // row's mask as bytes.
  std::unique_ptr<float[]> bucket_a, bucket_b;  // uninitialised
  std::vector<int32_t> filled, bucket_at;
  std::vector<uint8_t> flags;
  std::vector<uint8_t> ones = lanes_then_none();  // kLanes ones, then kLanes zeros

  static std::vector<uint8_t> lanes_then_none() {
    std::vector<uint8_t> bytes(2 * kLanes, 0);
    std::fill(bytes.begin(), bytes.begin() + kLanes, 1);
    return bytes;
  }

  explicit SegmentTables(const SegmentLabels& labels_) : labels(labels_) {}

  // The start of block `block`, whose sums of each segment go to `blocks`.
  void start_block(int64_t block, BlockSums& blocks) {
    sums = blocks.sums + block * blocks.per_block;
    seen = blocks.kept.data() + block * blocks.per_block;
  }

  // Row `row`'s runs, in order; none for a row of buckets (`bucketed`).
  void start_row(int64_t row) {
    runs.clear();
    split = false;
    bucketed = false;
    labels_ahead = nullptr;
    if (!labels.per_token) {
      runs.push_back({labels.width, labels.segment_at(row, 0)});
    } else if (labels.kind == 1) {
      start_labels(static_cast<const int32_t*>(labels.values) + row * labels.width);
    } else {
      start_labels(static_cast<const int64_t*>(labels.values) + row * labels.width);
    }
  }

  template <typename T>
  void start_labels(const T* row) {
    bucketed = short_runs(row, labels.width);
    if (!bucketed) {
      add_runs(row);
    } else {
      labels_ahead = reinterpret_cast<const char*>(row);
      label_bytes = sizeof(T);
    }
  }

  // Row `row`'s counted tokens put in their segments' buckets (float32, or bfloat16
  // widened); `read(segment)` reads a bucket that fills up.
  template <typename Read>
  void fill_buckets(int64_t row, const char* b_row, const char* a_row, int log_prob_kind,
                    const char* m_row, int mask_kind, Read read) {
    const int64_t width = labels.width;
    if (static_cast<int64_t>(bucket_at.size()) < width) {
      flags.resize(width);
      bucket_at.resize(width);
    }
    if (filled.empty()) {  // the segments', then one for the tokens that do not count
      filled.assign(labels.segments + 2, 0);
      bucket_a.reset(new float[(labels.segments + 2) * kBucketStride]);
      bucket_b.reset(new float[(labels.segments + 2) * kBucketStride]);
    }
    const uint8_t* counted = counted_bytes(m_row, mask_kind, width, flags.data());
    const int64_t at = row * width;
    if (labels.kind == 1) {
      buckets_of(static_cast<const int32_t*>(labels.values) + at, counted);
    } else {
      buckets_of(static_cast<const int64_t*>(labels.values) + at, counted);
    }
    int64_t end = width;  // past the row's last counted token: right padding is skipped
    for (uint64_t eight = 0; end >= 8; end -= 8) {
      std::memcpy(&eight, counted + end - 8, 8);
      if (eight) break;
    }
    while (end > 0 && !counted[end - 1]) --end;
    if (log_prob_kind == 0) {
      put<float>(a_row, b_row, end, read);
    } else {
      put<uint16_t>(a_row, b_row, end, read);
    }
  }

  // Each token's bucket (`bucket_at`): its segment's, or the last where it does not count.
  template <typename T>
  void buckets_of(const T* row, const uint8_t* counted) {
    const uint64_t named = static_cast<uint64_t>(labels.segments);
    const int32_t none = labels.segments + 1;
    int32_t* out = bucket_at.data();
    for (int64_t t = 0; t < labels.width; ++t) {
      const uint64_t label = static_cast<uint64_t>(static_cast<int64_t>(row[t]));
      const int32_t segment = static_cast<int32_t>(label < named ? label : named);
      out[t] = counted[t] ? segment : none;
    }
  }

  // Each token written at its bucket's next place; a full bucket read (the last emptied).
  template <typename LogProb, typename Read>
  void put(const char* a_row, const char* b_row, int64_t end, Read read) {
    const auto* a = reinterpret_cast<const LogProb*>(a_row);
    const auto* b = reinterpret_cast<const LogProb*>(b_row);
    const int32_t none = labels.segments + 1;
    float* const to_a = bucket_a.get();
    float* const to_b = bucket_b.get();
    const int32_t* at = bucket_at.data();
    int32_t* const next = filled.data();
    for (int64_t t = 0; t < end; ++t) {
      const int32_t bucket = at[t];
      const int32_t k = next[bucket];
      to_a[bucket * kBucketStride + k] = widened(a[t]);
      to_b[bucket * kBucketStride + k] = widened(b[t]);
      next[bucket] = k + 1;
      if (k + 1 == kBucket) {
        if (bucket == none) {
          next[bucket] = 0;
        } else {
          read(bucket);
        }
      }
    }
  }

  // The sums of a segment's tokens, added into its sums.
  void add_to_segment(int segment, const RowSums& found) {
    if (seen[segment]) {
      sums[segment].add(found);
    } else {
      (new (sums + segment) SegmentSums)->keep(found);
      seen[segment] = 1;
    }
  }

  template <typename T>
  void add_runs(const T* row) {
    for (int64_t begin = 0; begin < labels.width;) {
      const int64_t end = run_end(row, begin, labels.width);
      runs.push_back({end, labels.segment_of(row[begin])});
      begin = end;
    }
  }

  // The end of `run`, whose sums `sums` hold: added into its segment's; unless it is the
  // row's last, kept in `before` and cleared, else the runs before it added back.
  void end_run(RowSums& sums, const Run* run) {
    add_to_segment(run->segment, sums);
    if (run == &runs.back()) {
      if (split) before.add_to(sums);
      return;
    }
    if (split) {
      before.add(sums);
    } else {
      before.keep(sums);
    }
    SegmentSums::clear(sums);
    split = true;
  }

};

// A vector across the end of a run (`segments` not null): added once for the lanes of each
// run it holds, from `position` to `end` (the row's end for its last, padded vector), the
// inputs' sums once for all lanes. `run` and `run_end` follow the runs.
template <bool kCatalog, int kInputs, bool kProfile>
__attribute__((always_inline)) inline void add_runs(
    RowSums& sums, PendingExtras<kCatalog, kProfile>& pending, f32 a, f32 b, i32 masked,
    int64_t position, int64_t end, const Options& options, SegmentTables& segments,
    const Run*& run, int64_t& run_end, RowExtras* extras) {
  const i32 lanes = lane_numbers();
  for (int64_t begin = position; begin < end;) {
    const int64_t stop = std::min(run_end, end);
    const i32 own = (lanes >= static_cast<int32_t>(begin - position)) &
                    (lanes < static_cast<int32_t>(stop - position));
    sums.add<kCatalog, kInputs, kProfile, false>(a, b, masked & own, options);
    if (extras) pending.add(sums.last, position);
    if (stop == run_end) {
      segments.end_run(sums, run);
      run_end = run == &segments.runs.back() ? INT64_MAX : (++run)->end;
    }
    begin = stop;
  }
  if constexpr (kInputs == kInline) sums.add_inputs(tokens_of(a, b, masked));
}

// One row's tokens added into `sums`, a block of tokens at a time. A mask of another dtype
// than bool is first turned into bytes for the block, and bfloat16 log-probs into float32
// (in L1), which keeps the arithmetic the same for all.
// kProfile: `extras` (not null) keeps the profile too.
// `segments`: null, or the row's runs (`SegmentTables`), whose sums it keeps apart.
template <bool kCatalog, int kInputs, bool kProfile>
__attribute__((always_inline)) inline void add_row_blocks(
    RowSums& sums, const char* b_row, const char* a_row, int log_prob_kind, const char* m_row,
    int mask_kind, int64_t width, const Options& options, RowExtras* extras,
    SegmentTables* segments) {
  PendingExtras<kCatalog, kProfile> pending{extras};
  // The run the pass is in and where it ends (never, without segments or tokens).
  const Run* run = segments ? segments->runs.data() : nullptr;
  int64_t run_end = segments && !segments->runs.empty() ? run->end : INT64_MAX;
  const char* labels = segments ? segments->labels_ahead : nullptr;
  const int64_t label_size = labels ? segments->label_bytes : 0;
  uint8_t bytes[kBlock];
  alignas(64) float a_block[kBlock], b_block[kBlock];  // bfloat16 log-probs, widened
  const int64_t mask_size = kMaskBytes[mask_kind];
  for (int64_t start = 0; start < width; start += kBlock) {
    const int64_t count = std::min(kBlock, width - start);
    const char* mask = m_row + start * mask_size;
    const uint8_t* flags = counted_bytes(mask, mask_kind, count, bytes);
    // Float32 rows are read in place, bfloat16 rows widened into the blocks.
    const float *a = a_block, *b = b_block;
    if (log_prob_kind == 0) {
      a = reinterpret_cast<const float*>(a_row) + start;
      b = reinterpret_cast<const float*>(b_row) + start;
    } else {
      widen_bfloat16(reinterpret_cast<const uint16_t*>(a_row) + start, count, a_block);
      widen_bfloat16(reinterpret_cast<const uint16_t*>(b_row) + start, count, b_block);
    }
    const int64_t whole = count - count % kLanes;
    // The last tokens of the row, padded with masked-out zeros.
    alignas(64) float a_tail[kLanes] = {}, b_tail[kLanes] = {};
    uint8_t m_tail[kLanes] = {};
    if (whole < count) {
      const int64_t rest = count - whole;
      std::memcpy(a_tail, a + whole, rest * sizeof(float));
      std::memcpy(b_tail, b + whole, rest * sizeof(float));
      std::memcpy(m_tail, flags + whole, rest);
    }
    for (int64_t j = 0; j < whole;) {
      // The vectors before the one where the current run ends (all of them, without
      // segments), then that one.
      const int64_t inside = std::min(whole, run_end - start - kLanes);
      for (; j < inside; j += kLanes) {
        // The next kilobytes of the row on their way: its streams otherwise outrun the
        // hardware prefetcher (for a block of bfloat16 rows, a harmless hint).
        prefetch_ahead(a + j, 4096);
        prefetch_ahead(b + j, 4096);
        const char* mask_ahead = mask + (j + 1024) * mask_size;
        for (int64_t line = 0; line < mask_size * kLanes; line += 64) {
          __builtin_prefetch(mask_ahead + line);
        }
        if (labels) {  // a bucketed row's, read once the row is
          const char* at = labels + (start + j) * label_size;
          for (int64_t line = 0; line < label_size * kLanes; line += 64) __builtin_prefetch(at + line);
        }
        sums.add<kCatalog, kInputs, kProfile>(floats_of(a + j), floats_of(b + j),
                                              nonzero(flags + j), options);
        if (extras) pending.add(sums.last, start + j);
      }
      if (j < whole) {
        add_runs<kCatalog, kInputs, kProfile>(sums, pending, floats_of(a + j), floats_of(b + j),
                                              nonzero(flags + j), start + j, start + j + kLanes,
                                              options, *segments, run, run_end, extras);
        j += kLanes;
      }
    }
    if (whole < count && start + count >= run_end) {  // the row's last run ends here
      add_runs<kCatalog, kInputs, kProfile>(sums, pending, floats_of(a_tail), floats_of(b_tail),
                                            nonzero(m_tail), start + whole, start + count,
                                            options, *segments, run, run_end, extras);
    } else if (whole < count) {
      sums.add<kCatalog, kInputs, kProfile>(floats_of(a_tail), floats_of(b_tail),
                                            nonzero(m_tail), options);
      if (extras) pending.add(sums.last, start + whole);
    }
    if constexpr (kInputs == kApart) {  // the same block again, from L1
      for (int64_t j = 0; j < whole; j += kLanes) {
        sums.add_inputs(tokens_of(floats_of(a + j), floats_of(b + j), nonzero(flags + j)));
      }
      if (whole < count) {
        sums.add_inputs(tokens_of(floats_of(a_tail), floats_of(b_tail), nonzero(m_tail)));
      }
    }
  }
  if (extras) pending.flush();
}

// What a bucket's tokens are read for: the seed group's columns, the catalog's, or those
// of a segment's default metrics alone (`kDefaultColumns`).
enum Reading { kSeedColumns, kCatalogColumns, kDefaults };

constexpr uint64_t kDefaultColumns =
    (1ull << c_count) | (1ull << c_nonfinite) | (1ull << c_max_a) | (1ull << c_max_b) |
    (1ull << c_max_diff) | (1ull << c_diff) | (1ull << c_abs_r) | (1ull << c_r) |
    (1ull << c_k3) | (1ull << c_high) | (1ull << c_low);

// The reading of the buckets of a pass whose row sums compute the catalog or not.
inline Reading bucket_reading(const SegmentLabels& labels, bool catalog) {
  if ((labels.columns & ~kDefaultColumns) == 0) return kDefaults;
  return catalog ? kCatalogColumns : kSeedColumns;
}

// One vector of a bucket's tokens added into `sums`, for the columns of `kReading`.
template <Reading kReading>
__attribute__((always_inline)) inline void add_bucket_vector(RowSums& sums, f32 a, f32 b,
                                                             i32 counted,
                                                             const Options& options) {
  if constexpr (kReading == kDefaults) {
    sums.add_defaults(a, b, counted, options);
  } else {
    sums.add<kReading == kCatalogColumns, kNoInputs, false>(a, b, counted, options);
  }
}

// The sums of the tokens in `segment`'s bucket (all counted), into the segment's.
template <Reading kReading>
void read_bucket(SegmentTables& segments, int segment, const Options& options) {
  const int64_t count = segments.filled[segment];
  const float* a = segments.bucket_a.get() + segment * kBucketStride;
  const float* b = segments.bucket_b.get() + segment * kBucketStride;
  RowSums sums;
  // The lanes that count, read as a row's mask is (a constant one has GCC do the selects
  // of `tokens_of` one lane at a time): from `ones`, every lane, then `rest` of them.
  const uint8_t* every = segments.ones.data();
  const int64_t whole = count - count % kLanes, rest = count - whole;
  for (int64_t j = 0; j < whole; j += kLanes) {
    add_bucket_vector<kReading>(sums, floats_of(a + j), floats_of(b + j), nonzero(every),
                                options);
  }
  if (rest) {  // the last tokens, padded with masked-out zeros
    alignas(64) float a_tail[kLanes] = {}, b_tail[kLanes] = {};
    std::memcpy(a_tail, a + whole, rest * sizeof(float));
    std::memcpy(b_tail, b + whole, rest * sizeof(float));
    add_bucket_vector<kReading>(sums, floats_of(a_tail), floats_of(b_tail),
                                nonzero(every + kLanes - rest), options);
  }
  segments.add_to_segment(segment, sums);
  segments.filled[segment] = 0;
}

// The segments of a `SegmentTables::bucketed` row (whose own sums were taken apart): its
// counted tokens put in their segments' buckets, each read when full.
template <Reading kReading>
void add_bucketed_row(SegmentTables& segments, const char* b_row, const char* a_row,
                    int log_prob_kind, const char* m_row, int mask_kind, int64_t row,
                    const Options& options) {
  segments.fill_buckets(row, b_row, a_row, log_prob_kind, m_row, mask_kind,
                        [&](int segment) { read_bucket<kReading>(segments, segment, options); });
}

// The buckets read at the end of a block of rows.
template <Reading kReading>
void read_buckets(SegmentTables& segments, const Options& options) {
  if (segments.filled.empty()) return;
  for (int segment = 0; segment <= segments.labels.segments; ++segment) {
    if (segments.filled[segment]) read_bucket<kReading>(segments, segment, options);
  }
  segments.filled.back() = 0;
}

// One row into its sums (`out`).
template <bool kCatalog, int kInputs, bool kProfile>
void reduce_row_blocks(const char* b_row, const char* a_row, int log_prob_kind,
                       const char* m_row, int mask_kind, int64_t width, const Options& options,
                       double* out, RowExtras* extras, SegmentTables* segments) {
  RowSums sums;
  add_row_blocks<kCatalog, kInputs, kProfile>(sums, b_row, a_row, log_prob_kind, m_row,
                                              mask_kind, width, options, extras, segments);
  sums.write(out);
}

// One row. With every group, the running sums of the inputs and of the statistics
// outnumber the 32 vector registers of AVX-512: without the profile, the inputs' take a
// second loop over each block (0.83x the time for every group). With the profile they
// share the first, whose memory increments leave the arithmetic units room for them; and
// with 16 registers both loops would spill (1.01x to 1.07x the time apart).
template <bool kCatalog, bool kInputSums, bool kProfile>
void reduce_row(const char* b_row, const char* a_row, int log_prob_kind, const char* m_row,
                int mask_kind, int64_t width, const Options& options, double* out,
                RowExtras* extras, SegmentTables* segments) {
  constexpr bool kApartFits = kLanes == 16 && !kProfile;
  constexpr int kInputs = !kInputSums ? kNoInputs : kApartFits ? kApart : kInline;
  reduce_row_blocks<kCatalog, kInputs, kProfile>(b_row, a_row, log_prob_kind, m_row, mask_kind,
                                                 width, options, out, extras, segments);
}

void reduce_rows(const char* rollout, const char* old, int log_prob_kind, const char* mask,
                 int mask_kind, int64_t width, int64_t begin, int64_t end, int level,
                 const Options& options, double* out, const ExtrasRequest* request,
                 int32_t* counts, ProfileTables* profile, WorstSoFar* worst,
                 SegmentTables* segments) {
  const int64_t row_bytes = width * log_prob_size(log_prob_kind);
  // Bit 0: the catalog beyond the seed group; bit 1: sums of the inputs (any other level:
  // both).
  const int sums = level >= 0 && level < 3 ? level : 3;
  const Reading reading = segments ? bucket_reading(segments->labels, sums & 1) : kSeedColumns;
  for (int64_t row = begin; row < end; ++row) {
    if (segments) segments->start_row(row);
    const char* b = rollout + row * row_bytes;
    const char* a = old + row * row_bytes;
    const char* m = mask + row * width * kMaskBytes[mask_kind];
    double* slots = out + row * kSlots;
    RowExtras* extras = nullptr;
    alignas(64) unsigned char storage[sizeof(RowExtras)];
    if (request) extras = new (storage) RowExtras(*request, counts, profile, worst->floor);
    const int kind = sums | (profile ? 4 : 0);  // bit 2: the profile
    // The row's runs; a bucketed row has none (its segments are read apart, after it).
    SegmentTables* runs = segments;
    const auto row_with = [&](auto reduce) {
      reduce(b, a, log_prob_kind, m, mask_kind, width, options, slots, extras, runs);
    };
    switch (kind) {
      case 0: row_with(reduce_row<false, false, false>); break;
      case 1: row_with(reduce_row<true, false, false>); break;
      case 2: row_with(reduce_row<false, true, false>); break;
      case 3: row_with(reduce_row<true, true, false>); break;
      case 4: row_with(reduce_row<false, false, true>); break;
      case 5: row_with(reduce_row<true, false, true>); break;
      case 6: row_with(reduce_row<false, true, true>); break;
      default: row_with(reduce_row<true, true, true>); break;
    }
    if (extras) {
      const double* catalog = kind & 1 ? slots : nullptr;  // the row's sums hold the catalog
      extras->write(request->rows + row * (kMoments + 2 * request->k), catalog);
      worst->add(extras->keys, extras->filled);
    }
    if (segments && segments->bucketed) {
      const auto bucketed = reading == kDefaults         ? add_bucketed_row<kDefaults>
                            : reading == kCatalogColumns ? add_bucketed_row<kCatalogColumns>
                                                         : add_bucketed_row<kSeedColumns>;
      bucketed(*segments, b, a, log_prob_kind, m, mask_kind, row, options);
    }
  }
  if (segments) {
    const auto read = reading == kDefaults         ? read_buckets<kDefaults>
                      : reading == kCatalogColumns ? read_buckets<kCatalogColumns>
                                                   : read_buckets<kSeedColumns>;
    read(*segments, options);
  }
}

// The 2^kBits copies of each count of a part ([slot][copy]) added up into `totals`.
template <int kBits>
void add_copies(const int32_t* counts, int64_t* totals) {
  for (int slot = 0; slot < kCounted; ++slot) {
    int64_t total = 0;
    for (int copy = 0; copy < (1 << kBits); ++copy) total += counts[(slot << kBits) + copy];
    totals[slot] = total;
  }
}

void add_copies(const int32_t* counts, int copy_bits, int64_t* totals) {
  switch (copy_bits) {
    case 0: add_copies<0>(counts, totals); break;
    case 1: add_copies<1>(counts, totals); break;
    default: add_copies<2>(counts, totals); break;
  }
}

// The profile block from the parts' counts (their copies added up), their maxima and the
// blocks' sums; `idle` tokens that do not count are taken off the counts of the slots of
// zeros. With `coarse`, the histograms' bins are added up from the fine counts there too.
void write_profile(const int64_t* part_totals, int64_t parts, const double* block_sums,
                   int64_t blocks, const std::vector<float>& maxima, int64_t width,
                   int64_t idle, const ExtrasRequest& request, double* coarse, double* out) {
  std::vector<int64_t> totals(part_totals, part_totals + kCounted);
  for (int64_t part = 1; part < parts; ++part) {
    const int64_t* own = part_totals + part * kCounted;
    for (int slot = 0; slot < kCounted; ++slot) totals[slot] += own[slot];
  }
  // The tokens that do not count were counted at d = r = +0 and a = b = +0 (-a = -0.0).
  const f32 zero = splat<f32>(0.0f);
  const int joint_zero = log_bin<kJointBits>(-zero, kJointLow, kJointOctaves)[0];
  const int zeros[3] = {log_bin<kFineBits>(zero, kDiffLow, kDiffOctaves)[0],
                        kDiffBins + signed_fine_bin(zero)[0],
                        kJointCounted + joint_zero * kJointSide + joint_zero};
  for (const int slot : zeros) totals[slot] -= idle;
  // Whole numbers: float64 holds them exactly below 2^53.
  std::fill(out, out + kProfileSize, 0.0);
  std::copy(totals.begin(), totals.begin() + kDiffBins, out + part_at(p_diff_bins));
  write_fine_log_bins(totals.data() + kDiffBins, out + part_at(p_log_bins));
  std::copy(totals.begin() + kJointCounted, totals.end(), out + part_at(p_joint));
  if (coarse) write_coarse_bins(request, totals.data(), coarse);
  double sums[kBlockSlots] = {};
  for (int64_t block = 0; block < blocks; ++block) {
    for (int i = 0; i < kBlockSlots; ++i) sums[i] += block_sums[block * kBlockSlots + i];
  }
  const struct { ProfilePart part; int from, size; } parts_of_sums[] = {
      {p_position_tokens, b_position_tokens, kPositionBuckets},
      {p_position_diff, b_position_diff, kPositionBuckets},
      {p_position_k3, b_position_k3, kPositionBuckets},
      {p_probability_tokens, b_probability_tokens, kProbabilityBuckets},
      {p_probability_diff, b_probability_diff, kProbabilityBuckets},
      {p_probability_log, b_probability_log, kProbabilityBuckets}};
  for (const auto& part : parts_of_sums) {
    std::memcpy(out + part_at(part.part), sums + part.from, part.size * sizeof(double));
  }
  float diff_max = -kInf, log_max = -kInf;
  for (int64_t part = 0; part < parts; ++part) {
    diff_max = std::max(diff_max, maxima[2 * part]);
    log_max = std::max(log_max, maxima[2 * part + 1]);
  }
  out[part_at(p_diff_max)] = diff_max;
  out[part_at(p_log_max)] = log_max;
  out[part_at(p_width)] = static_cast<double>(width);
}

// Blocks of at least 2^15 tokens, at most 64, whose segments' sums are kept apart (the
// profile's blocks where there is the profile): each segment's sums are written once a
// block, whatever its runs.
constexpr int64_t kTokensPerSegmentBlock = int64_t{1} << 15;

inline int64_t segment_blocks(int64_t rows, int64_t width) {
  const int64_t by_tokens = rows * width / kTokensPerSegmentBlock;
  return std::max<int64_t>(1, std::min({rows, by_tokens, int64_t{64}}));
}

// `labels`: null, or the segments', whose rows of sums go into `segment_rows` ([segments +
// 1][kSlots]).
void run(const void* rollout, const void* old, int log_prob_kind, const void* mask,
         int mask_kind, int64_t rows, int64_t width, int level, Options options, int threads,
         double* out, const ExtrasRequest* request, const SegmentLabels* labels,
         double* segment_rows) {
  const bool profile = request && request->profile;
  // Threads take whole blocks of rows: the profile's float64 sums are kept per block, and
  // the segments' (one block per row without either).
  const int64_t blocks = profile  ? profile_blocks(rows, width)
                         : labels ? segment_blocks(rows, width)
                                  : rows;
  BlockSums block_sums_of_segments(labels ? blocks : 0, labels ? labels->segments + 1 : 0);
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, blocks));
  // Each part counts into bins of its own (kCopies copies of them); summed at the end,
  // in a fixed order, so the result does not depend on the threads.
  const int stride = request ? ratio_bins(*request) + diff_bins(*request) : 0;
  // int32 counts: a copy overflows only past 2^31 tokens of two lanes of one call. None
  // where the histograms' bins come from the profile's.
  const bool fine_only = profile && coarse_from_fine(*request);
  const bool counted = request && request->histograms && !fine_only;
  std::vector<int32_t> counts(counted ? parts * kCopies * stride : 0);
  const int copy_bits = profile ? profile_copy_bits(rows * width / parts) : 0;
  const int64_t counted_size = int64_t{kCounted} << copy_bits;  // a part's copies
  // The profile's tables, each part's cleared by the part itself (in parallel, into its
  // thread's caches), and its counts added up over their copies there too.
  const auto tables_of = [profile](int64_t size) { return profile ? size : 0; };
  std::unique_ptr<int32_t[]> profile_counts(new int32_t[tables_of(parts * counted_size)]);
  std::unique_ptr<double[]> lane_sums(new double[tables_of(parts * kLaneSums)]);
  std::unique_ptr<double[]> block_sums(new double[tables_of(blocks * kBlockSlots)]);
  std::unique_ptr<int64_t[]> part_totals(new int64_t[tables_of(parts * kCounted)]);
  std::vector<float> maxima(profile ? 2 * parts : 0);
  std::vector<int64_t> idle(profile ? parts : 0);
  auto part = [&](int64_t index) {
    const int64_t first = blocks * index / parts, last = blocks * (index + 1) / parts;
    const auto* b = static_cast<const char*>(rollout);
    const auto* a = static_cast<const char*>(old);
    const auto* m = static_cast<const char*>(mask);
    int32_t* own = counts.empty() ? nullptr : counts.data() + index * kCopies * stride;
    WorstSoFar worst{request ? request->k : 0};
    if (labels && !profile) {
      SegmentTables segments(*labels);
      for (int64_t block = first; block < last; ++block) {
        segments.start_block(block, block_sums_of_segments);
        reduce_rows(b, a, log_prob_kind, m, mask_kind, width, rows * block / blocks,
                    rows * (block + 1) / blocks, level, options, out, request, own, nullptr,
                    &worst, &segments);
      }
      return;
    }
    if (!profile) {
      reduce_rows(b, a, log_prob_kind, m, mask_kind, width, rows * first / blocks,
                  rows * last / blocks, level, options, out, request, own, nullptr, &worst,
                  nullptr);
      return;
    }
    std::unique_ptr<SegmentTables> segments(labels ? new SegmentTables(*labels) : nullptr);
    int32_t* own_counts = profile_counts.get() + index * counted_size;
    double* own_lanes = lane_sums.get() + index * kLaneSums;
    std::fill(own_counts, own_counts + counted_size, 0);
    std::fill(own_lanes, own_lanes + kLaneSums, 0.0);
    ProfileTables tables{own_counts, copy_bits, lane_numbers() & ((1 << copy_bits) - 1),
                         own_lanes, nullptr};
    for (int64_t block = first; block < last; ++block) {
      tables.block = block_sums.get() + block * kBlockSlots;
      std::fill(tables.block, tables.block + kBlockSlots, 0.0);
      if (segments) segments->start_block(block, block_sums_of_segments);
      reduce_rows(b, a, log_prob_kind, m, mask_kind, width, rows * block / blocks,
                  rows * (block + 1) / blocks, level, options, out, request, own, &tables,
                  &worst, segments.get());
      tables.end_block();
    }
    add_copies(own_counts, copy_bits, part_totals.get() + index * kCounted);
    maxima[2 * index] = tables.diff_max;
    maxima[2 * index + 1] = tables.log_max;
    idle[index] = tables.idle;
  };
  if (parts == 1) {
    part(0);
  } else {
#if defined(_OPENMP)
  // torch's own OpenMP pool when torch loaded libgomp (the same soname): its threads
  // are warm, and no second pool competes with them for the cores.
#pragma omp parallel for num_threads(parts) schedule(static, 1)
  for (int64_t k = 0; k < parts; ++k) part(k);
#else
  std::vector<std::thread> workers;
  for (int64_t k = 1; k < parts; ++k) workers.emplace_back(part, k);
  part(0);
  for (auto& worker : workers) worker.join();
#endif
  }
  if (!counts.empty()) {
    for (int bin = 0; bin < stride; ++bin) {
      int64_t total = 0;
      for (int64_t copy = 0; copy < parts * kCopies; ++copy) total += counts[copy * stride + bin];
      request->bins[bin] = static_cast<double>(total);
    }
  }
  if (profile) {
    int64_t idle_tokens = 0;
    for (const int64_t tokens : idle) idle_tokens += tokens;
    write_profile(part_totals.get(), parts, block_sums.get(), blocks, maxima, width,
                  idle_tokens, *request, fine_only ? request->bins : nullptr,
                  profile_block(*request));
  }
  if (labels) block_sums_of_segments.write(segment_rows);
}

// ------------------------------------------------------------ the packed states
// The slots of the statistics' packed state (`STATE` in layout.py), in its order, and the
// groups of the catalog an update may take: the loader checks both by name.
#define ROLLOUT_STATE_SLOTS(X)                                                              \
  X(s_count, "count") X(s_pa, "prob_actor") X(s_pb, "prob_rollout") X(s_diff, "prob_diff")   \
  X(s_abs_r, "log_diff") X(s_pa2, "prob_actor*prob_actor")                                  \
  X(s_pb2, "prob_rollout*prob_rollout") X(s_papb, "prob_actor*prob_rollout")                \
  X(s_diff2, "prob_diff*prob_diff") X(s_r2, "log_diff*log_diff") X(s_nonfinite, "nonfinite") \
  X(s_log_ratio, "log_ratio") X(s_k3, "kl_k3") X(s_mult, "mult_error_m1")                    \
  X(s_rm1, "ratio_m1") X(s_rsqm1, "ratio_sq_m1") X(s_ratio, "ratio") X(s_ratio2, "ratio_sq") \
  X(s_high, "ratio_high") X(s_low, "ratio_low") X(s_sequences, "sequences")                 \
  X(s_ppl_a, "seq_ppl_actor") X(s_ppl_b, "seq_ppl_rollout") X(s_seq_r, "seq_log_ratio")      \
  X(s_outside, "seq_outside") X(s_id_updates, "id_updates") X(s_id_rows, "id_rows")          \
  X(s_id_diff, "id_diff") X(s_id_diff_rows, "id_diff_rows")                                 \
  X(s_zero_b, "zero_rollout_log_prob") X(s_zero_run, "zero_rollout_log_prob_run")          \
  X(s_masked_a, "masked_actor_log_prob") X(s_pairs, "neighbour_pairs")                      \
  X(s_pad_updates, "pad_updates") X(s_pad, "pad_in_mask")                                   \
  X(s_sum_a, "sum_actor_log_prob") X(s_sum_b, "sum_rollout_log_prob")                       \
  X(s_aa, "sum_actor_log_prob_sq") X(s_bb, "sum_rollout_log_prob_sq")                       \
  X(s_ab, "sum_actor_x_rollout") X(s_ab_next, "sum_actor_x_next_rollout")                   \
  X(s_ab_prev, "sum_next_actor_x_rollout") X(s_plus_a, "plus_actor")                       \
  X(s_plus_a2, "plus_actor_sq") X(s_plus_b, "plus_rollout") X(s_plus_b2, "plus_rollout_sq")   \
  X(s_minus_a, "minus_actor") X(s_minus_a2, "minus_actor_sq") X(s_minus_b, "minus_rollout")   \
  X(s_minus_b2, "minus_rollout_sq") X(s_max_diff, "max_prob_diff")                          \
  X(s_max_abs_r, "max_log_diff") X(s_max_r, "max_log_ratio")                                \
  X(s_max_seq_abs, "max_seq_abs_log_ratio") X(s_max_seq, "max_seq_log_ratio")               \
  X(s_max_a, "max_actor_log_prob") X(s_max_b, "max_rollout_log_prob")                       \
  X(s_min_r, "min_log_ratio") X(s_min_seq, "min_seq_log_ratio")
#define ROLLOUT_GROUPS(X)                                                                   \
  X(g_seed, "seed") X(g_log_space, "log_space") X(g_kl, "kl") X(g_ratio, "importance_ratio") \
  X(g_sequence, "sequence") X(g_health, "health")
// The fields of a worst-token candidate (`WORST_FIELDS` in worst_tokens.py): `segment` is
// the token's segment (-1 here: `label_candidates` in worst_tokens.py writes it from the
// labels once the candidates are finished), `context_j` the id j positions before the
// token in its row.
#define ROLLOUT_WORST_FIELDS(X)                                                             \
  X(w_key, "abs_log_ratio") X(w_r, "log_ratio") X(w_pa, "actor_prob") X(w_pb, "rollout_prob") \
  X(w_batch, "batch") X(w_row, "row") X(w_position, "position") X(w_id, "token_id")         \
  X(w_rank, "rank") X(w_segment, "segment") X(w_context_1, "context_1")                     \
  X(w_context_2, "context_2") X(w_context_3, "context_3") X(w_context_4, "context_4")       \
  X(w_context_5, "context_5") X(w_context_6, "context_6")

#define ROLLOUT_ENUM(id, name) id,
#define ROLLOUT_NAME(id, name) name,
enum Slot { ROLLOUT_STATE_SLOTS(ROLLOUT_ENUM) kStateSlots };
enum Group { ROLLOUT_GROUPS(ROLLOUT_ENUM) kGroups };
enum WorstField { ROLLOUT_WORST_FIELDS(ROLLOUT_ENUM) kWorstFields };
constexpr const char* kSlotNames[] = {ROLLOUT_STATE_SLOTS(ROLLOUT_NAME)};
constexpr const char* kGroupNames[] = {ROLLOUT_GROUPS(ROLLOUT_NAME)};
constexpr const char* kWorstNames[] = {ROLLOUT_WORST_FIELDS(ROLLOUT_NAME)};
constexpr int kContextTokens = kWorstFields - w_context_1;  // `CONTEXT_TOKENS`
#undef ROLLOUT_ENUM
#undef ROLLOUT_NAME

// The packed state of the statistics from the row table (`layout.STATE`): the slots of
// the groups asked for are written, the others keep what the caller put there (the
// empty window).
struct StateOf {
  const double* table;  // [rows, kSlots]
  int64_t rows;
  uint64_t needed;  // bit c: column c is computed
  int groups;       // bit g: group g is on

  bool has(Column c) const { return (needed >> c) & 1; }
  bool on(Group g) const { return (groups >> g) & 1; }
  double at(int64_t row, Column c) const { return table[row * kSlots + c]; }
  double total(Column c) const {
    double out = 0;
    for (int64_t row = 0; row < rows; ++row) out += at(row, c);
    return out;
  }
  double largest(Column c) const {
    double out = -INFINITY;
    for (int64_t row = 0; row < rows; ++row) out = std::max(out, at(row, c));
    return out;
  }

  void write(double low_bound, double high_bound, double* state) const {
    const double count = total(c_count);
    state[s_count] = count;
    state[s_nonfinite] = total(c_nonfinite);
    state[s_max_a] = largest(c_max_a);
    state[s_max_b] = largest(c_max_b);
    // Means and centred co-moments: M_xy = S_xy - S_x S_y / n.
    const double scale = 1.0 / std::max(count, 1.0);
    const struct { Column column; Slot slot; } means[] = {
        {c_pa, s_pa}, {c_pb, s_pb}, {c_diff, s_diff}, {c_abs_r, s_abs_r}};
    for (const auto& mean : means) {
      if (has(mean.column)) state[mean.slot] = total(mean.column) * scale;
    }
    const struct { Column xy, x, y; Slot slot; } pairs[] = {
        {c_pa2, c_pa, c_pa, s_pa2},      {c_pb2, c_pb, c_pb, s_pb2},
        {c_papb, c_pa, c_pb, s_papb},    {c_diff2, c_diff, c_diff, s_diff2},
        {c_r2, c_abs_r, c_abs_r, s_r2}};
    for (const auto& pair : pairs) {
      if (!has(pair.xy)) continue;
      const double value = total(pair.xy) - total(pair.x) * total(pair.y) * scale;
      state[pair.slot] = pair.x == pair.y ? std::max(value, 0.0) : value;
    }
    if (has(c_max_diff)) state[s_max_diff] = largest(c_max_diff);
    double r_max = -INFINITY, r_min = INFINITY;
    if (has(c_max_r)) r_max = largest(c_max_r), r_min = -largest(c_max_neg_r);
    if (has(c_abs_r)) state[s_max_abs_r] = std::max(r_max, -r_min);
    if (on(g_kl) || on(g_ratio)) state[s_log_ratio] = total(c_r);
    const struct { Column column; Slot slot; } sums[] = {
        {c_k3, s_k3},       {c_mult, s_mult},   {c_rm1, s_rm1},     {c_rsqm1, s_rsqm1},
        {c_ratio, s_ratio}, {c_ratio2, s_ratio2}, {c_high, s_high}, {c_low, s_low}};
    for (const auto& sum : sums) {
      if (has(sum.column)) state[sum.slot] = total(sum.column);
    }
    if (has(c_high)) {
      auto clamp = [](double x) { return std::isinf(x) ? x : std::min(std::max(x, -20.0), 20.0); };
      state[s_max_r] = clamp(r_max);
      state[s_min_r] = clamp(r_min);
    }
    if (on(g_health) || on(g_sequence)) {
      double sequences = 0;
      for (int64_t row = 0; row < rows; ++row) sequences += at(row, c_count) > 0;
      state[s_sequences] = sequences;
    }
    if (on(g_health)) {
      const struct { Column column; Slot slot; } health[] = {
          {c_zero_b, s_zero_b}, {c_zero_run, s_zero_run}, {c_masked_actor, s_masked_a},
          {c_pairs, s_pairs}, {c_sum_a, s_sum_a}, {c_sum_b, s_sum_b},
          {c_aa, s_aa},         {c_bb, s_bb},       {c_ab, s_ab},       {c_ab_next, s_ab_next},
          {c_ab_prev, s_ab_prev}, {c_plus_a, s_plus_a}, {c_plus_a2, s_plus_a2},
          {c_plus_b, s_plus_b},   {c_plus_b2, s_plus_b2}, {c_minus_a, s_minus_a},
          {c_minus_a2, s_minus_a2}, {c_minus_b, s_minus_b}, {c_minus_b2, s_minus_b2}};
      for (const auto& sum : health) state[sum.slot] = total(sum.column);
    }
    if (on(g_sequence)) write_sequences(low_bound, high_bound, state);
  }

  // Sequence statistics from the float64 row sums of a, b and r (`_sequence_sums`).
  void write_sequences(double low_bound, double high_bound, double* state) const {
    double ppl_a = 0, ppl_b = 0, log_ratio = 0, outside = 0;
    double max_abs = -INFINITY, max_r = -INFINITY, min_r = INFINITY;
    for (int64_t row = 0; row < rows; ++row) {
      const double count = at(row, c_count), sum_a = at(row, c_sum_a), sum_b = at(row, c_sum_b);
      const double per_row = std::max(count, 1.0);
      const double mean_r = at(row, c_r) / per_row;
      log_ratio += mean_r;
      if (count <= 0) continue;
      const double geo = std::exp(mean_r);
      outside += geo < low_bound || geo > high_bound;
      ppl_a += std::exp(-sum_a / per_row);
      ppl_b += std::exp(-sum_b / per_row);
      max_abs = std::max(max_abs, std::fabs(mean_r));
      max_r = std::max(max_r, mean_r);
      min_r = std::min(min_r, mean_r);
    }
    state[s_ppl_a] = ppl_a;
    state[s_ppl_b] = ppl_b;
    state[s_seq_r] = log_ratio;
    state[s_outside] = outside;
    state[s_max_seq_abs] = max_abs;
    state[s_max_seq] = max_r;
    state[s_min_seq] = min_r;
  }
};

// The packed segments (`SegmentWindow` in segments.py) from each segment's row of sums:
// each segment's statistics of the token-level groups, finished as a pass's rows are, into
// its copy of the state.
constexpr int kSegmentGroups = (1 << g_seed) | (1 << g_log_space) | (1 << g_kl) | (1 << g_ratio);

void write_segments(const double* rows, int segments, uint64_t needed, int groups,
                    double* state) {
  for (int segment = 0; segment <= segments; ++segment) {
    const StateOf of{rows + segment * kSlots, 1, needed, groups & kSegmentGroups};
    of.write(0.0, 0.0, state + segment * kStateSlots);
  }
}

inline double log_prob_at(const void* values, int kind, int64_t index) {
  float x;
  if (kind == 0) {
    x = static_cast<const float*>(values)[index];
  } else {
    const uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(values)[index]) << 16;
    std::memcpy(&x, &bits, sizeof x);
  }
  return x;
}

inline double id_at(const void* ids, int kind, int64_t index) {
  switch (kind) {
    case 1: return static_cast<double>(static_cast<const int32_t*>(ids)[index]);
    case 2: return static_cast<double>(static_cast<const int64_t*>(ids)[index]);
    default: return -1.0;
  }
}

// The k candidates of the packed extras, from `out` on.
void write_candidates(const void* rollout, const void* old, int kind, const void* ids,
                      int id_kind, int64_t rows, int64_t width, const ExtrasRequest& x,
                      double batch_index, double rank, const SegmentLabels* labels,
                      double* out) {
  const int per_row = kMoments + 2 * x.k;
  struct Candidate { double key; int64_t row, position; };
  std::vector<Candidate> found;
  for (int64_t row = 0; row < rows; ++row) {
    const double* pairs = x.rows + row * per_row + kMoments;
    for (int i = 0; i < x.k; ++i) {
      if (pairs[2 * i] > -INFINITY) {
        found.push_back({pairs[2 * i], row, static_cast<int64_t>(pairs[2 * i + 1])});
      }
    }
  }
  const size_t kept = std::min<size_t>(found.size(), x.k);
  std::partial_sort(found.begin(), found.begin() + kept, found.end(),
                    [](const Candidate& p, const Candidate& q) {
                      if (p.key != q.key) return p.key > q.key;
                      return p.row != q.row ? p.row < q.row : p.position < q.position;
                    });
  for (int i = 0; i < x.k; ++i, out += kWorstFields) {
    if (static_cast<size_t>(i) >= kept) {  // a placeholder: loses against any token
      const double empty[w_context_1] = {-INFINITY, 0, 0, 0, 0, 0, 0, -1, 0, -1};
      std::memcpy(out, empty, sizeof empty);
      std::fill(out + w_context_1, out + kWorstFields, -1.0);
      continue;
    }
    const Candidate& c = found[i];
    const int64_t index = c.row * width + c.position;
    // As the statistics read them: floored in float32, r = a - b in float32.
    const float a = std::max(static_cast<float>(log_prob_at(old, kind, index)), kLogProbFloor);
    const float b = std::max(static_cast<float>(log_prob_at(rollout, kind, index)), kLogProbFloor);
    const float r = a - b;
    out[w_key] = c.key;
    out[w_r] = r;
    out[w_pa] = std::exp(static_cast<double>(a));
    out[w_pb] = std::exp(static_cast<double>(b));
    out[w_batch] = batch_index;
    out[w_row] = static_cast<double>(c.row);
    out[w_position] = static_cast<double>(c.position);
    out[w_id] = ids ? id_at(ids, id_kind, index) : -1.0;
    out[w_rank] = rank;
    out[w_segment] = labels ? labels->segment_at(c.row, c.position) : -1.0;
    for (int j = 1; j <= kContextTokens; ++j) {  // the ids before it in its row
      out[w_context_1 + j - 1] = ids && c.position >= j ? id_at(ids, id_kind, index - j) : -1.0;
    }
  }
}

// Adds a pass's profile block into a window's: counts and sums add, and the last parts,
// the maxima and the width, keep the larger value (the window's starts at -inf).
static_assert(part_at(p_diff_max) + 3 == kProfileSize && part_at(p_width) + 1 == kProfileSize,
              "the maxima and the width end the profile block");
void add_profile(const double* pass, double* window) {
  constexpr int kSums = part_at(p_diff_max);
  for (int i = 0; i < kSums; ++i) window[i] += pass[i];
  for (int i = kSums; i < kProfileSize; ++i) window[i] = std::max(window[i], pass[i]);
}

// The packed extras (`TokenExtras` in extras.py) from the kernel's per-row extras: each
// histogram's bins and [num, min, max, sum, sum of squares], then the k candidates with
// the largest |r| among all rows' (ties: the earlier token), read back from the inputs,
// then the profile block.
void write_extras(const void* rollout, const void* old, int kind, const void* ids, int id_kind,
                  int64_t rows, int64_t width, const ExtrasRequest& x, double batch_index,
                  double rank, const SegmentLabels* labels, double* state) {
  const int per_row = kMoments + 2 * x.k;
  double* out = state;
  if (x.histograms) {
    double largest[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
    double totals[4] = {0, 0, 0, 0};
    for (int64_t row = 0; row < rows; ++row) {
      const double* moments = x.rows + row * per_row;
      for (int i = 0; i < 4; ++i) largest[i] = std::max(largest[i], moments[i]);
      for (int i = 0; i < 4; ++i) totals[i] += moments[4 + i];
    }
    const int sizes[2] = {ratio_bins(x), diff_bins(x)};
    const double* bins = x.bins;
    for (int h = 0; h < 2; ++h) {
      double num = 0;
      for (int bin = 0; bin < sizes[h]; ++bin) num += (*out++ = bins[bin]);
      bins += sizes[h];
      const double summary[5] = {num, -largest[2 * h + 1], largest[2 * h], totals[2 * h],
                                 totals[2 * h + 1]};
      std::memcpy(out, summary, sizeof summary);
      out += 5;
    }
  }
  if (x.k) {
    write_candidates(rollout, old, kind, ids, id_kind, rows, width, x, batch_index, rank, labels,
                     out);
  }
  if (x.profile == 1) {
    std::memcpy(out + x.k * kWorstFields, profile_block(x), kProfileSize * sizeof(double));
  } else if (x.profile == 2) {
    add_profile(profile_block(x), out + x.k * kWorstFields);
  }
}

}  // namespace

// The name of entry `index` of a table (1: the statistics' state slots, 2: the groups,
// 3: the worst-token fields, 4: the parts of the profile block, 5: the profile's
// constants), or null past its end.
extern "C" const char* rollout_name(int table, int index) {
#define ROLLOUT_PART_NAME(id, name, size) name,
#define ROLLOUT_CONSTANT_NAME(name, value) name,
  static const char* const parts[] = {ROLLOUT_PROFILE_PARTS(ROLLOUT_PART_NAME)};
  static const char* const constants[] = {ROLLOUT_PROFILE_CONSTANTS(ROLLOUT_CONSTANT_NAME)};
#undef ROLLOUT_PART_NAME
#undef ROLLOUT_CONSTANT_NAME
  constexpr int kConstants = sizeof constants / sizeof constants[0];
  switch (table) {
    case 1: return index >= 0 && index < kStateSlots ? kSlotNames[index] : nullptr;
    case 2: return index >= 0 && index < kGroups ? kGroupNames[index] : nullptr;
    case 3: return index >= 0 && index < kWorstFields ? kWorstNames[index] : nullptr;
    case 4: return index >= 0 && index < kProfileParts ? parts[index] : nullptr;
    case 5: return index >= 0 && index < kConstants ? constants[index] : nullptr;
    default: return nullptr;
  }
}

// The value of entry `index` of table 4 (the number of slots of a part of the profile
// block) or 5 (a constant of the profile) of `rollout_name`; NaN past its end.
extern "C" double rollout_profile_value(int table, int index) {
#define ROLLOUT_CONSTANT_VALUE(name, value) static_cast<double>(value),
  static const double constants[] = {ROLLOUT_PROFILE_CONSTANTS(ROLLOUT_CONSTANT_VALUE)};
#undef ROLLOUT_CONSTANT_VALUE
  constexpr int kConstants = sizeof constants / sizeof constants[0];
  if (table == 4 && index >= 0 && index < kProfileParts) return kPartSizes[index];
  if (table == 5 && index >= 0 && index < kConstants) return constants[index];
  return NAN;
}

// The statistics' packed state from a row table of `rollout_row_sums` (`needed`: bit c
// for each computed column; `groups`: bit g for each group on). Writes the slots of the
// groups on into `state`, which holds the empty window.
extern "C" int rollout_finish_state(const double* table, int64_t rows, uint64_t needed,
                                    int groups, double low_bound, double high_bound,
                                    double* state) {
  StateOf{table, rows, needed, groups}.write(low_bound, high_bound, state);
  return 0;
}

// The packed extras from the per-row extras and bins of `rollout_row_sums` (`ints` as
// there). `ids`: null, or token ids (`id_kind` 1: int32, 2: int64) shown in the table.
// `labels`: null, or the segment labels of the pass (its arguments), each candidate's
// segment written from them. With profile 2, `state`'s profile block is a window's: the
// pass's is added into it.
extern "C" int rollout_finish_extras(const void* rollout, const void* old, int log_prob_kind,
                                     const void* ids, int id_kind, int64_t rows,
                                     int64_t width, const int* ints, const double* extras_rows,
                                     const double* bins, double batch_index, double rank,
                                     const void* labels, int label_kind, int per_token,
                                     int segments, double* state) {
  const ExtrasRequest x{ints[0], ints[1], ints[2], ints[3], ints[4], ints[5], ints[6],
                        const_cast<double*>(extras_rows), const_cast<double*>(bins)};
  if (x.k < 0 || x.k > kMaxWorst || (log_prob_kind != 0 && log_prob_kind != 1)) return 3;
  if (x.profile < 0 || x.profile > 2 || ((x.histograms || x.profile) && !bins)) return 3;
  const SegmentLabels by_segment{labels, label_kind, per_token != 0, segments, width, 0};
  const bool segments_known = segments >= 1 && segments <= kMaxSegments;
  if (labels && ((label_kind != 1 && label_kind != 2) || !segments_known)) return 3;
  write_extras(rollout, old, log_prob_kind, ids, id_kind, rows, width, x, batch_index, rank,
               labels ? &by_segment : nullptr, state);
  return 0;
}

// The packed segments (`SegmentWindow` in segments.py: `segments` + 1 copies of the
// statistics' state, the last for every label outside [0, segments)) from the segments'
// rows of `rollout_row_sums` (`needed`, `groups` as `rollout_finish_state`'s): each copy
// gets the slots of the token-level groups among `groups`, the others keep what the
// caller put there (the empty window).
extern "C" int rollout_finish_segments(const double* rows, int segments, uint64_t needed,
                                       int groups, double* state) {
  if (segments < 1 || segments > kMaxSegments) return 3;
  write_segments(rows, segments, needed, groups, state);
  return 0;
}

// The name of output column `index`, or null past the last column.
extern "C" const char* rollout_row_column(int index) {
  return index >= 0 && index < kSlots ? kColumns[index] : nullptr;
}

// log_prob_kind: 0 float32, 1 bfloat16. mask_kind: 0 bool/uint8, 1 int32, 2 int64,
// 3 float32. `extras`: null, or what the extras take: the histograms' bins (`ints`:
// ratio low, ratio octaves, diff low, diff octaves, histograms on, k, profile: 0, 1 or 2) and
// where they go (`rows`: [rows, 8 + 2 k], `bins`: the histograms' bins, then the profile
// block). `labels`: null, or the segments' labels, [rows] (`per_token` 0) or [rows, width]
// (1), int32 (`label_kind` 1) or int64 (2), whose `segments` + 1 rows of sums (the last for
// every label outside [0, segments)) go into `segment_rows` ([segments + 1, kSlots]), of
// which `segment_columns` (bit c: column c) are needed. Returns 0; other values for arguments it does not know.
extern "C" int rollout_row_sums(const void* rollout, const void* old, const void* mask,
                                int log_prob_kind, int mask_kind, int64_t rows, int64_t width,
                                int level, float ratio_high_m1, float ratio_low_m1,
                                int threads, double* out, const int* ints, double* extras_rows,
                                double* bins, const void* labels, int label_kind, int per_token,
                                int segments, uint64_t segment_columns, double* segment_rows) {
  const Options options{ratio_high_m1, ratio_low_m1};
  ExtrasRequest request{};
  const ExtrasRequest* x = nullptr;
  if (ints) {
    request = ExtrasRequest{ints[0], ints[1], ints[2],     ints[3], ints[4],
                            ints[5], ints[6], extras_rows, bins};
    const bool summed = request.histograms || request.profile;
    if (request.k < 0 || request.k > kMaxWorst || request.profile < 0 || request.profile > 2 ||
        (summed && !bins) || !extras_rows) {
      return 3;
    }
    if (request.histograms && !bins_fit(request)) return 3;
    x = &request;
  }
  if (log_prob_kind != 0 && log_prob_kind != 1) return 1;
  if (mask_kind < 0 || mask_kind > 3) return 2;
  const SegmentLabels by_segment{labels,   label_kind, per_token != 0,
                                 segments, width,      segment_columns};
  const bool segments_known = segments >= 1 && segments <= kMaxSegments && segment_rows;
  if (labels && ((label_kind != 1 && label_kind != 2) || !segments_known)) return 3;
  run(rollout, old, log_prob_kind, mask, mask_kind, rows, width, level, options, threads, out, x,
      labels ? &by_segment : nullptr, segment_rows);
  return 0;
}

// The shape of the extras' rows: `kMoments` moments, then up to `kMaxWorst` pairs.
extern "C" int rollout_extras_shape(int which) { return which == 0 ? kMoments : kMaxWorst; }

// The float32 values one step of the loop takes: 16, 8 or 4.
extern "C" int rollout_vector_lanes() { return kLanes; }

// The widest build this CPU runs: 16 lanes where it has the AVX-512 sets that build is
// compiled with (setup.py), 8 with AVX2, FMA and BMI2, 4 with SSE4.2, else none (0). The
// operating system's support for the wide registers is part of the check. Called on the
// 4-lane build only.
extern "C" int rollout_cpu_lanes() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("sse4.2") || !__builtin_cpu_supports("popcnt")) return 0;
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("bmi2");
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
  if (avx2 && avx512) return 16;
  if (avx2) return 8;
#endif
  return 4;
}
