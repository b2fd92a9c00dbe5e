"""Alerts: an allowed range per metric, and what happens when a logged value leaves it.

The callback checks the metrics of every logged window against ``alert_ranges`` (allowed
``(low, high)`` per un-prefixed metric name, either bound ``None`` for open, both
inclusive). A value outside its range is a *crossing*; what happens then is ``on_alert``:

* ``"warn"``: a rank-zero :class:`RolloutAlertWarning` naming the metric, its value and
  its range, once per crossing *episode*: the metric warns again only after a window in
  which it was back inside its range, so a metric that stays out does not warn on every
  step. A window where the metric is undefined (not logged) does not end an episode.
* ``"stop"``: the same warnings, and ``trainer.should_stop = True`` on every rank at every
  window with a value out of range (the values are identical on every rank after the
  window's reduction, so every rank decides the same).
* ``"raise"``: :class:`RolloutAlertError` naming every metric out of range, on every rank.

The defaults (:data:`DEFAULT_ALERT_RANGES`) are declared with their metrics in
:mod:`~lightning_rollout_debug.metrics.catalog` and come from public reference points;
see ``docs/tensorboard.md``.

A fixed range misses a slow creep that stays under it: *drift alerts* (:mod:`.drift`)
compare each metric with a multiple of its own baseline, in the same episodes
(:func:`track_episode`) and with the same ``on_alert`` actions.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from lightning_rollout_debug.metrics.catalog import DEFAULT_ALERT_RANGES, GROUPS, METRIC_NAMES

AlertAction = Literal["warn", "stop", "raise"]
"""What to do when a metric leaves its range."""

ALERT_ACTIONS: tuple[str, ...] = ("warn", "stop", "raise")
"""The valid values of ``on_alert``."""

Bound = float | None


class RolloutAlertError(RuntimeError):
    """A rollout metric left its allowed range and ``on_alert="raise"``."""


class RolloutAlertWarning(UserWarning):
    """A rollout metric left its allowed range."""


@dataclass(frozen=True)
class Alert:
    """A metric of a logged window whose value is outside its allowed range."""

    name: str
    value: float
    low: Bound
    high: Bound

    @property
    def back(self) -> str:
        """When the episode ends: the value is in its range again."""
        return "back in range"

    def describe(self, prefix: str = "") -> str:
        """E.g. ``training/rollout_probs_diff_mean = 0.02 is outside [-inf, 0.01]``."""
        allowed = format_range(self.low, self.high)
        value = format_apart(self.value, self.low, self.high)
        return f"`{prefix}{self.name}` = {value} is outside {allowed}"


def format_bound(bound: float) -> str:
    """``bound`` in 6 significant digits, or in full where those would round it.

    Example:
        >>> format_bound(0.99), format_bound(1.0), format_bound(0.1234567)
        ('0.99', '1', '0.1234567')
    """
    short = f"{bound:g}"
    return short if float(short) == bound else repr(float(bound))


def format_apart(value: float, *bounds: Bound) -> str:
    """``value`` in 6 significant digits, or as many more as tell it from ``bounds``.

    A value just outside its range must not print as the bound it crossed.

    Example:
        >>> format_apart(0.0123456789, 0.01), format_apart(0.99999999, 1.0)
        ('0.0123457', '0.99999999')
    """
    for digits in range(6, 18):
        text = f"{value:.{digits}g}"
        shown = float(text)
        if not any(bound is not None and shown == bound != value for bound in bounds):
            return text
    return repr(float(value))


def format_range(low: Bound, high: Bound) -> str:
    """``[low, high]`` with an open side written as infinity."""
    low_text = "-inf" if low is None else format_bound(low)
    return f"[{low_text}, {'inf' if high is None else format_bound(high)}]"


def enabled_metric_names(groups: Collection[str]) -> list[str]:
    """The un-prefixed metric names of ``groups``, in catalog order."""
    return [name for group in GROUPS if group in groups for name in METRIC_NAMES[group]]


def alert_problems(alert_ranges: Any, on_alert: Any, groups: Collection[str]) -> list[str]:
    """Return what is wrong with ``alert_ranges`` and ``on_alert`` (empty if nothing).

    ``groups`` are the enabled metric groups: a range on a metric that is not logged
    would never fire, so it is refused too.
    """
    problems = []
    if not isinstance(on_alert, str) or on_alert not in ALERT_ACTIONS:
        problems.append(f"`on_alert` must be one of {list(ALERT_ACTIONS)}, got {on_alert!r}.")
    if alert_ranges is None:
        return problems
    if not isinstance(alert_ranges, Mapping):
        problems.append(
            "`alert_ranges` must be None (the defaults), {} (no alerts) or a dict "
            f"{{metric_name: (low, high)}}, got {alert_ranges!r}."
        )
        return problems
    problems += name_problems("alert_ranges", "a range", alert_ranges, groups)
    for name, bounds in alert_ranges.items():
        if _parse_range(bounds) is None:
            problems.append(
                f"`alert_ranges[{name!r}]` must be (low, high) with each a number or None, at "
                f"least one a number, and low <= high; got {bounds!r}."
            )
    return problems


def name_problems(
    argument: str, what: str, chosen: Collection[str], groups: Collection[str]
) -> list[str]:
    """What is wrong with the metric names of ``argument``: unknown, or of a group not logged.

    A setting on a metric that is not logged would never act, so it is refused too.
    """
    problems = []
    valid = enabled_metric_names(groups)
    group_of = {name: group for group, names in METRIC_NAMES.items() for name in names}
    unknown = [name for name in chosen if name not in group_of]
    for name in chosen:
        if name in group_of and name not in valid:
            problems.append(
                f"`{argument}` has {what} for `{name}`, but its group `{group_of[name]}` is "
                f"not logged (enabled groups: {[g for g in GROUPS if g in groups]})."
            )
    if unknown:
        problems.append(
            f"`{argument}` names unknown metrics {unknown}; use un-prefixed names, valid "
            f"names are {valid}."
        )
    return problems


def resolve_alert_ranges(
    alert_ranges: Mapping[str, Any] | None, groups: Collection[str]
) -> dict[str, tuple[Bound, Bound]]:
    """The ranges to check: the defaults of the enabled groups for ``None``, else as given.

    Call :func:`alert_problems` first; this assumes valid input.
    """
    if alert_ranges is None:
        names = set(enabled_metric_names(groups))
        return {name: bounds for name, bounds in DEFAULT_ALERT_RANGES.items() if name in names}
    parsed = {name: _parse_range(bounds) for name, bounds in alert_ranges.items()}
    return {name: bounds for name, bounds in parsed.items() if bounds is not None}


def _parse_range(bounds: Any) -> tuple[Bound, Bound] | None:
    if isinstance(bounds, (str, bytes, Mapping)):
        return None
    try:
        low, high = bounds
    except (TypeError, ValueError):
        return None
    parsed = []
    for bound in (low, high):
        if bound is None:
            parsed.append(None)
        elif isinstance(bound, bool) or not isinstance(bound, numbers.Real) or math.isnan(bound):
            return None
        else:
            parsed.append(float(bound))
    if parsed == [None, None]:
        return None
    if parsed[0] is not None and parsed[1] is not None and parsed[0] > parsed[1]:
        return None
    return parsed[0], parsed[1]


class AlertMonitor:
    """Checks each logged window's metrics against allowed ranges, tracking crossing episodes.

    Args:
        ranges: allowed ``(low, high)`` per un-prefixed metric name (see
            :func:`resolve_alert_ranges`).

    Example:
        >>> monitor = AlertMonitor({"rollout_probs_diff_mean": (None, 0.01)})
        >>> [a.value for a in monitor.check({"rollout_probs_diff_mean": 0.02}).new]
        [0.02]
        >>> monitor.check({"rollout_probs_diff_mean": 0.03}).new  # same episode
        []
        >>> monitor.check({"rollout_probs_diff_mean": 0.001}).outside
        []
        >>> len(monitor.check({"rollout_probs_diff_mean": 0.02}).new)  # a new episode
        1
    """

    @dataclass(frozen=True)
    class Result:
        """The alerts of one window: all metrics out of range, and those newly out."""

        outside: list[Alert]
        new: list[Alert]

    def __init__(self, ranges: Mapping[str, tuple[Bound, Bound]]) -> None:
        self.ranges = dict(ranges)
        self._active: set[str] = set()

    def reset(self) -> None:
        """Forget the open episodes (the next crossing of every metric alerts again)."""
        self._active.clear()

    def check(self, metrics: Mapping[str, float]) -> AlertMonitor.Result:
        """Compare a window's metrics (un-prefixed names) with the ranges.

        A metric missing from ``metrics`` or NaN (undefined for the window) is skipped
        and keeps its episode state.
        """
        outside, new = [], []
        for name, (low, high) in self.ranges.items():
            value = metrics.get(name, math.nan)
            if math.isnan(value):
                continue
            crossed = (low is not None and value < low) or (high is not None and value > high)
            alert = Alert(name, value, low, high) if crossed else None
            track_episode(self._active, name, alert, outside, new)
        return AlertMonitor.Result(outside, new)


def track_episode(
    active: set[str], name: str, alert: Any, outside: list[Any], new: list[Any]
) -> None:
    """Record a metric's check in the crossing episodes of ``active``.

    ``alert`` (``None`` when the metric is fine) joins ``outside``, and ``new`` too when
    the metric was not already in an episode.
    """
    if alert is None:
        active.discard(name)
        return
    outside.append(alert)
    if name not in active:
        active.add(name)
        new.append(alert)
