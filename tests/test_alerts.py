"""Alerts: validation, crossing episodes, and each action in a real Trainer run."""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from lightning_helpers import TRAINER_DEFAULTS, RolloutModule, make_batch

from lightning_rollout_debug import RolloutDebugCallback
from lightning_rollout_debug.checks.alerts import (
    DEFAULT_ALERT_RANGES,
    AlertMonitor,
    RolloutAlertError,
    RolloutAlertWarning,
    alert_problems,
    resolve_alert_ranges,
)
from lightning_rollout_debug.metrics.catalog import GROUPS, METRIC_NAMES

pytestmark = [
    pytest.mark.filterwarnings("ignore:The '.*dataloader' does not have many workers"),
    pytest.mark.filterwarnings("ignore:`isinstance.treespec, LeafSpec.` is deprecated"),
    pytest.mark.filterwarnings("ignore:RolloutDebugCallback. the Trainer has no logger"),
]

MEAN = "rollout_probs_diff_mean"
RANGE = {MEAN: (None, 0.01)}
GOOD, BAD = 1e-4, 0.2  # noise on the log-probs: diff mean about 3e-5 and about 0.07


def batches(noises: list[float]) -> list[dict[str, torch.Tensor]]:
    return [
        make_batch(8, 16, seed=i, index=i, noise=noise, mask="ones")
        for i, noise in enumerate(noises)
    ]


def fit(noises: list[float], callback: RolloutDebugCallback, **kwargs: Any) -> RolloutModule:
    module = RolloutModule(batches(noises))
    options = {**TRAINER_DEFAULTS, "max_steps": len(noises), "log_every_n_steps": 1}
    trainer = pl.Trainer(**{**options, **kwargs}, logger=False, callbacks=[callback])
    trainer.fit(module)
    module.trainer_ = trainer
    return module


def alert_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, RolloutAlertWarning)]


# ---------------------------------------------------------------------- Trainer runs
def test_warn_once_per_crossing_episode() -> None:
    noises = [GOOD, BAD, BAD, BAD, GOOD, BAD, GOOD]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = fit(noises, RolloutDebugCallback(alert_ranges=RANGE))
    messages = alert_warnings(caught)
    # Two episodes (batches 1-3 and batch 5): two warnings, at steps 1 and 5.
    assert len(messages) == 2, messages
    assert [m.split(":")[0] for m in messages] == [
        "RolloutDebugCallback at step 1",
        "RolloutDebugCallback at step 5",
    ]
    for message in messages:
        assert f"`training/{MEAN}` = " in message and "is outside [-inf, 0.01]" in message
    assert module.seen == list(range(len(noises)))  # "warn" never stops


def test_stop_ends_fit_at_the_crossing_step() -> None:
    noises = [GOOD, GOOD, GOOD, BAD, GOOD, GOOD, GOOD, GOOD]
    with pytest.warns(RolloutAlertWarning, match="stopping the training"):
        module = fit(noises, RolloutDebugCallback(alert_ranges=RANGE, on_alert="stop"))
    assert module.seen == [0, 1, 2, 3]
    assert module.trainer_.global_step == 4


def test_raise_names_the_metric_value_and_range() -> None:
    callback = RolloutDebugCallback(
        alert_ranges={**RANGE, "rollout_actor_mult_prob_error": (None, 1.05)},
        on_alert="raise",
    )
    with pytest.raises(RolloutAlertError) as error:
        fit([GOOD, GOOD, BAD, GOOD], callback)
    message = str(error.value)
    assert message.startswith("RolloutDebugCallback at step 2:")
    assert f"`training/{MEAN}`" in message and "[-inf, 0.01]" in message
    assert "`training/rollout_actor_mult_prob_error`" in message and "[-inf, 1.05]" in message


def test_defaults_apply_and_empty_dict_turns_alerts_off() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit([BAD], RolloutDebugCallback())
    defaults = alert_warnings(caught)
    assert any(MEAN in message for message in defaults), defaults
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit([BAD], RolloutDebugCallback(alert_ranges={}))
    assert alert_warnings(caught) == []


def test_good_run_stays_quiet_with_the_defaults() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit([GOOD, GOOD], RolloutDebugCallback())
    assert alert_warnings(caught) == []


# ---------------------------------------------------------------------- the monitor
def test_monitor_episodes_bounds_and_undefined_values() -> None:
    monitor = AlertMonitor({"x": (0.5, 2.0)})
    assert monitor.check({"x": 0.5}).outside == []  # bounds are inclusive
    assert [a.value for a in monitor.check({"x": 0.4}).new] == [0.4]
    assert monitor.check({"x": math.nan}).outside == []  # undefined: episode continues
    assert monitor.check({}).outside == []
    result = monitor.check({"x": 3.0})
    assert result.new == [] and [a.value for a in result.outside] == [3.0]
    assert monitor.check({"x": 1.0}).outside == []  # back in range: the episode ends
    assert len(monitor.check({"x": 2.5}).new) == 1
    monitor.reset()
    assert len(monitor.check({"x": 2.5}).new) == 1


def test_defaults_follow_the_enabled_groups() -> None:
    assert resolve_alert_ranges(None, GROUPS) == DEFAULT_ALERT_RANGES
    assert resolve_alert_ranges(None, ["kl"]) == {
        name: DEFAULT_ALERT_RANGES[name]
        for name in ("rollout_actor_mult_prob_error", "rollout_actor_kl_k3")
    }
    assert RolloutDebugCallback(groups=["health"]).config.alert_ranges == {}
    assert RolloutDebugCallback(alert_ranges={}).config.alert_ranges == {}
    every = {name for names in METRIC_NAMES.values() for name in names}
    assert set(DEFAULT_ALERT_RANGES) <= every


def test_ranges_accept_ints_lists_and_one_open_side() -> None:
    callback = RolloutDebugCallback(alert_ranges={MEAN: [0, 1], "rollout_is_ess": (0.5, None)})
    assert callback.config.alert_ranges == {MEAN: (0.0, 1.0), "rollout_is_ess": (0.5, None)}


# ---------------------------------------------------------------------- validation
def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(ValueError) as error:
        RolloutDebugCallback(
            alert_ranges={
                "rollout_probs_diff_mean_typo": (None, 1.0),
                MEAN: (0.2, 0.1),
                "rollout_is_ess": (None, None),
                "rollout_actor_kl_k3": "0.01",
                "rollout_token_diff_count": (None, 0),
            },
            on_alert="shout",
            log_every_n_steps=0,
        )
    message = str(error.value)
    assert "`on_alert` must be one of ['warn', 'stop', 'raise'], got 'shout'" in message
    assert "unknown metrics ['rollout_probs_diff_mean_typo']" in message
    assert "valid names are ['rollout_probs_diff_valid', 'rollout_probs_diff_max'" in message
    for name in (MEAN, "rollout_is_ess", "rollout_actor_kl_k3"):
        assert f"`alert_ranges[{name!r}]` must be (low, high)" in message
    assert "group `token_ids` is not logged" in message
    assert "`log_every_n_steps`" in message


@pytest.mark.parametrize(
    "bounds", [(None, math.nan), (True, None), (1.0,), (1.0, 2.0, 3.0), None, {"low": 1}]
)
def test_malformed_ranges_are_refused(bounds: Any) -> None:
    with pytest.raises(ValueError, match=r"must be \(low, high\)"):
        RolloutDebugCallback(alert_ranges={MEAN: bounds})


@pytest.mark.parametrize("ranges", [[(MEAN, (None, 1.0))], "rollout_probs_diff_mean"])
def test_alert_ranges_must_be_a_mapping(ranges: Any) -> None:
    with pytest.raises(ValueError, match="`alert_ranges` must be None"):
        RolloutDebugCallback(alert_ranges=ranges)


@pytest.mark.parametrize(
    ("value", "low", "high", "shown"),
    [
        (0.99999999, 1.0, None, "= 0.99999999 is outside [1, inf]"),
        (0.0100000004, None, 0.01, "= 0.0100000004 is outside [-inf, 0.01]"),
        (0.0123456789, None, 0.01, "= 0.0123457 is outside [-inf, 0.01]"),
        (2.0, None, 1.0000001, "= 2 is outside [-inf, 1.0000001]"),
    ],
)
def test_an_alert_never_prints_its_value_as_the_bound_it_crossed(
    value: float, low: float | None, high: float | None, shown: str
) -> None:
    (alert,) = (
        AlertMonitor({"rollout_probs_diff_mean": (low, high)})
        .check({"rollout_probs_diff_mean": value})
        .new
    )
    assert alert.describe().endswith(shown)


def test_numpy_numbers_are_bounds() -> None:
    ranges = resolve_alert_ranges(
        {"rollout_probs_diff_mean": (np.float32(0.5), np.int64(2))}, GROUPS
    )
    assert ranges["rollout_probs_diff_mean"] == (0.5, 2.0)
    for bad in (np.float64("nan"), np.bool_(True)):
        assert alert_problems({"rollout_probs_diff_mean": (bad, None)}, "warn", GROUPS)


def _turns(noises: list[float], late: float) -> list[dict[str, torch.Tensor]]:
    """Batches of two turns: the second's log-probs carry ``late`` more noise."""
    found = []
    for batch in batches(noises):
        turn = (torch.arange(16) >= 8).long().expand(8, 16).contiguous()
        generator = torch.Generator().manual_seed(7)
        extra = late * torch.randn(8, 16, generator=generator) * turn
        batch = {**batch, "rollout_log_probs": batch["rollout_log_probs"] + extra}
        found.append({**batch, "segment_ids": turn})
    return found


@pytest.mark.parametrize("segment_alerts", [True, False])
def test_segment_alerts_name_the_segment(segment_alerts: bool) -> None:
    """With ``segment_alerts`` a segment's value outside its range warns, its tag naming the
    segment, while the window's mean stays inside; without, only the window's are checked."""
    callback = RolloutDebugCallback(
        alert_ranges={MEAN: (None, 0.05)},
        drift_factors={},
        segment_names=["first", "second"],
        segment_alerts=segment_alerts,
    )
    module = RolloutModule(_turns([GOOD, GOOD, GOOD], late=0.15))
    options = {**TRAINER_DEFAULTS, "max_steps": 3, "log_every_n_steps": 1}
    trainer = pl.Trainer(**options, logger=False, callbacks=[callback])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module)
    messages = alert_warnings(caught)
    if not segment_alerts:
        assert messages == []
        return
    assert len(messages) == 1, messages  # one episode, from the first logged step
    assert f"`training/segments/second/{MEAN}` = " in messages[0]
    assert "is outside [-inf, 0.05]" in messages[0]
    assert "first" not in messages[0].split("=")[0]
