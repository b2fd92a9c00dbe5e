"""The torch arithmetic of one update: a batch's tokens reduced to row sums, in one pass.

:func:`token_sums` reads a checked batch once and returns :class:`TokenSums`: for every
row of the batch its sums, extremes and centred second moments (the statistics), and for
the whole batch its counted bins, its sums by position and by probability and its
worst-token candidates (the extras). Nothing leaves the device and no operation depends
on the batch's values, so an update costs the same number of torch operations at every
size. :mod:`.finish` turns the sums of any number of batches into the packed states of
:mod:`.layout`, exactly (the window finishes them together when it folds).

The per-token values (:mod:`.values`) are named planes of a :class:`Planes` set: eagerly
one buffer, written in place, so an update holds a fixed amount of memory and reduces
every plane in one operation; traced by ``torch.compile``, plain values that the compiler
fuses into the kernels reading them.

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
from lightning_rollout_debug.metrics.torch_pass.health import LAG, LAG_PAIRS, Wide, lag_products
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
from lightning_rollout_debug.metrics.torch_pass.values import token_values

INF = math.inf


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
    """Each row's largest value (``-inf``: no token) of each plane of
    :attr:`PassPlan.tops`: ``[B]`` each; eagerly ``[planes, B]``, of
    :attr:`PassPlan.top_run`."""
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
    """Each row's sums of ``x_t y_(t+1)`` (health): ``[B]`` for each pair of
    :data:`.health.LAG_PAIRS`; eagerly ``[6, 6, B]``, over the planes of
    :data:`.health.WIDE`."""
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
    """The same sums by segment row (:mod:`.segments`): ``first``, ``top``, ``second``, the
    sums of ``r`` and ``shift``, each over ``G L (S + 1)`` segment rows
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
    wide = token_values(plan, p, rollout_log_probs, old_log_probs, mask)
    edges = constants(dtype, mask)
    segments: SegmentRows | NoSegments = NO_SEGMENTS
    if plan.segments and segment_ids is not None:
        segments = SegmentRows(segment_ids, plan.segments, mask.shape[1])
    if p.traced:
        following = _following(plan, rollout_log_probs, old_log_probs, mask, dtype)
        sums = _reduce_compiled(plan, p, edges, token_ids, segments, following)
    else:
        sums = _reduce_eagerly(plan, p, edges, token_ids, segments, wide)
    # Whether it was traced, last: a compiled function may run eagerly after all.
    return (*sums, p.traced)


def _reduce_eagerly(
    plan: PassPlan,
    p: Planes,
    edges: Constants,
    token_ids: Tensor | None,
    by_segment: SegmentRows | NoSegments = NO_SEGMENTS,
    wide: Wide | None = None,
) -> tuple[Any, ...]:
    """The sums of the planes, eagerly: few operations, each in place on the planes.

    The values of tokens that do not count (finite, :func:`.values._zero_where_uncounted`)
    are cleared by arithmetic in place: -inf added there just long enough to take each
    row's largest value, then 0 (the smallest ``d`` is taken apart, the smallest ``r`` is
    the largest ``nr``; the lean planes are 0 there already, and ``a`` and ``b`` get their
    -inf once the rows are summed); rows are summed in the planes' dtype, second moments
    about each row's mean (:func:`_seconds`); the extras' bins are counted in one
    scatter-add, sums by bucket each in one of their own.
    """
    one = p["one"]
    missing = _missing(one)
    tops = p.names[plan.top_run.start], p.names[plan.top_run.stop - 1]
    segment_tops = p.names[plan.segment_tops.start], p.names[plan.segment_tops.stop - 1]
    extremes: dict[str, Tensor] = {}
    bottom = _smallest(plan, p, missing)

    def clear(planes: Tensor) -> Tensor:  # their values are finite where a token does not count
        planes.add_(missing)
        if plan.worst_tokens_k:
            extremes["key"] = worst_keys(p["l"])
        extremes["top"] = p.run(*tops).amax(-1)
        by_segment.keep_largest(_flat(p, p.run(*segment_tops)))
        return planes.nan_to_num_(nan=math.nan, posinf=INF, neginf=0.0)

    if not plan.lean:
        p.update(p.names[0], p.names[-2], clear)  # masked, last, counts masked tokens
    every = p.run(p.names[0], p.names[-1])
    first = every.sum(-1, keepdim=True)
    by_segment.keep_sums("first", _flat(p, every))
    log_ratio = _log_ratios(plan, p, by_segment, wide)
    if plan.lean:  # a and b, read no more, with -inf where a token does not count
        p.update("a", "b", lambda x: x.add_(missing))
        extremes["top"] = p.run(*tops).amax(-1)
    lag = lag_products(wide) if wide is not None else None  # wide's planes are free then
    room = wide.pair if wide is not None else None
    counts, position, probability, worst = eager_extras(
        plan, p, edges, extremes.get("key"), token_ids, by_segment, room
    )
    # Centre each row's (segment row's) values at its mean, then sum squares and products.
    start, stop = p.names[plan.centred.start], p.names[plan.centred.stop - 1]
    shift, centre = _centres(plan, first, one, by_segment)
    centred = p.update(start, stop, lambda x: x.addcmul_(one, centre, value=-1.0))
    second = _seconds(plan, p, centred, by_segment)
    fields = (first, extremes["top"], bottom, shift, second, lag, counts, position)
    return (*fields, probability, worst, log_ratio, by_segment.fields())


def _seconds(
    plan: PassPlan, p: Planes, centred: Tensor, segments: SegmentRows | NoSegments
) -> Tensor:
    """``[k + products, B]``: the sums of squares and products of the centred planes.

    The squares of the ``k`` centred planes, then the products of
    :attr:`PassPlan.products` (by segment row too, where there are segments): element-wise
    products and one sum. A matrix product of float32 planes could round its inputs to
    TF32 on a GPU (``torch.set_float32_matmul_precision("high")``).
    """
    if "ab" not in p.at:
        p.write("papb", torch.mul, p["pa"], p["pb"])
    else:  # [a, pa] [b, pb]: ab and papb in one product
        torch.mul(p.spaced("a", "pa"), p.spaced("b", "pb"), out=p.run("ab", "papb"))
    centred.square_()
    squares = p.run(p.names[plan.centred.start], p.names[p.at[plan.tail] - 1])
    segments.keep_sums("second", _flat(p, squares))
    return squares.sum(-1)


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
    # The tokens (``one`` comes before the centred planes) and the centred planes' sums.
    at, centred = plan.at["one"], plan.centred
    sizes = [at, 1, centred.start - at - 1, centred.stop - centred.start]
    parts = first.split([*sizes, len(plan.planes) - sum(sizes)])
    shift = parts[3] / parts[1].clamp(min=1.0)
    return shift, shift


def _log_ratios(
    plan: PassPlan, p: Planes, segments: SegmentRows | NoSegments, wide: Wide | None
) -> Tensor | None:
    """Each row's sum of the float64 differences ``a - b`` (``None``: a plan that needs none).

    k1 keeps the digits of small log-ratios; the segment rows keep theirs. With the health
    group's float64 copies, the differences are taken there.
    """
    if not plan.log_ratio:
        return None
    if wide is not None:
        differences = torch.sub(wide.a, wide.b, out=wide.difference)
    else:
        differences = torch.sub(p["a"].double(), p["b"])
    segments.keep_sums("log_ratio", differences)
    return differences.sum(-1)


def _smallest(plan: PassPlan, p: Planes, missing: Tensor) -> list[Tensor] | None:
    """Each row's smallest value of the planes of :attr:`PassPlan.bottoms` (``None``: none).

    Where a token does not count, ``missing`` (-inf) is taken off first.
    """
    return [torch.sub(p[name], missing).amin(-1) for name in plan.bottoms] or None


def _missing(one: Tensor) -> Tensor:
    """``one - 1 / one``: 0 where a token counts, -inf where it does not (eagerly).

    ``one`` is the input added to, not a broadcast 1: on the CPU an operation whose first
    two inputs are both broadcast scalars takes a loop four times slower.
    """
    unit = on_device("one", one)
    out = None
    if keeps(one):
        out = kept("missing", one.numel(), one.dtype, one.shape, lambda f: f.view(one.shape))
    return torch.addcdiv(one, unit, one, value=-1.0, out=out)


def _following(
    plan: PassPlan,
    rollout_log_probs: Tensor,
    old_log_probs: Tensor,
    mask: Tensor,
    dtype: torch.dtype,
) -> dict[str, Tensor] | None:
    """Traced, the values of :data:`.health.LAG` at each token's next one (0 after the last).

    Computed from the inputs one token on, not read from the values at ``t + 1``: a kernel
    that reads a stored value of its own at another token cannot be fused with the one
    that stores it, and the inputs are always stored.
    """
    if "health" not in plan.groups:
        return None
    inputs = [
        torch.nn.functional.pad(x[:, 1:], (0, 1)) for x in (rollout_log_probs, old_log_probs, mask)
    ]
    q = planes_for(plan, inputs[2], dtype)
    token_values(plan, q, *inputs)
    counted = q["one"] > 0
    return _squared({name: torch.where(counted, q[name], 0.0) for name in LAG[:4]})


def _squared(values: dict[str, Tensor]) -> dict[str, Tensor]:
    """``values`` in float64, with the squares of ``a`` and ``b``."""
    wide = {name: x.double() for name, x in values.items()}
    return {**wide, "a^2": wide["a"] * wide["a"], "b^2": wide["b"] * wide["b"]}


def _summed_rows(
    plan: PassPlan, value: dict[str, Tensor], masked: Tensor, following: dict[str, Tensor] | None
) -> tuple[list[Tensor], Tensor]:
    """What a compiled pass sums along its rows, and the float64 differences ``a - b``.

    In order: every plane (``r`` as those differences, so that its sum is exact) and
    ``masked``, the squares of the centred planes, the products, the lag products of
    :data:`.health.LAG_PAIRS` (health), and the differences where no plane is ``r``.
    """
    exact = value["a"].double() - value["b"].double()
    rows = [exact if name == "r" else plane for name, plane in value.items()]
    rows.append(masked)
    rows += [value[name] * value[name] for name in plan.planes[plan.centred]]
    health = "health" in plan.groups
    rows += [
        value[x] * value[y] if (x, y) == ("pa", "pb") or health else value["one"] * 0.0
        for x, y in plan.products
    ]
    if following is not None:  # x_t y_(t+1)
        now = _squared({name: value[name] for name in LAG[:4]})
        rows += [now[x] * following[y] for x, y in LAG_PAIRS]
    if "r" not in value:
        rows.append(exact)
    return rows, exact


def _reduce_compiled(
    plan: PassPlan,
    p: Planes,
    edges: Constants,
    token_ids: Tensor | None,
    segments: SegmentRows | NoSegments = NO_SEGMENTS,
    following: dict[str, Tensor] | None = None,
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
    rows, exact = _summed_rows(plan, value, p["masked"], following)
    # Lists of [B] rows, each written where its reduction is: stacked when a window folds.
    sums = [row.sum(-1, dtype=f64) for row in rows]
    top = [torch.where(counted, raw[n], -INF).amax(-1) for n in plan.tops]
    first = sums[: len(names) + 1]
    at = len(names) + 1 + len(names[plan.centred]) + len(plan.products)
    second = sums[len(names) + 1 : at]
    lag = sums[at : at + len(LAG_PAIRS)] if following is not None else None
    log_ratio = sums[plan.at["r"] if "r" in value else -1]
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
        seconds = at - len(names) - 1
        by_segment = segments.traced(
            [*rows[:at], exact], len(names) + 1, seconds, torch.stack(largest)
        )
    return (*fields, log_ratio, by_segment)
