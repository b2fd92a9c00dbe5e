"""An independent float64 NumPy reference of the metric catalog (docs: METRICS.md).

Written straight from the definitions, token by token: the counting tokens are
gathered with boolean indexing and every statistic is the textbook formula in
float64. Nothing here is imported from the package under test.

:func:`reference_metrics` returns a :class:`Reference`: a plain ``dict`` of the
un-prefixed metric names (NaN where a value is undefined) that also carries the
magnitudes :func:`assert_metrics_close` needs to choose its tolerances.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

FLOOR = -20.0
CLAMP = 20.0
EPS32 = float(np.finfo(np.float32).eps)
RTOL = 1e-5
ATOL = 5e-7

PEARSON = "rollout_actor_probs_pearson_corr"
ONE_MINUS_PEARSON = "rollout_actor_probs_one_minus_pearson_corr"

NAMES: dict[str, tuple[str, ...]] = {
    "seed": (
        "rollout_probs_diff_valid",
        "rollout_probs_diff_max",
        "rollout_probs_diff_mean",
        "rollout_probs_diff_std",
        PEARSON,
        ONE_MINUS_PEARSON,
    ),
    "log_space": (
        "rollout_log_probs_diff_max",
        "rollout_log_probs_diff_mean",
        "rollout_log_probs_diff_std",
        "rollout_stale_period",
    ),
    "kl": (
        "rollout_actor_kl_k1",
        "rollout_actor_kl_k3",
        "rollout_actor_mult_prob_error",
        "rollout_actor_mult_prob_error_minus_one",
    ),
    "importance_ratio": (
        "rollout_is_ratio_mean",
        "rollout_is_ratio_mean_minus_one",
        "rollout_is_ratio_min",
        "rollout_is_ratio_max",
        "rollout_is_ratio_frac_high",
        "rollout_is_ratio_frac_low",
        "rollout_is_chi2",
        "rollout_is_ess",
        "rollout_is_one_minus_ess",
    ),
    "sequence": (
        "actor_ppl",
        "rollout_ppl",
        "rollout_actor_log_ppl_diff",
        "rollout_actor_log_ppl_abs_diff_max",
        "rollout_seq_geo_ratio_min",
        "rollout_seq_geo_ratio_max",
        "rollout_seq_frac_outside",
    ),
    "health": (
        "rollout_tokens",
        "rollout_sequences",
        "rollout_nonfinite_tokens",
        "rollout_alignment_lag",
        "rollout_zero_log_prob_tokens",
    ),
    "token_ids": ("rollout_token_diff_count", "rollout_token_diff_seq_frac"),
    "quantiles": (
        "rollout_probs_diff_p50",
        "rollout_probs_diff_p90",
        "rollout_probs_diff_p99",
        "rollout_probs_diff_p999",
        "rollout_log_probs_diff_p50",
        "rollout_log_probs_diff_p90",
        "rollout_log_probs_diff_p99",
        "rollout_log_probs_diff_p999",
    ),
}
"""The catalog, group by group, copied from METRICS.md and docs/metrics.md."""

QUANTILE_RTOL = 0.03
"""The quantiles' promised relative error, where the value is at least :data:`QUANTILE_FLOOR`."""
QUANTILE_FLOOR = 1e-8
QUANTILE_TOPS = {"rollout_probs_diff": 2.0, "rollout_log_probs_diff": 32.0}
"""Where the quantiles' bins end (docs/metrics.md)."""

SEED_FUNCTION_NAMES: tuple[str, ...] = NAMES["seed"][:5]
"""What the original ``calculate_debug_metrics`` returns: the seed group without
``rollout_actor_probs_one_minus_pearson_corr``."""

ALL_NAMES: tuple[str, ...] = tuple(name for names in NAMES.values() for name in names)

# Statistics in probability space: errors scale with the largest probability involved.
_PROB_SPACE = frozenset(NAMES["seed"][1:4])
# The Pearson correlation and its distance from 1: condition-aware tolerances, and the
# range each must stay in.
_PEARSON_RANGE = {PEARSON: (-1.0, 1.0), ONE_MINUS_PEARSON: (0.0, 2.0)}
# Statistics of log-ratios (terms up to ~20 nats): errors scale with max |r|.
_LOG_SPACE = frozenset(
    (
        *NAMES["log_space"],
        "rollout_actor_kl_k1",
        "rollout_actor_log_ppl_diff",
        "rollout_actor_log_ppl_abs_diff_max",
    )
)


class Reference(dict):
    """Reference metric values plus what the comparison needs to know about the data.

    Attributes:
        log_scale: ``max(1, max |r|)`` over the counting tokens.
        prob_scale: the largest ``pa`` or ``pb`` over the counting tokens (1 when none).
        pearson_sides: ``[(mean, population std), ...]`` of the two Pearson inputs, or
            ``None`` when fewer than two values count.
    """

    log_scale: float = 1.0
    prob_scale: float = 1.0
    pearson_sides: list[tuple[float, float]] | None = None
    lags: Mapping[int, float] = {}
    """Correlations of the log-probs by lag (:func:`lag_correlations`)."""
    lag_sides: Mapping[int, list[tuple[float, float]] | None] = {}
    """By lag, ``(mean, population std)`` of both sides of its pairs (:func:`lag_sides`)."""

    def select(self, names: Iterable[str]) -> Reference:
        """The same reference restricted to ``names`` (in that order)."""
        out = Reference({name: self[name] for name in names})
        out.log_scale, out.prob_scale = self.log_scale, self.prob_scale
        out.pearson_sides = self.pearson_sides
        out.lags, out.lag_sides = self.lags, self.lag_sides
        return out


def to_numpy(value: Any) -> np.ndarray:
    """A float64 copy of a tensor (exact upcast from any float dtype) or array-like."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().double().numpy()
    return np.asarray(value, dtype=np.float64)


def _ids_numpy(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().to(torch.int64).numpy()
    return np.asarray(value, dtype=np.int64)


def _as_list(value: Any, length: int | None = None) -> list[Any]:
    if value is None:
        return [None] * (length or 0)
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def _mean(x: np.ndarray) -> float:
    return float(np.mean(x)) if x.size >= 1 else math.nan


def _max(x: np.ndarray) -> float:
    return float(np.max(x)) if x.size >= 1 else math.nan


def _min(x: np.ndarray) -> float:
    return float(np.min(x)) if x.size >= 1 else math.nan


def _std(x: np.ndarray) -> float:
    return float(np.std(x, ddof=1)) if x.size >= 2 else math.nan


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    """Pearson correlation of two 1-D float64 samples; NaN if ``n < 2`` or a side is constant."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.size < 2:
        return math.nan
    dx, dy = x - x.mean(), y - y.mean()
    sxx, syy = float(np.sum(dx * dx)), float(np.sum(dy * dy))
    if not (0.0 < sxx < math.inf and 0.0 < syy < math.inf):
        return math.nan  # a constant side, or squares beyond float64
    return float(np.sum(dx * dy) / (math.sqrt(sxx) * math.sqrt(syy)))


def pearson_sides(x: np.ndarray, y: np.ndarray) -> list[tuple[float, float]] | None:
    """``(mean, population std)`` of both Pearson inputs, ``None`` when fewer than two."""
    if np.asarray(x).size < 2:
        return None
    return [(float(np.mean(v)), float(np.std(v))) for v in (x, y)]


def reference_metrics(
    rollout_log_probs: Any,
    old_log_probs: Any,
    mask: Any,
    *,
    is_threshold: float = 2.0,
    seq_ratio_bounds: tuple[float, float] = (0.99, 1.01),
    rollout_ids: Any = None,
    trainer_ids: Any = None,
) -> Reference:
    """Every metric of the catalog over a window of one or several ``[B, T]`` batches.

    Each argument is one batch or a list of batches (widths may differ between
    batches); the statistics are exact over the concatenation of all their counting
    tokens, and sequences are the rows of each batch. Token ids may be ``None`` for the
    whole window or for single batches (those batches then add nothing to the token-id
    group, which is NaN when no batch had ids).
    """
    rollouts = _as_list(rollout_log_probs)
    olds = _as_list(old_log_probs)
    masks = _as_list(mask)
    r_ids = _as_list(rollout_ids, len(rollouts))
    t_ids = _as_list(trainer_ids, len(rollouts))
    assert len(rollouts) == len(olds) == len(masks) == len(r_ids) == len(t_ids)

    token_a: list[np.ndarray] = []
    token_b: list[np.ndarray] = []
    seq_mean_a: list[float] = []
    seq_mean_b: list[float] = []
    seq_mean_r: list[float] = []
    nonfinite = 0
    zero_rollout = 0
    pairs_next: list[tuple[float, float]] = []  # (a_t, b_(t+1)), both counting
    pairs_prev: list[tuple[float, float]] = []  # (a_(t+1), b_t)
    batch_means: list[float] = []  # each batch's mean |r| (NaN: no counting token)
    batch_errors: list[float] = []  # and its standard error, sqrt(var(|r|) / n)
    ids_seen = False
    id_diff = 0
    id_rows = 0
    id_diff_rows = 0
    nan = math.nan
    for rollout, old, m, rid, tid in zip(rollouts, olds, masks, r_ids, t_ids, strict=True):
        b = np.maximum(to_numpy(rollout), FLOOR)  # NaN stays NaN, -inf becomes -20
        a = np.maximum(to_numpy(old), FLOOR)
        masked = to_numpy(m) != 0
        assert a.ndim == 2 and a.shape == b.shape == masked.shape
        finite = np.isfinite(a) & np.isfinite(b)
        counts = masked & finite
        nonfinite += int(np.sum(masked & ~finite))
        token_a.append(a[counts])
        token_b.append(b[counts])
        if masked.size:
            abs_batch = np.abs(a - b)[counts]
            batch_means.append(float(np.mean(abs_batch)) if counts.any() else nan)
            spread = float(np.std(abs_batch) / math.sqrt(abs_batch.size)) if counts.any() else nan
            batch_errors.append(spread)
        zero_rollout += int(np.sum(counts & (b == 0.0) & (a < -1.0)))
        for row in range(a.shape[0]):
            for t in range(a.shape[1] - 1):
                if counts[row, t] and counts[row, t + 1]:
                    pairs_next.append((a[row, t], b[row, t + 1]))
                    pairs_prev.append((a[row, t + 1], b[row, t]))

        for row in range(a.shape[0]):
            keep = counts[row]
            if keep.any():
                seq_mean_a.append(float(np.mean(a[row][keep])))
                seq_mean_b.append(float(np.mean(b[row][keep])))
                seq_mean_r.append(float(np.mean(a[row][keep] - b[row][keep])))
        if rid is not None and tid is not None:
            ids_seen = True
            differs = masked & (_ids_numpy(rid) != _ids_numpy(tid))
            id_diff += int(np.sum(differs))
            id_rows += int(np.sum(masked.any(axis=1)))
            id_diff_rows += int(np.sum(differs.any(axis=1)))

    a = np.concatenate(token_a) if token_a else np.zeros(0)
    b = np.concatenate(token_b) if token_b else np.zeros(0)
    n = a.size
    pa, pb = np.exp(a), np.exp(b)
    prob_diff = np.abs(pa - pb)
    r = a - b
    abs_r = np.abs(r)
    rho = np.exp(np.clip(r, -CLAMP, CLAMP))
    c = float(is_threshold)
    lo, hi = seq_ratio_bounds

    mean_a, mean_b, mean_r = np.array(seq_mean_a), np.array(seq_mean_b), np.array(seq_mean_r)
    seqs = mean_a.size
    geo = np.exp(mean_r)

    lags = lag_correlations(a, b, pairs_prev, pairs_next)
    values = {
        # seed group
        "rollout_probs_diff_valid": 1.0 if n >= 1 else 0.0,
        "rollout_probs_diff_max": _max(prob_diff),
        "rollout_probs_diff_mean": _mean(prob_diff),
        "rollout_probs_diff_std": _std(prob_diff),
        PEARSON: pearson(pa, pb),
        ONE_MINUS_PEARSON: 1.0 - pearson(pa, pb),
        # log-space group
        "rollout_log_probs_diff_max": _max(abs_r),
        "rollout_log_probs_diff_mean": _mean(abs_r),
        "rollout_log_probs_diff_std": _std(abs_r),
        "rollout_stale_period": stale_period(batch_means, batch_errors),
        # KL group; rho - 1 is evaluated as expm1 so that k3 keeps its digits near r = 0
        "rollout_actor_kl_k1": _mean(-r),
        "rollout_actor_kl_k3": _mean(np.expm1(np.clip(r, -CLAMP, CLAMP)) - r),
        "rollout_actor_mult_prob_error": _mean(np.exp(abs_r)),
        "rollout_actor_mult_prob_error_minus_one": _mean(np.expm1(abs_r)),
        # importance-ratio group
        "rollout_is_ratio_mean": _mean(rho),
        "rollout_is_ratio_mean_minus_one": _mean(np.expm1(np.clip(r, -CLAMP, CLAMP))),
        "rollout_is_ratio_min": _min(rho),
        "rollout_is_ratio_max": _max(rho),
        "rollout_is_ratio_frac_high": _mean((rho > c).astype(np.float64)),
        "rollout_is_ratio_frac_low": _mean((rho < 1.0 / c).astype(np.float64)),
        "rollout_is_chi2": _mean(rho**2) - 1.0,
        "rollout_is_ess": float(np.sum(rho) ** 2 / (n * np.sum(rho**2))) if n >= 1 else nan,
        # 1 - (sum rho)^2 / (N sum rho^2) = var(rho) / mean(rho^2), with rho - 1 as expm1
        "rollout_is_one_minus_ess": (
            float(np.var(np.expm1(np.clip(r, -CLAMP, CLAMP))) / np.mean(rho**2)) if n >= 1 else nan
        ),
        # sequence group
        "actor_ppl": _mean(np.exp(-mean_a)),
        "rollout_ppl": _mean(np.exp(-mean_b)),
        "rollout_actor_log_ppl_diff": _mean(mean_b - mean_a),
        "rollout_actor_log_ppl_abs_diff_max": _max(np.abs(mean_b - mean_a)),
        "rollout_seq_geo_ratio_min": _min(geo),
        "rollout_seq_geo_ratio_max": _max(geo),
        "rollout_seq_frac_outside": _mean(((geo < lo) | (geo > hi)).astype(np.float64)),
        # health group
        "rollout_tokens": float(n),
        "rollout_sequences": float(seqs),
        "rollout_nonfinite_tokens": float(nonfinite),
        "rollout_alignment_lag": _best_lag(lags),
        "rollout_zero_log_prob_tokens": float(zero_rollout),
        # token-id group
        "rollout_token_diff_count": float(id_diff) if ids_seen else nan,
        "rollout_token_diff_seq_frac": id_diff_rows / id_rows if ids_seen and id_rows else nan,
        # quantiles group
        **{
            f"{stem}_p{label}": quantile(values, per_mille)
            for stem, values in (
                ("rollout_probs_diff", prob_diff),
                ("rollout_log_probs_diff", abs_r),
            )
            for label, per_mille in (("50", 500), ("90", 900), ("99", 990), ("999", 999))
        },
    }
    assert tuple(values) == ALL_NAMES
    out = Reference(values)
    out.log_scale = max(1.0, _max(abs_r)) if n else 1.0
    out.prob_scale = max(_max(pa), _max(pb)) if n else 1.0
    out.pearson_sides = pearson_sides(pa, pb)
    out.lags = lags
    out.lag_sides = lag_sides(a, b, pairs_prev, pairs_next)
    return out


# ---------------------------------------------------------------------- segments
OTHER = "other"
"""The segment of the labels outside ``[0, num_segments)``."""

SEGMENT_GROUPS = ("seed", "log_space", "kl", "importance_ratio")
"""The groups whose metrics a segment has (but ``rollout_stale_period``), besides
``rollout_tokens`` and ``rollout_nonfinite_tokens``."""

SEGMENT_NAMES: tuple[str, ...] = (
    *(name for group in SEGMENT_GROUPS for name in NAMES[group] if name != "rollout_stale_period"),
    "rollout_tokens",
    "rollout_nonfinite_tokens",
)
"""The token-level metrics of the catalog, copied from the segments' contract."""


def token_labels(segment_ids: Any, shape: tuple[int, ...]) -> np.ndarray:
    """The ``[B, T]`` labels of a batch: a ``[B]`` label per row spread over its tokens."""
    labels = _ids_numpy(segment_ids)
    if labels.ndim == 1:
        labels = np.repeat(labels[:, None], shape[1], axis=1)
    assert labels.shape == tuple(shape), (labels.shape, shape)
    return labels


def reference_segments(
    rollout_log_probs: Any,
    old_log_probs: Any,
    mask: Any,
    segment_ids: Any,
    num_segments: int | None = None,
    **kwargs: Any,
) -> dict[int | str, Reference]:
    """:func:`reference_metrics` of each segment: the window with the mask cut to its tokens.

    Arguments as :func:`reference_metrics` takes them, plus the labels of each batch
    (``[B]`` or ``[B, T]``, ``None``: the batch's tokens are in no segment).
    ``num_segments=None``: the largest label plus one. Labels outside
    ``[0, num_segments)`` make the segment :data:`OTHER`. Only the segments with at least
    one counting token are returned, by label.
    """
    rollouts = _as_list(rollout_log_probs)
    olds = _as_list(old_log_probs)
    masks = _as_list(mask)
    labels = _as_list(segment_ids, len(rollouts))
    assert len(rollouts) == len(olds) == len(masks) == len(labels)
    spread = [
        None if ids is None else token_labels(ids, tuple(m.shape))
        for ids, m in zip(labels, masks, strict=True)
    ]
    if num_segments is None:
        num_segments = 1 + max(
            (int(x.max()) for x in spread if x is not None and x.size), default=-1
        )
    keys: list[int | str] = [*range(num_segments), OTHER]
    out: dict[int | str, Reference] = {}
    for key in keys:
        cut = []
        for m, ids in zip(masks, spread, strict=True):
            masked = to_numpy(m) != 0
            if ids is None:
                here = np.zeros_like(masked)
            elif key == OTHER:
                here = (ids < 0) | (ids >= num_segments)
            else:
                here = ids == key
            cut.append(masked & here)
        want = reference_metrics(rollouts, olds, cut, **kwargs)
        if want["rollout_tokens"] >= 1:
            out[key] = want
    return out


def stale_period(means: Sequence[float], errors: Sequence[float]) -> float:
    """``rollout_stale_period`` of the per-batch mean ``|r|`` (docs/metrics.md), the last 64.

    For each period ``P`` in 2..16 held three times and each phase: every drop and every
    whole period's rise above 0, at least two drops; the fit ``c0 + (c1 + c2 t') k`` with
    ``R^2 >= 0.8``; at every drop and whole period the fitted rise above 0, at least half
    ``c0``, and the step at least half the fitted rise and four standard errors of the
    two batches' difference (``errors``: each mean's). The best ``R^2``'s ``P``, else 0.
    """
    x = np.asarray(list(means)[-64:], dtype=np.float64)
    se = np.asarray(list(errors)[-64:], dtype=np.float64)
    n, t = x.size, np.arange(x.size)
    best, found = -math.inf, 0
    for period in range(2, 17):
        if n < 3 * period:
            break
        for phase in range(period):
            k = (t - phase) % period
            drops_at = t[(k == 0) & (t > 0)]
            rises_at = t[(k == 0) & (t + period <= n)]
            steps = [(x[s - 1] - x[s], s - 1, s) for s in drops_at]
            steps += [(x[s + period - 1] - x[s], s, s + period - 1) for s in rises_at]
            seen = [(step, at, other) for step, at, other in steps if not np.isnan(step)]
            seen_drops = sum(not np.isnan(x[s - 1] - x[s]) for s in drops_at)
            if seen_drops < 2 or len(seen) == seen_drops or min(s for s, _, _ in seen) <= 0:
                continue
            scaled = (t - (n - 1) / 2) / n
            design = np.stack([np.ones(n), k, k * scaled], axis=1)
            valid = ~np.isnan(x)
            coef = np.linalg.lstsq(design[valid], x[valid], rcond=None)[0]
            residual = x[valid] - design[valid] @ coef
            r2 = 1.0 - np.sum(residual**2) / np.sum((x[valid] - x[valid].mean()) ** 2)
            rise = (coef[1] + coef[2] * scaled) * (period - 1)
            holds = all(
                rise[at] > 0
                and rise[at] >= 0.5 * coef[0]
                and step >= 0.5 * rise[at]
                and step >= 4.0 * math.hypot(se[at], se[other])
                for step, at, other in seen
            )
            if r2 >= 0.8 and holds and r2 > best:
                best, found = r2, period
    return float(found)


def quantile(values: np.ndarray, per_mille: int) -> float:
    """The inverted-CDF quantile: the smallest ``v`` with at least ``q N`` values ``<= v``.

    ``q = per_mille / 1000``, so ``ceil(q N)`` is computed exactly in integers.
    """
    n = values.size
    if n == 0:
        return math.nan
    rank = -(-per_mille * n // 1000)
    return float(np.sort(values)[rank - 1])


def quantile_close(got: float, want: float, name: str = "") -> bool:
    """Within the promise: 3% where the value is at least 1e-8, exactly 0 for 0.

    Above the top of the bins (2 for ``|pa - pb|``, 32 nats for ``|a - b|``: reached only
    by positive "log-probs") a quantile is only known to lie above the top.
    """
    top = QUANTILE_TOPS.get(name.rpartition("_")[0], math.inf)
    if want >= top:
        return got >= top
    if want == 0.0:
        return got == 0.0
    if want < QUANTILE_FLOOR:
        return 0.0 <= got <= QUANTILE_FLOOR * (1 + QUANTILE_RTOL)
    return abs(got - want) <= QUANTILE_RTOL * want


def lag_correlations(
    a: np.ndarray,
    b: np.ndarray,
    pairs_prev: Sequence[tuple[float, float]],
    pairs_next: Sequence[tuple[float, float]],
) -> dict[int, float]:
    """Pearson correlation of the log-probs at lags -1, 0, +1: of the pairs ``(a_t, b_(t+L))``.

    At lag 0 the pairs are the counting tokens; at -1 and +1 the neighbouring tokens of a
    sequence that both count. NaN with fewer than two pairs or a constant side.
    """
    return {
        -1: pearson(*_sides(pairs_prev)),
        0: pearson(a, b),
        1: pearson(*_sides(pairs_next)),
    }


def lag_sides(
    a: np.ndarray,
    b: np.ndarray,
    pairs_prev: Sequence[tuple[float, float]],
    pairs_next: Sequence[tuple[float, float]],
) -> dict[int, list[tuple[float, float]] | None]:
    """``(mean, population std)`` of both sides of each lag's pairs (``None``: fewer than 2)."""
    return {
        -1: pearson_sides(*_sides(pairs_prev)),
        0: pearson_sides(a, b),
        1: pearson_sides(*_sides(pairs_next)),
    }


def _sides(pairs: Sequence[tuple[float, float]]) -> tuple[np.ndarray, np.ndarray]:
    table = np.array(pairs, dtype=np.float64).reshape(-1, 2)
    return table[:, 0], table[:, 1]


def _best_lag(lags: Mapping[int, float]) -> float:
    defined = {lag: c for lag, c in lags.items() if not math.isnan(c)}
    return float(max(defined, key=lambda lag: (defined[lag], lag == 0))) if defined else math.nan


def pearson_tolerance(sides: Sequence[tuple[float, float]] | None) -> float | None:
    """Absolute tolerance of a Pearson value, or ``None`` when a side is nearly constant.

    float32 rounding of the inputs perturbs a correlation by about
    ``eps32 * |mean| / std`` per side, so the tolerance grows with that condition
    number. A side whose spread is within ``16 * eps32`` of its mean is nearly constant:
    the package may report NaN or any correlation there.
    """
    if sides is None:
        return 0.0
    if any(std <= 16 * EPS32 * abs(mean) for mean, std in sides):
        return None
    return 1e-5 + 64 * EPS32 * sum(abs(mean) / std for mean, std in sides)


def assert_pearson_close(
    got: float, want: float, sides: Sequence[tuple[float, float]] | None, name: str = PEARSON
) -> None:
    """Check one Pearson value (or ``1 -`` it) against the reference, condition-aware (see above).

    ``name`` ends in the un-prefixed name of the metric, which sets the range it must stay in.
    """
    assert isinstance(got, float), f"{name}: expected a float, got {type(got).__name__}"
    low, high = _PEARSON_RANGE[ONE_MINUS_PEARSON if name.endswith(ONE_MINUS_PEARSON) else PEARSON]
    atol = pearson_tolerance(sides)
    if atol is None:
        assert math.isnan(got) or low <= got <= high, f"{name}: {got!r} (nearly constant side)"
        return
    if math.isnan(want):
        assert math.isnan(got), f"{name}: got {got!r}, want NaN"
        return
    assert low <= got <= high, f"{name}: {got!r} outside [{low:g}, {high:g}]"
    assert abs(got - want) <= atol, f"{name}: got {got!r}, want {want!r} (atol {atol:.3g})"


def _lag_close(got: float, want: Reference) -> bool:
    """Whether ``got`` is a lag whose correlation is the largest, to rounding.

    A lag with a side nearly constant over its pairs (spread within float32 rounding of
    its mean) may be undefined or take any value in the package.
    """
    uncertain = {
        lag
        for lag, sides in want.lag_sides.items()
        if sides and any(std <= 16 * EPS32 * abs(mean) for mean, std in sides)
    }
    certain = {lag: c for lag, c in want.lags.items() if not math.isnan(c) and lag not in uncertain}
    if math.isnan(got):
        return not certain
    if int(got) in uncertain or not certain:
        return int(got) in uncertain or int(got) in want.lags
    return int(got) in certain and certain[int(got)] >= max(certain.values()) - 1e-4


def metric_atol(name: str, want: Reference) -> float:
    """Absolute tolerance of one metric: ``ATOL`` times its natural magnitude."""
    if name in _PROB_SPACE:
        return ATOL * want.prob_scale
    if name in _LOG_SPACE:
        return ATOL * want.log_scale
    return ATOL


def assert_metrics_close(got: Mapping[str, float], want: Reference, *, prefix: str = "") -> None:
    """Assert ``got`` has exactly the (prefixed) names of ``want``, each value close to it.

    NaN must match NaN; Pearson and ``1 -`` it use :func:`assert_pearson_close`; quantiles
    :func:`quantile_close`; everything else ``|got - want| <= metric_atol + RTOL * |want|``.
    The quantiles come from a window's profile: when ``got`` has none of them (a
    ``MismatchStats`` without a profile), they are not expected; nor is
    ``rollout_stale_period`` without the run's series (which the reference reads from the
    window's batches).
    """
    if not any(prefix + name in got for name in NAMES["quantiles"]):
        want = want.select([name for name in want if name not in NAMES["quantiles"]])
    if prefix + "rollout_stale_period" not in got:  # a window without the run's series
        want = want.select([name for name in want if name != "rollout_stale_period"])
    expected = [prefix + name for name in want]
    assert sorted(got) == sorted(expected), (
        f"names differ: extra {sorted(set(got) - set(expected))}, "
        f"missing {sorted(set(expected) - set(got))}"
    )
    failures = []
    for name, value in want.items():
        key = prefix + name
        actual = got[key]
        if not isinstance(actual, float):
            failures.append(f"{key}: expected a Python float, got {type(actual).__name__}")
            continue
        if name in _PEARSON_RANGE:
            try:
                assert_pearson_close(actual, value, want.pearson_sides, key)
            except AssertionError as error:
                failures.append(str(error))
            continue
        if name == "rollout_alignment_lag" and not _lag_close(actual, want):
            failures.append(f"{key}: got {actual!r}, correlations by lag {want.lags}")
            continue
        if name == "rollout_alignment_lag":
            continue
        if name in NAMES["quantiles"] and not (math.isnan(value) or math.isnan(actual)):
            if not quantile_close(actual, value, name):
                failures.append(f"{key}: got {actual!r}, want {value!r} (rtol {QUANTILE_RTOL})")
            continue
        if math.isnan(value) or math.isnan(actual):
            if not (math.isnan(value) and math.isnan(actual)):
                failures.append(f"{key}: got {actual!r}, want {value!r}")
            continue
        atol = metric_atol(name, want)
        if not abs(actual - value) <= atol + RTOL * abs(value):
            failures.append(
                f"{key}: got {actual!r}, want {value!r} "
                f"(diff {abs(actual - value):.3g}, atol {atol:.3g}, rtol {RTOL})"
            )
    assert not failures, "metrics differ from the reference:\n  " + "\n  ".join(failures)


# ---------------------------------------------------------------------- profiles
# The profiles of docs/metrics.md, with their bucket edges recomputed from the formulas.
LN2 = math.log(2.0)
# The joint histogram: bins of -log p, four per octave from 2**-10 to 2**5.
SURPRISAL_EDGES = np.array([2.0 ** (-10 + j // 4) * (1 + (j % 4) / 4) for j in range(61)])
LOG_PROB_EDGES = -SURPRISAL_EDGES[::-1]
POSITION_BUCKETS = 24
PROBABILITY_BUCKETS = 29


def tokens_of(batches: Sequence[dict[str, torch.Tensor]]) -> dict[str, np.ndarray]:
    """Counting tokens of all batches in float64: a, b, their column and the batch width."""
    a_all, b_all, columns = [], [], []
    for data in batches:
        a = np.maximum(to_numpy(data["old_log_probs"]), FLOOR)
        b = np.maximum(to_numpy(data["rollout_log_probs"]), FLOOR)
        keep = (to_numpy(data["response_mask"]) != 0) & np.isfinite(a) & np.isfinite(b)
        a_all.append(a[keep])
        b_all.append(b[keep])
        columns.append(np.nonzero(keep)[1])
    return {
        "a": np.concatenate(a_all),
        "b": np.concatenate(b_all),
        "column": np.concatenate(columns),
        "width": max(data["response_mask"].shape[1] for data in batches),
    }


def reference_profile(batches: Sequence[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """The profile of the definitions, plus each probability bucket's ambiguous tokens."""
    t = tokens_of(batches)
    a, b = t["a"], t["b"]
    r = a - b
    pa, pb = np.exp(a), np.exp(b)
    diff, log_diff = np.abs(pa - pb), np.abs(r)
    k3 = np.expm1(np.clip(r, -20, 20)) - r
    position = np.where(t["column"] == 0, 0, np.floor(np.log2(np.maximum(t["column"], 1))) + 1)
    position = np.minimum(position, POSITION_BUCKETS - 1).astype(int)
    by_position = []
    for i in range(POSITION_BUCKETS):
        start = 0 if i == 0 else 2 ** (i - 1)
        if start >= t["width"]:
            break
        stop = t["width"] if i == POSITION_BUCKETS - 1 else min(2**i, t["width"])
        here = position == i
        by_position.append(
            {
                "start": start,
                "stop": stop,
                "tokens": float(here.sum()),
                "probs_diff_mean": _mean(diff[here]),
                "kl_k3": _mean(k3[here]),
            }
        )
    halvings = -a / LN2  # pa in (2**-(k+1), 2**-k] for k = floor of it
    k = np.clip(np.floor(halvings), 0, PROBABILITY_BUCKETS - 1).astype(int)
    near_edge = np.abs(halvings - np.round(halvings)) < 1e-5
    by_probability = []
    for i in range(PROBABILITY_BUCKETS):
        here = k == PROBABILITY_BUCKETS - 1 - i
        by_probability.append(
            {
                "low": 2.0 ** (i - PROBABILITY_BUCKETS),
                "high": 2.0 ** (i + 1 - PROBABILITY_BUCKETS),
                "tokens": float(here.sum()),
                "probs_diff_mean": _mean(diff[here]),
                "log_probs_diff_mean": _mean(log_diff[here]),
                "ambiguous": int((here & near_edge).sum()),
            }
        )
    side = len(LOG_PROB_EDGES) + 1
    # Bins of the log-prob closed on the right: (edges[i-1], edges[i]].
    rows = np.searchsorted(LOG_PROB_EDGES, a, side="left")
    columns = np.searchsorted(LOG_PROB_EDGES, b, side="left")
    joint = np.zeros((side, side))
    np.add.at(joint, (rows, columns), 1.0)
    quantiles = {
        f"{stem}_{suffix}": quantile(values, per_mille)
        for stem, values in (("rollout_probs_diff", diff), ("rollout_log_probs_diff", log_diff))
        for suffix, per_mille in (("p50", 500), ("p90", 900), ("p99", 990), ("p999", 999))
    }
    return {
        "quantiles": quantiles,
        "by_position": by_position,
        "by_probability": by_probability,
        "joint": joint,
    }


def _profile_close(got: float, want: float, rtol: float = 2e-5, atol: float = 1e-9) -> bool:
    if math.isnan(want):
        return math.isnan(got)
    return abs(got - want) <= atol + rtol * abs(want)


def assert_profile(got: dict[str, Any], want: dict[str, Any]) -> None:
    """``got`` (``mismatch_profile``'s dict) against :func:`reference_profile`."""
    assert set(got["quantiles"]) == set(NAMES["quantiles"])
    for name, value in want["quantiles"].items():
        assert quantile_close(got["quantiles"][name], value), (name, got["quantiles"][name], value)
    assert len(got["by_position"]) == len(want["by_position"])
    for mine, theirs in zip(got["by_position"], want["by_position"], strict=True):
        assert (mine["start"], mine["stop"], mine["tokens"]) == (
            theirs["start"],
            theirs["stop"],
            theirs["tokens"],
        )
        assert _profile_close(mine["probs_diff_mean"], theirs["probs_diff_mean"]), (mine, theirs)
        assert _profile_close(mine["kl_k3"], theirs["kl_k3"], atol=1e-8), (mine, theirs)
    moved = 0
    for mine, theirs in zip(got["by_probability"], want["by_probability"], strict=True):
        assert (mine["low"], mine["high"]) == (theirs["low"], theirs["high"])
        # A trainer log-prob within rounding of a bucket edge may sit on either side.
        assert abs(mine["tokens"] - theirs["tokens"]) <= theirs["ambiguous"] + moved, mine
        moved = int(abs(mine["tokens"] - theirs["tokens"]))
        if mine["tokens"] == theirs["tokens"] and not theirs["ambiguous"]:
            assert _profile_close(mine["probs_diff_mean"], theirs["probs_diff_mean"]), (
                mine,
                theirs,
            )
            assert _profile_close(mine["log_probs_diff_mean"], theirs["log_probs_diff_mean"]), mine
    assert sum(b["tokens"] for b in got["by_probability"]) == sum(
        b["tokens"] for b in want["by_probability"]
    )
    np.testing.assert_array_equal(got["joint_histogram"]["edges"], LOG_PROB_EDGES)
    np.testing.assert_array_equal(np.array(got["joint_histogram"]["counts"]), want["joint"])
