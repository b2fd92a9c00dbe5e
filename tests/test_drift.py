"""Drift alerts: a metric above a factor times its own baseline (the median of its first values)."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from lightning_helpers import TRAINER_DEFAULTS, RolloutModule, make_batch
from pytorch_lightning.callbacks import ModelCheckpoint

from lightning_rollout_debug import (
    RolloutAlertError,
    RolloutAlertWarning,
    RolloutDebugCallback,
    RolloutDebugMonitor,
    RolloutDebugWarning,
)
from lightning_rollout_debug.checks.drift import (
    DEFAULT_DRIFT_BASELINE,
    DEFAULT_DRIFT_FACTORS,
    DriftMonitor,
    resolve_drift_factors,
)
from lightning_rollout_debug.metrics.catalog import GROUPS

pytestmark = [
    pytest.mark.filterwarnings("ignore:The '.*dataloader' does not have many workers"),
    pytest.mark.filterwarnings("ignore:`isinstance.treespec, LeafSpec.` is deprecated"),
    pytest.mark.filterwarnings("ignore:RolloutDebugCallback. the Trainer has no logger"),
]

MEAN, K3 = "rollout_probs_diff_mean", "rollout_actor_kl_k3"
STEPS = 14


def creeping(n: int = STEPS, start: float = 0.01, growth: float = 1.15) -> list[dict[str, Any]]:
    """Batches whose log-prob noise grows ``growth`` times per batch: a slow creep.

    With the defaults ``rollout_probs_diff_mean`` goes from about 0.004 to 0.02 over 12
    batches and never crosses the fixed 0.01 range by much: the median of the first 10
    windows is about 0.008, and window 10 (0.0165) is the first above twice that.
    """
    return [
        make_batch(8, 16, seed=i, index=i, noise=start * growth**i, mask="ones") for i in range(n)
    ]


def fit(
    batches: list[dict[str, Any]],
    callback: RolloutDebugCallback,
    *,
    max_steps: int | None = None,
    ckpt_path: str | None = None,
    callbacks: tuple[Any, ...] = (),
    **kwargs: Any,
) -> tuple[RolloutModule, pl.Trainer, list[str]]:
    """Train on ``batches`` logging every step; the alert warnings it gave."""
    module = RolloutModule(batches)
    options = {**TRAINER_DEFAULTS, "max_steps": max_steps or len(batches), "log_every_n_steps": 1}
    trainer = pl.Trainer(**{**options, **kwargs}, logger=False, callbacks=[callback, *callbacks])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, ckpt_path=ckpt_path)
    return module, trainer, alert_messages(caught)


def alert_messages(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, RolloutAlertWarning)]


def step_of(message: str) -> int:
    return int(message.split(" at step ")[1].split(":")[0])


# ---------------------------------------------------------------------- DriftMonitor
def test_baseline_is_the_median_of_the_first_values() -> None:
    monitor = DriftMonitor({"x": 2.0}, baseline_windows=5)
    for value in (1.0, 9.0, 2.0, 3.0, 2.5):  # median 2.5, mean 3.5
        assert monitor.check({"x": value}).outside == []  # collecting never alerts
    assert monitor.baselines() == {"x": 2.5}
    assert monitor.check({"x": 5.0}).outside == []  # exactly 2 x 2.5: not above
    (alert,) = monitor.check({"x": 5.01}).new
    assert (alert.name, alert.value, alert.factor, alert.baseline, alert.windows) == (
        "x",
        5.01,
        2.0,
        2.5,
        5,
    )
    assert alert.limit == 5.0
    assert monitor.baselines() == {"x": 2.5}  # values after the baseline do not move it


def test_only_values_above_factor_times_baseline_alert_in_episodes() -> None:
    monitor = DriftMonitor({"x": 3.0}, baseline_windows=1)
    monitor.check({"x": 1.0})
    assert monitor.check({"x": 2.9}).outside == []
    assert monitor.check({"x": 0.1}).outside == []  # far below is no drift
    assert len(monitor.check({"x": 4.0}).new) == 1
    result = monitor.check({"x": 10.0})  # the same episode
    assert result.new == [] and [a.value for a in result.outside] == [10.0]
    assert monitor.check({"x": math.nan}).outside == []  # undefined: the episode goes on
    assert monitor.check({}).new == []
    assert monitor.check({"x": 5.0}).new == []
    assert monitor.check({"x": 3.0}).outside == []  # at the limit: the episode ends
    assert len(monitor.check({"x": 3.5}).new) == 1  # a new episode
    monitor.reset()  # episodes only: the baseline stays
    assert len(monitor.check({"x": 3.5}).new) == 1
    monitor.restart()  # a new baseline
    assert monitor.check({"x": 3.5}).outside == [] and monitor.baselines() == {"x": 3.5}


@pytest.mark.parametrize("first", [[0.0, 0.0, 0.0], [-1.0, -2.0, 0.0]])
def test_a_baseline_of_zero_or_below_never_alerts(first: list[float]) -> None:
    monitor = DriftMonitor({"x": 2.0}, baseline_windows=3)
    for value in first:
        monitor.check({"x": value})
    for value in (1e-9, 1.0, 1e6):
        assert monitor.check({"x": value}).outside == []


def test_nan_is_not_collected_and_each_metric_has_its_own_baseline() -> None:
    monitor = DriftMonitor({"x": 2.0, "y": 4.0}, baseline_windows=2)
    monitor.check({"x": 1.0, "y": math.nan})
    monitor.check({"x": math.nan, "y": 1.0})
    monitor.check({"x": math.inf, "y": -math.inf})  # nor infinity: no baseline of inf
    assert monitor.baselines() == {}
    assert monitor.state()["values"] == {"x": [1.0], "y": [1.0]}
    assert monitor.check({"x": 3.0, "y": 3.0}).outside == []  # the second values
    result = monitor.check({"x": 4.1, "y": 4.1})
    assert [a.name for a in result.new] == ["x"]  # x: 2 x 2.0; y: 4 x 2.0
    assert monitor.baselines() == {"x": 2.0, "y": 2.0}


def test_message_names_metric_value_factor_and_baseline() -> None:
    monitor = DriftMonitor({MEAN: 2.0}, baseline_windows=10)
    for _ in range(10):
        monitor.check({MEAN: 0.011})
    (alert,) = monitor.check({MEAN: 0.036}).new
    assert alert.describe("training/") == (
        f"`training/{MEAN}` = 0.036 drifted above 2 x its baseline 0.011 "
        "(the median of its first 10 logged values)"
    )
    assert alert.back == "back at or below 0.022"


def test_state_round_trip_and_another_baseline_count() -> None:
    monitor = DriftMonitor({"x": 2.0, "y": 2.0}, baseline_windows=3)
    for value in (1.0, 2.0, 3.0):
        monitor.check({"x": value, "y": value if value < 3 else math.nan})
    state = monitor.state()
    assert state == {"baseline_windows": 3, "values": {"x": [1.0, 2.0, 3.0], "y": [1.0, 2.0]}}
    assert DriftMonitor.state_problems(state) == []

    same = DriftMonitor({"x": 2.0, "z": 2.0}, baseline_windows=3)
    assert same.load_state(state) == []
    assert same.state()["values"] == {"x": [1.0, 2.0, 3.0], "z": []}  # z: starts collecting
    smaller = DriftMonitor({"x": 2.0, "y": 2.0}, baseline_windows=2)
    assert smaller.load_state(state) == []
    assert smaller.baselines() == {"x": 1.5, "y": 1.5}  # the first 2 are the first 2
    larger = DriftMonitor({"x": 2.0, "y": 2.0}, baseline_windows=4)
    assert larger.load_state(state) == ["x"]  # complete at 3: the 4th first value is lost
    assert larger.state()["values"] == {"x": [], "y": [1.0, 2.0]}  # y: still collecting


@pytest.mark.parametrize(
    ("state", "fragment"),
    [
        ([1.0], "is a list, not a dict"),
        ({"values": {}}, "`baseline_windows` is None"),
        ({"baseline_windows": True, "values": {}}, "`baseline_windows` is True"),
        ({"baseline_windows": 2}, "`values` is NoneType"),
        ({"baseline_windows": 2, "values": {"x": [1.0, 2.0, 3.0]}}, "at most 2 finite numbers"),
        ({"baseline_windows": 2, "values": {"x": [math.nan]}}, "of `x` is [nan]"),
        ({"baseline_windows": 2, "values": {"x": [math.inf]}}, "at most 2 finite numbers"),
        ({"baseline_windows": 2, "values": {"x": [0.1, -math.inf]}}, "of `x` is [0.1, -inf]"),
        ({"baseline_windows": 2, "values": {"x": ["0.1"]}}, "of `x` is ['0.1']"),
        ({"baseline_windows": 2, "values": {"x": 0.1}}, "of `x` is 0.1"),
    ],
)
def test_damaged_states_are_named(state: Any, fragment: str) -> None:
    problems = DriftMonitor.state_problems(state)
    assert len(problems) == 1 and fragment in problems[0], problems


# ---------------------------------------------------------------------- configuration
def test_defaults_follow_the_enabled_groups() -> None:
    assert resolve_drift_factors(None, GROUPS) == DEFAULT_DRIFT_FACTORS == {MEAN: 2.0, K3: 4.0}
    assert RolloutDebugCallback().config.drift_factors == DEFAULT_DRIFT_FACTORS
    assert RolloutDebugCallback().config.drift_baseline == DEFAULT_DRIFT_BASELINE == 10
    assert RolloutDebugCallback(groups=["seed"]).config.drift_factors == {MEAN: 2.0}
    assert RolloutDebugMonitor(groups=["kl"]).config.drift_factors == {K3: 4.0}
    assert RolloutDebugCallback(groups=["health"]).config.drift_factors == {}
    assert RolloutDebugCallback(drift_factors={}).config.drift_factors == {}
    callback = RolloutDebugCallback(drift_factors={"rollout_is_chi2": 3}, drift_baseline=4)
    assert (
        callback.config.drift_factors == {"rollout_is_chi2": 3.0}
        and callback.config.drift_baseline == 4
    )
    assert callback.monitor._drift.factors == {"rollout_is_chi2": 3.0}
    assert callback.monitor._drift.baseline_windows == 4


def test_every_drift_problem_is_reported_at_once() -> None:
    with pytest.raises(ValueError) as error:
        RolloutDebugCallback(
            groups=["seed", "kl"],
            drift_factors={
                "rollout_probs_diff_mean_typo": 2.0,
                K3: 1.0,
                "rollout_actor_kl_k1": True,
                "rollout_probs_diff_max": "2",
                "rollout_is_ess": 2.0,
            },
            drift_baseline=0,
        )
    message = str(error.value)
    assert message.startswith("Invalid RolloutDebugCallback arguments:")
    assert "`drift_factors` names unknown metrics ['rollout_probs_diff_mean_typo']" in message
    assert "valid names are ['rollout_probs_diff_valid', 'rollout_probs_diff_max'" in message
    assert "'rollout_actor_kl_k3'" in message.split("valid names are")[1]
    for name in (K3, "rollout_actor_kl_k1", "rollout_probs_diff_max"):
        assert f"`drift_factors[{name!r}]` must be a number > 1" in message
    assert "`drift_factors` has a factor for `rollout_is_ess`, but its group" in message
    assert "`importance_ratio` is not logged (enabled groups: ['seed', 'kl'])" in message
    assert "`drift_baseline` must be an int >= 1" in message and "got 0." in message


@pytest.mark.parametrize("factor", [1, 0.5, -2.0, math.nan, math.inf, None, False, [2.0]])
def test_factors_must_be_numbers_above_one(factor: Any) -> None:
    with pytest.raises(ValueError, match=r"`drift_factors\['rollout_probs_diff_mean'\]` must"):
        RolloutDebugMonitor(drift_factors={MEAN: factor})


@pytest.mark.parametrize("baseline", [0, -1, 2.5, "10", True, None])
def test_drift_baseline_must_be_a_positive_int(baseline: Any) -> None:
    with pytest.raises(ValueError, match="`drift_baseline` must be an int >= 1"):
        RolloutDebugCallback(drift_baseline=baseline)


@pytest.mark.parametrize("factors", [[(MEAN, 2.0)], "rollout_probs_diff_mean", 2.0])
def test_drift_factors_must_be_a_mapping(factors: Any) -> None:
    with pytest.raises(ValueError, match=r"`drift_factors` must be None \(the defaults\), \{\}"):
        RolloutDebugMonitor(drift_factors=factors)


# ---------------------------------------------------------------------- Trainer runs
def test_a_slow_creep_warns_after_the_baseline_and_not_before() -> None:
    module, _, messages = fit(creeping(), RolloutDebugCallback(alert_ranges={}))
    assert module.seen == list(range(STEPS))  # "warn" never stops
    assert messages, "the creep was not noticed"
    assert all("drifted above" in m for m in messages), messages
    assert min(step_of(m) for m in messages) >= DEFAULT_DRIFT_BASELINE  # not while collecting
    mean = [m for m in messages if f"`training/{MEAN}`" in m]
    assert len(mean) == 1, messages  # one episode: it stays above
    assert "drifted above 2 x its baseline" in mean[0]
    assert "(the median of its first 10 logged values)" in mean[0]
    assert "warning again only after it is back at or below" in mean[0]

    # The same run with fewer windows than the baseline needs: silent.
    _, _, short = fit(creeping(DEFAULT_DRIFT_BASELINE), RolloutDebugCallback(alert_ranges={}))
    assert short == []
    # drift_factors={} turns drift alerts off; alert_ranges={} had left them on.
    _, _, off = fit(creeping(), RolloutDebugCallback(alert_ranges={}, drift_factors={}))
    assert off == []


def test_a_steady_run_does_not_drift() -> None:
    steady = [make_batch(8, 16, seed=i, index=i, noise=0.01, mask="ones") for i in range(STEPS)]
    _, _, messages = fit(steady, RolloutDebugCallback(alert_ranges={}))
    assert messages == []


def test_stop_ends_fit_at_the_first_drifted_window() -> None:
    callback = RolloutDebugCallback(alert_ranges={}, on_alert="stop")
    module, trainer, messages = fit(creeping(20), callback)
    first = min(step_of(m) for m in messages)
    assert first >= DEFAULT_DRIFT_BASELINE and all("stopping the training" in m for m in messages)
    assert module.seen == list(range(first + 1)) and trainer.global_step == first + 1
    assert trainer.should_stop and callback.monitor.should_stop


def test_raise_names_the_drift() -> None:
    callback = RolloutDebugCallback(alert_ranges={}, drift_factors={MEAN: 2.0}, on_alert="raise")
    module = RolloutModule(creeping(20))
    options = {**TRAINER_DEFAULTS, "max_steps": 20, "log_every_n_steps": 1}
    trainer = pl.Trainer(**options, logger=False, callbacks=[callback])
    with pytest.raises(RolloutAlertError) as error:
        trainer.fit(module)
    message = str(error.value)
    assert message.startswith("RolloutDebugCallback at step ")
    assert f"`training/{MEAN}` = " in message and "drifted above 2 x its baseline" in message
    assert step_of(message) >= DEFAULT_DRIFT_BASELINE and module.seen[-1] == step_of(message)


def test_fixed_ranges_and_drift_alert_together() -> None:
    # The fixed range catches the jump at once, drift only once it has a baseline.
    callback = RolloutDebugCallback(
        alert_ranges={MEAN: (None, 0.012)}, drift_factors={MEAN: 2.0}, drift_baseline=3
    )
    _, _, messages = fit(creeping(), callback)
    fixed = [m for m in messages if "is outside [-inf, 0.012]" in m]
    drift = [m for m in messages if "drifted above" in m]
    assert len(fixed) == 1 and len(drift) == 1, messages
    assert "median of its first 3 logged values" in drift[0]


@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before")
def test_a_resumed_run_keeps_the_baseline(tmp_path: Path) -> None:
    batches = creeping()
    ckpt_step = DEFAULT_DRIFT_BASELINE  # after the 10 windows of the baseline
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)
    options = {"enable_checkpointing": True}
    first = RolloutDebugCallback(alert_ranges={})
    _, _, uninterrupted = fit(batches, first, callbacks=(checkpoint,), **options)
    (drifted,) = [m for m in uninterrupted if f"`training/{MEAN}`" in m]

    ckpt = tmp_path / "ckpt" / f"epoch=0-step={ckpt_step}.ckpt"
    state = torch.load(ckpt, weights_only=False)["callbacks"][first.state_key]
    assert state["drift"]["baseline_windows"] == DEFAULT_DRIFT_BASELINE
    assert [len(v) for v in state["drift"]["values"].values()] == [DEFAULT_DRIFT_BASELINE] * 2

    # Resumed: the batches after the checkpoint, judged against the saved baseline.
    rest = batches[ckpt_step:]
    resumed = RolloutDebugCallback(alert_ranges={})
    module, _, messages = fit(
        rest,
        resumed,
        max_steps=len(batches),
        ckpt_path=str(ckpt),
        callbacks=(ModelCheckpoint(dirpath=tmp_path / "again", every_n_train_steps=1),),
        **options,
    )
    assert module.seen == list(range(ckpt_step, len(batches)))
    (again,) = [m for m in messages if f"`training/{MEAN}`" in m]
    assert again == drifted  # the same step, value and baseline as without the restart
    assert resumed.monitor._drift.baselines() == first.monitor._drift.baselines()

    # A new run on the same batches is not restored: it collects its own baseline.
    _, _, fresh = fit(rest, RolloutDebugCallback(alert_ranges={}))
    assert fresh == []


@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before")
@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
def test_a_damaged_baseline_in_a_checkpoint(tmp_path: Path, strict: bool) -> None:
    batches = creeping()
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=10)
    first = RolloutDebugCallback(alert_ranges={})
    fit(batches, first, callbacks=(checkpoint,), enable_checkpointing=True)
    ckpt = tmp_path / "ckpt" / "epoch=0-step=10.ckpt"
    saved = torch.load(ckpt, weights_only=False)
    saved["callbacks"][first.state_key]["drift"]["values"][MEAN] = ["broken"]
    torch.save(saved, ckpt)

    callback = RolloutDebugCallback(alert_ranges={}, strict=strict)
    module = RolloutModule(batches[10:])
    options = {**TRAINER_DEFAULTS, "max_steps": len(batches), "log_every_n_steps": 1}
    trainer = pl.Trainer(**options, logger=False, callbacks=[callback])
    if strict:
        with pytest.raises(ValueError, match="the drift baseline of `rollout_probs_diff_mean`"):
            trainer.fit(module, ckpt_path=str(ckpt))
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, ckpt_path=str(ckpt))
    debug = [str(w.message) for w in caught if issubclass(w.category, RolloutDebugWarning)]
    debug = [m for m in debug if "checkpoint" in m]
    assert len(debug) == 1 and "checkpoint's state cannot be restored" in debug[0], debug
    assert "the drift baselines are collected again" in debug[0]
    assert alert_messages(caught) == []  # collecting again: no drift yet
    values = callback.monitor._drift.state()["values"]
    assert [len(values[MEAN]), len(values[K3])] == [4, 4]  # the 4 windows after the restart


# ---------------------------------------------------------------------- the monitor
def test_monitor_keeps_the_baseline_through_its_state_dict(tmp_path: Path) -> None:
    batches = creeping()
    monitor = RolloutDebugMonitor(alert_ranges={}, drift_factors={MEAN: 2.0})
    for step, batch in enumerate(batches[:10]):
        monitor.update(batch)
        monitor.log(step)
    path = tmp_path / "monitor.pt"
    torch.save(monitor.state_dict(), path)
    state = torch.load(path, weights_only=True)  # plain values: the safe loader reads them
    assert len(state["drift"]["values"][MEAN]) == 10

    restored = RolloutDebugMonitor(alert_ranges={}, drift_factors={MEAN: 2.0}, on_alert="stop")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RolloutDebugWarning)
        restored.load_state_dict(state)
    restored.update(batches[10])
    with pytest.warns(RolloutAlertWarning, match="drifted above 2 x its baseline") as caught:
        restored.log(10)
    assert "RolloutDebugMonitor at step 10: `training/" in str(caught[0].message)
    assert restored.should_stop

    restored.reset()  # a new run: a new baseline
    assert not restored.should_stop and restored._drift.baselines() == {}
    restored.update(batches[11])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RolloutAlertWarning)
        restored.log(11)

    raising = RolloutDebugMonitor(alert_ranges={}, drift_factors={MEAN: 2.0}, on_alert="raise")
    raising.load_state_dict(state)
    raising.update(batches[12])
    with pytest.raises(RolloutAlertError, match=r"RolloutDebugMonitor at step 12: .*drifted"):
        raising.log(12)


@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
def test_monitor_with_a_damaged_baseline(strict: bool) -> None:
    monitor = RolloutDebugMonitor(alert_ranges={}, drift_baseline=2)
    monitor.update(make_batch(seed=1))
    monitor.log(0)
    monitor.update(make_batch(seed=2))
    state = monitor.state_dict()
    state["drift"]["baseline_windows"] = 0
    restored = RolloutDebugMonitor(alert_ranges={}, drift_baseline=2, strict=strict)
    if strict:
        with pytest.raises(ValueError, match="drift baseline's `baseline_windows` is 0"):
            restored.load_state_dict(state)
        return
    with pytest.warns(RolloutDebugWarning, match="the drift baselines are collected again"):
        restored.load_state_dict(state)
    assert restored.batches_in_window == 1  # the window itself is restored
    assert restored._drift.state()["values"] == {MEAN: [], K3: []}


def test_monitor_with_another_drift_baseline_warns_and_collects_again() -> None:
    monitor = RolloutDebugMonitor(alert_ranges={}, drift_baseline=2)
    for seed in (1, 2):
        monitor.update(make_batch(seed=seed))
        monitor.log(seed)
    state = monitor.state_dict()
    larger = RolloutDebugMonitor(alert_ranges={}, drift_baseline=3)
    with pytest.warns(RolloutDebugWarning, match="median of 2 logged values, fewer than"):
        larger.load_state_dict(state)
    assert larger._drift.state()["values"] == {MEAN: [], K3: []}
    smaller = RolloutDebugMonitor(alert_ranges={}, drift_baseline=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RolloutDebugWarning)
        smaller.load_state_dict(state)
    assert [len(v) for v in smaller._drift.state()["values"].values()] == [1, 1]


def test_a_checkpoint_without_a_baseline_collects_one() -> None:
    monitor = RolloutDebugMonitor(alert_ranges={})
    monitor.update(make_batch(seed=3))
    state = monitor.state_dict()
    del state["drift"]  # written before drift alerts existed
    restored = RolloutDebugMonitor(alert_ranges={})
    with warnings.catch_warnings():
        warnings.simplefilter("error", RolloutDebugWarning)
        restored.load_state_dict(state)
    assert restored.batches_in_window == 1
    assert restored._drift.state()["values"] == {MEAN: [], K3: []}
