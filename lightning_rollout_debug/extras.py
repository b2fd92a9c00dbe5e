"""Device-side histograms and worst tokens of a window: :class:`TokenExtras`.

Next to the statistics, :class:`TokenExtras` keeps one packed float64 vector on the
batch's device, laid out by a :class:`~lightning_rollout_debug.layout.Layout`:

* two histograms with FIXED bins, of the log ratio ``r = a - b`` and of
  ``abs(exp(a) - exp(b))`` over the counting tokens, each with its count, minimum,
  maximum, sum and sum of squares (what ``SummaryWriter.add_histogram_raw`` takes);
* the ``k`` counting tokens with the largest ``abs(r)``, with where they came from.

An update is masked arithmetic (a bin index from each value's bits, ``scatter_add_``
into a fixed-size tensor, ``topk``) with no host synchronisation. Because the bins are
fixed, windows and ranks merge exactly: bin counts, counts and sums add, extremes fold,
and the best ``k`` of all candidates are kept. :meth:`TokenExtras.summary` reads a
merged vector, copied to the host once; the writers of :mod:`.tensorboard` draw it.

Tokens count exactly as in the statistics: log-probs are floored at
:data:`~lightning_rollout_debug.rows.LOG_PROB_FLOOR` first, and a token counts where
the mask is non-zero and both log-probs are finite.
"""

from __future__ import annotations

import functools
import math
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_rollout_debug import native
from lightning_rollout_debug.backends import (
    compile_problems,
    native_wanted,
    run_fused,
    token_id_states,
)
from lightning_rollout_debug.batch import (
    TOKEN_ID_DTYPES,
    MismatchInputs,
    check_inputs,
    check_token_ids,
)
from lightning_rollout_debug.bins import (
    HISTOGRAMS,
    LOG_RATIO_BINS,
    PROBS_DIFF_BINS,
    LogBins,
    QuarterOctaveBins,
)
from lightning_rollout_debug.layout import Block, Layout
from lightning_rollout_debug.native import WORST_FIELDS
from lightning_rollout_debug.profile import (
    PROFILE_SIZE,
    QUANTILE_BINS,
    Profile,
    profile_blocks,
    profile_from_tokens,
    read_profile,
)
from lightning_rollout_debug.rows import (
    ROW_FIELDS,
    counting_tokens,
    exp,
    kl_k3_tokens,
    prob_diff,
    rows_for,
)
from lightning_rollout_debug.stats import MismatchStats, ThreadSafeWindow

_F = len(WORST_FIELDS)
_MOMENTS = ("num", "min", "max", "sum", "sum_squares")
_PLACEHOLDER = (-math.inf, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1.0, 0.0)
"""A candidate that loses against any token (no token id)."""

WORST_TIES = ("batch", "rank", "row", "position")
"""Of tokens of equal ``abs(r)`` the earlier one in the window ranks first: the earlier
batch, then (in distributed runs) the lower rank, row and position."""

MAX_WORST_TOKENS_K = 1000
"""The most worst tokens a table lists: every batch's ``k`` candidates wait on the device
until the window merges them."""


def extras_problems(*, histograms: Any, worst_tokens_k: Any, dashboard_layout: Any) -> list[str]:
    """Return what is wrong with the TensorBoard-extras arguments (empty if nothing)."""
    problems = []
    for name, value in (("histograms", histograms), ("dashboard_layout", dashboard_layout)):
        if not isinstance(value, bool):
            problems.append(f"`{name}` must be True or False, got {value!r}.")
    if (
        isinstance(worst_tokens_k, bool)
        or not isinstance(worst_tokens_k, int)
        or not 0 <= worst_tokens_k <= MAX_WORST_TOKENS_K
    ):
        problems.append(
            f"`worst_tokens_k` must be an int from 0 (the table off) to {MAX_WORST_TOKENS_K}, "
            f"got {worst_tokens_k!r}."
        )
    return problems


def _earliest_top(key: Tensor, k: int) -> Tensor:
    """The indices of the ``k`` largest of ``key`` (1-D), of equal ones the lowest.

    ``topk`` alone leaves ties at the k-th value to chance; a second ``topk`` ranks the
    tokens above the k-th value first (all of them are kept) and those equal to it by
    index. No host synchronisation.
    """
    if k == 0:
        return torch.zeros(0, dtype=torch.int64, device=key.device)
    kth = torch.topk(key, k).values[-1]
    index = torch.arange(key.numel(), device=key.device, dtype=torch.float64)
    score = torch.where(key > kth, math.inf, torch.where(key == kth, -index, -math.inf))
    return torch.topk(score, k).indices


# ------------------------------------------------------------------------ summaries
@dataclass(frozen=True)
class Histogram:
    """A merged fixed-bin histogram, on the host.

    ``counts[i]`` is the number of values in bin ``i`` of ``edges`` (see
    :data:`HISTOGRAMS` for the convention); ``num`` is their total.
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


@dataclass(frozen=True)
class WorstToken:
    """One of the tokens with the largest ``abs(r)`` of a window.

    ``batch`` is the index of the training batch within the window (0 for the first
    batch after the previous logged step), ``row`` and ``position`` locate the token in
    that batch's ``[B, T]`` tensors, ``token_id`` is ``None`` when the batch had no ids.
    """

    log_ratio: float
    actor_prob: float
    rollout_prob: float
    batch: int
    row: int
    position: int
    token_id: int | None
    rank: int


@dataclass(frozen=True)
class ExtrasSummary:
    """What a window's extras show: histograms by tag, worst tokens, profile.

    The worst tokens come worst first; the profile
    (:class:`~lightning_rollout_debug.profile.Profile`) is ``None`` when not kept.
    """

    histograms: dict[str, Histogram]
    worst_tokens: list[WorstToken]
    profile: Profile | None = None


# ------------------------------------------------------------------------ the state
class TokenExtras(ThreadSafeWindow):
    """Histograms and worst tokens of a window of tokens, kept on the batch's device.

    Feed it the same ``[B, T]`` tensors as :class:`~lightning_rollout_debug.MismatchStats`
    with :meth:`update` (from several threads if need be: adding a batch to the window
    holds a lock); :attr:`state` is one packed float64 vector of fixed length
    :attr:`size`, and :meth:`merge_states` merges several (windows, or every rank's) into
    one. :meth:`summary` reads a merged state on the host.

    Args:
        histograms: keep the two fixed-bin histograms of :data:`HISTOGRAMS`.
        worst_tokens_k: keep the ``k`` tokens with the largest ``abs(r)``; 0 keeps none.
        profile: keep the :mod:`~lightning_rollout_debug.profile` of the window:
            quantiles, profiles by position and by probability, the joint histogram.
        chunk_tokens: rows are processed in chunks of about this many tokens, which
            bounds the temporary memory of an update.
        compile: fuse an update, as :class:`~lightning_rollout_debug.MismatchStats`
            does: on CPUs through the native kernel (``k`` up to 64), on accelerators
            with ``torch.compile`` (``None``: for batches of at least 65,536 tokens, never
            compiling on a CPU, falling back to eager arithmetic where fusing fails).

    Example:
        >>> import torch
        >>> extras = TokenExtras(worst_tokens_k=1)
        >>> rollout = torch.log(torch.tensor([[0.5, 0.25, 0.9]]))
        >>> actor = torch.log(torch.tensor([[0.5, 0.20, 0.9]]))
        >>> extras.update(rollout, actor, torch.tensor([[1, 1, 0]]), batch_index=3)
        >>> summary = extras.summary(extras.state)
        >>> summary.histograms["rollout_log_ratio_hist"].num
        2.0
        >>> worst = summary.worst_tokens[0]
        >>> worst.batch, worst.row, worst.position, round(worst.actor_prob, 6)
        (3, 0, 1, 0.2)
    """

    def __init__(
        self,
        *,
        histograms: bool = True,
        worst_tokens_k: int = 10,
        profile: bool = False,
        chunk_tokens: int = 1 << 18,
        compile: bool | None = None,
    ) -> None:
        problems = extras_problems(
            histograms=histograms, worst_tokens_k=worst_tokens_k, dashboard_layout=True
        )
        if not isinstance(profile, bool):
            problems.append(f"`profile` must be True or False, got {profile!r}.")
        if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
            problems.append(f"`chunk_tokens` must be a positive int, got {chunk_tokens!r}.")
        problems += compile_problems(compile)
        if problems:
            raise ValueError("Invalid TokenExtras arguments:\n- " + "\n- ".join(problems))
        self.histograms = histograms
        self.worst_tokens_k = worst_tokens_k
        self.profile = profile
        self.chunk_tokens = chunk_tokens
        self.compile = compile
        self._histograms = HISTOGRAMS if histograms else ()
        self.layout = extras_layout(self._histograms, worst_tokens_k, profile)
        """The packed state: each histogram as ``[bin counts..., num, min, max, sum,
        sum_squares]``, then ``k`` candidates of :data:`WORST_FIELDS`, then the profile
        block (:data:`~lightning_rollout_debug.profile.PROFILE_SIZE` values)."""
        self._profile_at = self.layout.size - (PROFILE_SIZE if profile else 0)
        self._worst_at = self._profile_at - worst_tokens_k * _F
        self.size = self.layout.size
        self._state: Tensor | None = None
        self._pending: list[Tensor] = []
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ state
    def identity_state(self, device: torch.device | str | None = None) -> Tensor:
        """The packed state of an empty window, built with fill kernels on ``device``."""
        return self.layout.identity(device)

    def state_problems(self, state: Any, what: str = "the extras window") -> list[str]:
        """Why ``state`` cannot be a packed extras window of real tokens (or ``[]``)."""
        return self.layout.problems(state, what)

    def merge_states(self, states: Tensor) -> Tensor:
        """Merge packed states stacked as ``[n, size]`` into one, on their device.

        Bin counts, counts and sums add, minima and maxima fold, and the ``k`` candidates
        with the largest ``abs(r)`` among all ``n * k`` are kept.
        """
        return self.layout.merge(states)

    # ----------------------------------------------------------------- update
    @torch.no_grad()
    def update(
        self,
        rollout_log_probs: Tensor,
        old_log_probs: Tensor,
        mask: Tensor,
        token_ids: Tensor | None = None,
        *,
        batch_index: int = 0,
        rank: int = 0,
    ) -> None:
        """Add one batch to the window.

        Args:
            rollout_log_probs: ``[B, T]`` log-probs the rollout engine recorded (``b``).
            old_log_probs: ``[B, T]`` log-probs the trainer recomputed (``a``).
            mask: ``[B, T]``; a position counts where it is non-zero.
            token_ids: optional ``[B, T]`` integer ids of the sampled tokens, shown in the
                worst-tokens table.
            batch_index: the batch's index within the window, shown in the table.
            rank: the process's rank, shown in the table.

        Raises:
            ValueError: the tensors have the wrong type, rank, shape, dtype or devices.
        """
        inputs = check_inputs(rollout_log_probs, old_log_probs, mask)
        if token_ids is not None:
            check_token_ids(token_ids, token_ids, mask, names=("token_ids", "token_ids", "mask"))
        batch, width = mask.shape
        device = mask.device
        parts = []
        found = self.kernel_states(inputs, token_ids, batch_index, rank)
        if found is not None:
            parts.append(found[1])
        elif batch * width > 0:
            rows = max(1, self.chunk_tokens // width)
            # As tensors made by fill kernels (no copy from the host): a compiler would
            # otherwise specialise on every new batch index.
            labels = [
                torch.full((), float(value), dtype=torch.float64, device=device)
                for value in (batch_index, rank)
            ]

            def chunks(state_of: Callable[..., Tensor], fused: bool) -> list[Tensor]:
                return [
                    state_of(
                        self,
                        inputs.rollout_log_probs[start : start + rows],
                        inputs.old_log_probs[start : start + rows],
                        inputs.mask[start : start + rows],
                        None if token_ids is None else token_ids[start : start + rows],
                        start,
                        labels[0],
                        labels[1],
                    )
                    for start in range(0, batch, rows)
                ]

            compile = self.compile if device.type != "cpu" else bool(self.compile)
            parts += run_fused(TokenExtras._chunk_state, compile, batch * width, chunks)
        self._add(parts, device)

    # ------------------------------------------------------------ native kernel
    def kernel_request(self) -> native.ExtrasRequest | None:
        """What the native kernel accumulates for these extras (``None``: k too large)."""
        if self.worst_tokens_k > native.MAX_WORST_TOKENS:
            return None
        return native.ExtrasRequest(
            ratio_bins=(LOG_RATIO_BINS.low, LOG_RATIO_BINS.octaves),
            diff_bins=(PROBS_DIFF_BINS.low, PROBS_DIFF_BINS.octaves),
            histograms=bool(self._histograms),
            k=self.worst_tokens_k,
            profile=self.profile,
        )

    def kernel_states(
        self,
        inputs: MismatchInputs,
        token_ids: Tensor | None,
        batch_index: int,
        rank: int,
        stats: MismatchStats | None = None,
    ) -> tuple[Tensor | None, Tensor | None] | None:
        """One native pass over a CPU batch: ``(statistics state, extras state)``.

        The statistics' state is that of ``stats`` (``None``: not computed).  ``None``
        where the kernel does not apply (off the CPU, an empty batch, ``k`` above
        :data:`~.native.MAX_WORST_TOKENS`, ``compile=False``, other dtypes).
        """
        batch, width = inputs.mask.shape
        request = self.kernel_request()
        compile = self.compile if stats is None else stats.compile
        cpu = inputs.mask.device.type == "cpu"
        if not (cpu and batch * width > 0 and request and native_wanted(compile)):
            return None
        statistics = None
        needed: frozenset[str] = frozenset()
        if stats is not None:
            statistics = native.StateRequest(stats.groups, stats.seq_ratio_bounds)
            needed = rows_for(stats.groups)
        return native.states(
            inputs.rollout_log_probs,
            inputs.old_log_probs,
            inputs.mask,
            needed,
            2.0 if stats is None else stats.is_threshold,
            ROW_FIELDS,
            statistics=statistics,
            extras=request,
            token_ids=token_ids,
            batch_index=batch_index,
            rank=rank,
        )

    def _chunk_state(
        self,
        rollout_log_probs: Tensor,
        old_log_probs: Tensor,
        mask: Tensor,
        token_ids: Tensor | None,
        first_row: int,
        batch_index: Tensor,
        rank: Tensor,
    ) -> Tensor:
        f64 = torch.float64
        a, b, r, masked, finite = counting_tokens(rollout_log_probs, old_log_probs, mask)
        counting = masked & finite
        parts = []
        if self._histograms or self.profile:
            # The same abs(pa - pb) as the statistics; r and the diff are zero where a
            # token does not count.
            prob_actor, prob_rollout = exp(a), exp(b)
            diff = prob_diff(prob_actor, prob_rollout, r)
        profile = None
        if self.profile:
            k3 = kl_k3_tokens(prob_actor, prob_rollout, r)
            profile = profile_from_tokens(a, b, r, counting, diff, k3)
        if self._histograms:
            keep = counting.flatten()
            weight = keep.to(f64)
            values = {"rollout_log_ratio_hist": r, "rollout_probs_diff_hist": diff}
            finer = {}
            if profile is not None:  # the profile's fine bins of abs(pa - pb) lead its block
                fine = QUANTILE_BINS[0][2]
                finer["rollout_probs_diff_hist"] = (fine, profile[: len(fine.edges) + 1])
            for name, spec in self._histograms:
                parts.append(
                    _histogram_state(values[name].flatten(), keep, weight, spec, finer.get(name))
                )
        if self.worst_tokens_k:
            parts.append(
                self._candidates(a, b, r, counting, token_ids, first_row, batch_index, rank)
            )
        if profile is not None:
            parts.append(profile)
        return torch.cat(parts)

    def _candidates(
        self,
        a: Tensor,
        b: Tensor,
        r: Tensor,
        counting: Tensor,
        token_ids: Tensor | None,
        first_row: int,
        batch_index: Tensor,
        rank: Tensor,
    ) -> Tensor:
        """The chunk's ``k`` tokens with the largest ``abs(r)``, as ``[k * F]`` (no sync)."""
        f64 = torch.float64
        width = r.shape[1]
        key = torch.where(counting, r.abs(), -math.inf).flatten()
        k = min(self.worst_tokens_k, key.numel())
        index = _earliest_top(key, k)
        keys = key.index_select(0, index)

        def pick(values: Tensor) -> Tensor:
            # A picked token that does not count (fewer counting tokens than k) may hold
            # NaN or inf in `a`: zero it, its key of -inf drops it anyway.
            picked = values.flatten().index_select(0, index).to(f64)
            return torch.where(torch.isfinite(keys), picked, 0.0)

        return self._candidate_rows(
            keys,
            (pick(r), pick(a), pick(b)),
            (batch_index.expand(k), index // width + first_row, index % width, rank.expand(k)),
            None if token_ids is None else pick(token_ids),
        )

    def _candidate_rows(
        self,
        keys: Tensor,
        values: tuple[Tensor, Tensor, Tensor],
        places: tuple[Tensor, Tensor, Tensor, Tensor],
        token_ids: Tensor | None,
    ) -> Tensor:
        """``[k * F]`` candidates of :data:`WORST_FIELDS`, placeholders after the found ones.

        ``values`` are ``(r, a, b)`` (zero for no token), ``places`` ``(batch, row,
        position, rank)``.
        """
        f64 = torch.float64
        r, a, b = values
        options: dict[str, Any] = {"dtype": f64, "device": keys.device}
        count = len(keys)
        ids = torch.full((count,), -1.0, **options) if token_ids is None else token_ids
        batch, row, position, rank = (place.to(f64) for place in places)
        columns = [keys.to(f64), r, torch.exp(a), torch.exp(b), batch, row, position, ids, rank]
        found = torch.stack(columns, dim=1)
        if count < self.worst_tokens_k:
            placeholders = self._empty_candidates(self.worst_tokens_k - count, options)
            found = torch.cat([found, placeholders])
        return found.flatten()

    @staticmethod
    def _empty_candidates(count: int, options: dict[str, Any]) -> Tensor:
        """``count`` placeholder candidates that lose against any token."""
        return torch.tensor(_PLACEHOLDER, **options).repeat(count, 1)

    # --------------------------------------------------------------- summary
    def summary(self, state: Tensor | Sequence[float]) -> ExtrasSummary:
        """Read a (merged) packed state: histograms by tag and worst tokens, worst first.

        Give it a host tensor or a list: reading a device tensor copies it to the host.
        """
        if isinstance(state, Tensor):
            state = state.detach().to("cpu", torch.float64).numpy()
        block = np.asarray(state, dtype=np.float64)
        if block.shape != (self.size,):
            raise ValueError(f"A packed extras state has {self.size} values; got {block.size}.")
        values = block[: self._profile_at].tolist()  # the profile's block stays an array
        histograms = {}
        offset = 0
        for name, spec in self._histograms:
            edges = spec.edges
            bins = len(edges) + 1
            moments = values[offset + bins : offset + bins + len(_MOMENTS)]
            histograms[name] = Histogram(edges, tuple(values[offset : offset + bins]), *moments)
            offset += bins + len(_MOMENTS)
        worst = []
        for start in range(self._worst_at, self._profile_at, _F):
            row = dict(zip(WORST_FIELDS, values[start : start + _F], strict=True))
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
                )
            )
        worst.sort(key=lambda t: (-abs(t.log_ratio), t.batch, t.rank, t.row, t.position))
        profile = read_profile(block[self._profile_at :]) if self.profile else None
        return ExtrasSummary(histograms, worst, profile)


def _histogram_state(
    values: Tensor,
    keep: Tensor,
    weight: Tensor,
    bins: QuarterOctaveBins,
    finer: tuple[LogBins, Tensor] | None = None,
) -> Tensor:
    """``[bin counts..., num, min, max, sum, sum_squares]`` of ``values`` where ``keep``.

    ``values`` (float32 or float64) must be zero where ``keep`` is false, so plain sums
    skip those tokens; ``weight`` is ``keep`` as float64. ``finer`` is ``(fine, counts)``:
    the counts of the same values in finer bins. Where each bin is a union of fine bins
    (both unsigned, the fine bins spanning these bins' range), the counts are added up
    from them: the same whole numbers as counting the values.
    """
    counts = torch.zeros(len(bins.edges) + 1, dtype=torch.float64, device=values.device)
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
        # between the two lowest edges, clamped alike.
        steps = torch.arange(-1, len(fine.edges), device=values.device)
        steps = (steps >> (fine.bits - bins.bits)) - bins.steps * (bins.low - fine.low)
        counts.index_add_(0, steps.clamp_(-1, bins.top).add_(1), finer[1])
    else:
        counts.scatter_add_(0, bins.index(values), weight)
    exact = values.to(torch.float64)
    moments = [
        weight.sum(),
        torch.where(keep, values, math.inf).amin().to(torch.float64),
        torch.where(keep, values, -math.inf).amax().to(torch.float64),
        exact.sum(),
        torch.dot(exact, exact),
    ]
    return torch.cat([counts, torch.stack(moments)])


@functools.lru_cache(maxsize=32)
def extras_layout(
    histograms: tuple[tuple[str, QuarterOctaveBins], ...],
    worst_tokens_k: int,
    profile: bool = False,
) -> Layout:
    """The packed extras state: per histogram its bins and moments, the candidates, the profile.

    Built once per configuration (the profile alone has thousands of named slots) and
    shared: a layout is not changed after it is built.
    """
    blocks = []
    for name, spec in histograms:
        bins = tuple(f"{name}[{i}]" for i in range(len(spec.edges) + 1))
        blocks += [
            Block("sum", (*bins, f"{name}.num"), whole=True),
            Block("min", (f"{name}.min",)),
            Block("max", (f"{name}.max",)),
            Block("sum", (f"{name}.sum", f"{name}.sum_squares")),
        ]
    if worst_tokens_k:
        blocks.append(
            Block("top", WORST_FIELDS, k=worst_tokens_k, empty=_PLACEHOLDER, ties=WORST_TIES)
        )
    if profile:
        blocks += profile_blocks()
    return Layout(blocks)


def token_ids_for(ids: Any, mask: Tensor) -> Tensor | None:
    """``ids`` if it is an integer ``[B, T]`` tensor matching ``mask``, else ``None``."""
    if (
        isinstance(ids, Tensor)
        and ids.dtype in TOKEN_ID_DTYPES
        and ids.shape == mask.shape
        and ids.device == mask.device
    ):
        return ids
    return None


@torch.no_grad()
def update_together(
    stats: MismatchStats,
    extras: TokenExtras,
    inputs: MismatchInputs,
    token_ids: Tensor | None,
    *,
    batch_index: int,
    rank: int,
) -> bool:
    """Add a checked batch to the statistics and the extras in ONE read of the batch.

    On CPUs, where the native kernel takes the batch (float32 or bfloat16 log-probs, a
    fused update), its single pass fills both windows. Returns ``False``, having added
    nothing, where it does not: the caller then updates each window on its own.
    """
    found = extras.kernel_states(inputs, token_ids, batch_index, rank, stats)
    if found is None:
        return False
    statistics, extras_state = found
    device = inputs.mask.device
    stats._add([statistics, *token_id_states(inputs, stats.groups)], device)
    extras._add([extras_state], device)
    return True
