"""A monitor's logged step: the window merged, logged, diagnosed and checked.

:class:`LoggedStep` is the part of :class:`~.monitor.RolloutDebugMonitor` that a logged
step runs through: the window merged over the ranks and copied to the host once
(:class:`~.window.DeviceWindow`), its metrics computed and written (:class:`~.logs.WindowLogs`),
the log-probs' signs checked, the pipeline's mistakes named
(:mod:`~lightning_rollout_debug.checks.diagnosis`), and the alerts acted on
(:mod:`~lightning_rollout_debug.checks.alerts`, :mod:`~lightning_rollout_debug.checks.drift`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from lightning_rollout_debug.checks.alerts import (
    AlertMonitor,
    RolloutAlertError,
    RolloutAlertWarning,
)
from lightning_rollout_debug.checks.diagnosis import (
    Diagnosis,
    RolloutDiagnosisError,
    RolloutDiagnosisWarning,
    active_dropout,
    diagnose,
)
from lightning_rollout_debug.checks.drift import DriftMonitor
from lightning_rollout_debug.loop.batch_updates import (
    FrontDoor,
    RolloutDebugWarning,
    SkippedBatches,
)
from lightning_rollout_debug.loop.config import RolloutDebugConfig
from lightning_rollout_debug.loop.logs import WindowLogs
from lightning_rollout_debug.loop.ranks import Ranks, global_rank
from lightning_rollout_debug.loop.window import DeviceWindow
from lightning_rollout_debug.metrics import caller
from lightning_rollout_debug.metrics.formulas import Window
from lightning_rollout_debug.metrics.profile import Profile
from lightning_rollout_debug.metrics.sawtooth import Series
from lightning_rollout_debug.metrics.segments import OTHER, segment_metric_names, segment_values
from lightning_rollout_debug.metrics.stats import MismatchStats

POSITIVE_LOG_PROB_TOLERANCE = 1e-3
"""Log-probs above this (nats) are reported: no log-probability is above 0."""


class LoggedStep:
    """The logged steps of a monitor: merge, log, diagnose, alert."""

    config: RolloutDebugConfig
    should_stop: bool
    profile: Profile | None
    diagnosed: set[str]
    causes: set[str]
    _door: FrontDoor
    _window: DeviceWindow
    _logs: WindowLogs
    _alerts: AlertMonitor
    _drift: DriftMonitor

    _warn_once: Callable[[str, str], None]
    skips: SkippedBatches

    def log_window(
        self, step: int, loggers: Sequence[Any], ranks: Ranks
    ) -> tuple[dict[str, float], dict[str, float]]:
        """Merge the window over ``ranks``, log it at ``step`` and empty it.

        :meth:`log` for a loop that brings its own ranks and checks the alerts itself
        (:meth:`check_alerts`), as the callback does. Returns the logged scalars by
        prefixed name, and every metric by its own.
        """
        stats, extras, window_series, shifts, by_segment = self._window.on_host(ranks)
        # A window restored without its extras has a profile of only part of its tokens:
        # no quantiles and no pictures for it.
        partial = self._window.partial_profile
        nothing = self.skips.learned_nothing(self._window.batches, step)
        if nothing is not None and ranks.is_global_zero:
            caller.warn(f"{self._door.name}: {nothing}", RolloutDebugWarning)
        self.skips.empty()
        self._window.empty()
        self.profile = None if extras is None or partial else extras.profile
        series = self._series_after(window_series)
        metrics = stats.compute(self.profile, series)
        metrics |= self._segment_metrics(by_segment, ranks.is_global_zero)
        scalars = {
            f"{self.config.prefix}{name}": value
            for name, value in metrics.items()
            if not math.isnan(value)
        }
        if ranks.is_global_zero:  # the merged window: said and written once
            self._check_log_prob_signs(stats, step)
            show_rank = ranks.world_size > 1
            self._logs.write(loggers, scalars, extras, self.profile, step, show_rank=show_rank)
        # After the writes: with strict=True the window a mistake is named from is logged.
        window = Window(stats.state.tolist(), series=series, shifts=shifts)
        self._diagnose(window, metrics, ranks.is_global_zero)
        return scalars, metrics

    def _segment_metrics(self, state: torch.Tensor | None, rank_zero: bool) -> dict[str, float]:
        """The metrics of each segment with tokens, by ``segments/<name>/<metric>``."""
        if state is None:
            return {}
        config = self.config
        values = segment_values(state, config.max_segments, config.segment_metrics)
        if config.max_segments in values and rank_zero:
            self._warn_once(
                "segments-other",
                f"`{config.segment_key}` holds labels outside [0, {config.max_segments}) "
                f"(max_segments={config.max_segments}): their tokens count in the segment "
                f"`{OTHER}`. Raise max_segments, or map the labels into that range.",
            )
        return segment_metric_names(values, config.max_segments, config.segment_names)

    def _series_after(self, window: list[float] | None) -> Series | None:
        """The run's per-batch series once the merged ``window``'s are added (``None``: none)."""
        if window is None or self._window.series is None:
            return None
        return self._window.series.extend(window)

    def _check_log_prob_signs(self, stats: MismatchStats, step: int) -> None:
        """Warn once per key when the window holds log-probs above 0 (read off the host copy)."""
        keys = (self.config.old_log_probs_key, self.config.rollout_log_probs_key)
        for key, largest in zip(keys, stats.largest_log_probs(), strict=True):
            if largest > POSITIVE_LOG_PROB_TOLERANCE:
                self._warn_once(
                    f"positive:{key}",
                    f"`{key}` holds values up to {largest:.6g} in the window ending at step "
                    f"{step}; log-probabilities are at most 0 (logits, or negative "
                    "log-likelihoods?). Its tokens are counted as they are: probabilities "
                    "above 1, perplexities below 1.",
                )

    def check_alerts(self, metrics: Mapping[str, float], step: int, *, warn: bool) -> bool:
        """Act on the metrics outside their range or drifted; whether the loop should stop.

        The metrics are the same on every rank, so every rank decides the same; only
        ``warn`` ranks (rank 0) warn.
        """
        fixed, drift = self._alerts.check(metrics), self._drift.check(metrics)
        outside = [*fixed.outside, *drift.outside]
        if not outside:
            return False
        if self.config.on_alert == "raise":
            found = "; ".join(alert.describe(self.config.prefix) for alert in outside)
            raise RolloutAlertError(f"{self._door.name} at step {step}: {found}.")
        stop = self.config.on_alert == "stop"
        self.should_stop = self.should_stop or stop
        for alert in [*fixed.new, *drift.new] if warn else ():
            then = (
                "stopping the training (on_alert='stop')"
                if stop
                else f"warning again only after it is {alert.back}"
            )
            caller.warn(
                f"{self._door.name} at step {step}: {alert.describe(self.config.prefix)}; {then}.",
                RolloutAlertWarning,
            )
        return stop

    def check_dropout(self, model: torch.nn.Module) -> None:
        """Warn once (raise with ``strict=True``) if ``model`` has dropout active.

        Log-probs recomputed by a model in training mode with dropout ``p > 0`` carry
        dropout noise that reads as mismatch; compute them in eval mode. Found, it is known
        to the windows' diagnoses (:func:`~lightning_rollout_debug.checks.diagnosis.diagnose`):
        what its noise can look like is not named after it.
        """
        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"`check_dropout` takes a torch.nn.Module, got a {type(model).__name__}."
            )
        active = active_dropout(model)
        if not active:
            self.causes.discard("dropout")
            return
        self.causes.add("dropout")  # on every rank: it explains the windows' symptoms
        shown = ", ".join(active[:3]) + (", ..." if len(active) > 3 else "")
        self._report(
            Diagnosis(
                "dropout",
                f"{len(active)} dropout module(s) of the model are active in training mode "
                f"({shown}). Log-probs recomputed with dropout carry its noise, which reads "
                "as mismatch, and can read as misaligned log-probs, padding or truncated "
                "sampling, which are not named while it is active: recompute old_log_probs in "
                f"eval mode (model.eval()), or set the dropout to 0. {self._door.dropout_off}",
            ),
            rank_zero=global_rank() == 0,
        )

    def _diagnose(self, window: Window, metrics: Mapping[str, float], rank_zero: bool) -> None:
        for found in diagnose(window, metrics, self.causes):
            self._report(found, rank_zero=rank_zero)

    def _report(self, found: Diagnosis, *, rank_zero: bool) -> None:
        """Warn once per kind (on rank zero), or raise with ``strict=True`` (every rank)."""
        if self.config.strict:
            raise RolloutDiagnosisError(f"{self._door.name}: {found.message}")
        if rank_zero and found.kind not in self.diagnosed:
            self.diagnosed.add(found.kind)
            caller.warn(f"{self._door.name}: {found.message}", RolloutDiagnosisWarning)
