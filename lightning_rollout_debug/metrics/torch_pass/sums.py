"""The torch arithmetic of one update: a batch's tokens reduced to row sums, in one pass.

:func:`token_sums` reads a checked batch once and returns :class:`TokenSums`: for every
row of the batch its sums, extremes and centred second moments (the statistics), and for
the whole batch its counted bins, its sums by position and by probability and its
worst-token candidates (the extras). Nothing leaves the device and no operation depends
on the batch's values, so an update costs the same number of torch operations at every
size. :mod:`.finish` turns the sums of any number of batches into the packed states of
:mod:`.layout`, exactly (the window finishes them together when it folds).

The per-token values follow the catalog's rules (:mod:`.tokens`): log-probs floored at
-20 nats, a token counting where the mask is non-zero and neither log-prob is NaN or
+inf. Each is a named plane of a :class:`Planes` set: eagerly one buffer, written in
place, so an update holds a fixed amount of memory and reduces every plane in one
operation; traced by ``torch.compile``, plain values that the compiler fuses into the
kernels reading them.

Sums along a row are float32 (float64 for float64 log-probs), rows and batches are added
in float64. Second moments are summed about each row's own mean (the row sums first, then
the centred squares), so no digits are lost however far the values are from zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_rollout_debug.metrics.layout import compiling
from lightning_rollout_debug.metrics.tokens import (
    LOG_PROB_FLOOR,
    LOG_RATIO_CLAMP,
    RATIO_MAX,
    RATIO_MIN,
    exp_tail,
)
from lightning_rollout_debug.metrics.torch_pass.bins import (
    eager_extras,
    scattered,
    worst_candidates,
    worst_keys,
)
from lightning_rollout_debug.metrics.torch_pass.constants import (
    Constants,
    constants,
    on_device,
)
from lightning_rollout_debug.metrics.torch_pass.health import health_values, lag_products
from lightning_rollout_debug.metrics.torch_pass.planes import (
    PassPlan,
    Planes,
    keeps,
    kept,
    planes_for,
)
from lightning_rollout_debug.metrics.torch_pass.segments import (
    NO_SEGMENTS,
    NoSegments,
    SegmentRows,
)

INF = math.inf


NEAR = 0.5
"""Below this ``|r|``, ``|pa - pb|`` is taken as ``pb |e^r - 1|``."""


@dataclass(frozen=True)
class TokenSums:
    """What one pass keeps of a batch (see :func:`token_sums`).

    Row sums are in the working dtype (float32, or float64 for float64 log-probs); the
    extras' sums by probability bucket are float64, their counts exact whole numbers.
    """

    plan: PassPlan
    width: int
    first: Tensor
    """``[planes, B]``: each row's sum of every plane over its counting tokens."""
    top: Tensor
    """``[tops, B]``: each row's largest value of the planes of :attr:`PassPlan.tops`
    (``-inf``: no token)."""
    bottom: list[Tensor] | None
    """``[B]`` for each plane of :attr:`PassPlan.bottoms`: each row's smallest value
    (``+inf``: no token; ``None``: no such plane)."""
    shift: Tensor | None
    """``[centred, B, 1]``: each row's mean of the centred planes, the values are centred at
    (``None``: not centred, the sums of squares are plain ones; or, with :attr:`segments`,
    centred at each segment row's mean, whose sums hold the second moments)."""
    second: Tensor
    """``[seconds, B]``: each row's sums of the squared centred values, then of the products
    ``pa pb`` and ``a b`` of centred values (:attr:`PassPlan.seconds`)."""
    lag: Tensor | None = None
    """``[6, 6, B]``: each row's sums of ``x_t y_(t+1)`` over ``zero, one, a, b, a^2, b^2``
    (health)."""
    counts: Tensor | None = None
    """``[bins]``: the counted bins of the extras' parts (:attr:`PassPlan.parts`). Eagerly
    they count every token: those that do not count in their part's bin of 0 values
    (:attr:`uncounted`)."""
    position: Tensor | None = None
    """``[planes, POSITION_BUCKETS]``: planes summed by position bucket (profile): every plane
    eagerly, ``one, d, k3`` compiled (:attr:`position_planes`)."""
    probability: Tensor | None = None
    """``[2, PROBABILITY_BUCKETS]``: ``|pa - pb|`` and ``|a - b|`` summed by bucket."""
    worst: tuple[Tensor, Tensor, Tensor | None, Tensor | None] | None = None
    """The ``k`` worst candidates: their keys (:func:`places` finds them), ``[a, b]``, their
    ids with those before them (``[1 + CONTEXT_TOKENS, k]``) and their segments (``[k]``;
    ``None``: no ids, no segment labels)."""
    log_ratio: Tensor | None = None
    """``[B]``: each row's sum of ``r`` from the float64 differences ``a - b`` (``None``: a
    plan that needs none, :attr:`PassPlan.log_ratio`)."""
    segments: tuple[Tensor | None, ...] | None = None
    """The same sums by segment row (:mod:`.segments`): ``first``, ``top``, the smallest ``r``,
    ``second``, the sums of ``r`` and ``shift``, each over ``G L (S + 1)`` segment rows
    (``None``: no segment labels). Eagerly the second moments are centred at each segment
    row's mean (``shift``), and the rows' own (:attr:`shift` ``None``) are not kept."""
    position_planes: tuple[str, ...] = ()
    """The planes of :attr:`position`, in order."""
    uncounted: bool = False
    """Whether :attr:`counts` hold the tokens that do not count too (an eager pass)."""
    batch: int = 0
    """The batch's index in its window."""
    rank: int = 0
    """The rank of the process that read it."""
    first_row: int = 0
    """The row of the batch that row 0 is (a batch too large for one pass takes several)."""


def token_sums(
    plan: PassPlan,
    rollout_log_probs: Tensor,
    old_log_probs: Tensor,
    mask: Tensor,
    token_ids: Tensor | None = None,
    segment_ids: Tensor | None = None,
) -> tuple[Any, ...]:
    """The sums of one checked ``[B, T]`` batch (``B * T > 0``), as :class:`TokenSums`'s fields.

    With ``segment_ids`` (``[B]`` or ``[B, T]``) and a plan of segments, by segment row too.

    Returns the tuple of the fields after ``plan`` and ``width``, then whether the pass was
    traced (:func:`.backends.read_sums` makes the dataclass): a fixed number of torch
    operations, none of which waits for the device. The values of the tokens are the same
    eagerly and compiled; how they are reduced is each one's own (:func:`_reduce_eagerly`,
    :func:`_reduce_compiled`).
    """
    f64 = torch.float64
    dtype = f64 if f64 in (rollout_log_probs.dtype, old_log_probs.dtype) else torch.float32
    p = planes_for(plan, mask, dtype)
    _token_values(plan, p, rollout_log_probs, old_log_probs, mask)
    edges = constants(dtype, mask)
    reduce = _reduce_compiled if p.traced else _reduce_eagerly
    segments: SegmentRows | NoSegments = NO_SEGMENTS
    if plan.segments and segment_ids is not None:
        segments = SegmentRows(segment_ids, plan.segments, mask.shape[1])
    # Whether it was traced, last: a compiled function may run eagerly after all.
    return (*reduce(plan, p, edges, token_ids, segments), p.traced)


def _token_values(
    plan: PassPlan, p: Planes, rollout_log_probs: Tensor, old_log_probs: Tensor, mask: Tensor
) -> None:
    """Each token's values, written into ``p`` (anything where a token does not count)."""
    on = plan.groups
    # The floored log-probs, and the tokens that count.
    health, same = "health" in on, old_log_probs.dtype == rollout_log_probs.dtype == p.dtype
    floored = not (p.traced or health) and same
    if p.traced:
        p.values["a"], p.values["b"] = old_log_probs.to(p.dtype), rollout_log_probs.to(p.dtype)
    elif floored:  # floored as they are copied
        torch.clamp(old_log_probs, min=LOG_PROB_FLOOR, out=p["a"])
        torch.clamp(rollout_log_probs, min=LOG_PROB_FLOOR, out=p["b"])
    elif same:
        torch.stack([old_log_probs, rollout_log_probs], out=p.run("a", "b"))
    else:  # converted as they are copied: a stack would convert into temporaries first
        p["a"].copy_(old_log_probs)
        p["b"].copy_(rollout_log_probs)
    if health:  # a log-prob of -inf, before the floor
        p.map(("ninf_a", "ninf_b"), torch.eq, ("a", "b"), -INF)
    if not floored:
        p.update("a", "b", lambda x: x.clamp_(min=LOG_PROB_FLOOR))
    if "r" in p.at:
        p.write("l", torch.abs, p.write("r", torch.sub, p["a"], p["b"]))
    else:  # the lean planes keep |r| alone
        p.write("l", torch.sub, p["a"], p["b"])
        p.update("l", "l", torch.abs_)
    if mask.dtype == torch.bool and not p.traced:  # compared as bytes, not widened to int64
        mask = mask.view(torch.uint8)
    p.write("masked", torch.ne, mask, 0)
    p.write("one", torch.lt, p["l"], INF)
    p.update("one", "one", lambda x: x.mul_(p["masked"]))
    _zero_where_uncounted(p)
    p.map(("pa", "pb"), torch.exp, ("a", "b"))
    if plan.lean:  # 1 where a token does not count: 0 from here on, as every lean plane
        p.update("pa", "pb", lambda x: x.mul_(p["one"]))
    # |pa - pb| near r = 0 without cancellation: pb |e^r - 1|, or min(pa, pb) (e^|r| - 1);
    # farther out (where r has rounded) the difference itself, as the CPU kernel takes it.
    # papb is free until the centring.
    if "e" in p.at:
        p.map(("e", "mult"), _expm1, ("r", "l"))  # pa / pb - 1, e^|r| - 1
        p.write("d", torch.mul, p["e"], p["pb"])
    else:
        p.write("d", _expm1, p["l"])
        p.write("papb", torch.minimum, p["pa"], p["pb"])
        p.write("d", torch.mul, p["d"], p["papb"])
    p.write("papb", torch.sub, p["pa"], p["pb"])
    p.write("d", torch.where, p["l"] < NEAR, p["d"], p["papb"])
    p.update("d", "d", torch.abs_)
    if "r" in p.at:
        _ratio_values(plan, p)
    if "health" in on:
        health_values(p)


def _zero_where_uncounted(p: Planes) -> None:
    """The log-probs and their differences set to 0 where a token does not count.

    Every value computed from them is then finite there (the NaN or infinite log-probs
    of tokens that do not count never reach them), so that an eager pass clears those
    tokens with arithmetic: on the CPU ``torch.where`` costs ten times a product.
    """
    one = p["one"]
    if p.traced:  # a, b, r (where there is one) and l
        p.update("a", "l", lambda x: torch.where(one > 0, x, 0.0))
    else:
        p.update("a", "l", lambda x: x.nan_to_num_(0.0, 0.0, 0.0).mul_(one))


def _ratio_values(plan: PassPlan, p: Planes) -> None:
    """The values of the KL and importance-ratio groups."""
    on, r = plan.groups, p["r"]
    if {"kl", "importance_ratio"} & on:  # rho - 1 = e^clamp(r) - 1 from here on
        p.update("e", "e", lambda e: e.clamp_(RATIO_MIN - 1.0, RATIO_MAX - 1.0))
    if "k3" in p.at:
        p.write("k3", _kl_k3, r, p["e"])
    if "importance_ratio" in on:
        p.write("rho", torch.clamp, r, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        p.update("rho", "rho", torch.exp_)
        p.map(("hi", "hilo"), torch.gt, ("r", "l"), math.log(plan.is_threshold))


def _reduce_eagerly(
    plan: PassPlan,
    p: Planes,
    edges: Constants,
    token_ids: Tensor | None,
    by_segment: SegmentRows | NoSegments = NO_SEGMENTS,
) -> tuple[Any, ...]:
    """The sums of the planes, eagerly: few operations, each in place on the planes.

    The values of tokens that do not count (finite, :func:`_zero_where_uncounted`) are
    cleared by arithmetic in place: -inf added there just long enough to take each row's
    largest value, then 0 (the smallest of ``r`` and ``d`` are taken apart; the lean planes
    are 0 there already, and ``a`` and ``b`` get their -inf once the rows are summed); rows are
    summed in the planes' dtype, second moments about each row's mean; the extras' bins
    are counted in one scatter-add, sums by bucket each in one of their own.
    """
    one = p["one"]
    missing = _missing(one)
    tops = p.names[plan.segment_tops.start], p.names[plan.segment_tops.stop - 1]
    extremes: dict[str, Tensor] = {}
    bottom = _smallest(plan, p, missing, by_segment)

    def clear(planes: Tensor) -> Tensor:  # their values are finite where a token does not count
        planes.add_(missing)
        if plan.worst_tokens_k:
            extremes["key"] = worst_keys(p["l"])
        extremes["top"] = planes.amax(-1)
        by_segment.keep_largest(_flat(p, p.run(*tops)))
        return planes.nan_to_num_(nan=math.nan, posinf=INF, neginf=0.0)

    if not plan.lean:
        p.update(p.names[0], p.names[-2], clear)  # masked, last, counts masked tokens
    every = p.run(p.names[0], p.names[-1])
    first = every.sum(-1, keepdim=True)
    by_segment.keep_sums("first", _flat(p, every))
    log_ratio = _log_ratios(plan, p, by_segment)
    if plan.lean:  # a and b, read no more, with -inf where a token does not count
        p.update("a", "b", lambda x: x.add_(missing))
        extremes["top"] = p.run(p.names[plan.tops.start], p.names[plan.tops.stop - 1]).amax(-1)
    counts, position, probability, worst = eager_extras(
        plan, p, edges, extremes.get("key"), token_ids, by_segment
    )
    lag = lag_products(p) if "health" in plan.groups else None
    # Centre each row's (segment row's) values at its mean, then sum squares and products.
    start, stop = p.names[plan.centred.start], p.names[plan.centred.stop - 1]
    shift, centre = _centres(plan, first, one, by_segment)
    p.update(start, stop, lambda x: x.addcmul_(one, centre, value=-1.0))
    p.write("papb", torch.mul, p["pa"], p["pb"])
    if "health" in plan.groups:
        p.write("ab", torch.mul, p["a"], p["b"])
    p.update(start, stop, torch.square_)
    squares = p.run(start, p.names[p.at[plan.tail] - 1])
    by_segment.keep_sums("second", _flat(p, squares))
    fields = (first, extremes["top"], bottom, shift, squares.sum(-1), lag, counts, position)
    return (*fields, probability, worst, log_ratio, by_segment.fields())


def _flat(p: Planes, run: Tensor) -> Tensor:
    """A run of planes as ``[n, B T]``: a view made once for a set of planes."""
    return p.derived(("flat", run.data_ptr(), len(run)), lambda: run.view(len(run), -1))


def _centres(
    plan: PassPlan, first: Tensor, one: Tensor, segments: SegmentRows | NoSegments
) -> tuple[Tensor | None, Tensor]:
    """The rows' means the centred planes are centred at, and each token's.

    With segment rows, each token's segment row's mean (:meth:`.SegmentRows.centre`): no
    row-wide one (``None``).
    """
    if isinstance(segments, SegmentRows):
        return None, segments.centre(plan.centred, plan.at["one"], one.shape)
    shift = first[plan.centred] / first[plan.at["one"]].clamp(min=1.0)
    return shift, shift


def _log_ratios(plan: PassPlan, p: Planes, segments: SegmentRows | NoSegments) -> Tensor | None:
    """Each row's sum of the float64 differences ``a - b`` (``None``: a plan that needs none).

    k1 keeps the digits of small log-ratios; the segment rows keep theirs.
    """
    differences = torch.sub(p["a"].double(), p["b"]) if plan.log_ratio else None
    segments.keep_sums("log_ratio", differences)
    return None if differences is None else differences.sum(-1)


def _smallest(
    plan: PassPlan, p: Planes, missing: Tensor, segments: SegmentRows | NoSegments
) -> list[Tensor] | None:
    """Each row's smallest value of the planes of :attr:`PassPlan.bottoms` (``None``: none).

    Where a token does not count, ``missing`` (-inf) is taken off first; the segment rows
    keep their smallest ``r``.
    """
    bottom = []
    for name in plan.bottoms:
        lowered = torch.sub(p[name], missing)
        bottom.append(lowered.amin(-1))
        if name == "r":
            segments.keep_smallest(lowered)
    return bottom or None


def _missing(one: Tensor) -> Tensor:
    """``1 - 1 / one``: 0 where a token counts, -inf where it does not (eagerly)."""
    unit = on_device("one", one)
    out = None
    if keeps(one):
        out = kept("missing", one.numel(), one.dtype, one.shape, lambda f: f.view(one.shape))
    return torch.addcdiv(unit, unit, one, value=-1.0, out=out)


def _reduce_compiled(
    plan: PassPlan,
    p: Planes,
    edges: Constants,
    token_ids: Tensor | None,
    segments: SegmentRows | NoSegments = NO_SEGMENTS,
) -> tuple[Any, ...]:
    """The sums of the planes, traced by torch.compile: one loop over the rows, one scatter.

    Written as values, not updates, and each reduced on its own from ``[B, T]`` to ``[B]``:
    reductions of one shape share one kernel, which computes every plane it reads. Every
    row sum, largest value, square, product and lag product is in that loop
    (float64 sums, so nothing needs centring); every counted bin and sum by bucket is in
    one scatter-add.
    """
    f64 = torch.float64
    one = p["one"]
    width = one.shape[-1]
    counted = one > 0
    names = p.names[:-1]  # masked, last, counts masked tokens
    raw = {name: p.values.get(name, torch.zeros_like(one)) for name in names}
    value = {name: torch.where(counted, plane, 0.0) for name, plane in raw.items()}
    rows = [*value.values(), p["masked"]]
    centred = names[plan.centred]
    rows += [value[name] * value[name] for name in centred]
    health = "health" in plan.groups
    rows += [
        value[x] * value[y] if (x, y) == ("pa", "pb") or health else one * 0.0
        for x, y in plan.products
    ]
    if health:  # x_t y_(t+1) of zero, one, a, b, a^2, b^2 (0 after the last)
        now = [value[name].double() for name in ("zero", "one", "a", "b")]
        now += [now[2] * now[2], now[3] * now[3]]
        following = [torch.nn.functional.pad(x[:, 1:], (0, 1)) for x in now]
        rows += [x * y for x in now for y in following]
    # Lists of [B] rows, each written where its reduction is: stacked when a window folds.
    rows.append(value["a"].double() - value["b"].double())  # r's exact float64 sum
    sums = [row.sum(-1, dtype=f64) for row in rows]
    top = [torch.where(counted, raw[n], -INF).amax(-1) for n in p.names[plan.tops]]
    first = sums[: len(names) + 1]
    at = len(names) + 1 + len(centred) + len(plan.products)
    second = sums[len(names) + 1 : at]
    lag = sums[at:-1] if health else None
    counts = position = probability = worst = None
    if plan.parts:
        counts, position, probability = scattered(plan, value, edges, width)
    if plan.worst_tokens_k:
        keys = worst_keys(torch.where(counted, raw["l"], -INF))
        worst = worst_candidates(keys, p, token_ids, plan.worst_tokens_k, width, value, segments)
    bottom = [torch.where(counted, raw[n], INF).amin(-1) for n in plan.bottoms] or None
    fields = (first, top, bottom, None, second, lag, counts, position, probability, worst)
    by_segment = None
    if isinstance(segments, SegmentRows):  # float64 power sums, as the rows'
        largest = [torch.where(counted, raw[n], -INF) for n in names[plan.segment_tops]]
        low = "r" in plan.bottoms
        if low:  # the smallest r: the largest -r
            largest.append(torch.where(counted, -raw["r"], -INF))
        seconds = at - len(names) - 1
        by_segment = segments.traced(rows, len(names) + 1, seconds, torch.stack(largest), low)
    return (*fields, sums[-1], by_segment)


def _expm1(x: Tensor, out: Tensor | None = None) -> Tensor:
    """``e^x - 1`` without cancellation near 0.

    Eagerly ``torch.expm1``. Traced, the series of :func:`~.tokens.exp_tail` for
    ``|x| < 1/2``: compilers may lower ``expm1`` to ``exp(x) - 1`` (inductor's CPU code
    does), which loses every digit of a small difference.
    """
    if out is not None or not compiling():
        return torch.expm1(x, out=out)
    return torch.where(x.abs() < 0.5, x + x * x * exp_tail(x), torch.exp(x) - 1.0)


def _kl_k3(r: Tensor, e: Tensor, out: Tensor | None = None) -> Tensor:
    """``k3 = rho - 1 - r`` (``e``: ``rho - 1``) without cancellation near ``r = 0``.

    Eagerly from ``e^r - 1`` in float64, whose rounding is far below ``k3``'s; traced, the
    series of :func:`~.tokens.exp_tail` near 0 (the kernel's fused float32 arithmetic).
    """
    if out is None:
        near = r * r * exp_tail(r)
        return torch.where(r.abs() < NEAR, near, e.clamp(RATIO_MIN - 1.0, RATIO_MAX - 1.0) - r)
    wide = r.clone() if r.dtype == torch.float64 else r.double()
    wide.expm1_().clamp_(RATIO_MIN - 1.0, RATIO_MAX - 1.0)
    return torch.sub(wide, r, out=out)
