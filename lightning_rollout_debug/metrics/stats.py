"""MismatchStats: a mergeable window of the mismatch statistics.

:class:`MismatchStats` keeps one packed float64 vector on the batch's device
(:data:`~lightning_rollout_debug.metrics.layout.STATE`): a token count, means and centred
co-moments (merged with Chan's parallel formulas), sums, maxima and minima. An update is
masked arithmetic on the device with no host synchronisation (:mod:`.rows`, through the
path :mod:`.backends` chooses); merging two windows, or the windows of several ranks, is
exact; :meth:`MismatchStats.compute` copies the packed vector to the host once and
derives every metric of the catalog (:mod:`.catalog`) from it.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_rollout_debug.metrics.backends import add_batch, compile_problems
from lightning_rollout_debug.metrics.catalog import (
    GROUPS,
    METRIC_NAMES,
    SERIES_METRICS,
    metrics_from_state,
)
from lightning_rollout_debug.metrics.inputs import MismatchInputs, check_inputs
from lightning_rollout_debug.metrics.layout import STATE, STATE_SIZE, identity_state, merge_states
from lightning_rollout_debug.metrics.packed_window import ThreadSafeWindow
from lightning_rollout_debug.metrics.profile import Profile
from lightning_rollout_debug.metrics.rows import pad_slots
from lightning_rollout_debug.metrics.sawtooth import Series
from lightning_rollout_debug.metrics.settings import (
    validate_groups,
    validate_is_threshold,
    validate_seq_ratio_bounds,
)

_SETTING_OF_GROUP = {"importance_ratio": "is_threshold", "sequence": "seq_ratio_bounds"}
"""The setting whose value a group's sums are counted with."""

_COUNTED_APART = frozenset({"quantiles", "token_ids"})
"""Groups that a window of other settings cannot bias: the quantiles come from a profile,
not from the statistics' state, and the token-id comparisons count their own updates."""


class MismatchStats(ThreadSafeWindow):
    """Mergeable statistics of the mismatch between rollout and trainer log-probabilities.

    Feed it ``[batch, response_length]`` tensors with :meth:`update` (any device, any
    floating dtype, any number of batches); read every metric with :meth:`compute`. The
    window is everything since construction or :meth:`reset`. Two instances merge
    exactly with :meth:`merge`, so per-rank or per-batch windows combine into the
    statistics of all their tokens. :meth:`update` and :meth:`merge` are safe to call from
    several threads at once: each batch's arithmetic runs unlocked, and only adding its
    state to the window holds a lock.

    Args:
        is_threshold: ``C`` of the importance-ratio group: ``rho > C`` counts as high,
            ``rho < 1/C`` as low. Must be greater than 1.
        seq_ratio_bounds: ``(lo, hi)`` with ``0 < lo <= 1 <= hi``: a sequence whose
            geometric-mean ratio falls outside counts in ``rollout_seq_frac_outside``.
        groups: the metric groups to compute, a subset of :data:`GROUPS` (default: all
            but ``"quantiles"``, which come from a profile: see :meth:`compute`).
            Leaving groups out skips their arithmetic.
        compile: fuse an update into one pass: on CPUs with float32 or bfloat16
            log-probs the package's native kernel (built on first use with the system
            C++ compiler), on accelerators ``torch.compile``. ``None`` (the default)
            takes the kernel on CPUs and ``torch.compile`` on accelerators, at every
            size, never compiles on a CPU, and falls back to eager arithmetic, with one
            warning, where neither is available; ``False`` never fuses; ``True`` fuses
            every block (with ``torch.compile`` on a CPU where the kernel does not apply).
        chunk_tokens: the most tokens one pass of the torch arithmetic reads (default
            4,194,304): a larger batch is read in passes of whole rows, which bounds the
            temporary memory of an update.

    Example:
        >>> import torch
        >>> stats = MismatchStats()
        >>> rollout = torch.log(torch.tensor([[0.5, 0.25, 0.9]]))
        >>> actor = torch.log(torch.tensor([[0.5, 0.20, 0.9]]))
        >>> stats.update(rollout, actor, torch.tensor([[1, 1, 0]]))
        >>> metrics = stats.compute()
        >>> metrics["rollout_tokens"], round(metrics["rollout_probs_diff_max"], 6)
        (2.0, 0.05)
    """

    statistics = True

    def __init__(
        self,
        *,
        is_threshold: float = 2.0,
        seq_ratio_bounds: tuple[float, float] = (0.99, 1.01),
        groups: Iterable[str] | None = None,
        compile: bool | None = None,
        chunk_tokens: int | None = None,
    ) -> None:
        self.is_threshold = validate_is_threshold(is_threshold)
        self.seq_ratio_bounds = validate_seq_ratio_bounds(seq_ratio_bounds)
        self.groups = validate_groups(groups) - ({"quantiles"} if groups is None else set())
        for problem in compile_problems(compile):
            raise ValueError(problem)
        if chunk_tokens is not None and (
            isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1
        ):
            raise ValueError(
                f"`chunk_tokens` must be None (auto) or a positive int, got {chunk_tokens!r}."
            )
        self.compile = compile
        self.chunk_tokens = chunk_tokens
        self.size = STATE_SIZE
        self.layout = STATE
        self._state: Tensor | None = None
        self._pending: list[Tensor] = []
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ state
    def merge_states(self, states: Tensor) -> Tensor:
        """Merge packed states stacked as ``[n, STATE_SIZE]`` into one, exactly."""
        return merge_states(states)

    def identity_state(self, device: torch.device | str | None = None) -> Tensor:
        """The packed state of an empty window, built with fill kernels on ``device``."""
        return identity_state(device)

    @classmethod
    def from_state(cls, state: Tensor, **kwargs: Any) -> MismatchStats:
        """Build statistics holding a packed ``state`` (for example a merged one)."""
        stats = cls(**kwargs)
        stats.load_state(state)
        return stats

    def merge(self, other: MismatchStats | Tensor) -> MismatchStats:
        """Add the window of ``other`` (statistics or a packed state) to this one.

        Statistics must hold the sums of this instance's groups as it counts them: the
        same groups or more, and the same ``is_threshold`` and ``seq_ratio_bounds`` for
        the groups that use them (a packed state is taken as it is).

        Raises:
            TypeError: ``other`` is neither statistics nor a tensor.
            ValueError: ``other`` is not a packed state of this length, or statistics
                whose window lacks some of these sums (:meth:`unmatched_groups`).
        """
        if isinstance(other, MismatchStats):
            self._check_settings(other.settings(), "Cannot merge these statistics")
        incoming = other.state if isinstance(other, MismatchStats) else other
        if not isinstance(incoming, Tensor):
            raise TypeError(
                f"`merge` takes MismatchStats or a packed state tensor, got a "
                f"{type(other).__name__}."
            )
        if incoming.shape != (STATE_SIZE,):
            raise ValueError(
                f"A packed state has shape ({STATE_SIZE},); got {tuple(incoming.shape)}."
            )
        self._add([incoming.detach().to(torch.float64).clone()])
        return self

    def synced(
        self,
        all_gather: Callable[[Tensor], Tensor],
        device: torch.device | str | None = None,
    ) -> MismatchStats:
        """Return the window of all processes merged, with one collective; ``self`` is unchanged.

        ``all_gather`` maps this process's packed state to the ``[world_size,
        STATE_SIZE]`` stack of every process's (for example
        ``trainer.strategy.all_gather``). Every process must call it, empty window or
        not, so the shapes agree. ``device`` is where the collective runs (the
        strategy's root device); by default the device of the window.
        """
        local = self.state if device is None else self.state.to(device)
        gathered = all_gather(local).reshape(-1, STATE_SIZE).to(torch.float64)
        merged = copy.copy(self)
        merged._state, merged._pending = merge_states(gathered), []
        return merged

    # ----------------------------------------------------------------- update
    def update(
        self,
        rollout_log_probs: Tensor,
        old_log_probs: Tensor,
        mask: Tensor,
        rollout_token_ids: Tensor | None = None,
        trainer_token_ids: Tensor | None = None,
    ) -> None:
        """Add one batch to the window.

        Args:
            rollout_log_probs: ``[B, T]`` log-probs the rollout engine recorded (``b``).
            old_log_probs: ``[B, T]`` log-probs the trainer recomputed (``a``).
            mask: ``[B, T]``; a position counts where it is non-zero.
            rollout_token_ids: optional ``[B, T]`` token ids the rollout produced.
            trainer_token_ids: optional ``[B, T]`` token ids the trainer used.

        Raises:
            ValueError: the tensors have the wrong type, rank, shape, dtype or devices.
        """
        self._update_inputs(
            check_inputs(
                rollout_log_probs, old_log_probs, mask, rollout_token_ids, trainer_token_ids
            )
        )

    @torch.no_grad()
    def _update_inputs(self, inputs: MismatchInputs) -> None:
        """Add one batch whose tensors :func:`~.inputs.check_inputs` has checked."""
        add_batch(inputs, None, stats=self, extras=None)

    @torch.no_grad()
    def count_pads(self, mask: Tensor, token_ids: Tensor, pad_token_id: int) -> None:
        """Count the padding among ``token_ids`` inside ``mask`` ([B, T]; :func:`.pad_slots`)."""
        if token_ids.shape != mask.shape:
            raise ValueError(
                f"`token_ids` has shape {tuple(token_ids.shape)}; expected the mask's "
                f"{tuple(mask.shape)}."
            )
        self._add([STATE.pack(pad_slots(mask, token_ids, pad_token_id))], mask.device)

    # ---------------------------------------------------------------- compute
    def compute(
        self, profile: Profile | None = None, series: Series | None = None
    ) -> dict[str, float]:
        """Return every metric of the enabled groups as Python floats (NaN if undefined).

        One device-to-host copy of the packed state; the rest is host arithmetic. The
        quantiles come from the window's ``profile`` (kept by
        :class:`~lightning_rollout_debug.metrics.extras.TokenExtras`), the period of stale
        weights from the run's per-batch ``series`` (kept by
        :class:`~lightning_rollout_debug.metrics.series.MismatchSeries`): without them
        they are left out.
        """
        groups = [
            group
            for group in GROUPS
            if group in self.groups and (profile is not None or group != "quantiles")
        ]
        metrics = metrics_from_state(self.state.tolist(), profile, groups, series)
        return {
            name: metrics[name]
            for group in groups
            for name in METRIC_NAMES[group]
            if series is not None or name not in SERIES_METRICS
        }

    def largest_log_probs(self) -> tuple[float, float]:
        """The largest counting ``(old_log_probs, rollout_log_probs)`` of the window.

        Log-probabilities are at most 0; a positive maximum means the inputs are
        something else (logits, negative log-likelihoods). ``-inf`` for an empty window.
        Reads the state, so call it on a host copy to avoid a second transfer.
        """
        values = self.state.tolist()
        return values[STATE.at["max_actor_log_prob"]], values[STATE.at["max_rollout_log_prob"]]

    # ------------------------------------------------------------ persistence
    def settings(self) -> dict[str, Any]:
        """What the window's sums are counted with: its groups and the settings they use."""
        return {
            "is_threshold": self.is_threshold,
            "seq_ratio_bounds": tuple(self.seq_ratio_bounds),
            "groups": sorted(self.groups),
        }

    def unmatched_groups(self, settings: Mapping[str, Any]) -> dict[str, str]:
        """This instance's groups whose sums a window counted with ``settings`` lacks, with why.

        ``settings`` are those of the statistics that made the window (:meth:`settings`;
        a key left out counts as this instance's). Such a window's tokens would count in
        every mean, but not, or otherwise, in the sums of a group it did not track or
        counted with another ``is_threshold`` or ``seq_ratio_bounds``: merged in, it would
        bias that group's metrics.

        Example:
            >>> stats = MismatchStats(groups=["seed", "kl", "importance_ratio"], is_threshold=4.0)
            >>> stats.unmatched_groups(MismatchStats(groups=["seed", "kl"]).settings())
            {'importance_ratio': 'not tracked'}
            >>> stats.unmatched_groups(MismatchStats().settings())
            {'importance_ratio': '`is_threshold` 2.0, here 4.0'}
        """
        tracked = _group_names(settings.get("groups", self.groups))
        unmatched = {}
        for group in GROUPS:
            if group not in self.groups or group in _COUNTED_APART:
                continue
            name = _SETTING_OF_GROUP.get(group)
            if group not in tracked:
                unmatched[group] = "not tracked"
            elif name is not None and not _same_setting(settings.get(name), getattr(self, name)):
                unmatched[group] = f"`{name}` {settings[name]!r}, here {getattr(self, name)!r}"
        return unmatched

    def _check_settings(self, settings: Mapping[str, Any], action: str) -> None:
        unmatched = self.unmatched_groups(settings)
        if unmatched:
            reasons = "; ".join(f"{group}: {why}" for group, why in unmatched.items())
            raise ValueError(
                f"{action}: its window does not hold the sums of groups {list(unmatched)} as "
                f"this instance counts them ({reasons}); build both with the same `groups` "
                "(or more), `is_threshold` and `seq_ratio_bounds`."
            )

    def state_dict(self) -> dict[str, Any]:
        """The window and its :meth:`settings`, on the CPU, for checkpoints."""
        return {"state": self.state.detach().cpu().clone(), **self.settings()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a window saved by :meth:`state_dict` (the configuration stays as built).

        Raises:
            ValueError: the window lacks sums of this instance's groups
                (:meth:`unmatched_groups`): build this instance as the saved one was.
        """
        self._check_settings(state_dict, "Cannot load this state")
        self.load_state(state_dict["state"])


def _group_names(saved: Any) -> frozenset[str]:
    """The groups a saved state names; none where it names them in no form of theirs."""
    if isinstance(saved, str):
        return frozenset({saved})
    if isinstance(saved, (list, tuple, set, frozenset)):
        return frozenset(name for name in saved if isinstance(name, str))
    return frozenset()


def _same_setting(saved: Any, current: float | tuple[float, float]) -> bool:
    """Whether a saved ``is_threshold`` or ``seq_ratio_bounds`` is ``current`` (missing: yes)."""
    if saved is None:
        return True
    try:
        if isinstance(current, tuple):
            return tuple(float(bound) for bound in saved) == current
        return float(saved) == current
    except (TypeError, ValueError):
        return False
