"""The segments of a kernel pass: the labels it reads and the rows of sums it writes.

Given a :class:`SegmentRequest` (a batch's ``[B]`` or ``[B, T]`` labels, ``S`` segments),
the pass keeps the sums of each row's runs of equal label apart in the same read of the
batch (``row_sums.cpp``: at the end of a run its sums go to its segment, and the row's are
its runs' added up; the counted tokens of a row of runs shorter than 48 tokens on average
go to their segments' buckets, read for the row quantities the segments need alone), and
adds them up into one row of sums a segment, the last for every label outside ``[0, S)``:
:class:`PassLabels` holds what the pass reads and writes.
``passes.states`` then finishes those rows into the packed segments of
``segments.SegmentWindow``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_rollout_debug.metrics.rows import SEGMENT_GROUPS, rows_for

LABEL_KINDS = {torch.int32: 1, torch.int64: 2}
"""The dtypes of the labels the kernel reads, by its number for them (others are copied
as int64)."""


@dataclass(frozen=True, eq=False)
class SegmentRequest:
    """What the kernel finishes into the packed segments (``segments.SegmentWindow``).

    ``labels``: the batch's ``[B]`` or ``[B, T]`` integer labels; ``segments``: ``S``, whose
    last copy, ``other``, takes every label outside ``[0, S)``; ``groups``: the groups whose
    token-level slots (those of ``rows.SEGMENT_GROUPS``) each copy gets; ``rows``: the row
    quantities it is read for (``SegmentWindow.rows``).
    """

    labels: Tensor
    segments: int
    groups: frozenset[str]
    rows: frozenset[str]


@dataclass
class PassLabels:
    """A pass's segments (the default: none).

    The labels it reads, the rows of sums it writes (``[S + 1, columns]``), its arguments
    for them (the row function's last) and the row quantities they need.
    """

    labels: Tensor | None = None
    segment_rows: Tensor | None = None
    arguments: list[int | None] = field(default_factory=lambda: [None, 0, 0, 0, 0, None])
    needed: frozenset[str] = frozenset()


def pass_labels(request: SegmentRequest | None, fields: tuple[str, ...]) -> PassLabels:
    """What a pass reads and writes of its segments (``fields``: the kernel's row columns).

    None where there is no request, or the kernel cannot read its labels (off the CPU, a
    tensor subclass, not integers): the torch road takes the segments.
    """
    labels = None if request is None else request.labels
    if type(labels) is not Tensor or labels.device.type != "cpu" or labels.is_floating_point():
        return PassLabels()
    assert request is not None
    if labels.dtype not in LABEL_KINDS:
        labels = labels.to(torch.int64)
    labels = labels.contiguous()
    segment_rows = torch.empty(request.segments + 1, len(fields), dtype=torch.float64)
    needed = segment_rows_for(request.groups) & request.rows  # those of its groups
    arguments = [
        labels.data_ptr(),
        LABEL_KINDS[labels.dtype],
        int(labels.dim() == 2),
        request.segments,
        column_bits(fields, needed),
        segment_rows.data_ptr(),
    ]
    return PassLabels(labels, segment_rows, arguments, needed)


@functools.lru_cache(maxsize=64)
def column_bits(fields: tuple[str, ...], needed: frozenset[str]) -> int:
    """The bits of the columns of ``fields`` among ``needed``, as the kernel reads them."""
    return sum(1 << i for i, name in enumerate(fields) if name in needed)


@functools.lru_cache(maxsize=64)
def segment_rows_for(groups: frozenset[str]) -> frozenset[str]:
    """The row quantities of the token-level groups among ``groups``: a segment's."""
    return rows_for(groups & frozenset(SEGMENT_GROUPS))
