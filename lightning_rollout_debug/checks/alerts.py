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

A fixed range misses a slow creep that stays under it. *Drift alerts*
(:class:`DriftMonitor`) compare each metric of ``drift_factors`` with its own baseline,
the median of its first ``drift_baseline`` logged values: a later value above ``factor x
baseline`` is a crossing too, with the same episodes and the same ``on_alert`` actions.
"""

from __future__ import annotations

import math
import numbers
import statistics
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from lightning_rollout_debug.metrics.catalog import DEFAULT_ALERT_RANGES, GROUPS, METRIC_NAMES

AlertAction = Literal["warn", "stop", "raise"]
"""What to do when a metric leaves its range."""

ALERT_ACTIONS: tuple[str, ...] = ("warn", "stop", "raise")
"""The valid values of ``on_alert``."""

Bound = float | None

DEFAULT_DRIFT_FACTORS: dict[str, float] = {
    "rollout_probs_diff_mean": 2.0,
    "rollout_actor_kl_k3": 4.0,
}
"""The drift factors used when ``drift_factors=None`` (metrics of disabled groups are left
out). ``k3`` grows about as the square of the per-token error, so 4x matches the 2x of the
probability difference."""

DEFAULT_DRIFT_BASELINE = 10
"""How many logged windows the drift baseline is the median of, by default."""


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
            _track_episode(self._active, name, alert, outside, new)
        return AlertMonitor.Result(outside, new)


def _track_episode(
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


# ---------------------------------------------------------------------- drift
@dataclass(frozen=True)
class DriftAlert:
    """A metric of a logged window above ``factor`` times its baseline."""

    name: str
    value: float
    factor: float
    baseline: float
    windows: int
    """How many logged values the baseline is the median of."""

    @property
    def limit(self) -> float:
        """``factor x baseline``: the largest value that does not alert."""
        return self.factor * self.baseline

    @property
    def back(self) -> str:
        """When the episode ends: the value is at or below the limit again."""
        return f"back at or below {self.limit:.6g}"

    def describe(self, prefix: str = "") -> str:
        """E.g. ``training/rollout_probs_diff_mean = 0.036 drifted above 2 x its baseline ...``."""
        return (
            f"`{prefix}{self.name}` = {self.value:.6g} drifted above {self.factor:g} x its "
            f"baseline {self.baseline:.6g} (the median of its first {self.windows} logged "
            "values)"
        )


def drift_problems(drift_factors: Any, drift_baseline: Any, groups: Collection[str]) -> list[str]:
    """Return what is wrong with ``drift_factors`` and ``drift_baseline`` (empty if nothing).

    ``groups`` are the enabled metric groups: a factor on a metric that is not logged
    would never fire, so it is refused too.

    Example:
        >>> drift_problems({"rollout_probs_diff_mean": 2}, 10, ["seed"])
        []
        >>> for problem in drift_problems({"rollout_probs_diff_mean": 0.5}, 0, ["seed"]):
        ...     print(problem[:59])
        `drift_factors['rollout_probs_diff_mean']` must be a number
        `drift_baseline` must be an int >= 1 (the number of first l
    """
    problems = []
    if drift_factors is not None and not isinstance(drift_factors, Mapping):
        problems.append(
            "`drift_factors` must be None (the defaults), {} (no drift alerts) or a dict "
            f"{{metric_name: factor}}, got {drift_factors!r}."
        )
    elif drift_factors is not None:
        problems += name_problems("drift_factors", "a factor", drift_factors, groups)
        for name, factor in drift_factors.items():
            if (
                isinstance(factor, bool)
                or not isinstance(factor, numbers.Real)
                or not math.isfinite(factor)
                or factor <= 1
            ):
                problems.append(
                    f"`drift_factors[{name!r}]` must be a number > 1 (a value above factor x "
                    f"its baseline alerts), got {factor!r}."
                )
    if (
        isinstance(drift_baseline, bool)
        or not isinstance(drift_baseline, numbers.Integral)
        or drift_baseline < 1
    ):
        problems.append(
            "`drift_baseline` must be an int >= 1 (the number of first logged values whose "
            f"median is a metric's baseline), got {drift_baseline!r}."
        )
    return problems


def resolve_drift_factors(
    drift_factors: Mapping[str, Any] | None, groups: Collection[str]
) -> dict[str, float]:
    """The factors to check: the defaults of the enabled groups for ``None``, else as given.

    Call :func:`drift_problems` first; this assumes valid input.

    Example:
        >>> resolve_drift_factors(None, ["seed"])
        {'rollout_probs_diff_mean': 2.0}
        >>> resolve_drift_factors({"rollout_actor_kl_k3": 3}, ["kl"])
        {'rollout_actor_kl_k3': 3.0}
    """
    if drift_factors is None:
        names = set(enabled_metric_names(groups))
        return {name: f for name, f in DEFAULT_DRIFT_FACTORS.items() if name in names}
    return {name: float(factor) for name, factor in drift_factors.items()}


class DriftMonitor:
    """Checks each logged window's metrics against a multiple of their own baseline.

    A metric's baseline is the median of its first ``baseline_windows`` logged values
    (NaN, an undefined value, is not counted, nor is an infinite one). After that, a value
    above ``factor x baseline`` is a crossing, in episodes as :class:`AlertMonitor` has
    them; a baseline of 0 (or below) never alerts.

    Args:
        factors: the factor per un-prefixed metric name (see :func:`resolve_drift_factors`).
        baseline_windows: how many first logged values the baseline is the median of.

    Example:
        >>> monitor = DriftMonitor({"rollout_probs_diff_mean": 2.0}, baseline_windows=3)
        >>> for value in (0.010, 0.012, 0.011):  # the baseline: median 0.011
        ...     monitor.check({"rollout_probs_diff_mean": value}).outside
        []
        []
        []
        >>> monitor.check({"rollout_probs_diff_mean": 0.02}).outside  # below 2 x 0.011
        []
        >>> (alert,) = monitor.check({"rollout_probs_diff_mean": 0.036}).new
        >>> alert.describe("training/")  # doctest: +NORMALIZE_WHITESPACE
        '`training/rollout_probs_diff_mean` = 0.036 drifted above 2 x its baseline 0.011
        (the median of its first 3 logged values)'
        >>> monitor.check({"rollout_probs_diff_mean": 0.04}).new  # same episode
        []
        >>> monitor.baselines()
        {'rollout_probs_diff_mean': 0.011}
    """

    @dataclass(frozen=True)
    class Result:
        """The drift alerts of one window: all metrics above their limit, and those newly."""

        outside: list[DriftAlert]
        new: list[DriftAlert]

    def __init__(
        self, factors: Mapping[str, float], baseline_windows: int = DEFAULT_DRIFT_BASELINE
    ) -> None:
        self.factors = dict(factors)
        self.baseline_windows = int(baseline_windows)
        self._first: dict[str, list[float]] = {name: [] for name in self.factors}
        self._active: set[str] = set()

    def reset(self) -> None:
        """Forget the open episodes; the baselines stay."""
        self._active.clear()

    def restart(self) -> None:
        """Forget the open episodes and the baselines: collect new ones."""
        self._active.clear()
        for values in self._first.values():
            values.clear()

    def baselines(self) -> dict[str, float]:
        """The baseline of every metric that has collected its ``baseline_windows`` values."""
        return {
            name: statistics.median(values)
            for name, values in self._first.items()
            if len(values) >= self.baseline_windows
        }

    def check(self, metrics: Mapping[str, float]) -> DriftMonitor.Result:
        """Collect the baselines, or compare a window's metrics (un-prefixed names) with them.

        A metric missing from ``metrics`` or NaN is skipped and keeps its episode state.
        """
        outside, new = [], []
        for name, factor in self.factors.items():
            value = float(metrics.get(name, math.nan))
            if math.isnan(value):
                continue
            first = self._first[name]
            if len(first) < self.baseline_windows:
                if math.isfinite(value):
                    first.append(value)
                continue
            baseline = statistics.median(first)
            drifted = baseline > 0 and value > factor * baseline
            alert = DriftAlert(name, value, factor, baseline, self.baseline_windows)
            _track_episode(self._active, name, alert if drifted else None, outside, new)
        return DriftMonitor.Result(outside, new)

    # ------------------------------------------------------------------ checkpoints
    def state(self) -> dict[str, Any]:
        """The collected first values (plain Python: ``torch.load(weights_only=True)`` reads it).

        Example:
            >>> monitor = DriftMonitor({"rollout_actor_kl_k3": 4.0}, baseline_windows=2)
            >>> _ = monitor.check({"rollout_actor_kl_k3": 1e-4})
            >>> monitor.state()
            {'baseline_windows': 2, 'values': {'rollout_actor_kl_k3': [0.0001]}}
        """
        return {
            "baseline_windows": self.baseline_windows,
            "values": {name: list(values) for name, values in self._first.items()},
        }

    @staticmethod
    def state_problems(state: Any) -> list[str]:
        """What is wrong with a :meth:`state` read from a checkpoint (empty if nothing)."""
        if not isinstance(state, Mapping):
            return [f"its drift baseline is a {type(state).__name__}, not a dict"]
        windows = state.get("baseline_windows")
        if isinstance(windows, bool) or not isinstance(windows, int) or windows < 1:
            return [f"the drift baseline's `baseline_windows` is {windows!r}; expected an int >= 1"]
        values = state.get("values")
        if not isinstance(values, Mapping):
            return [f"the drift baseline's `values` is {type(values).__name__}, not a dict"]
        problems = []
        for name, first in values.items():
            if (
                not isinstance(first, (list, tuple))
                or len(first) > windows
                or not all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                    for v in first
                )
            ):
                problems.append(
                    f"the drift baseline of `{name}` is {first!r}; expected a list of at most "
                    f"{windows} finite numbers"
                )
        return problems

    def load_state(self, state: Mapping[str, Any]) -> list[str]:
        """Continue the baselines of :meth:`state`; the names that must collect again.

        Call :meth:`state_problems` first; this assumes a valid state. A metric without
        saved values starts collecting. Saved with another ``baseline_windows``: the first
        values serve a smaller count, and a count still being collected, as they are; a
        larger count than a complete saved baseline cannot be known, and that metric
        collects a new one (its name is returned).
        """
        saved_windows = int(state["baseline_windows"])
        again = []
        self.restart()
        for name, first in self._first.items():
            saved = [float(v) for v in state["values"].get(name, ())]
            if len(saved) >= saved_windows and self.baseline_windows > saved_windows:
                again.append(name)
                continue
            first.extend(saved[: self.baseline_windows])
        return again
