"""Drift alerts: each metric against a multiple of its own baseline.

A fixed range misses a slow creep that stays under it. :class:`DriftMonitor` compares each
metric of ``drift_factors`` with its own baseline, the median of its first
``drift_baseline`` logged (defined, finite) values: a later value above ``factor x
baseline`` is a crossing, in the same episodes as the fixed ranges of :mod:`.alerts` and
with the same ``on_alert`` actions. The baselines are plain Python in a checkpoint
(:meth:`DriftMonitor.state`), so a resumed run goes on with them.
"""

from __future__ import annotations

import math
import numbers
import statistics
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from lightning_rollout_debug.checks.alerts import (
    enabled_metric_names,
    name_problems,
    track_episode,
)

DEFAULT_DRIFT_FACTORS: dict[str, float] = {
    "rollout_probs_diff_mean": 2.0,
    "rollout_actor_kl_k3": 4.0,
}
"""The drift factors used when ``drift_factors=None`` (metrics of disabled groups are left
out). ``k3`` grows about as the square of the per-token error, so 4x matches the 2x of the
probability difference."""


DEFAULT_DRIFT_BASELINE = 10
"""How many logged windows the drift baseline is the median of, by default."""


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
    above ``factor x baseline`` is a crossing, in episodes as :class:`~.alerts.AlertMonitor` has
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
            track_episode(self._active, name, alert if drifted else None, outside, new)
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
