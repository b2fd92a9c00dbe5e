"""The checkpoint state of a monitor's window: the saved dict, its checks, and its restore.

A state holds the window merged over the ranks (the packed statistics and extras, on the
CPU), its batch count, the configuration it was written with, the settings the extras
were laid out by, the drift baselines and the run's per-batch series (:func:`saved_state`).
:class:`StateReader` reads one back into a
:class:`~lightning_rollout_debug.RolloutDebugMonitor`'s window: every part is checked
first, a damaged part starts empty with a warning (an error with ``strict=True``),
another configuration warns (extras kept with other settings start empty, and so does a
window whose sums the statistics now count otherwise: other groups, another
``is_threshold`` or ``seq_ratio_bounds``, or none recorded), and the first rank of the
process group alone carries the merged window on; the series, merged, every rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from torch import Tensor

from lightning_rollout_debug.checks.drift import DriftMonitor
from lightning_rollout_debug.loop.arguments import checkpoint_problems
from lightning_rollout_debug.loop.ranks import global_rank, rank_in
from lightning_rollout_debug.metrics import caller
from lightning_rollout_debug.metrics.extras import TokenExtras
from lightning_rollout_debug.metrics.layout import state_problems
from lightning_rollout_debug.metrics.segments import SegmentWindow
from lightning_rollout_debug.metrics.series import MismatchSeries, series_problems
from lightning_rollout_debug.metrics.stats import MismatchStats


def saved_state(
    stats: MismatchStats,
    extras: Tensor | None,
    batches_in_window: int,
    config: Mapping[str, Any],
    drift: DriftMonitor,
    extras_settings: Mapping[str, Any] | None = None,
    series: Tensor | None = None,
) -> dict[str, Any]:
    """A checkpoint state of the window ``stats`` and ``extras``, on the CPU.

    Args:
        stats: the window's statistics (merged over the ranks when there are several).
        extras: the window's packed extras state, or ``None`` without extras.
        batches_in_window: the updates since the window began.
        config: the configuration the state is written with.
        drift: the drift baselines, kept with the window.
        extras_settings: what ``extras`` is laid out by (``TokenExtras.settings``), or
            ``None`` without extras.
        series: the run's per-batch series (``MismatchSeries.state``), or ``None``
            without one.
    """
    return {
        "window": stats.state.detach().cpu().clone(),
        "batches_in_window": batches_in_window,
        "extras_window": None if extras is None else extras.detach().cpu().clone(),
        "extras_settings": None if extras_settings is None else dict(extras_settings),
        "config": dict(config),
        "drift": drift.state(),
        "series": series,
    }


class Restored(NamedTuple):
    """What a restored state gives the window beyond its statistics and extras.

    Attributes:
        batches_in_window: the updates of the restored window.
        partial_profile: whether the window was restored without its extras, so that its
            profile would hold only part of its tokens.
    """

    batches_in_window: int
    partial_profile: bool


@dataclass(frozen=True)
class StateReader:
    """Reads a checkpoint state of :func:`saved_state` back into a monitor's window.

    Attributes:
        name: the front door the messages name.
        prefix: the monitor's prefix, which a rejected state's message shows.
        strict: raise on a state that cannot be restored instead of warning.
        drift_baseline: the monitor's ``drift_baseline``, which a shorter saved baseline is
            named against.
        stats: the window's statistics, loaded on the first rank of the process group.
        extras: the window's extras, if it keeps them.
        drift: the drift baselines, continued from the state.
        process_group: the process group whose first rank carries the saved window on.
        category: the category of the warnings.
        series: the run's per-batch series, continued from the state on every rank (it is
            merged); ``None`` where the monitor keeps none.
        segments: the window of each segment, loaded with the statistics where the state
            keeps one of the same ``max_segments`` (``None``: none kept).
    """

    name: str
    prefix: str
    strict: bool
    drift_baseline: int
    stats: MismatchStats
    extras: TokenExtras | None
    drift: DriftMonitor
    process_group: Any | None
    category: type[Warning]
    series: MismatchSeries | None = None
    segments: SegmentWindow | None = None

    def read(self, state_dict: Any, config: Mapping[str, Any]) -> Restored | None:
        """Restore ``state_dict`` into an empty window; ``None`` if it was rejected.

        Args:
            state_dict: a state of :func:`saved_state`, as a checkpoint gave it back.
            config: the configuration the window continues with; another saved one warns.
        """
        problems = checkpoint_problems(state_dict) or state_problems(state_dict["window"])
        window_tokens = 0.0 if problems else float(state_dict["window"][0])  # count first
        batches_in_window = 0 if problems else state_dict.get("batches_in_window", 0)
        if window_tokens > 0 and batches_in_window == 0:
            problems = [
                f"its window holds {window_tokens:g} tokens, but `batches_in_window` is 0; "
                "expected at least 1"
            ]
        if problems:
            self._reject(problems, "the window starts empty")
            return None
        carried = self._compare_configuration(state_dict.get("config") or {}, config)
        self._load_drift(state_dict.get("drift"))
        self._load_series(state_dict.get("series"))
        if not carried:  # its tokens would count in every mean, not in those groups' sums
            return Restored(0, False)
        extras = self._extras(state_dict, window_tokens)
        segments = self._segments(state_dict)
        profiled = self.extras is not None and self.extras.profile
        partial_profile = profiled and extras is None and window_tokens > 0
        if rank_in(self.process_group, global_rank()) == 0:
            # The state holds the window of all ranks (of the process group) merged: the
            # first rank (of each group: they hold the same tokens) alone carries it on.
            self.stats.load_state(state_dict["window"])
            if self.extras is not None and extras is not None:
                self.extras.load_state(extras)
            if self.segments is not None and segments is not None:
                self.segments.load_state(segments)
        return Restored(batches_in_window, partial_profile)

    def _segments(self, state_dict: Mapping[str, Any]) -> Tensor | None:
        """The checkpoint's segments, if it keeps them with this window's ``max_segments``.

        Others start empty (with the configuration's warning: ``max_segments`` is in it);
        damaged ones are rejected.
        """
        saved = state_dict.get("segments_window")
        if self.segments is None or saved is None:
            return None
        if _plain(state_dict.get("segments_settings")) != self.segments.settings():
            return None
        if problems := self.segments.state_problems(saved):
            self._reject(problems, "the segments start empty")
            return None
        return saved

    def _compare_configuration(self, saved: Mapping[str, Any], config: Mapping[str, Any]) -> bool:
        """Warn where the saved configuration is not ``config``; whether the window carries on.

        It starts empty where the statistics now count the sums of some groups otherwise
        (other groups, another ``is_threshold`` or ``seq_ratio_bounds``), or where the state
        does not record what they were counted with (no ``config``, or one without those
        settings): nothing says its sums are those of these settings.
        """
        changed = [key for key in config if _plain(saved.get(key)) != _plain(config[key])]
        unrecorded = [key for key in self.stats.settings() if key not in saved]
        if not changed and not unrecorded:
            return True
        unmatched = {} if unrecorded else self.stats.unmatched_groups(saved)
        differences = "; ".join(
            f"`{key}` {saved.get(key)!r}, now {config[key]!r}" for key in changed
        )
        if unrecorded:
            consequence = (
                f" It does not record the {', '.join(f'`{key}`' for key in unrecorded)} its "
                "sums were counted with: its window starts empty."
            )
        elif unmatched:
            consequence = (
                f" Its window does not hold the sums of groups {list(unmatched)} as they are "
                "counted now, and starts empty."
            )
        else:
            consequence = ""
        self._warn_on_rank_zero(
            f"{self.name}: the checkpoint was written with another configuration "
            f"({differences if saved else 'it records none: no `config`'}); continuing "
            f"with the constructor's.{consequence}"
        )
        return not (unrecorded or unmatched)

    def _extras(self, state_dict: Mapping[str, Any], window_tokens: float) -> Tensor | None:
        """The checkpoint's extras window, if it is one of this monitor's layout.

        Kept with other settings (or none kept) they start empty, with a warning when the
        window holds tokens: its first log has extras of part of its tokens. Kept with
        these settings but damaged, they are rejected. A checkpoint that names no
        settings (an older version) is read by the shape of its extras.
        """
        if self.extras is None:
            return None
        extras, now = state_dict.get("extras_window"), self.extras.settings()
        kept = state_dict.get("extras_settings", _UNNAMED)
        laid_out = isinstance(extras, Tensor) and extras.shape == (self.extras.size,)
        if extras is not None and (_plain(kept) == now or (kept is _UNNAMED and laid_out)):
            if problems := self.extras.state_problems(extras):
                self._reject(problems, "the histograms and worst tokens start empty")
                return None
            return extras
        if extras is None or kept is None:
            before = "no histograms, worst tokens or profile"
        elif isinstance(kept, Mapping):
            before = _described(kept)
        else:
            size = extras.numel() if isinstance(extras, Tensor) else type(extras).__name__
            before = f"extras of another layout ({size} values)"
        if window_tokens > 0:
            self._warn_on_rank_zero(
                f"{self.name}: the checkpoint's window kept {before}, this one keeps "
                f"{_described(now)}: its extras start empty, so the first window logged "
                "after the resume has histograms and worst tokens of its new tokens only, "
                "and no quantiles or pictures."
            )
        return None

    def _load_drift(self, state: Any) -> None:
        """Continue the drift baselines of a checkpoint (none saved: they are collected)."""
        if state is None:
            return
        if problems := DriftMonitor.state_problems(state):
            self._reject(problems, "the drift baselines are collected again")
            return
        if again := self.drift.load_state(state):
            self._warn_on_rank_zero(
                f"{self.name}: the checkpoint's drift baselines are the median of "
                f"{state['baseline_windows']} logged values, fewer than "
                f"drift_baseline={self.drift_baseline}; the baselines of {again} are "
                "collected again."
            )

    def _load_series(self, state: Any) -> None:
        """Continue the run's per-batch series (none saved: it starts empty)."""
        if self.series is None or state is None:
            return
        if problems := series_problems(state):
            self._reject(problems, "the stale-weights series starts empty")
            return
        self.series.load_state(state)

    def _reject(self, problems: Sequence[str], consequence: str) -> None:
        message = (
            f"{self.name}(prefix={self.prefix!r}): the checkpoint's state cannot be "
            f"restored: {'; '.join(problems)}."
        )
        if self.strict:
            raise ValueError(message)
        self._warn_on_rank_zero(f"{message} Training goes on; {consequence}.")

    def _warn_on_rank_zero(self, message: str) -> None:
        if global_rank() == 0:
            caller.warn(message, self.category)


_UNNAMED = object()
"""The extras settings of a checkpoint of a version that did not keep them."""


def _plain(value: Any) -> Any:
    """``value`` with its lists as tuples, as a configuration holds them.

    A checkpoint converted through another format may hold lists.
    """
    if isinstance(value, list | tuple):
        return tuple(_plain(item) for item in value)
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    return value


def _described(settings: Mapping[str, Any]) -> str:
    """The settings of a window's extras, for a message."""
    names = ("histograms", "worst_tokens_k", "profile")
    return ", ".join(f"{name}={settings.get(name)!r}" for name in names)
