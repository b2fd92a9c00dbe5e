"""From the sums of the torch pass to the packed extras: histograms, worst tokens, profile.

:func:`finish_extras` finishes the waiting batches of a window of
:class:`~.extras.TokenExtras` into one packed extras state, laid out as the extras'
:class:`~.layout.Layout` says: each histogram's counted bins and moments, the best ``k``
of every batch's worst-token candidates (:mod:`.worst_tokens`), and the profile's counts
and sums by bucket (:mod:`.profile`). The rows' sums come from :class:`~.finish.RowSums`,
as the statistics' do. An eager pass counts the tokens that do not count too, in the bin
of zero values: they are taken out here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from lightning_rollout_debug.metrics.bins import LOG_RATIO_BINS, PROBS_DIFF_BINS
from lightning_rollout_debug.metrics.finish import RowSums, row_count, stacked_rows
from lightning_rollout_debug.metrics.layout import Layout, filled, ranked
from lightning_rollout_debug.metrics.profile import JOINT_BINS, QUANTILE_BINS
from lightning_rollout_debug.metrics.torch_pass.bins import POSITION_PLANES, places
from lightning_rollout_debug.metrics.torch_pass.constants import JOINT_EDGES, PROBABILITY_EDGES
from lightning_rollout_debug.metrics.torch_pass.sums import TokenSums
from lightning_rollout_debug.metrics.worst_tokens import (
    CONTEXT_TOKENS,
    PLACEHOLDER,
    WORST_FIELDS,
    WORST_TIES,
    known_context,
)


def finish_extras(batches: Sequence[TokenSums], layout: Layout) -> Tensor:
    """The packed extras (laid out by ``layout``) of the tokens of ``batches``.

    The histograms' bins and moments, the ``k`` worst tokens of all the batches'
    candidates, and the profile, as :class:`~.extras.TokenExtras` lays them out.
    """
    plan = batches[0].plan
    rows = RowSums(batches)
    device = rows.count.device
    parts: dict[str, Tensor] = {}
    if plan.parts:
        counts = _summed(batches, "counts").split([size for _, size in plan.parts])
        parts = dict(zip((name for name, _ in plan.parts), counts, strict=True))
        _drop_uncounted(parts, batches, rows)
    pieces = []
    if plan.histograms:
        for value, bins in (("r", parts["ratio"]), ("d", parts.get("diff"))):
            if bins is None:  # |pa - pb|'s bins add up its fine bins
                bins = torch.zeros(_DIFF_BINS, dtype=torch.float64, device=device)
                bins.index_add_(0, _fine_to_diff(device), parts["fine_d"])
            square_root = "l" if value == "r" else "d"  # r^2 = |r|^2
            moments = [
                rows.count,
                rows.extreme("min", value),
                rows.extreme("max", value),
                rows.log_ratio.sum() if value == "r" else rows.total(value),
                rows.squares(square_root),
            ]
            pieces += [bins, torch.stack(moments)]
    if plan.worst_tokens_k:
        pieces.append(_worst_block(batches, plan.worst_tokens_k, device))
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
            torch.stack([rows.extreme("max", "d"), rows.extreme("max", "l"), width]),
        ]
    return torch.cat(pieces)


def _by_position(batches: Sequence[TokenSums]) -> Tensor:
    """The tokens, ``|pa - pb|`` and k3 summed by position bucket over the batches."""
    rows = [
        torch.stack([sums.position[sums.position_planes.index(name)] for name in POSITION_PLANES])
        for sums in batches
    ]
    return (rows[0] if len(rows) == 1 else torch.stack(rows).sum(0)).to(torch.float64)


def _drop_uncounted(parts: dict[str, Tensor], batches: Sequence[TokenSums], rows: RowSums) -> None:
    """Take the tokens that do not count out of the counted bins an eager pass filled.

    An eager pass counts them too, every one in its part's bin of 0 values (their values
    are cleared to 0).
    """
    eager = [sums for sums in batches if sums.uncounted]
    if not eager:
        return
    tokens = sum(row_count(sums) * sums.width for sums in eager)
    if len(eager) == len(batches):
        counted = rows.count
    else:
        at = rows.at["one"]
        counted = sum(
            stacked_rows(sums.first, "first")[at].to(torch.float64).sum() for sums in eager
        )
    for name, part in parts.items():
        part[ZERO_BINS[name]] -= tokens - counted


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


def _worst_block(batches: Sequence[TokenSums], k: int, device: torch.device) -> Tensor:
    """The best ``k`` of every batch's worst-token candidates, as the packed ``"top"`` block."""
    found = [sums.worst for sums in batches]
    keys = torch.cat([w[0] for w in found])
    place = places(keys).to(torch.float64)
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
    ]
    candidates = torch.cat([torch.stack(columns, dim=1), known_context(ids[1:].t(), position)], 1)
    placeholder = filled(PLACEHOLDER, dtype=torch.float64, device=device)
    counted = keys > -(1 << 32)  # a token that does not count has -inf's bits above
    candidates = torch.where(counted.unsqueeze(1), candidates, placeholder)
    if len(candidates) < k:
        candidates = torch.cat([candidates, placeholder.repeat(k - len(candidates), 1)])
    best = ranked(candidates, [WORST_FIELDS.index(name) for name in WORST_TIES])
    return candidates.index_select(0, best[:k]).flatten()


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
