"""The rise and drop that stale weights give a run's per-batch mismatch.

An engine whose weights are synced every ``k`` optimizer steps samples, at each step since
the sync, with weights one step further behind the trainer's: the mean ``|r|`` of each
batch rises for ``k`` batches and drops back at each sync. :func:`sawtooth` finds that
pattern in a :class:`Series` of per-batch means (and their standard errors), the one
:class:`~.series.MismatchSeries` keeps.

Example:
    >>> found = sawtooth(Series([0.01, 0.02, 0.03, 0.04] * 4))  # synced every 4 batches
    >>> found.period, found.drops, round(found.trough, 3), round(found.peak, 3)
    (4, 3, 0.01, 0.04)
    >>> sawtooth(Series([0.01, 0.012, 0.011, 0.0105] * 4)) is None  # a rise of 20%: noise
    True
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

PERIODS = range(2, 17)
"""The periods, in batches, a rise and drop is looked for at."""
SAWTOOTH_FIT = 0.8
"""The least share of the series' variance the rise and drop must explain (``R^2``)."""
SAWTOOTH_RISE = 0.5
"""The least rise over a period, as a share of the mean ``|r|`` right after a drop."""
SAWTOOTH_STEP = 0.5
"""The least share of that rise every drop and every whole period's rise must show."""
SAWTOOTH_ERRORS = 4.0
"""And the standard errors of the two batches' difference each of them must reach: a
batch whose mean a few tokens far off carry (masked logits, padding) is no rise."""


@dataclass(frozen=True)
class Series:
    """Per-batch mean ``|r|``, oldest first (NaN: a batch without tokens), with standard errors.

    ``errors``: each mean's standard error (``sqrt(var(|r|) / n)`` over its tokens); by
    default 0.
    """

    means: Sequence[float]
    errors: Sequence[float] = field(default=())

    def error(self, t: int) -> float:
        """The standard error of batch ``t``'s mean (0 where not given)."""
        return self.errors[t] if self.errors else 0.0

    @functools.cached_property
    def rise_and_drop(self) -> Sawtooth | None:
        """:func:`sawtooth` of the series, found once (the metrics and the diagnoses read it)."""
        return sawtooth(self)


@dataclass(frozen=True)
class Sawtooth:
    """A rise and drop of the per-batch mean ``|r|`` that repeats every :attr:`period` batches.

    Attributes:
        period: batches from one drop to the next.
        trough: the mean ``|r|`` of the batches right after a drop, on average.
        peak: the mean ``|r|`` of the batches right before a drop, on average.
        fit: the share of the series' variance the rise and drop explain (``R^2``).
        drops: the drops the series holds.
        batches: the batches of the series.
    """

    period: int
    trough: float
    peak: float
    fit: float
    drops: int
    batches: int


def sawtooth(series: Series) -> Sawtooth | None:
    """The rise and drop that repeats in ``series``, or ``None``.

    For each period ``P`` of :data:`PERIODS` that the series holds three times, and each
    phase, the means are fitted by a trough plus a rise proportional to the batches since
    the last drop (``k_t``, ``0 .. P - 1``), whose size may drift along the series (an
    optimizer's steps shrink as it trains): ``x_t = c0 + (c1 + c2 t') k_t``. The best fit
    (the largest ``R^2``) is a rise and drop where it explains :data:`SAWTOOTH_FIT` of the
    variance, and every drop and every whole period's rise of the series (two drops at
    least) is at least :data:`SAWTOOTH_STEP` of the fitted rise there, itself at least
    :data:`SAWTOOTH_RISE` of the trough, and :data:`SAWTOOTH_ERRORS` standard errors.
    """
    best: Sawtooth | None = None
    means = np.asarray(series.means, dtype=np.float64)
    for period in PERIODS:
        if len(means) < 3 * period:
            break
        for phase in _rising_phases(means, period):
            found = _fitted(series, period, int(phase))
            if found is not None and (best is None or found.fit > best.fit):
                best = found
    return best


def _rising_phases(means: np.ndarray, period: int) -> np.ndarray:
    """The phases of ``period`` whose steps all rise and drop: the only ones to fit.

    Those of :func:`_fitted`, every phase at once: two drops at least (``x[t - 1] - x[t]``
    for ``t = phase mod period``) and a whole period's rise (``x[t + P - 1] - x[t]`` for
    ``t = phase mod period``), every one of them above 0 (NaN: a batch without tokens,
    no step).
    """
    n = len(means)
    phases = np.arange(n) % period
    drops = (means[:-1] - means[1:], phases[1:])
    rises = (means[period - 1 :] - means[: n - period + 1], phases[: n - period + 1])
    seen, falls = [], np.zeros(period, dtype=np.int64)
    for steps, at in (drops, rises):
        kept = ~np.isnan(steps)
        seen.append(np.bincount(at[kept], minlength=period))
        falls += np.bincount(at[kept & ~(steps > 0)], minlength=period)
    return np.flatnonzero((seen[0] >= 2) & (seen[1] >= 1) & (falls == 0))


def _fitted(series: Series, period: int, phase: int) -> Sawtooth | None:
    """The rise and drop of ``period`` with drops before the batches ``phase + j P``."""
    means, n = series.means, len(series.means)
    drops = [(t - 1, t) for t in range(phase or period, n, period)]  # the batches around each
    rises = [(t, t + period - 1) for t in range(phase, n - period + 1, period)]  # whole periods
    steps = [(means[a] - means[b], a, b) for a, b in drops]
    seen_drops = sum(not math.isnan(step) for step, _, _ in steps)
    steps += [(means[b] - means[a], a, b) for a, b in rises]
    steps = [step for step in steps if not math.isnan(step[0])]  # NaN: a batch without tokens
    if seen_drops < 2 or len(steps) == seen_drops or min(step for step, _, _ in steps) <= 0:
        return None  # no rise and drop at every period: nothing to fit
    since = [(t - phase) % period for t in range(n)]
    centre = (n - 1) / 2
    rows = [(1.0, k, k * (t - centre) / n) for t, k in enumerate(since)]
    points = [(row, x) for row, x in zip(rows, means, strict=True) if not math.isnan(x)]
    coef = _least_squares(points)
    mean = sum(x for _, x in points) / len(points)
    total = sum((x - mean) ** 2 for _, x in points)
    if coef is None or total <= 0:
        return None
    fit = 1.0 - sum((x - _dot(coef, row)) ** 2 for row, x in points) / total
    if fit < SAWTOOTH_FIT:
        return None
    trough = coef[0]

    def rise(t: int) -> float:  # the fitted rise over a period, at batch t
        return (coef[1] + coef[2] * (t - centre) / n) * (period - 1)

    for step, a, b in steps:
        size = rise(a)
        noise = SAWTOOTH_ERRORS * math.hypot(series.error(a), series.error(b))
        if not (size > 0 and size >= SAWTOOTH_RISE * trough):
            return None
        if not step >= max(SAWTOOTH_STEP * size, noise):
            return None
    after = [x for x, k in zip(means, since, strict=True) if k == 0 and not math.isnan(x)]
    before = [x for x, k in zip(means, since, strict=True) if k == period - 1 and not math.isnan(x)]
    return Sawtooth(period, sum(after) / len(after), sum(before) / len(before), fit, seen_drops, n)


def _least_squares(points: Sequence[tuple[tuple[float, ...], float]]) -> list[float] | None:
    """The coefficients of the least-squares fit of the ``x`` by their rows (``None``: singular).

    The normal equations, solved by Gaussian elimination with partial pivoting.
    """
    size = len(points[0][0])
    system = [
        [sum(row[i] * row[j] for row, _ in points) for j in range(size)]
        + [sum(row[i] * x for row, x in points)]
        for i in range(size)
    ]
    scale = max(abs(system[i][i]) for i in range(size)) or 1.0
    for col in range(size):
        pivot = max(range(col, size), key=lambda r: abs(system[r][col]))
        if abs(system[pivot][col]) <= 1e-12 * scale:
            return None
        system[col], system[pivot] = system[pivot], system[col]
        for r in range(col + 1, size):
            factor = system[r][col] / system[col][col]
            system[r] = [a - factor * b for a, b in zip(system[r], system[col], strict=True)]
    coef = [0.0] * size
    for r in reversed(range(size)):
        known = sum(system[r][j] * coef[j] for j in range(r + 1, size))
        coef[r] = (system[r][size] - known) / system[r][r]
    return coef


def _dot(coef: Sequence[float], row: Sequence[float]) -> float:
    return sum(c * v for c, v in zip(coef, row, strict=True))
