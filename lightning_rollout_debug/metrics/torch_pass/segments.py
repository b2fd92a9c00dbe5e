"""The sums of a pass by segment: a batch's tokens of one segment, spread over a few rows.

With segment labels (``[B]``: one a row, a data source or a task; ``[B, T]``: one a token,
the turn of a multi-turn rollout), a pass reduces its planes by *segment row* as well.
Token ``t`` of row ``i``, labelled ``s``, goes to segment row ``(g L + l) (S + 1) + s``
of ``G L (S + 1)``: ``S`` is the number of segments and label ``S`` the last, *other* one
(every label below 0 or above ``S - 1``), ``l = t mod L`` its *lane* and ``g = i mod G``
its row's *group* (:func:`segment_layout`). Row ``r`` is always of segment
``r mod (S + 1)``; the lanes keep a turn's consecutive tokens from adding into one sum
one after another, the groups keep rows of a batch apart, and the rows stay as many
whatever the batch. A segment row is a small window as a row is, its second moments
centred at its own mean, and the finishing merges the segment rows of each segment
(:func:`~lightning_rollout_debug.metrics.finish.finish_segments`). Each reduction is one
scatter, whatever the labels, and nothing waits for the device.

Example:
    >>> import torch
    >>> labels = torch.tensor([[0, 0, 1], [1, 7, -1]])
    >>> rows = SegmentRows(labels, segments=2, lanes=1, groups=2)
    >>> rows.flat.tolist()  # row i, segment s: i * 3 + s; 7 and -1 are "other" (2)
    [0, 0, 1, 4, 5, 5]
    >>> rows.sums(torch.ones(1, 2, 3)).tolist()
    [[2.0, 1.0, 0.0, 0.0, 1.0, 2.0]]
    >>> SegmentRows(labels, segments=2, lanes=2, groups=1).flat.tolist()  # lane 1: 3 on
    [0, 3, 1, 1, 5, 2]
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_rollout_debug.metrics.torch_pass.constants import by_shape

LANES = 8
"""``L``: the lanes of a batch's segment rows (:func:`segment_layout`)."""
MAX_SEGMENT_ROWS = 4096
"""The most segment rows of a batch (:func:`segment_layout`)."""


class NoSegments:
    """A batch without segment labels: an eager pass keeps nothing by segment row."""

    def keep_largest(self, planes: Tensor) -> None:
        """Nothing."""

    def keep_sums(self, name: str, planes: Tensor | None) -> None:
        """Nothing."""

    def fields(self) -> None:
        """No sums by segment row."""

    def of_places(self, places: Tensor, width: int) -> None:
        """No segments."""


NO_SEGMENTS = NoSegments()


class SegmentRows:
    """The segment row of each token of a batch, and the reductions of planes by it.

    Args:
        labels: ``[B]`` or ``[B, T]`` integer segment labels (any integer dtype).
        segments: ``S``, the number of named segments; the rows have ``S + 1`` each.
        width: ``T`` (needed with ``[B]`` labels).
        lanes, groups: ``L`` and ``G`` (by default :func:`segment_layout`'s).
    """

    def __init__(
        self,
        labels: Tensor,
        segments: int,
        width: int | None = None,
        lanes: int | None = None,
        groups: int | None = None,
    ) -> None:
        self.segments = segments
        self.per_row = per_row = segments + 1
        rows = labels.shape[0]
        width = labels.shape[1] if width is None else width
        default_lanes, default_groups = segment_layout(segments)
        lanes = default_lanes if lanes is None else lanes
        groups = default_groups if groups is None else groups
        self.count = groups * lanes * per_row
        """The segment rows: ``G L (S + 1)``."""
        signed = labels if labels.dtype.is_signed else labels.long()
        # -1 and every label above S - 1 become S: the "other" segment.
        label = signed.clamp(-1, segments).remainder_(per_row)

        def group_starts(device: torch.device) -> Tensor:
            group = torch.arange(rows, device=device).remainder_(groups).mul_(lanes * per_row)
            return group if labels.dim() == 1 else group.unsqueeze(1)

        def lane_starts(device: torch.device) -> Tensor:
            return torch.arange(width, device=device).remainder_(lanes).mul_(per_row).unsqueeze(0)

        key = (segments, lanes, groups)
        index = label + by_shape(("segment groups", *key), labels, group_starts)
        # Each token's lane added (with [B] labels, each row's spread along it).
        lane = by_shape(("segment lanes", *key, width), labels, lane_starts)
        index = index.unsqueeze(1) + lane if index.dim() == 1 else index.add_(lane)
        self.flat = index.view(-1)
        """``[B T]``: the segment row of each token."""
        self._kept: dict[str, Tensor | None] = {}

    def sums(self, planes: Tensor) -> Tensor:
        """``[n, G L (S + 1)]``: the sums of ``planes`` (``[n, B, T]`` or ``[B, T]``)."""
        flat = self._flat(planes)
        return _base(self, flat, 0.0).index_add(1, self.flat, flat)

    def largest(self, planes: Tensor) -> Tensor:
        """The largest value of ``planes`` in each segment row (``-inf``: none)."""
        flat = self._flat(planes)
        return _base(self, flat, -math.inf).scatter_reduce(1, self._index(flat), flat, "amax")

    def of_places(self, places: Tensor, width: int) -> Tensor:
        """The segment of the tokens at ``places`` (``row * T + t``) of the batch."""
        return torch.take(self.flat, places).remainder_(self.per_row)

    # An eager pass keeps each reduction as it comes (:meth:`fields` gives them).
    def keep_largest(self, planes: Tensor) -> None:
        """Keep the largest value of each plane of each segment row."""
        self._kept["top"] = self.largest(planes)

    def keep_sums(self, name: str, planes: Tensor | None) -> None:
        """Keep the sums of ``planes`` by segment row as ``name`` (``None``: nothing)."""
        self._kept[name] = None if planes is None else self.sums(planes)

    def centre(self, centred: slice, one: int, shape: torch.Size) -> Tensor:
        """Each token's mean of the planes ``centred``, ``[k, B, T]``: its segment row's.

        From the kept sums (``first``; ``one``: the plane of the tokens): an eager pass
        centres the values of each segment row at its own mean, so that another segment's
        values in the same row (a ratio of ``e^20`` at the floor) cost it no digits.
        """
        first = self._kept["first"]
        assert first is not None
        shift = first[centred] / first[one].clamp(min=1.0)
        self._kept["shift"] = shift
        return shift.index_select(1, self.flat).view(-1, *shape)

    def fields(self) -> tuple[Tensor | None, ...]:
        """What a pass keeps by segment row: ``first, top, second, log_ratio, shift``."""
        kept = self._kept
        r, shift = kept.get("log_ratio"), kept.get("shift")
        names = ("first", "top", "second")
        found = [kept.get(name) for name in names]
        return (*found, None if r is None else r[0], None if shift is None else shift[..., None])

    def traced(
        self, rows: list[Tensor], firsts: int, seconds: int, tops: Tensor
    ) -> tuple[Tensor | None, ...]:
        """Traced: the same from the values a compiled pass sums along its rows.

        ``rows``: its ``firsts`` values, then ``seconds`` squares and products, ..., and
        ``r`` last, all summed in float64 in one scatter (nothing is centred); ``tops``:
        the planes whose largest values it takes (``-inf`` where not counting), in one
        scatter too.
        """
        at = firsts + seconds
        sums = self.sums(torch.stack([row.double() for row in (*rows[:at], rows[-1])]))
        return sums[:firsts], self.largest(tops), sums[firsts:at], sums[at], None

    def _flat(self, planes: Tensor) -> Tensor:
        """``planes`` as ``[n, B T]`` (given so, as they are: a kept view costs nothing)."""
        tokens = self.flat.shape[0]
        if planes.dim() == 2 and planes.shape[1] == tokens:
            return planes
        return planes.reshape(-1, tokens)

    def _index(self, flat: Tensor) -> Tensor:
        return self.flat.expand(flat.shape[0], -1)


def _base(rows: SegmentRows, flat: Tensor, fill: float) -> Tensor:
    """``[n, G L (S + 1)]`` filled with ``fill``, made once a shape (a scatter's start)."""
    shape = (flat.shape[0], rows.count)

    def make(device: torch.device) -> Tensor:
        return torch.full(shape, fill, dtype=flat.dtype, device=device)

    return by_shape(("segment base", fill, shape, flat.dtype), flat, make)


def segment_layout(segments: int) -> tuple[int, int]:
    """``L`` and ``G``: the lanes and the groups of rows of a batch's segment rows.

    :data:`LANES` lanes: a scatter into one sum waits for each addition (on a CPU, 16
    turns of 128 tokens take 4.1x the time of 8 lanes; on a GPU, a warp's atomic additions
    to one address queue), and as many groups as :data:`MAX_SEGMENT_ROWS` rows hold, at
    least one. Fixed by ``S`` alone: a compiled pass keeps one shape for any batch, and
    the sums waiting in a window (32 batches) stay small.

    Example:
        >>> segment_layout(16), segment_layout(256)
        ((8, 30), (8, 1))
    """
    return LANES, max(1, MAX_SEGMENT_ROWS // (LANES * (segments + 1)))
