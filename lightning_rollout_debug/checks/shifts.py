"""Log-probs shifted by more than one position: the prompt's columns, and other slices.

Log-probs of the whole sequence (prompt and response) sliced from its start, ``lp[:, :T]``,
have the response's width, but the trainer's value of response token ``t`` sits ``P``
columns later (``P - 1`` where ``lp`` starts at the second token): the trainer's are late
by about the prompt's width. The window's exact sums see lags -1, 0 and +1 only
(:func:`~lightning_rollout_debug.checks.diagnosis.diagnose`'s ``misaligned``); a
monitor's window keeps a sample of its first batch
(:class:`~lightning_rollout_debug.metrics.shifts.ShiftSample`) whose pairs' sums at every
lag up to half its width :func:`shifted` reads, by the one-position rule's measures.

Example:
    >>> import torch
    >>> from lightning_rollout_debug.metrics.formulas import Window
    >>> from lightning_rollout_debug.metrics.inputs import check_inputs
    >>> from lightning_rollout_debug.metrics.layout import identity_state
    >>> from lightning_rollout_debug.metrics.shifts import ShiftSample
    >>> log_p = -torch.rand(8, 64, generator=torch.Generator().manual_seed(0)) * 5
    >>> whole = torch.cat([-torch.rand(8, 12) * 5, log_p], dim=1)  # a prompt of 12 tokens
    >>> sample = ShiftSample()
    >>> sample.add(check_inputs(log_p, whole[:, :64], torch.ones(8, 64)))
    >>> sums = sample.window_values(torch.device("cpu")).tolist()
    >>> found = shifted(Window(identity_state().tolist(), shifts=sums))
    >>> found.kind, found.message.split(":")[0]
    ('prompt', "The trainer's log-probs look 12 positions late")
"""

from __future__ import annotations

import math

import numpy as np

from lightning_rollout_debug.checks.findings import Diagnosis
from lightning_rollout_debug.metrics.formulas import Window, pair_agreement
from lightning_rollout_debug.metrics.shifts import LAGS, SUMS

MIN_SHIFT_PAIRS = 48
"""Pairs a lag of the sample needs before it is judged."""
SHIFTED_CORRELATION = 0.5
"""The correlation a shifted lag must reach, as for a shift by one position."""
SHIFT_MARGIN = 0.25
"""How far its correlation must beat the unshifted one, its pairs agreeing better too."""
SHIFTED_SPREAD = 0.25
"""Or its pairs' mean squared difference at most this share of the unshifted one."""


def shifted(window: Window) -> Diagnosis | None:
    """A shift of two positions or more on the window's sample, if any.

    Among the lags ``L`` with ``2 <= |L|`` and at least :data:`MIN_SHIFT_PAIRS` pairs, the
    best correlated one, where it reaches :data:`SHIFTED_CORRELATION` and its pairs agree:
    their mean squared difference is at most :data:`SHIFTED_SPREAD` of the unshifted one,
    or below it with a correlation :data:`SHIFT_MARGIN` above. Late trainer's log-probs
    (``L < 0``) are named ``prompt``, early ones ``misaligned``.
    """
    if window.shifts is None:
        return None
    # Every lag's sums, lag -LAGS first (:func:`~.shifts.lag_sums`), judged at once.
    sums = np.asarray(window.shifts, dtype=np.float64).reshape(len(SUMS), 2 * LAGS + 1)
    correlation, spreads = pair_agreement(*sums)
    lags = np.arange(-LAGS, LAGS + 1)
    candidate = (np.abs(lags) >= 2) & (sums[0] >= MIN_SHIFT_PAIRS) & ~np.isnan(correlation)
    if not candidate.any():
        return None
    at = int(np.argmax(np.where(candidate, correlation, -np.inf)))  # the first best lag
    lag, best, spread = int(lags[at]), float(correlation[at]), float(spreads[at])
    unshifted, spread_0 = float(correlation[LAGS]), float(spreads[LAGS])
    if best < SHIFTED_CORRELATION:
        return None
    margin = math.isnan(unshifted) or best - unshifted >= SHIFT_MARGIN
    if not (spread <= SHIFTED_SPREAD * spread_0 or (margin and spread < spread_0)):
        return None
    return _named(lag, best, unshifted, spread, spread_0)


def _named(lag: int, best: float, unshifted: float, spread: float, spread_0: float) -> Diagnosis:
    n, sign = abs(lag), "-" if lag < 0 else "+"
    seen = (
        f"old_log_probs[:, t] correlates {best:.3f} with rollout_log_probs[:, t {sign} {n}], "
        f"against {unshifted:.3f} unshifted, and differs from it by {spread:.3g} (mean "
        f"square) against {spread_0:.3g}, on the window's sample"
    )
    if lag > 0:
        return Diagnosis(
            "misaligned",
            f"The trainer's log-probs look {n} positions early: {seen}. Their slice starts "
            f"{n} columns too far into the sequence: for a prompt of width P, take "
            "logits[:, P - 1 : -1] (see lightning_rollout_debug.response_log_probs).",
        )
    return Diagnosis(
        "prompt",
        f"The trainer's log-probs look {n} positions late: {seen}. That is what the "
        "log-probs of the whole sequence (prompt and response) sliced from its start give, "
        f"lp[:, :T], with a prompt of {n} columns ({n + 1} where lp holds the log-probs of "
        "every token after the first): the prompt's columns are kept and the response's "
        f"last {n} dropped. Take the response's columns: lp[:, -T:] of log-probs over the "
        "whole sequence, or logits[:, P - 1 : -1] for a prompt of width P (see "
        "lightning_rollout_debug.response_log_probs).",
    )
