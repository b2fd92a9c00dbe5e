"""The sums of a pass by segment: each row's tokens of one segment, as a row of their own.

With segment labels (``[B]``: one a row, a data source or a task; ``[B, T]``: one a token,
the turn of a multi-turn rollout), a pass reduces its planes by *segment row* as well: the
tokens of row ``i`` labelled ``s`` make row ``i (S + 1) + s`` of ``B (S + 1)``, where ``S``
is the number of segments and label ``S`` the last, *other* one (every label below 0 or
above ``S - 1``). An eager pass spreads them over ``L`` *lanes* of ``B (S + 1)`` rows each
(:func:`lanes_for`), so that row ``r`` is always of segment ``r mod (S + 1)``. A segment
row is a small window as a row is, its second moments centred at its own mean, and the
finishing merges the segment rows of each segment
(:func:`~lightning_rollout_debug.metrics.finish.finish_segments`). Each reduction is one
scatter, whatever the labels, and nothing waits for the device.

Example:
    >>> import torch
    >>> labels = torch.tensor([[0, 0, 1], [1, 7, -1]])
    >>> rows = SegmentRows(labels, segments=2, lanes=1)
    >>> rows.flat.tolist()  # row i, segment s: i * 3 + s; 7 and -1 are "other" (2)
    [0, 0, 1, 4, 5, 5]
    >>> rows.sums(torch.ones(1, 2, 3)).tolist()
    [[2.0, 1.0, 0.0, 0.0, 1.0, 2.0]]
    >>> SegmentRows(labels, segments=2, lanes=2).flat.tolist()  # lane 1: 6 rows on
    [0, 6, 1, 4, 11, 5]
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_rollout_debug.metrics.layout import compiling
from lightning_rollout_debug.metrics.torch_pass.constants import by_shape

MAX_LANE_ROWS = 16384
"""The most segment rows an eager pass spreads a batch's into (:func:`lanes_for`)."""


class NoSegments:
    """A batch without segment labels: an eager pass keeps nothing by segment row."""

    def keep_smallest(self, r: Tensor) -> None:
        """Nothing."""

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
        lanes: ``L`` (by default 1 traced, else :func:`lanes_for`).
    """

    def __init__(
        self, labels: Tensor, segments: int, width: int | None = None, lanes: int | None = None
    ) -> None:
        self.segments = segments
        self.per_row = segments + 1
        rows = labels.shape[0]
        width = labels.shape[1] if width is None else width
        if lanes is None:
            lanes = 1 if compiling() else lanes_for(rows, self.per_row)
        self.lanes = lanes
        """``L``: the segment rows of each row and segment (:func:`lanes_for`)."""
        self.count = self.lanes * rows * self.per_row
        """The segment rows: ``L B (S + 1)``."""
        signed = labels if labels.dtype.is_signed else labels.long()
        # -1 and every label above S - 1 become S: the "other" segment.
        label = signed.clamp(-1, segments).remainder_(self.per_row)

        def starts(device: torch.device) -> Tensor:
            first = torch.arange(rows, device=device) * self.per_row
            return first if labels.dim() == 1 else first.unsqueeze(1)

        def spread(device: torch.device) -> Tensor:
            lane = torch.arange(width, device=device).remainder_(lanes)
            return lane.mul_(rows * self.per_row).unsqueeze(0)

        index = label + by_shape(("segment starts", segments), labels, starts)
        # Each token's lane added (with [B] labels, each row's spread along it): the same
        # operation for one lane, whatever the batch's size.
        lane = by_shape(("lanes", lanes, width, segments), labels, spread)
        index = index.unsqueeze(1) + lane if index.dim() == 1 else index.add_(lane)
        self.flat = index.view(-1)
        """``[B T]``: the segment row of each token."""
        self._kept: dict[str, Tensor | None] = {}

    def sums(self, planes: Tensor) -> Tensor:
        """``[n, L B (S + 1)]``: the sums of ``planes`` (``[n, B, T]`` or ``[B, T]``)."""
        flat = self._flat(planes)
        return _base(self, flat, 0.0).index_add(1, self.flat, flat)

    def largest(self, planes: Tensor) -> Tensor:
        """The largest value of ``planes`` in each segment row (``-inf``: none)."""
        flat = self._flat(planes)
        return _base(self, flat, -math.inf).scatter_reduce(1, self._index(flat), flat, "amax")

    def smallest(self, planes: Tensor) -> Tensor:
        """The smallest value of ``planes`` in each segment row (``+inf``: none)."""
        flat = self._flat(planes)
        return _base(self, flat, math.inf).scatter_reduce(1, self._index(flat), flat, "amin")

    def of_places(self, places: Tensor, width: int) -> Tensor:
        """The segment of the tokens at ``places`` (``row * T + t``) of the batch."""
        return torch.take(self.flat, places).remainder_(self.per_row)

    # An eager pass keeps each reduction as it comes (:meth:`fields` gives them).
    def keep_smallest(self, r: Tensor) -> None:
        """Keep the smallest ``r`` of each segment row (``-inf`` added where not counting)."""
        self._kept["low"] = self.smallest(r)

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
        """What a pass keeps by segment row: ``first, top, low, second, log_ratio, shift``."""
        kept = self._kept
        r, shift = kept.get("log_ratio"), kept.get("shift")
        names = ("first", "top", "low", "second")
        found = [kept.get(name) for name in names]
        return (*found, None if r is None else r[0], None if shift is None else shift[..., None])

    def traced(
        self, rows: list[Tensor], firsts: int, seconds: int, tops: Tensor, low: bool
    ) -> tuple[Tensor | None, ...]:
        """Traced: the same from the values a compiled pass sums along its rows.

        ``rows``: its ``firsts`` values, then ``seconds`` squares and products, ..., and
        ``r`` last, all summed in float64 in one scatter (nothing is centred); ``tops``:
        the planes whose largest values it takes, in one scatter too, with ``low``
        ``-r`` last (``-inf`` where not counting), whose largest is the smallest ``r``.
        """
        at = firsts + seconds
        sums = self.sums(torch.stack([row.double() for row in (*rows[:at], rows[-1])]))
        largest = self.largest(tops)
        top, smallest = (largest[:-1], -largest[-1:]) if low else (largest, None)
        return sums[:firsts], top, smallest, sums[firsts:at], sums[at], None

    def _flat(self, planes: Tensor) -> Tensor:
        """``planes`` as ``[n, B T]`` (given so, as they are: a kept view costs nothing)."""
        tokens = self.flat.shape[0]
        if planes.dim() == 2 and planes.shape[1] == tokens:
            return planes
        return planes.reshape(-1, tokens)

    def _index(self, flat: Tensor) -> Tensor:
        return self.flat.expand(flat.shape[0], -1)


def _base(rows: SegmentRows, flat: Tensor, fill: float) -> Tensor:
    """``[n, B (S + 1)]`` filled with ``fill``, made once a shape (what a scatter starts from)."""
    shape = (flat.shape[0], rows.count)

    def make(device: torch.device) -> Tensor:
        return torch.full(shape, fill, dtype=flat.dtype, device=device)

    return by_shape(("segment base", fill, shape, flat.dtype), flat, make)


def lanes_for(rows: int, per_row: int) -> int:
    """``L``: how many segment rows an eager pass gives each row's tokens of one segment.

    Token ``t`` goes to lane ``t mod L`` (row ``l B (S + 1) + i (S + 1) + s``): a turn's
    consecutive tokens then add into ``L`` sums in turn, not into one (on a CPU a scatter
    into one sum waits for each addition; 4.1x the time of 8 lanes for 16 turns of 128
    tokens). At most 8 lanes and :data:`MAX_LANE_ROWS` rows, whose sums wait to be merged.

    Example:
        >>> lanes_for(64, 17), lanes_for(256, 17), lanes_for(1024, 17)
        (8, 3, 1)
    """
    return max(1, min(8, MAX_LANE_ROWS // (rows * per_row)))
