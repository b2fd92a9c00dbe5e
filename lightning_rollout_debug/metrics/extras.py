"""Device-side histograms, worst tokens and profile of a window: :class:`TokenExtras`.

Next to the statistics, :class:`TokenExtras` keeps one packed float64 vector on the
batch's device, laid out by a :class:`~lightning_rollout_debug.metrics.layout.Layout`:

* two histograms with FIXED bins (:mod:`.histograms`), of the log ratio ``r = a - b``
  and of ``abs(exp(a) - exp(b))`` over the counting tokens;
* the ``k`` counting tokens with the largest ``abs(r)``, with where they came from
  (:mod:`.worst_tokens`);
* the window's :mod:`.profile`: quantile bins, position and probability buckets, the
  joint histogram.

An update is masked arithmetic (a bin index from each value's bits, ``scatter_add_``
into a fixed-size tensor, ``topk``) with no host synchronisation, one pass of the native
kernel on CPUs. Because the bins are fixed, windows and ranks merge exactly: bin counts,
counts and sums add, extremes fold, and the best ``k`` of all candidates are kept.
:meth:`TokenExtras.summary` reads a merged vector, copied to the host once; the writers
of :mod:`lightning_rollout_debug.views.tensorboard` draw it.

Tokens count exactly as in the statistics: log-probs are floored at
:data:`~lightning_rollout_debug.metrics.tokens.LOG_PROB_FLOOR` first, and a token counts where
the mask is non-zero and both log-probs are finite.
"""

from __future__ import annotations

import functools
import numbers
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_rollout_debug.metrics import native
from lightning_rollout_debug.metrics.backends import add_batch, compile_problems, native_wanted
from lightning_rollout_debug.metrics.bins import (
    HISTOGRAMS,
    LOG_RATIO_BINS,
    PROBS_DIFF_BINS,
    QuarterOctaveBins,
)
from lightning_rollout_debug.metrics.finish_extras import finish_extras
from lightning_rollout_debug.metrics.histograms import Histogram, histogram_blocks, read_histograms
from lightning_rollout_debug.metrics.inputs import MismatchInputs, check_inputs, check_token_ids
from lightning_rollout_debug.metrics.layout import Layout
from lightning_rollout_debug.metrics.packed_window import PENDING, ThreadSafeWindow
from lightning_rollout_debug.metrics.profile import (
    PROFILE_SIZE,
    Profile,
    profile_blocks,
    read_profile,
)
from lightning_rollout_debug.metrics.rows import ROW_FIELDS, rows_for
from lightning_rollout_debug.metrics.stats import MismatchStats
from lightning_rollout_debug.metrics.token_pass import TokenSums
from lightning_rollout_debug.metrics.worst_tokens import (
    FIELDS,
    MAX_WORST_TOKENS_K,
    WorstToken,
    read_worst_tokens,
    worst_tokens_block,
)


def extras_problems(*, histograms: Any, worst_tokens_k: Any, dashboard_layout: Any) -> list[str]:
    """Return what is wrong with the TensorBoard-extras arguments (empty if nothing)."""
    problems = []
    for name, value in (("histograms", histograms), ("dashboard_layout", dashboard_layout)):
        if not isinstance(value, bool):
            problems.append(f"`{name}` must be True or False, got {value!r}.")
    if (
        isinstance(worst_tokens_k, bool)
        or not isinstance(worst_tokens_k, numbers.Integral)
        or not 0 <= worst_tokens_k <= MAX_WORST_TOKENS_K
    ):
        problems.append(
            f"`worst_tokens_k` must be an int from 0 (the table off) to {MAX_WORST_TOKENS_K}, "
            f"got {worst_tokens_k!r}."
        )
    return problems


# ------------------------------------------------------------------------ summaries
@dataclass(frozen=True)
class ExtrasSummary:
    """What a window's extras show: histograms by tag, worst tokens, profile.

    The worst tokens come worst first; the profile
    (:class:`~lightning_rollout_debug.metrics.profile.Profile`) is ``None`` when not kept.
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
    one. :meth:`summary` reads a merged state on the host. With the profile, a CPU batch
    of the native kernel has its profile block added into the window's in place (its
    pass holds the lock), so a window holds one profile block however many batches wait.

    Args:
        histograms: keep the two fixed-bin histograms of :data:`HISTOGRAMS`.
        worst_tokens_k: keep the ``k`` tokens with the largest ``abs(r)``; 0 keeps none.
        profile: keep the :mod:`~lightning_rollout_debug.metrics.profile` of the window:
            quantiles, profiles by position and by probability, the joint histogram.
        chunk_tokens: the most tokens one pass of the torch arithmetic reads (default
            4,194,304): a larger batch is read in passes of whole rows.
        compile: fuse an update, as :class:`~lightning_rollout_debug.MismatchStats`
            does: on CPUs through the native kernel (``k`` up to 64), on accelerators
            with ``torch.compile`` (``None``: every batch, never compiling on a CPU,
            falling back to eager arithmetic where fusing fails).

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
        chunk_tokens: int | None = None,
        compile: bool | None = None,
    ) -> None:
        problems = extras_problems(
            histograms=histograms, worst_tokens_k=worst_tokens_k, dashboard_layout=True
        )
        if not isinstance(profile, bool):
            problems.append(f"`profile` must be True or False, got {profile!r}.")
        if chunk_tokens is not None and (
            isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1
        ):
            problems.append(
                f"`chunk_tokens` must be None (auto) or a positive int, got {chunk_tokens!r}."
            )
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
        block (:data:`~lightning_rollout_debug.metrics.profile.PROFILE_SIZE` values)."""
        self._profile_at = self.layout.size - (PROFILE_SIZE if profile else 0)
        self._worst_at = self._profile_at - worst_tokens_k * FIELDS
        self.size = self.layout.size
        self._state: Tensor | None = None
        self._pending: list[Tensor] = []
        self._lock = threading.Lock()
        # With the profile, the batches of the CPU kernel: their profile is added up in
        # place (a merge of thousands of slots a batch saved), the rest waits.
        self._head_layout = extras_layout(self._histograms, worst_tokens_k)
        self._added: Tensor | None = None
        """A packed state whose profile block holds those batches' profile (the other
        slots: the last batch's)."""
        self._added_head: Tensor | None = None  # its slots before the profile block
        self._heads: list[Tensor] = []
        """Their packed states without the profile block (:attr:`_head_layout`), waiting."""

    # ------------------------------------------------------------------ state
    def settings(self) -> dict[str, Any]:
        """What the packed state is laid out by, as plain values (a checkpoint keeps them).

        Example:
            >>> TokenExtras(worst_tokens_k=3).settings()["worst_tokens_k"]
            3
        """
        return {
            "histograms": self.histograms,
            "worst_tokens_k": self.worst_tokens_k,
            "profile": self.profile,
            "size": self.size,
        }

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
        add_batch(inputs, token_ids, stats=None, extras=self, batch=batch_index, rank=rank)

    def finish(self, sums: Sequence[TokenSums]) -> Tensor:
        """The packed extras of the tokens of the passes ``sums``."""
        return finish_extras(sums, self.layout)

    # ------------------------------------------------------------ native kernel
    def kernel_request(self, *, add_profile: bool = False) -> native.ExtrasRequest | None:
        """What the native kernel accumulates for these extras (``None``: k too large).

        ``add_profile``: the pass's profile is added into the state it is finished into.
        """
        if self.worst_tokens_k > native.MAX_WORST_TOKENS:
            return None
        return native.ExtrasRequest(
            ratio_bins=(LOG_RATIO_BINS.low, LOG_RATIO_BINS.octaves),
            diff_bins=(PROBS_DIFF_BINS.low, PROBS_DIFF_BINS.octaves),
            histograms=bool(self._histograms),
            k=self.worst_tokens_k,
            profile=self.profile,
            add_profile=add_profile and self.profile,
        )

    def kernel_states(
        self,
        inputs: MismatchInputs,
        token_ids: Tensor | None,
        batch_index: int,
        rank: int,
        stats: MismatchStats | None = None,
        *,
        into: Tensor | None = None,
    ) -> tuple[Tensor | None, Tensor | None] | None:
        """One native pass over a CPU batch: ``(statistics state, extras state)``.

        The statistics' state is that of ``stats`` (``None``: not computed).  ``None``
        where the kernel does not apply (off the CPU, an empty batch, ``k`` above
        :data:`~.native.MAX_WORST_TOKENS`, ``compile=False``, other dtypes). ``into``:
        with the profile, a packed extras state the batch's is finished into, its profile
        block added to (the extras' state returned).
        """
        batch, width = inputs.mask.shape
        request = self.kernel_request(add_profile=into is not None)
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
            into=into,
        )

    def _kernel_add(
        self,
        inputs: MismatchInputs,
        token_ids: Tensor | None,
        batch_index: int,
        rank: int,
        stats: MismatchStats | None = None,
    ) -> tuple[bool, Tensor | None]:
        """Add a CPU batch with one native pass: whether it did, and the statistics' state.

        The statistics' state is that of ``stats`` (``None``: not computed). With the
        profile the pass holds the window's lock: the kernel adds the batch's profile
        block into the window's in place, and the rest of its state waits.
        """
        device = inputs.mask.device
        if device.type != "cpu":
            return False, None
        if not self.profile:
            found = self.kernel_states(inputs, token_ids, batch_index, rank, stats)
            if found is None:
                return False, None
            self._add([found[1]], device)  # type: ignore[list-item]
            return True, found[0]
        with self._lock:
            self._move(device)
            # The first batch's packed state is the window's to add the next ones into.
            found = self.kernel_states(
                inputs, token_ids, batch_index, rank, stats, into=self._added
            )
            if found is None or found[1] is None:
                return False, None
            if self._added is None:
                self._added = found[1]
            if self._added_head is None:  # a view, made once a window
                self._added_head = self._added[: self._profile_at]
            self._heads.append(self._added_head.clone())
            if len(self._heads) >= PENDING:
                self._heads = [self._head_layout.merge(torch.stack(self._heads))]
        return True, found[0]

    def _replace(self, state: Tensor | None) -> None:
        super()._replace(state)
        self._added, self._added_head, self._heads = None, None, []

    def _device(self) -> torch.device | None:
        found = super()._device()
        return found if found is not None or not self._heads else self._heads[0].device

    def _fold(self) -> None:
        """Merge the waiting states, the kernel's batches as one (the caller holds the lock)."""
        if self._heads and self._added is not None:
            # One waiting head may be a merge of a fold's worth: always written back.
            self._added[: self._profile_at] = (
                self._heads[0]
                if len(self._heads) == 1
                else self._head_layout.merge(torch.stack(self._heads))
            )
            self._pending.append(self._added)
            self._added, self._added_head, self._heads = None, None, []
        super()._fold()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_heads"] = list(self._heads)
        if self._added is not None:  # added into in place: a copy holds its own
            state["_added"], state["_added_head"] = self._added.clone(), None
        return state

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
        histograms = read_histograms(values, self._histograms)
        worst = read_worst_tokens(values[self._worst_at :])
        profile = read_profile(block[self._profile_at :]) if self.profile else None
        return ExtrasSummary(histograms, worst, profile)


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
    blocks = [block for name, bins in histograms for block in histogram_blocks(name, bins)]
    if worst_tokens_k:
        blocks.append(worst_tokens_block(worst_tokens_k))
    if profile:
        blocks += profile_blocks()
    return Layout(blocks)
