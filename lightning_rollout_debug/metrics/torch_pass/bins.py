"""The extras of a pass: counted bins, sums by bucket, worst-token candidates.

Eagerly (:func:`eager_extras`: :func:`bin_indices`, :func:`count_bins`, :func:`by_position`,
:func:`by_probability`): the bins' indices in planes of their own, counted in one
scatter-add; compiled (:func:`scattered`): every counted bin and sum by bucket in one
float64 scatter-add. The worst tokens are the ``k`` largest keys (:func:`worst_keys`),
each row's best first, with their ids and those before them where the batch has ids.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_rollout_debug.metrics.layout import compiling
from lightning_rollout_debug.metrics.profile import (
    JOINT_BINS,
    POSITION_BUCKETS,
    PROBABILITY_BUCKETS,
)
from lightning_rollout_debug.metrics.torch_pass.constants import (
    FINE_STEPS,
    HOST,
    Constants,
    by_shape,
    on_device,
    part_starts,
    plane_starts,
)
from lightning_rollout_debug.metrics.torch_pass.planes import (
    FINE,
    PassPlan,
    Planes,
    counted_planes,
)
from lightning_rollout_debug.metrics.torch_pass.segments import NoSegments, SegmentRows
from lightning_rollout_debug.metrics.worst_tokens import CONTEXT_TOKENS, ids_before

INF = math.inf

SOURCES = {"fine_d": "d", "fine_l": "l", "ratio": "r", "diff": "d", "probability": "a"}
"""The plane each counted part (but the joint bins) bins."""


def worst_keys(abs_r: Tensor) -> Tensor:
    """Each token's worst-token key: ``|r|``'s bits above, less the token's place.

    ``abs_r`` holds ``|r|`` (``-inf`` where a token does not count). Non-negative floats order
    as their bits do, so a larger key is a larger ``|r|``, then an earlier token (row, then
    column); a token that does not count has a negative key. Float64 values are ranked at
    float32 precision (ties go to the earlier token).
    """
    bits = (abs_r if abs_r.dtype == torch.float32 else abs_r.float()).view(torch.int32)
    rows, width = abs_r.shape
    if compiling():
        places = torch.arange(0, -abs_r.numel(), -1, device=abs_r.device).view(abs_r.shape)
        return torch.add(places, bits, alpha=1 << 32)

    def starts(device: torch.device) -> Tensor:  # -(each row's first place), [B, 1]
        return torch.arange(0, -rows * width, -width, device=device).view(rows, 1)

    keys = torch.add(by_shape("row starts", abs_r, starts), bits, alpha=1 << 32)
    return keys.sub_(by_shape("columns", abs_r, lambda device: torch.arange(width, device=device)))


def eager_extras(
    plan: PassPlan,
    p: Planes,
    edges: Constants,
    key: Tensor | None,
    token_ids: Tensor | None,
    by_segment: SegmentRows | NoSegments,
    room: Tensor | None = None,
) -> tuple[Tensor | None, ...]:
    """An eager pass's counted bins, sums by position and by probability, and candidates.

    The candidates are the worst tokens of ``key`` (:func:`worst_keys`); each is ``None``
    where the plan has none. ``room``: two float64 planes no longer read, for
    :func:`by_probability`.
    """
    width = p["one"].shape[-1]
    position = probability = counts = worst = None
    if plan.parts:  # the tokens that do not count land in each part's bin of 0 values
        if plan.profile:
            every = p.run(p.names[0], p.names[-1])
            position = by_position(every.sum(1), width, edges.position)
        indices = bin_indices(plan, p, edges)
        if plan.profile:
            probability = by_probability(p, indices["probability"], room)
        counts = count_bins(plan, indices)
    if key is not None:
        worst = worst_candidates(key, p, token_ids, plan.worst_tokens_k, width, None, by_segment)
    return counts, position, probability, worst


def bin_indices(plan: PassPlan, p: Planes, edges: Constants) -> Planes:
    """Each token's bin in every counted part (:func:`counted_parts`), from 0 in its part.

    The planes lie as :func:`.planes.counted_planes` says. ``joint`` counts the bins of
    ``a`` and ``b`` backwards (``3843 - bin``): the finishing reverses the part.
    """
    names = list(counted_planes(plan.parts))
    if plan.profile:  # the joint bins take two planes: a's, then b's, added into a's
        names.append("joint_b")

    def make() -> Planes:
        buffer = p.tail(plan.tail, len(names), torch.int32)
        return Planes(names, p["one"], torch.int32, buffer, pairs=False)

    index: Planes = p.derived(("index", *names), make)
    by_bits = FINE if plan.profile and p.dtype == torch.float32 else ()
    for name in names:
        if name in SOURCES and name not in by_bits:
            right = name != "probability"
            values, bins = p[SOURCES[name]], getattr(edges, name)
            index.write(name, torch.bucketize, values, bins, out_int32=True, right=right)
    if by_bits:
        _fine_bins(p, index)
    if plan.profile:
        index.write(
            ("joint", "joint_b"), torch.bucketize, p.run("a", "b"), edges.joint, out_int32=True
        )
        side = len(JOINT_BINS.edges) + 1
        index.write("joint", torch.add, index["joint_b"], index["joint"], alpha=side)
    return index


def _fine_bins(p: Planes, index: Planes) -> None:
    """The fine bins of ``|a - b|`` and ``|pa - pb|`` (float32), read off their bits.

    :meth:`.LogBins.layout`: each value's step (its bits shifted) less the lowest edge's,
    clamped to its part; three integer operations for the two planes, where
    ``torch.bucketize`` searches a thousand edges for each value. The two parts' bins
    share their shift and lowest edge and differ in their top.
    """
    shift, lowest = FINE_STEPS
    values = [SOURCES[name] for name in FINE]
    bits = p.derived(("bits", *FINE), lambda: p.spaced(*values).view(torch.int32))
    out = index.run(*FINE)
    torch.bitwise_right_shift(bits, shift, out=out)
    out.sub_(lowest - 1)
    out.clamp_(on_device("fine floor", out), on_device("fine top", out))


def count_bins(plan: PassPlan, index: Planes) -> Tensor:
    """The counted bins of every token, those that do not count too: one scatter-add.

    ``index_add_`` reads the int32 bin indices as they are (``index_put_`` would widen
    them to an int64 copy: 8 bytes a token a part), adding a 1 seen as a vector (made once
    for a set of planes). Float32 counts of whole numbers below 2^24 are exact in any order.
    """
    planes = counted_planes(plan.parts)
    like = index[planes[0]]
    offsets = _offsets(plane_starts(plan.parts), like)
    run = index.update(planes[0], planes[-1], lambda i: i.add_(offsets))
    flat = run.reshape(-1)
    ones = index.derived(("ones", len(flat)), lambda: _one(like).expand(len(flat)))
    total = part_starts(plan.parts)[-1]
    counts = torch.zeros(total, dtype=torch.float32, device=like.device)
    return counts.index_add_(0, flat, ones)


def _offsets(starts: tuple[int, ...], like: Tensor) -> Tensor:
    """``starts`` as an int32 ``[parts, 1, 1]`` tensor on the device of ``like``."""
    return on_device(("offsets", starts), like)


def _one(like: Tensor) -> Tensor:
    """A float32 1 on the device of ``like``."""
    return on_device("one", like)


def by_position(columns: Tensor, width: int, edges: Tensor) -> Tensor:
    """Every plane's column sums ``[planes, T]`` summed by position bucket, in float64.

    Column ``t`` is in bucket ``floor(log2 t) + 1`` (0 for column 0): the powers of two up
    to ``t``, of ``edges``.
    """

    def buckets(device: torch.device) -> Tensor:  # eagerly: on the CPU
        host = HOST[edges.dtype].position
        return torch.bucketize(torch.arange(width, dtype=edges.dtype), host, right=True)

    bucket = by_shape("position", columns, buckets)
    sums = torch.zeros(len(columns), POSITION_BUCKETS, dtype=torch.float64, device=columns.device)
    return sums.index_add_(1, bucket, columns.double())


def by_probability(p: Planes, bucket: Tensor, room: Tensor | None = None) -> Tensor:
    """``|pa - pb|`` and ``|a - b|`` summed by the trainer's probability bucket, in float64.

    The two planes are copied to float64 into ``room`` (``[2, B T]``: planes no longer
    read, else a new buffer), then each is added to its buckets along the flat batch: on
    the CPU a scatter of a single row adds in one tight loop, where a scatter along the
    buckets of ``[2, buckets]`` sums makes an operation of every token.
    """
    if room is None:
        room = torch.empty((2, bucket.numel()), dtype=torch.float64, device=bucket.device)
    room.copy_(p.derived("l, d", lambda: p.spaced("l", "d").flatten(1)))
    sums = torch.zeros(2, PROBABILITY_BUCKETS, dtype=torch.float64, device=bucket.device)
    flat = p.derived(("flat index", bucket.data_ptr()), lambda: bucket.view(-1))
    of_l, of_d = room.unbind()
    sums_d, sums_l = sums.unbind()
    sums_d.index_add_(0, flat, of_d)
    sums_l.index_add_(0, flat, of_l)
    return sums


def worst_candidates(
    keys: Tensor,
    p: Planes,
    token_ids: Tensor | None,
    k: int,
    width: int,
    value: dict[str, Tensor] | None = None,
    segments: SegmentRows | NoSegments | None = None,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """The ``k`` tokens of largest key: their keys, ``[a, b]``, ids and segments.

    Each row's best first (rows in parallel), then the best of those. The ids are
    ``[1 + CONTEXT_TOKENS, k]``: each token's, then those before it (:func:`ids_before`);
    the segments ``[k]`` (``None``: no labels).
    """
    best = keys.topk(min(k, width), dim=-1).values
    found = best.flatten().topk(min(k, best.numel())).values
    flat = places(found)
    if value is None:
        ab = p.run("a", "b").reshape(2, -1).index_select(1, flat)
    else:  # traced: a and b at those places alone, never laid out whole
        ab = torch.stack([value["a"].take(flat), value["b"].take(flat)])
    ids = None if token_ids is None else ids_before(token_ids, flat, _context_steps(flat))
    return found, ab, ids, None if segments is None else segments.of_places(flat, width)


def _context_steps(like: Tensor) -> Tensor:
    """The column ``0, 1, ..., CONTEXT_TOKENS`` on the device of ``like``."""

    def steps(device: torch.device) -> Tensor:
        return torch.arange(CONTEXT_TOKENS + 1, device=device).view(-1, 1)

    return by_shape("context steps", like, steps)


def places(keys: Tensor) -> Tensor:
    """The place in the batch (``row * T + t``) of each worst-token key."""
    return keys.neg().bitwise_and_(0xFFFFFFFF)


POSITION_PLANES = ("one", "d", "k3")
"""The planes a compiled pass sums by position: the tokens, ``|pa - pb|`` and k3."""


def scattered(
    plan: PassPlan, p: dict[str, Tensor], edges: Constants, width: int
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Compiled, every counted bin and every sum by bucket in one float64 scatter-add.

    The counted parts add each token's weight (1 where it counts, 0 elsewhere), the
    position and probability buckets their values; compiled, one kernel computes each
    token's slots and adds to them, and the concatenations are never stored.
    """
    one = p["one"]
    slots: list[Tensor] = []
    values: list[Tensor] = []
    start = 0
    for name, size in plan.parts:
        if name == "joint":
            ia, ib = (torch.bucketize(p[side], edges.joint) for side in ("a", "b"))
            bins = ia * (len(JOINT_BINS.edges) + 1) + ib
        else:
            values_of = p[SOURCES[name]]
            bins = torch.bucketize(values_of, getattr(edges, name), right=name != "probability")
        slots.append(bins + start)
        values.append(one)
        start += size
    position = probability = None
    if plan.profile:
        # The powers of two up to each column, as comparisons the compiler keeps in its loop.
        columns = torch.arange(width, device=one.device).expand_as(one)
        bucket = sum((columns >= 1 << k).long() for k in range(POSITION_BUCKETS - 1))
        for name in POSITION_PLANES:
            slots.append(bucket + start)
            values.append(p[name])
            start += POSITION_BUCKETS
        prob = torch.bucketize(p["a"], edges.probability)
        for name in ("d", "l"):
            slots.append(prob + start)
            values.append(p[name])
            start += PROBABILITY_BUCKETS
    summed = torch.zeros(start, dtype=torch.float64, device=one.device)
    index = torch.cat([slot.flatten() for slot in slots])
    summed.scatter_add_(0, index, torch.cat([value.flatten() for value in values]).double())
    bins_end = sum(size for _, size in plan.parts)
    if plan.profile:
        at = bins_end
        position = summed[at : at + 3 * POSITION_BUCKETS].view(3, POSITION_BUCKETS)
        at += 3 * POSITION_BUCKETS
        probability = summed[at : at + 2 * PROBABILITY_BUCKETS].view(2, PROBABILITY_BUCKETS)
    return summed[:bins_end], position, probability
