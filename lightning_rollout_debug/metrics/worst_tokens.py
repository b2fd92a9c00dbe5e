"""The worst tokens of a window: the counting tokens with the largest ``abs(r)``.

Each batch contributes ``k`` candidates to the packed extras state (a ``"top"`` block of
:class:`~lightning_rollout_debug.metrics.layout.Layout`, fields :data:`WORST_FIELDS`), found on
the batch's device without a host synchronisation; a merge of windows or ranks keeps the
best ``k`` of all candidates. Of tokens of equal ``abs(r)`` the earlier one in the
window wins (:data:`WORST_TIES`), on every path and in every merge. Where the batch has
token ids, a candidate carries its id and the :data:`CONTEXT_TOKENS` ids before it in its
row, so that a merge keeps each token's context with it and the state stays ``k`` rows.
:func:`read_worst_tokens` reads a merged block on the host.

Example:
    >>> import torch
    >>> r = torch.tensor([[0.1, -0.5, 0.5]])
    >>> zero = torch.zeros_like(r)
    >>> origin = (0, torch.tensor(0.0, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64))
    >>> counting = torch.ones_like(r, dtype=torch.bool)
    >>> block = candidates(zero, -r, r, counting, None, origin, k=2)
    >>> [(token.log_ratio, token.position) for token in read_worst_tokens(block.tolist())]
    [(-0.5, 1), (0.5, 2)]
    >>> block = candidates(zero, -r, r, counting, torch.tensor([[7, 8, 9]]), origin, k=2)
    >>> [(token.token_id, token.context) for token in read_worst_tokens(block.tolist())]
    [(8, (7,)), (9, (7, 8))]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_rollout_debug.metrics.layout import Block, filled

__all__ = [
    "CONTEXT_FIELDS",
    "CONTEXT_TOKENS",
    "MAX_WORST_TOKENS_K",
    "WORST_FIELDS",
    "WORST_TIES",
    "WorstToken",
    "candidates",
    "ids_before",
    "known_context",
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
    *CONTEXT_FIELDS,
)
"""Columns of a worst-token candidate in the packed extras (an id is -1 if unknown: no ids
in the batch, or before the start of the token's row)."""

FIELDS = len(WORST_FIELDS)
"""The values of one candidate in the packed state."""
PLACEHOLDER = (-math.inf, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1.0, 0.0, *(-1.0,) * CONTEXT_TOKENS)
"""A candidate that loses against any token (no token id, no context)."""

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
    earliest first (fewer near the row's start, none without ids).
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


def worst_tokens_block(k: int) -> Block:
    """The packed block of ``k`` candidates, merged by ``abs(r)`` with :data:`WORST_TIES`."""
    return Block("top", WORST_FIELDS, k=k, empty=PLACEHOLDER, ties=WORST_TIES)


def earliest_top(key: Tensor, k: int) -> Tensor:
    """The indices of the ``k`` largest of ``key`` (1-D, no NaN), of equal ones the lowest.

    In no particular order (the caller ranks the candidates).

    ``topk`` alone leaves ties at the k-th value to chance. A float32 key (up to 2**32 of
    them) is ranked with its position in one 64-bit integer: the key's bits, turned into
    an integer of the same order, above the position counted from the end, so that one
    ``topk`` orders by key, then by position. Other keys take a second ``topk``, which
    ranks those above the k-th value first (all of them are kept) and those equal to it
    by index. No host synchronisation.

    Example:
        >>> sorted(earliest_top(torch.tensor([0.5, 2.0, 0.5, -math.inf, 0.5]), 3).tolist())
        [0, 1, 2]
    """
    if k == 0:
        return torch.zeros(0, dtype=torch.int64, device=key.device)
    count = key.numel()
    if key.dtype == torch.float32 and count <= 1 << 32:
        bits = torch.where(key == 0.0, 0.0, key).view(torch.int32)  # -0.0 ties with +0.0
        # Negative floats order backwards as integers: flipping all but the sign fixes it.
        ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()
        from_end = (count - 1) - torch.arange(count, device=key.device)
        ranked = torch.topk(ordered * (1 << 32) + from_end, k).values
        return (count - 1) - (ranked & 0xFFFFFFFF)
    kth = torch.topk(key, k).values[-1]
    index = torch.arange(count, device=key.device, dtype=torch.float64)
    score = torch.where(key > kth, math.inf, torch.where(key == kth, -index, -math.inf))
    return torch.topk(score, k).indices


def ids_before(token_ids: Tensor, places: Tensor, steps: Tensor) -> Tensor:
    """``[1 + CONTEXT_TOKENS, n]``: the id at each of ``places``, then the ids before it.

    ``places`` are ``row * T + t`` in the ``[B, T]`` ``token_ids``; ``steps`` is the column
    ``0, 1, ..., CONTEXT_TOKENS`` (``[1 + CONTEXT_TOKENS, 1]``), row ``j`` of the result the
    id ``j`` places before. Near the start of a row those are the previous row's (or the
    first id): :func:`known_context` drops them. Three operations, no host synchronisation.

    Example:
        >>> ids = torch.arange(10, 20).view(2, 5)
        >>> steps = torch.arange(CONTEXT_TOKENS + 1).view(-1, 1)
        >>> ids_before(ids, torch.tensor([7, 1]), steps)[:4].tolist()
        [[17, 11], [16, 10], [15, 10], [14, 10]]
    """
    return torch.take(token_ids, torch.sub(places, steps).clamp_(min=0))


def known_context(context: Tensor, position: Tensor) -> Tensor:
    """``[n, CONTEXT_TOKENS]`` float64: the ids before each token, -1 before its row's start.

    ``context[:, j - 1]`` is the id ``j`` places before the token at ``position`` in its
    row (:func:`ids_before`); it is kept where ``j <= position``.

    Example:
        >>> context = torch.arange(CONTEXT_TOKENS).repeat(2, 1) + 10
        >>> known_context(context, torch.tensor([2.0, 9.0], dtype=torch.float64))[:, :3].tolist()
        [[10.0, 11.0, -1.0], [10.0, 11.0, 12.0]]
    """
    f64 = torch.float64
    steps = torch.arange(1, CONTEXT_TOKENS + 1, dtype=f64, device=position.device)
    return torch.where(position.unsqueeze(1) >= steps, context.to(f64), -1.0)


def candidates(
    a: Tensor,
    b: Tensor,
    r: Tensor,
    counting: Tensor,
    token_ids: Tensor | None,
    origin: tuple[int, Tensor, Tensor],
    *,
    k: int,
) -> Tensor:
    """The ``k`` counting tokens of ``[B, T]`` with the largest ``abs(r)``, as ``[k * F]``.

    ``a`` and ``b`` are the trainer's and the rollout's log-probs; ``origin`` is ``(first
    row, batch index, rank)``: the row of the batch that row 0 is, then the batch's index
    in the window and the process's rank as 0-d float64 tensors. No host
    synchronisation.
    """
    f64 = torch.float64
    first_row, batch_index, rank = origin
    width = r.shape[1]
    key = torch.where(counting, r.abs(), -math.inf).flatten()
    found = min(k, key.numel())
    index = earliest_top(key, found)
    keys = key.index_select(0, index)

    def pick(values: Tensor) -> Tensor:
        # A picked token that does not count (fewer counting tokens than k) may hold
        # NaN or inf in `a`: zero it, its key of -inf drops it anyway.
        picked = values.flatten().index_select(0, index).to(f64)
        return torch.where(torch.isfinite(keys), picked, 0.0)

    steps = torch.arange(CONTEXT_TOKENS + 1, device=index.device).view(-1, 1)
    return _candidate_rows(
        keys,
        (pick(r), pick(a), pick(b)),
        (batch_index.expand(found), index // width + first_row, index % width, rank.expand(found)),
        None if token_ids is None else ids_before(token_ids, index, steps).t(),
        k=k,
    )


def _candidate_rows(
    keys: Tensor,
    values: tuple[Tensor, Tensor, Tensor],
    places: tuple[Tensor, Tensor, Tensor, Tensor],
    token_ids: Tensor | None,
    *,
    k: int,
) -> Tensor:
    """``[k * F]`` candidates of :data:`WORST_FIELDS`, placeholders after the found ones.

    ``keys`` are the found tokens' ``abs(r)``, ``values`` their ``(r, a, b)`` (zero for
    no token), ``places`` their ``(batch, row, position, rank)``, ``token_ids`` their ids
    and those before them (``[n, 1 + CONTEXT_TOKENS]``, :func:`ids_before`).
    """
    f64 = torch.float64
    r, a, b = values
    options: dict[str, Any] = {"dtype": f64, "device": keys.device}
    count = len(keys)
    batch, row, position, rank = (place.to(f64) for place in places)
    if token_ids is None:
        ids = torch.full((count, 1 + CONTEXT_TOKENS), -1.0, **options)
    else:
        ids = torch.cat([token_ids[:, :1].to(f64), known_context(token_ids[:, 1:], position)], 1)
    columns = [keys.to(f64), r, torch.exp(a), torch.exp(b), batch, row, position, ids[:, 0], rank]
    found = torch.cat([torch.stack(columns, dim=1), ids[:, 1:]], dim=1)
    if count < k:
        found = torch.cat([found, filled(PLACEHOLDER, **options).repeat(k - count, 1)])
    return found.flatten()


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
