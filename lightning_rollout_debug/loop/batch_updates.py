"""A monitor's updates: each batch read and added to the window, and its warnings.

:class:`BatchUpdates` is the part of :class:`~.monitor.RolloutDebugMonitor` that an
update runs through: the batch read once
(:func:`~lightning_rollout_debug.metrics.batch.read_batch`), then added to the window on
its device, its pad tokens counted, by one call
(:func:`~lightning_rollout_debug.metrics.backends.add_batch`); a batch that cannot be
used is skipped with one :class:`RolloutDebugWarning` per kind of problem (raised with
``strict=True``).
:class:`FrontDoor` says how the messages name the monitor or the callback.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_rollout_debug.loop.config import RolloutDebugConfig
from lightning_rollout_debug.loop.ranks import global_rank
from lightning_rollout_debug.metrics import caller
from lightning_rollout_debug.metrics.backends import add_batch
from lightning_rollout_debug.metrics.batch import BatchRead, batch_type_error, read_batch
from lightning_rollout_debug.metrics.extras import TokenExtras
from lightning_rollout_debug.metrics.inputs import BatchError
from lightning_rollout_debug.metrics.segments import SegmentWindow
from lightning_rollout_debug.metrics.series import MismatchSeries
from lightning_rollout_debug.metrics.shifts import ShiftSample
from lightning_rollout_debug.metrics.stats import MismatchStats


class RolloutDebugWarning(UserWarning):
    """A batch that was skipped, or a setting that cannot be honoured."""


@dataclass(frozen=True)
class FrontDoor:
    """How messages name a front door.

    Its name, what it searches before the batch, and how its dropout check is turned off.
    """

    name: str
    before_batch: str
    dropout_off: str


class SkippedBatches:
    """The batches of a window that were skipped, and why the last one was.

    A window whose every batch was skipped learned nothing: its logged step says so, at
    most once per :data:`QUIET_STEPS` steps (:meth:`learned_nothing`).
    """

    QUIET_STEPS = 100

    def __init__(self) -> None:
        self.count = 0
        self.last_reason = ""
        self._said_at: int | None = None

    def note(self, reason: str) -> None:
        """Count a skipped batch of the window."""
        self.count += 1
        self.last_reason = reason

    def learned_nothing(self, batches: int, step: int) -> str | None:
        """What to say at ``step`` of a window of ``batches`` (``None``: nothing)."""
        if not batches or self.count < batches:
            return None
        if self._said_at is not None and step - self._said_at < self.QUIET_STEPS:
            return None
        self._said_at = step
        return (
            f"every one of the {batches} batches of the window logged at step {step} was "
            f"skipped, so its metrics are empty; the last because: {self.last_reason}"
        )

    def empty(self) -> None:
        """A new window: no batch skipped yet."""
        self.count, self.last_reason = 0, ""


class BatchUpdates:
    """The updates of a monitor's window, and the warnings once per kind of problem."""

    config: RolloutDebugConfig
    rank: int | None
    _door: FrontDoor
    _stats: MismatchStats
    _extras: TokenExtras | None
    _series: MismatchSeries | None
    _shifts: ShiftSample | None
    _segments: SegmentWindow
    _warned: set[str]
    skips: SkippedBatches

    def _update(self, sources: Sequence[Any], index: int) -> None:
        """Add the batch of ``sources`` (the batch last) as the window's ``index``-th."""
        try:
            read = read_batch(
                sources,
                rollout_log_probs_key=self.config.rollout_log_probs_key,
                old_log_probs_key=self.config.old_log_probs_key,
                response_mask_key=self.config.response_mask_key,
                token_ids_keys=self.config.token_ids_keys,
                segment_key=self.config.segment_key,
            )
            if read.mask_fallback is not None:
                self._warn_once("mask-fallback", read.mask_fallback)
            rank = self.rank if self.rank is not None else global_rank()
            add_batch(
                read.inputs,
                read.token_ids,
                stats=self._stats,
                extras=self._extras,
                batch=index,
                rank=rank,
                pad_token_id=self._pad_token_id(read),
                series=self._series,
                shifts=self._shifts,
                segments=None if read.segment_ids is None else (self._segments, read.segment_ids),
            )
        except BatchError as error:
            # No local may hold the error (its traceback holds this frame, and with it the
            # batch and any autograd graph, until a gc cycle).
            self._skip_batch(batch_type_error(sources[-1], error, self._door.before_batch))
            return
        except Exception as error:
            if self.config.strict:
                raise
            reason = f"Could not update the statistics ({error!r}); skipped."
            self.skips.note(reason)
            self._warn_once(type(error).__name__, reason)

    def _pad_token_id(self, read: BatchRead) -> int | None:
        """The pad id the batch's pad tokens are counted by (``None``: not counted).

        None is set, or the batch has no token ids (warned about once).
        """
        if self.config.pad_token_id is None:
            return None
        if read.token_ids is None:
            self._warn_once(
                "pad-ids",
                f"`pad_token_id={self.config.pad_token_id}` is set but the batch"
                f"{read.ids_problem}; pad tokens are not counted.",
            )
            return None
        return self.config.pad_token_id

    def _skip_batch(self, error: BatchError) -> None:
        if self.config.strict:
            raise error
        self.skips.note(str(error))
        self._warn_once(error.kind, f"{error} The batch is skipped.")

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            caller.warn(f"{self._door.name}: {message}", RolloutDebugWarning)
