"""The fixed-bin histograms of a window: their packed blocks and their summary.

Each histogram of :data:`~lightning_rollout_debug.metrics.bins.HISTOGRAMS` is, in the packed
extras state, its bin counts and five moments: ``num, min, max, sum, sum_squares``,
what ``SummaryWriter.add_histogram_raw`` takes. Bin counts, counts and sums add and
extremes fold, so windows and ranks merge exactly. :func:`read_histograms` reads a
merged block on the host.

Example:
    >>> import torch
    >>> from lightning_rollout_debug.metrics.bins import HISTOGRAMS
    >>> name, bins = HISTOGRAMS[0]
    >>> counts = [0.0] * (len(bins.edges) + 1)
    >>> counts[int(bins.index(torch.tensor([0.5]))[0])] = 2.0
    >>> histogram = read_histograms([*counts, 2.0, 0.5, 0.5, 1.0, 0.5], HISTOGRAMS[:1])[name]
    >>> histogram.num, histogram.max, histogram.sum_squares
    (2.0, 0.5, 0.5)
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_rollout_debug.metrics.bins import QuarterOctaveBins
from lightning_rollout_debug.metrics.layout import Block

__all__ = [
    "MOMENTS",
    "Histogram",
    "histogram_blocks",
    "read_histograms",
]

MOMENTS = ("num", "min", "max", "sum", "sum_squares")
"""What a packed histogram holds after its bin counts."""


@dataclass(frozen=True)
class Histogram:
    """A merged fixed-bin histogram, on the host.

    ``counts[i]`` is the number of values in bin ``i`` of ``edges`` (see
    :data:`~lightning_rollout_debug.metrics.bins.HISTOGRAMS` for the convention); ``num`` is
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
