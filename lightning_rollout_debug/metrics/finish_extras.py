"""From the sums of the torch pass to the packed extras: histograms, worst tokens, profile.

:func:`finish_extras` finishes the waiting batches of a window of
:class:`~.extras.TokenExtras` into one packed extras state, laid out as the extras'
:class:`~.layout.Layout` says: each histogram's counted bins and moments, and the
profile's counts and sums by bucket (:mod:`.profile`); beside it, every batch's
worst-token candidates (:mod:`.worst_tokens`), of which the window's merge keeps the best
``k`` (:meth:`~.layout.Layout.merge`). The rows' readings are those of the statistics
(:class:`~.finish.RowSums`, read once), taken as they are. An eager pass counts the
tokens that do not count too, in the bin of zero values: they are taken out here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from lightning_rollout_debug.metrics.bins import LOG_RATIO_BINS, PROBS_DIFF_BINS
from lightning_rollout_debug.metrics.finish import RowSums
from lightning_rollout_debug.metrics.profile import JOINT_BINS, QUANTILE_BINS
from lightning_rollout_debug.metrics.torch_pass.bins import POSITION_PLANES
from lightning_rollout_debug.metrics.torch_pass.constants import JOINT_EDGES, PROBABILITY_EDGES
from lightning_rollout_debug.metrics.torch_pass.sums import TokenSums
from lightning_rollout_debug.metrics.worst_tokens import CONTEXT_TOKENS, PLACEHOLDER


def finish_extras(batches: Sequence[TokenSums], rows: RowSums) -> tuple[Tensor, Tensor | None]:
    """The packed extras of the tokens of ``batches``, whose rows ``rows`` holds.

    The histograms' bins and moments and the profile, as :class:`~.extras.TokenExtras`
    lays them out, with a block of ``k`` empty worst-token candidates; and every
    batch's candidates (``None``: ``k`` is 0), of which a merge keeps the best ``k``.
    """
    plan = batches[0].plan
    k = plan.worst_tokens_k
    device = rows.count.device
    parts: dict[str, Tensor] = {}
    if plan.parts:
        counts = _summed(batches, "counts").split([size for _, size in plan.parts])
        parts = dict(zip((name for name, _ in plan.parts), counts, strict=True))
        if rows.uncounted is not None:  # an eager pass counts them in the bins of 0 values
            for name, part in parts.items():
                part[ZERO_BINS[name]] -= rows.uncounted
    pieces = []
    if plan.histograms:
        for value, bins in (("r", parts["ratio"]), ("d", parts.get("diff"))):
            if bins is None:  # |pa - pb|'s bins add up its fine bins
                bins = torch.zeros(_DIFF_BINS, dtype=torch.float64, device=device)
                bins.index_add_(0, _fine_to_diff(device), parts["fine_d"])
            square_root = "l" if value == "r" else "d"  # r^2 = |r|^2
            assert rows.log_ratio is not None
            moments = [
                rows.count,
                rows.smallest[value],
                rows.largest[value],
                rows.total_log_ratio if value == "r" else rows.total[value],
                rows.squares[square_root],
            ]
            pieces += [bins, torch.stack(moments)]
    candidates = None
    if k:
        placeholder = _placeholder(device)
        candidates = _candidates(batches, placeholder, device)
        pieces.append(placeholder.repeat(k))
    if plan.profile:
        position = _by_position(batches)
        probability = _summed(batches, "probability")
        width = torch.full((), float(max(rows.widths)), dtype=torch.float64, device=device)
        pieces += [
            parts["fine_d"],
            parts["fine_l"],
            position[0],
            parts["probability"],
            parts["joint"].flip(0),  # counted backwards
            position[1],
            position[2],
            probability[0],
            probability[1],
            torch.stack([rows.largest["d"], rows.largest["l"], width]),
        ]
    return torch.cat(pieces), candidates


def _by_position(batches: Sequence[TokenSums]) -> Tensor:
    """The tokens, ``|pa - pb|`` and k3 summed by position bucket over the batches."""
    rows = [
        torch.stack([sums.position[sums.position_planes.index(name)] for name in POSITION_PLANES])
        for sums in batches
    ]
    return (rows[0] if len(rows) == 1 else torch.stack(rows).sum(0)).to(torch.float64)


def _zero_bins() -> dict[str, int]:
    """The bin of a token whose values are all 0, in each counted part."""
    zero = torch.zeros(())
    ratio = int(torch.bucketize(zero, torch.tensor(LOG_RATIO_BINS.edges), right=True))
    probability = int(torch.bucketize(zero, torch.tensor(PROBABILITY_EDGES[torch.float32])))
    joint = int(torch.bucketize(zero, torch.tensor(JOINT_EDGES)))
    side = len(JOINT_BINS.edges) + 1
    return {
        "ratio": ratio,
        "diff": 0,
        "fine_d": 0,
        "fine_l": 0,
        "probability": probability,
        "joint": joint * side + joint,  # a's bin and b's, counted backwards
    }


ZERO_BINS = _zero_bins()
"""The bin, in each counted part, of a token whose values are all 0."""


def _summed(batches: Sequence[TokenSums], field: str) -> Tensor:
    parts = [getattr(sums, field) for sums in batches]
    total = parts[0] if len(parts) == 1 else torch.stack(parts).sum(0)
    return total.to(torch.float64)


_DIFF_BINS = 110


_FINE_TO_DIFF: dict[torch.device, Tensor] = {}


def _fine_to_diff(device: torch.device) -> Tensor:
    """The ``|pa - pb|`` histogram's bin of each of its fine bins (the first two nest)."""
    if device not in _FINE_TO_DIFF:
        fine, bins = QUANTILE_BINS[0][2], PROBS_DIFF_BINS
        steps = torch.arange(-1, len(fine.edges), device=device)
        steps = (steps >> (fine.bits - bins.bits)) - bins.steps * (bins.low - fine.low)
        _FINE_TO_DIFF[device] = steps.clamp(-1, bins.top) + 1
    return _FINE_TO_DIFF[device]


def _placeholder(device: torch.device) -> Tensor:
    """The fields of a candidate that loses against any token, made with fill kernels."""
    return torch.stack(
        [torch.full((), value, dtype=torch.float64, device=device) for value in PLACEHOLDER]
    )


def _candidates(batches: Sequence[TokenSums], placeholder: Tensor, device: torch.device) -> Tensor:
    """Every batch's worst-token candidates, as rows of their fields.

    A token that does not count is ``placeholder``.
    """
    found = [sums.worst for sums in batches]
    keys = torch.cat([w[0] for w in found])
    place = keys.neg().bitwise_and_(0xFFFFFFFF).to(torch.float64)  # a key's low bits
    a, b = torch.cat([w[1] for w in found], dim=1).unbind()
    sizes = [len(w[0]) for w in found]

    def label(value: Callable[[TokenSums], int]) -> Tensor:  # each candidate's, by fills
        return torch.cat(
            [
                torch.full((n,), float(value(s)), dtype=torch.float64, device=device)
                for s, n in zip(batches, sizes, strict=True)
            ]
        )

    batch, rank = label(lambda s: s.batch), label(lambda s: s.rank)
    width, first = label(lambda s: s.width), label(lambda s: s.first_row * s.width)
    place = place + first
    r = (a - b).to(torch.float64)  # float32 r, as it was ranked (and as the kernel reports it)
    row = torch.div(place, width, rounding_mode="floor")
    position = place - row * width
    ids = _ids([w[2] for w in found], sizes, device)
    columns = [
        r.abs(),
        r,
        a.to(torch.float64).exp(),
        b.to(torch.float64).exp(),
        batch,
        row,
        position,
        ids[0],
        rank,
        _segments([w[3] for w in found], sizes, device),
    ]
    candidates = torch.cat([torch.stack(columns, dim=1), known_context(ids[1:].t(), position)], 1)
    counted = keys > -(1 << 32)  # a token that does not count has -inf's bits above
    return torch.where(counted.unsqueeze(1), candidates, placeholder)


def _ids(ids: Sequence[Tensor | None], sizes: Sequence[int], device: torch.device) -> Tensor:
    """``[1 + CONTEXT_TOKENS, n]`` float64: the candidates' ids and those before them.

    -1 for the candidates of a batch without ids.
    """
    return torch.cat(
        [
            torch.full((1 + CONTEXT_TOKENS, n), -1.0, dtype=torch.float64, device=device)
            if i is None
            else i.to(torch.float64)
            for i, n in zip(ids, sizes, strict=True)
        ],
        dim=1,
    )


def _segments(
    segments: Sequence[Tensor | None], sizes: Sequence[int], device: torch.device
) -> Tensor:
    """``[n]`` float64: each candidate's segment index, -1 in a batch without labels."""
    return torch.cat(
        [
            torch.full((n,), -1.0, dtype=torch.float64, device=device)
            if s is None
            else s.to(torch.float64)
            for s, n in zip(segments, sizes, strict=True)
        ]
    )


def known_context(context: Tensor, position: Tensor) -> Tensor:
    """``[n, CONTEXT_TOKENS]`` float64: the ids before each token, -1 before its row's start.

    ``context[:, j - 1]`` is the id ``j`` places before the token at ``position`` in its
    row (:func:`~.worst_tokens.ids_before`); it is kept where ``j <= position``.

    Example:
        >>> context = torch.arange(CONTEXT_TOKENS).repeat(2, 1) + 10
        >>> known_context(context, torch.tensor([2.0, 9.0], dtype=torch.float64))[:, :3].tolist()
        [[10.0, 11.0, -1.0], [10.0, 11.0, 12.0]]
    """
    f64 = torch.float64
    steps = torch.arange(1, CONTEXT_TOKENS + 1, dtype=f64, device=position.device)
    return torch.where(position.unsqueeze(1) >= steps, context.to(f64), -1.0)
