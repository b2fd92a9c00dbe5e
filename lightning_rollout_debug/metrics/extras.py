"""Device-side histograms, worst tokens and profile of a window: :class:`TokenExtras`.

Next to the statistics, :class:`TokenExtras` keeps one packed float64 vector on the
batch's device, laid out by a :class:`~lightning_rollout_debug.metrics.layout.Layout`:

* two histograms with FIXED bins (:mod:`.histograms`), of the log ratio ``r = a - b``
  and of ``abs(exp(a) - exp(b))`` over the counting tokens;
* the ``k`` counting tokens with the largest ``abs(r)``, with where they came from and,
  where the batch has token ids, their ids and those before them (:mod:`.worst_tokens`);
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
from lightning_rollout_debug.metrics.backends import add_batch, compile_problems
from lightning_rollout_debug.metrics.bins import (
    HISTOGRAMS,
    LOG_RATIO_BINS,
    PROBS_DIFF_BINS,
    QuarterOctaveBins,
)
from lightning_rollout_debug.metrics.histograms import Histogram, histogram_blocks, read_histograms
from lightning_rollout_debug.metrics.inputs import check_inputs, check_token_ids
from lightning_rollout_debug.metrics.layout import Layout
from lightning_rollout_debug.metrics.packed_window import InPlaceBlock, ThreadSafeWindow
from lightning_rollout_debug.metrics.profile import (
    PROFILE_SIZE,
    Profile,
    profile_blocks,
    read_profile,
)
from lightning_rollout_debug.metrics.torch_pass.sums import TokenSums
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
        self._pending: list[Tensor | TokenSums] = []
        self._lock = threading.Lock()
        # With the profile, the batches of the CPU kernel add their profile up in place (a
        # merge of thousands of slots a batch saved); the rest of their state waits.
        head = extras_layout(self._histograms, worst_tokens_k)
        self._in_place = InPlaceBlock(self.layout, head) if profile else None

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
                worst-tokens table: each worst token's id and the ids of the
                :data:`~.worst_tokens.CONTEXT_TOKENS` tokens before it in its row.
            batch_index: the batch's index within the window, shown in the table.
            rank: the process's rank, shown in the table.

        Raises:
            ValueError: the tensors have the wrong type, rank, shape, dtype or devices.
        """
        inputs = check_inputs(rollout_log_probs, old_log_probs, mask)
        if token_ids is not None:
            check_token_ids(token_ids, token_ids, mask, names=("token_ids", "token_ids", "mask"))
        add_batch(inputs, token_ids, stats=None, extras=self, batch=batch_index, rank=rank)

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
