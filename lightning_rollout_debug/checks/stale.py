"""Stale weights: the mismatch rises between the engine's weight syncs and drops at each one.

An engine synced with the trainer every ``k`` optimizer steps samples, at each step since
the sync, with weights one step further behind: every window's statistics average the
lag away, but the run's per-batch mean ``|r|`` rises for ``k`` batches and falls back at
each sync. :func:`stale` names that rise and drop
(:func:`~lightning_rollout_debug.metrics.sawtooth.sawtooth`) from the series a monitor
keeps (:class:`~lightning_rollout_debug.metrics.series.MismatchSeries`).

Example:
    >>> from lightning_rollout_debug.metrics.layout import identity_state
    >>> from lightning_rollout_debug.metrics.formulas import Window
    >>> from lightning_rollout_debug.metrics.sawtooth import Series
    >>> series = Series([0.008, 0.017, 0.026, 0.035, 0.044] * 3)  # synced every 5 steps
    >>> found = stale(Window(identity_state().tolist(), series=series))
    >>> found.kind, found.message.split(":")[0]
    ('stale', 'The mismatch rises for 5 batches and drops back, 2 times in the last 15 batches')
"""

from __future__ import annotations

from lightning_rollout_debug.checks.findings import Diagnosis
from lightning_rollout_debug.metrics.formulas import Window


def stale(window: Window) -> Diagnosis | None:
    """A rise and drop of the run's per-batch mismatch that repeats: a late weight sync."""
    found = window.sawtooth
    if found is None:
        return None
    return Diagnosis(
        "stale",
        f"The mismatch rises for {found.period} batches and drops back, {found.drops} times in "
        f"the last {found.batches} batches: the mean |a - b| of a batch is {found.trough:.3g} "
        f"right after a drop and {found.peak:.3g} right before one, on average (the rise "
        f"and drop explains {found.fit:.0%} of its variance; rollout_stale_period = "
        f"{found.period}). An engine whose weights are synced every {found.period} optimizer "
        f"steps does this (every {found.period} / g steps with gradient accumulation over g "
        "batches: the period counts batches): at each step since the sync it samples with "
        "weights one step further behind the trainer's. Check the weight sync and its "
        "timing: that it runs before each rollout (or as often as intended), that it "
        "completes before the engine samples, and that it copies every parameter (compare "
        "checksums of the weights on both sides right after a sync). In an asynchronous or "
        "off-policy loop this is the policy lag by design: correct it with the importance "
        "ratio.",
    )
