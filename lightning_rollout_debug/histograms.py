"""The fixed-bin histograms of a window: their packed blocks, torch arithmetic and summary.

Each histogram of :data:`~lightning_rollout_debug.bins.HISTOGRAMS` is, in the packed
extras state, its bin counts and five moments: ``num, min, max, sum, sum_squares``,
what ``SummaryWriter.add_histogram_raw`` takes. Bin counts, counts and sums add and
extremes fold, so windows and ranks merge exactly. :func:`read_histograms` reads a
merged block on the host.

Example:
    >>> import torch
    >>> from lightning_rollout_debug.bins import HISTOGRAMS
    >>> name, bins = HISTOGRAMS[0]
    >>> values = torch.tensor([0.0, 0.5, 0.0])
    >>> keep = torch.tensor([True, True, False])
    >>> block = histogram_state(values, keep, keep.double(), bins)
    >>> histogram = read_histograms(block.tolist(), HISTOGRAMS[:1])[name]
    >>> histogram.num, histogram.max, histogram.sum_squares
    (2.0, 0.5, 0.25)
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_rollout_debug.bins import LogBins, QuarterOctaveBins
from lightning_rollout_debug.layout import Block
from lightning_rollout_debug.rows import over_rows

__all__ = [
    "MOMENTS",
    "MOMENT_ROWS",
    "Histogram",
    "histogram_blocks",
    "histogram_state",
    "moment_rows",
    "moments_of",
    "read_histograms",
]

MOMENTS = ("num", "min", "max", "sum", "sum_squares")
"""What a packed histogram holds after its bin counts."""


@dataclass(frozen=True)
class Histogram:
    """A merged fixed-bin histogram, on the host.

    ``counts[i]`` is the number of values in bin ``i`` of ``edges`` (see
    :data:`~lightning_rollout_debug.bins.HISTOGRAMS` for the convention); ``num`` is
    their total.
    """

    edges: tuple[float, ...]
    counts: tuple[float, ...]
    num: float
    min: float
    max: float
    sum: float
    sum_squares: float

    def bucket_limits(self) -> list[float]:
        """Upper limit of every bin, as TensorBoard wants it (the last is ``DBL_MAX``)."""
        return [*self.edges, sys.float_info.max]

    def support(self) -> slice:
        """The bins from the first to the last non-empty one (empty if there is none)."""
        filled = [i for i, count in enumerate(self.counts) if count > 0]
        return slice(filled[0], filled[-1] + 1) if filled else slice(0, 0)


def histogram_blocks(name: str, bins: QuarterOctaveBins) -> list[Block]:
    """The packed blocks of the histogram ``name``: bin counts and ``num``, then moments."""
    counts = tuple(f"{name}[{i}]" for i in range(len(bins.edges) + 1))
    return [
        Block("sum", (*counts, f"{name}.num"), whole=True),
        Block("min", (f"{name}.min",)),
        Block("max", (f"{name}.max",)),
        Block("sum", (f"{name}.sum", f"{name}.sum_squares")),
    ]


def histogram_state(
    values: Tensor,
    keep: Tensor,
    weight: Tensor,
    bins: QuarterOctaveBins,
    finer: tuple[LogBins, Tensor] | None = None,
    moments: Tensor | None = None,
    counts: Tensor | None = None,
) -> Tensor:
    """``[bin counts..., num, min, max, sum, sum_squares]`` of ``values`` where ``keep``.

    ``values`` (1-D, or ``[B, T]`` rows, float32 or float64) must be zero where ``keep``
    (of the same shape) is false, so plain sums skip those tokens; ``weight`` is ``keep``
    as float64. ``finer`` is ``(fine, counts)``: the counts of the same values in finer
    bins. Where each bin is a union of fine bins (both unsigned, the fine bins spanning
    these bins' range), the counts are added up from them: the same whole numbers as
    counting the values. ``moments``: the five moments, where the caller has reduced
    :func:`moment_rows` already (with other quantities' rows,
    :func:`~lightning_rollout_debug.rows.over_rows`). ``counts``: the bin counts, where
    the caller has counted them (in the profile's scatter-add).
    """
    if counts is None:
        counts = _bin_counts(values, weight, bins, finer)
    if moments is None:
        rows = (torch.atleast_2d(x) for x in (values, keep, weight))
        moments = moments_of(over_rows(moment_rows(*rows)))
    return torch.cat([counts, moments])


def _bin_counts(
    values: Tensor,
    weight: Tensor,
    bins: QuarterOctaveBins,
    finer: tuple[LogBins, Tensor] | None,
) -> Tensor:
    """The counts of :func:`histogram_state`: from the fine bins where they nest, else counted."""
    size = len(bins.edges) + 1
    fine = None if finer is None else finer[0]
    if (
        fine is not None
        and not (fine.signed or bins.signed)
        and fine.bits >= bins.bits
        and fine.low <= bins.low
        and bins.low + bins.octaves <= fine.low + fine.octaves
    ):
        # Fine bin i holds the values whose fine steps above 2**fine.low are i - 1 (-1:
        # below, clamped); their steps here are those shifted right, less the steps
        # between the two lowest edges, clamped alike. Each bin sums its fine bins (a
        # reduction, which a compiler does in one kernel; no atomic adds into zeros).
        steps = torch.arange(-1, len(fine.edges), device=values.device)
        steps = (steps >> (fine.bits - bins.bits)) - bins.steps * (bins.low - fine.low)
        of_bin = steps.clamp(-1, bins.top) + 1 == torch.arange(size, device=values.device)[:, None]
        return torch.where(of_bin, finer[1], 0.0).sum(1)  # type: ignore[index]
    counts = torch.zeros(size, dtype=torch.float64, device=values.device)
    return counts.scatter_add_(0, bins.index(values.flatten()), weight.flatten())


MOMENT_ROWS = ("num", "neg_min", "max_value", "sum", "sum_squares")
"""The names of :func:`moment_rows`, for :func:`~lightning_rollout_debug.rows.over_rows`:
``neg_min`` is the largest of the negated values, minus the smallest."""


def moment_rows(values: Tensor, keep: Tensor, weight: Tensor) -> dict[str, Tensor]:
    """Each row's part of the five moments of a ``[B, T]`` block (:data:`MOMENT_ROWS`)."""
    exact = values.to(torch.float64)
    parts = (
        weight.sum(-1),
        torch.where(keep, -values, -math.inf).amax(-1),
        torch.where(keep, values, -math.inf).amax(-1),
        exact.sum(-1),
        (exact * exact).sum(-1),
    )
    return dict(zip(MOMENT_ROWS, parts, strict=True))


def moments_of(totals: Mapping[str, Tensor]) -> Tensor:
    """``[num, min, max, sum, sum_squares]`` from the totals of :func:`moment_rows`."""
    num, neg_min, largest, total, squares = (totals[name] for name in MOMENT_ROWS)
    return torch.stack([num, -neg_min, largest, total, squares])


def read_histograms(
    values: Sequence[float], histograms: Sequence[tuple[str, QuarterOctaveBins]]
) -> dict[str, Histogram]:
    """The ``histograms`` (name and bins) packed one after another in ``values``, by name."""
    found = {}
    offset = 0
    for name, bins in histograms:
        edges = bins.edges
        size = len(edges) + 1
        moments = values[offset + size : offset + size + len(MOMENTS)]
        found[name] = Histogram(edges, tuple(values[offset : offset + size]), *moments)
        offset += size + len(MOMENTS)
    return found
