"""The worst tokens of a window: the counting tokens with the largest ``abs(r)``.

Each batch contributes ``k`` candidates to the packed extras state (a ``"top"`` block of
:class:`~lightning_rollout_debug.metrics.layout.Layout`, fields :data:`WORST_FIELDS`), found on
the batch's device without a host synchronisation; a merge of windows or ranks keeps the
best ``k`` of all candidates. Of tokens of equal ``abs(r)`` the earlier one in the
window wins (:data:`WORST_TIES`), on every path and in every merge. Where the batch has
token ids, a candidate carries its id and the :data:`CONTEXT_TOKENS` ids before it in its
row, so that a merge keeps each token's context with it and the state stays ``k`` rows;
where the batch has segment labels, it carries its segment's index too.
:func:`read_worst_tokens` reads a merged block on the host.

Example:
    >>> fields = [0.5, -0.5, 0.3, 0.5, 0, 0, 2, 9, 0, 3, 8, 7, -1, -1, -1, -1]  # WORST_FIELDS
    >>> block = fields + list(PLACEHOLDER)  # k = 2: one token, one placeholder
    >>> [(t.log_ratio, t.position, t.token_id, t.context, t.segment)
    ...  for t in read_worst_tokens(block)]
    [(-0.5, 2, 9, (7, 8), 3)]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_rollout_debug.metrics.layout import Block

__all__ = [
    "CONTEXT_FIELDS",
    "CONTEXT_TOKENS",
    "MAX_WORST_TOKENS_K",
    "WORST_FIELDS",
    "WORST_TIES",
    "WorstToken",
    "ids_before",
    "read_worst_tokens",
    "worst_tokens_block",
]

CONTEXT_TOKENS = 6
"""How many ids before a worst token its candidate keeps (its row's earlier tokens)."""

CONTEXT_FIELDS: tuple[str, ...] = tuple(f"context_{j}" for j in range(1, CONTEXT_TOKENS + 1))
"""The context's columns: ``context_j`` is the id ``j`` positions before the token."""

WORST_FIELDS: tuple[str, ...] = (
    "abs_log_ratio",
    "log_ratio",
    "actor_prob",
    "rollout_prob",
    "batch",
    "row",
    "position",
    "token_id",
    "rank",
    "segment",
    *CONTEXT_FIELDS,
)
"""Columns of a worst-token candidate in the packed extras (an id is -1 if unknown: no ids
in the batch, or before the start of the token's row; ``segment`` is the index of the
token's segment, -1 in a batch without segment labels)."""

FIELDS = len(WORST_FIELDS)
"""The values of one candidate in the packed state."""
PLACEHOLDER = (-math.inf, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1.0, 0.0, -1.0, *(-1.0,) * CONTEXT_TOKENS)
"""A candidate that loses against any token (no token id, no segment, no context)."""

WORST_TIES = ("batch", "rank", "row", "position")
"""Of tokens of equal ``abs(r)`` the earlier one in the window ranks first: the earlier
batch, then (in distributed runs) the lower rank, row and position."""

MAX_WORST_TOKENS_K = 1000
"""The most worst tokens a table lists: every batch's ``k`` candidates wait on the device
until the window merges them."""


@dataclass(frozen=True)
class WorstToken:
    """One of the tokens with the largest ``abs(r)`` of a window.

    ``batch`` is the index of the training batch within the window (0 for the first
    batch after the previous logged step), ``row`` and ``position`` locate the token in
    that batch's ``[B, T]`` tensors, ``token_id`` is ``None`` when the batch had no ids.
    ``context`` holds the ids of up to :data:`CONTEXT_TOKENS` tokens before it in its row,
    earliest first (fewer near the row's start, none without ids). ``segment`` is the
    index of the token's segment (``max_segments`` for ``other``), ``None`` when its
    batch had no segment labels.
    """

    log_ratio: float
    actor_prob: float
    rollout_prob: float
    batch: int
    row: int
    position: int
    token_id: int | None
    rank: int
    context: tuple[int, ...] = ()
    segment: int | None = None


def worst_tokens_block(k: int) -> Block:
    """The packed block of ``k`` candidates, merged by ``abs(r)`` with :data:`WORST_TIES`."""
    return Block("top", WORST_FIELDS, k=k, empty=PLACEHOLDER, ties=WORST_TIES)


def ids_before(token_ids: Tensor, places: Tensor, steps: Tensor) -> Tensor:
    """``[1 + CONTEXT_TOKENS, n]``: the id at each of ``places``, then the ids before it.

    ``places`` are ``row * T + t`` in the ``[B, T]`` ``token_ids``; ``steps`` is the column
    ``0, 1, ..., CONTEXT_TOKENS`` (``[1 + CONTEXT_TOKENS, 1]``), row ``j`` of the result the
    id ``j`` places before. Near the start of a row those are the previous row's (or the
    first id): the fold drops them. Three operations, no host synchronisation.

    Example:
        >>> ids = torch.arange(10, 20).view(2, 5)
        >>> steps = torch.arange(CONTEXT_TOKENS + 1).view(-1, 1)
        >>> ids_before(ids, torch.tensor([7, 1]), steps)[:4].tolist()
        [[17, 11], [16, 10], [15, 10], [14, 10]]
    """
    return torch.take(token_ids, torch.sub(places, steps).clamp_(min=0))


def read_worst_tokens(values: Sequence[float]) -> list[WorstToken]:
    """The tokens of a (merged) block of candidates, on the host: worst first, then earliest."""
    worst = []
    for start in range(0, len(values), FIELDS):
        row = dict(zip(WORST_FIELDS, values[start : start + FIELDS], strict=True))
        if row["abs_log_ratio"] == -math.inf:
            continue
        worst.append(
            WorstToken(
                log_ratio=row["log_ratio"],
                actor_prob=row["actor_prob"],
                rollout_prob=row["rollout_prob"],
                batch=int(row["batch"]),
                row=int(row["row"]),
                position=int(row["position"]),
                token_id=None if row["token_id"] < 0 else int(row["token_id"]),
                rank=int(row["rank"]),
                context=_context(row),
                segment=None if row["segment"] < 0 else int(row["segment"]),
            )
        )
    worst.sort(key=lambda t: (-abs(t.log_ratio), *(getattr(t, name) for name in WORST_TIES)))
    return worst


def _context(row: dict[str, float]) -> tuple[int, ...]:
    """The known ids before a candidate's token, earliest first (up to the first unknown)."""
    before = []
    for name in CONTEXT_FIELDS:
        if row[name] < 0:
            break
        before.append(int(row[name]))
    return tuple(reversed(before))
