"""The readings of a merged window that the catalog's formulas are written with.

:class:`Window` holds a merged window of statistics on the host (its packed state and,
if kept, its profile) and gives a formula what it needs: means, standard deviations,
per-token and per-sequence sums, extremes and quantiles, each NaN where undefined. The
formulas that several metrics share are here too: the Pearson correlation of two sides
from their moments, the effective sample size and its distance from 1, and the
correlations of the log-probs at lags -1, 0 and +1 with the lag that fits best.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from numpy.typing import ArrayLike

from lightning_rollout_debug.metrics.layout import STATE
from lightning_rollout_debug.metrics.profile import Profile
from lightning_rollout_debug.metrics.sawtooth import Sawtooth, Series

_AT = STATE.at


# A side of the Pearson correlation counts as constant when its spread is below what
# float32 arithmetic can resolve.
_CONSTANT_RELATIVE_STD = 8 * torch.finfo(torch.float32).eps


class Window:
    """A merged window of statistics on the host, with the readings formulas need.

    Undefined readings are NaN: a mean without tokens, a standard deviation of fewer
    than two tokens, an extreme of an empty window, a quantile without a profile, the
    period of stale weights without the run's series.
    """

    def __init__(
        self,
        state: Sequence[float],
        profile: Profile | None = None,
        series: Series | None = None,
        shifts: Sequence[float] | None = None,
    ) -> None:
        self.state = state
        self.profile = profile
        """The window's :class:`~.profile.Profile`, if it was kept."""
        self.series = series
        """The per-batch mean ``|r|`` of the run's last batches, if kept
        (:class:`~.series.MismatchSeries`)."""
        self.shifts = shifts
        """The sums at every lag of the window's sample, if kept (:class:`~.shifts.ShiftSample`,
        read with :func:`~.shifts.lag_sums`)."""
        self.n = state[_AT["count"]]
        """Counting tokens."""
        self.sequences = state[_AT["sequences"]]
        """Sequences with at least one counting token."""

    def __getitem__(self, slot: str) -> float:
        return self.state[_AT[slot]]

    def mean(self, name: str) -> float:
        """The mean of a token-level variable."""
        return self[name] if self.n >= 1 else math.nan

    def std(self, name: str) -> float:
        """The sample standard deviation (``n - 1``) of a token-level variable."""
        return (
            math.sqrt(max(self[f"{name}*{name}"], 0.0) / (self.n - 1)) if self.n >= 2 else math.nan
        )

    def per_token(self, name: str) -> float:
        """A sum divided by the token count."""
        return self[name] / self.n if self.n >= 1 else math.nan

    def per_sequence(self, name: str) -> float:
        """A sum over sequences divided by their number."""
        return self[name] / self.sequences if self.sequences >= 1 else math.nan

    def extreme(self, slot: str) -> float:
        """A maximum or minimum over the tokens (NaN without any)."""
        value = self[slot]
        return value if self.n >= 1 and math.isfinite(value) else math.nan

    def sequence_extreme(self, slot: str) -> float:
        """A maximum or minimum over the sequences (NaN without any)."""
        return self[slot] if self.sequences >= 1 else math.nan

    def quantile(self, name: str) -> float:
        """A quantile of the profile (NaN without a profile or tokens)."""
        return math.nan if self.profile is None else self.profile.quantiles[name]

    @functools.cached_property
    def probability_root(self) -> float:
        """``sqrt(M_xx) sqrt(M_yy)`` of the two probabilities (NaN: no correlation).

        Read once for :func:`pearson` and :func:`one_minus_pearson`.
        """
        return float(_pearson_root(*_probability_moments(self)[:5]))

    @property
    def sawtooth(self) -> Sawtooth | None:
        """The rise and drop of stale weights in the run's series (:func:`~.sawtooth.sawtooth`)."""
        return None if self.series is None else self.series.rise_and_drop


def stale_period(w: Window) -> float:
    """The period, in batches, of the series' rise and drop (0: none; NaN: no series)."""
    if w.series is None:
        return math.nan
    found = w.sawtooth
    return 0.0 if found is None else float(found.period)


def exp_or_inf(x: float) -> float:
    """``math.exp`` that overflows to ``inf`` instead of raising (absurd positive log-probs)."""
    return math.exp(x) if x < 709.0 else math.inf


def _clamp(value: float, low: float, high: float) -> float:
    """``value`` within ``[low, high]``; NaN stays NaN (undefined is never clamped)."""
    return value if math.isnan(value) else max(low, min(high, value))


def pearson_from_moments(
    n: ArrayLike,
    mean_x: ArrayLike,
    mean_y: ArrayLike,
    m_xx: ArrayLike,
    m_yy: ArrayLike,
    m_xy: ArrayLike,
    *,
    resolution: float = _CONSTANT_RELATIVE_STD,
) -> Any:
    """Pearson correlation from a count, two means and the centred co-moments.

    NaN when ``n < 2`` or when either side is constant: its standard deviation is at
    most ``resolution`` times its mean (by default what float32 arithmetic resolves,
    that of the probabilities of the catalog). Element by element for NumPy arrays (a
    float for floats).
    """
    root = _pearson_root(n, mean_x, mean_y, m_xx, m_yy, resolution)
    with np.errstate(all="ignore"):
        return _plain(np.clip(np.asarray(m_xy, dtype=np.float64) / root, -1.0, 1.0))


def _pearson_root(
    n: ArrayLike,
    mean_x: ArrayLike,
    mean_y: ArrayLike,
    m_xx: ArrayLike,
    m_yy: ArrayLike,
    resolution: float = _CONSTANT_RELATIVE_STD,
) -> np.ndarray:
    """``sqrt(M_xx) sqrt(M_yy)``, NaN where the correlation is undefined.

    The roots are taken apart so that the product of the co-moments cannot overflow
    where each is finite (float64 probabilities above ``e^177``); a co-moment that did
    overflow leaves the correlation undefined.
    """
    n, mean_x, mean_y, m_xx, m_yy = (
        np.asarray(value, dtype=np.float64) for value in (n, mean_x, mean_y, m_xx, m_yy)
    )
    with np.errstate(all="ignore"):
        defined = ~(n < 2)
        for m_self, center in ((m_xx, mean_x), (m_yy, mean_y)):
            defined &= ~(np.sqrt(np.maximum(m_self, 0.0) / n) <= resolution * np.abs(center))
            defined &= (m_self > 0.0) & (m_self < math.inf)
        return np.where(defined, np.sqrt(m_xx) * np.sqrt(m_yy), math.nan)


def _plain(value: np.ndarray) -> Any:
    """A float for a 0-d array, else the array."""
    return float(value) if value.ndim == 0 else value


def _probability_moments(w: Window) -> tuple[float, ...]:
    return (
        w.n,
        w["prob_actor"],
        w["prob_rollout"],
        w["prob_actor*prob_actor"],
        w["prob_rollout*prob_rollout"],
        w["prob_actor*prob_rollout"],
    )


def pearson(w: Window) -> float:
    """The Pearson correlation of the trainer's and the rollout's probabilities."""
    return _clamp(w["prob_actor*prob_rollout"] / w.probability_root, -1.0, 1.0)


def one_minus_pearson(w: Window) -> float:
    """``1 - rho`` as ``(sqrt(M_xx M_yy) - M_xy) / sqrt(M_xx M_yy)``, clamped to ``[0, 2]``."""
    root = w.probability_root
    return _clamp((root - w["prob_actor*prob_rollout"]) / root, 0.0, 2.0)


def effective_sample_size(w: Window) -> float:
    """The importance ratios' effective sample size, as a fraction of the tokens."""
    return w["ratio"] ** 2 / (w.n * w["ratio_sq"]) if w["ratio_sq"] > 0 else math.nan


def one_minus_ess(w: Window) -> float:
    """``1 - ESS`` without the cancellation of ``1 - ess`` when the ESS is close to 1.

    With ``d = rho - 1``: ``1 - ESS = (N sum d^2 - (sum d)^2) / (N sum rho^2)``, and
    ``sum d^2 = sum (rho^2 - 1) - 2 sum d``, from sums the window holds. Their float32
    terms round by about ``eps |d| max(1, rho)`` each, at most ``sqrt(N sum d^2) +
    sum d^2`` in all, which this form divides by ``sum rho^2``; ``1 - ess`` errs by about
    ``eps``. So the form is used where that bound is below ``sum rho^2`` (the ratios
    spread little around 1), and ``1 - ess`` elsewhere (many ``rho << 1``, where the sums
    of ``rho - 1`` lost the digits of ``rho``).
    """
    ess = effective_sample_size(w)
    if math.isnan(ess):
        return math.nan
    n, d1, sum_sq = w.n, w["ratio_m1"], w["ratio_sq"]
    d2 = max(w["ratio_sq_m1"] - 2.0 * d1, 0.0)
    if math.sqrt(n * d2) + d2 < sum_sq:
        return _clamp((n * d2 - d1 * d1) / (n * sum_sq), 0.0, 1.0)
    return _clamp(1.0 - ess, 0.0, 1.0)


def lag_correlations(w: Window) -> dict[int, float]:
    """Correlation of the trainer's and the rollout's log-probs at lags -1, 0 and +1.

    At lag ``L`` the pairs are ``(a_t, b_(t+L))`` of one sequence whose tokens both
    count (at ``L = 0`` every counting token), and ``c_L`` is their Pearson correlation,
    each side's mean and spread taken over the pairs. NaN with fewer than two pairs or a
    side constant over them.
    """
    return {
        -1: _pearson_of_sums(
            w["neighbour_pairs"], w["minus_actor"], w["minus_rollout"], w["minus_actor_sq"],
            w["minus_rollout_sq"], w["sum_next_actor_x_rollout"],
        ),
        0: _pearson_of_sums(
            w.n, w["sum_actor_log_prob"], w["sum_rollout_log_prob"],
            w["sum_actor_log_prob_sq"], w["sum_rollout_log_prob_sq"], w["sum_actor_x_rollout"],
        ),
        1: _pearson_of_sums(
            w["neighbour_pairs"], w["plus_actor"], w["plus_rollout"], w["plus_actor_sq"],
            w["plus_rollout_sq"], w["sum_actor_x_next_rollout"],
        ),
    }  # fmt: skip


def _pearson_of_sums(
    n: ArrayLike, sx: ArrayLike, sy: ArrayLike, sxx: ArrayLike, syy: ArrayLike, sxy: ArrayLike
) -> Any:
    """Pearson correlation from a count and the sums of ``x``, ``y``, ``x^2``, ``y^2``, ``xy``.

    Plain sums serve log-probs, whose spread is never small against their mean. Element
    by element for NumPy arrays.
    """
    n, sx, sy, sxx, syy, sxy = (
        np.asarray(value, dtype=np.float64) for value in (n, sx, sy, sxx, syy, sxy)
    )
    with np.errstate(all="ignore"):
        mean_x, mean_y = sx / n, sy / n
        m_xx, m_yy = sxx - sx * mean_x, syy - sy * mean_y
        return pearson_from_moments(n, mean_x, mean_y, m_xx, m_yy, sxy - sx * mean_y)


def pair_agreement(
    n: ArrayLike, sa: ArrayLike, sb: ArrayLike, saa: ArrayLike, sbb: ArrayLike, sab: ArrayLike
) -> tuple[Any, Any]:
    """The correlation and mean squared difference of pairs ``(a, b)`` from their sums.

    Their number and the sums of ``a``, ``b``, ``a^2``, ``b^2`` and ``a b`` (a lag's
    :data:`~.shifts.SUMS`; arrays: every lag's at once). NaN for both with fewer than two
    pairs.

    Example:
        >>> import numpy as np
        >>> a, b = np.array([1.0, 2.0, 3.0]), np.array([1.0, 2.0, 3.5])
        >>> correlation, spread = pair_agreement(3, a.sum(), b.sum(), a @ a, b @ b, a @ b)
        >>> round(correlation, 4), round(spread, 4)
        (0.9934, 0.0833)
    """
    n = np.asarray(n, dtype=np.float64)
    saa, sbb, sab = (np.asarray(value, dtype=np.float64) for value in (saa, sbb, sab))
    with np.errstate(all="ignore"):
        spread = np.where(n < 2, math.nan, np.maximum(saa + sbb - 2.0 * sab, 0.0) / n)
    return _pearson_of_sums(n, sa, sb, saa, sbb, sab), _plain(spread)


def alignment_lag(w: Window) -> float:
    """The lag of the largest :func:`lag_correlations` (0 on a tie); NaN if none is defined."""
    defined = {lag: c for lag, c in lag_correlations(w).items() if not math.isnan(c)}
    if not defined:
        return math.nan
    return float(max(defined, key=lambda lag: (defined[lag], lag == 0)))
