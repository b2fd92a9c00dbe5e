"""RolloutDebugMonitor: plain loops, Fabric (one and two processes), checkpoints, alerts.

Every logged window is compared with the float64 NumPy reference (``tests/reference.py``)
over exactly the batches of that window, on every rank.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import os
import re
import socket
import sys
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning_helpers import (
    LIGHTNING,
    NEEDS_LIGHTNING,
    PYTORCH_LIGHTNING,
    TRAINER_DEFAULTS,
    Lightning,
    make_batch,
    make_batches,
    read_scalars,
)
from reference import (
    NAMES,
    Reference,
    assert_metrics_close,
    assert_profile,
    reference_metrics,
    reference_profile,
)
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_stats import OpRecorder, host_syncs

from lightning_rollout_debug import (
    GROUPS,
    BatchError,
    MismatchStats,
    RolloutAlertError,
    RolloutAlertWarning,
    RolloutDebugCallback,
    RolloutDebugConfig,
    RolloutDebugMonitor,
    RolloutDebugWarning,
)
from lightning_rollout_debug.metrics.layout import STATE

pytestmark = [
    pytest.mark.filterwarnings("ignore:The '.*dataloader' does not have many workers"),
    pytest.mark.filterwarnings("ignore:`isinstance.treespec, LeafSpec.` is deprecated"),
    pytest.mark.filterwarnings("ignore:RolloutDebug(Monitor|Callback) at step .* is outside"),
]

PREFIX = "training/"
IDS = ("rollout_token_ids", "trainer_token_ids")
HISTOGRAM = f"{PREFIX}rollout_log_ratio_hist"
TEXT = f"{PREFIX}rollout_worst_tokens/text_summary"
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


# ---------------------------------------------------------------------- helpers
def window_reference(batches: Sequence[Mapping[str, torch.Tensor]], ids: bool = False) -> Reference:
    """The reference over the batches of a window (with their token ids if ``ids``)."""
    token_ids = {}
    if ids:
        token_ids = {
            "rollout_ids": [batch[IDS[0]] for batch in batches],
            "trainer_ids": [batch[IDS[1]] for batch in batches],
        }
    return reference_metrics(
        [batch["rollout_log_probs"] for batch in batches],
        [batch["old_log_probs"] for batch in batches],
        [batch["response_mask"] for batch in batches],
        **token_ids,
    )


def expected(want: Reference, groups: Sequence[str]) -> Reference:
    """What a window logs: the defined metrics of ``groups``."""
    return want.select([n for g in groups for n in NAMES[g] if not math.isnan(want[n])])


def unprefixed(logged: Mapping[str, float]) -> dict[str, float]:
    return {name[len(PREFIX) :]: value for name, value in logged.items()}


def default_groups() -> tuple[str, ...]:
    return tuple(group for group in GROUPS if group != "token_ids")


def tensorboard(log_dir: str | Path) -> EventAccumulator:
    accumulator = EventAccumulator(
        str(log_dir), size_guidance={"histograms": 0, "tensors": 0, "scalars": 0}
    )
    accumulator.Reload()
    return accumulator


TENSORBOARD_LOGGERS = [
    pytest.param(lit, kind, id=f"{name}.{kind}", marks=marks)
    for lit, name, marks in (
        (PYTORCH_LIGHTNING, "pytorch_lightning", ()),
        (LIGHTNING, "lightning", NEEDS_LIGHTNING),
    )
    for kind in ("pytorch", "fabric")
]
"""The TensorBoard loggers the monitor takes: the Trainer's and Fabric's, of both packages."""


# ---------------------------------------------------------------------- plain loops
@pytest.mark.parametrize(("lit", "kind"), TENSORBOARD_LOGGERS)
def test_a_plain_loop_logs_each_window_like_the_reference(
    tmp_path: Path, lit: Lightning, kind: str
) -> None:
    batches = make_batches(6, seed=31, token_ids=True)
    logger = getattr(lit, kind).loggers.TensorBoardLogger(tmp_path, name="tb", version=0)
    monitor = RolloutDebugMonitor(token_ids_keys=IDS, worst_tokens_k=3)
    logged = {}
    for step, batch in enumerate(batches):
        monitor.update(batch)
        if step % 3 == 2:
            logged[step] = monitor.log(step, logger)
    logger.finalize("success")

    windows = {2: batches[:3], 5: batches[3:]}
    for step, window in windows.items():
        assert_metrics_close(
            unprefixed(logged[step]), expected(window_reference(window, True), GROUPS)
        )
    series = read_scalars(logger.log_dir)
    for step, values in logged.items():
        assert {name: series[name][step] for name in values} == pytest.approx(values, rel=1e-6)
    events = tensorboard(logger.log_dir)
    histograms = {e.step: e.histogram_value.num for e in events.Histograms(HISTOGRAM)}
    assert histograms == {step: logged[step][f"{PREFIX}rollout_tokens"] for step in windows}
    assert sorted(event.step for event in events.Tensors(TEXT)) == sorted(windows)
    assert len(events.Tensors("custom_scalars__config__")) == 1
    assert monitor.batches_in_window == 0


def test_sources_are_searched_first_to_last() -> None:
    batch = make_batch(seed=32)
    replaced = batch["rollout_log_probs"] - 0.05
    monitor = RolloutDebugMonitor(alert_ranges={})
    monitor.update({"old_log_probs": replaced}, batch)
    want = window_reference([{**batch, "old_log_probs": replaced}])
    assert_metrics_close(unprefixed(monitor.log(0)), expected(want, default_groups()))


def test_several_loggers_and_none(tmp_path: Path) -> None:
    batches = make_batches(2, seed=33)
    memory = PYTORCH_LIGHTNING.MemoryLogger()
    csv = PYTORCH_LIGHTNING.fabric.loggers.CSVLogger(tmp_path, name="csv", version=0)
    monitor = RolloutDebugMonitor(alert_ranges={})
    monitor.update(batches[0])
    alone = monitor.log(0)
    monitor.update(batches[1])
    both = monitor.log(1, [memory, csv])
    csv.finalize("success")
    assert_metrics_close(
        unprefixed(alone), expected(window_reference(batches[:1]), default_groups())
    )
    assert memory.steps == {1: both}
    assert f"{PREFIX}rollout_tokens" in Path(csv.log_dir, "metrics.csv").read_text()


def test_an_update_waits_for_nothing_and_a_log_copies_once() -> None:
    monitor = RolloutDebugMonitor(worst_tokens_k=4, alert_ranges={})
    batch = make_batch(4, 9, seed=34)
    with OpRecorder() as recorder:
        monitor.update(batch)
    assert host_syncs(recorder.calls) == []
    copies = []
    original = torch.Tensor.cpu

    def cpu(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        copies.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    torch.Tensor.cpu = cpu  # type: ignore[method-assign]
    try:
        monitor.log(0)
    finally:
        torch.Tensor.cpu = original  # type: ignore[method-assign]
    assert len(copies) == 1  # statistics and extras in one transfer


def test_the_torch_path_makes_no_tensor_from_host_values() -> None:
    """On an accelerator a tensor made from Python values is a copy that the host waits for.

    The torch path (the one accelerators run; here eager, on the CPU) makes its constants
    with fill kernels: no update, merge of waiting states or empty window of a fresh
    process's layouts reads Python values into a tensor, with fewer tokens than
    ``worst_tokens_k`` too (the candidates' placeholders).
    """
    monitor = RolloutDebugMonitor(worst_tokens_k=50, alert_ranges={}, compile=False)
    batches = make_batches(3, batch_size=4, width=9, seed=36)
    extras = monitor._extras
    assert extras is not None
    for layout in (STATE, extras.layout):  # as a fresh process has them: nothing cached
        layout._empty.clear()
        layout._pair_columns.clear()
    with OpRecorder() as recorder:
        for batch in batches:
            monitor.update(batch)
        merged = (monitor._stats.state, extras.state)  # the waiting states merged
        empty = extras.identity_state()
    assert merged[1].shape == empty.shape and len(recorder.calls) > 100
    assert [name for name in recorder.names if name == "aten::lift_fresh"] == []
    assert host_syncs(recorder.calls) == []


def test_the_callback_logs_what_the_monitor_logs() -> None:
    batches = make_batches(4, seed=35)
    memory = PYTORCH_LIGHTNING.MemoryLogger()
    trainer = PYTORCH_LIGHTNING.Trainer(
        **TRAINER_DEFAULTS,
        max_epochs=1,
        log_every_n_steps=2,
        logger=memory,
        callbacks=[RolloutDebugCallback()],
    )
    trainer.fit(PYTORCH_LIGHTNING.RolloutModule(batches, log_loss=False))
    monitor = RolloutDebugMonitor()
    logged = {}
    for step, batch in enumerate(batches):
        monitor.update({}, batch)
        if step % 2 == 1:
            logged[step] = monitor.log(step)
    assert memory.steps == logged


# ---------------------------------------------------------------------- bad input
def test_a_bad_batch_is_skipped_once_per_kind_or_raised_when_strict() -> None:
    good = make_batch(seed=36)
    monitor = RolloutDebugMonitor(alert_ranges={})
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        monitor.update({"rollout_log_probs": good["rollout_log_probs"]})
        monitor.update({"rollout_log_probs": good["rollout_log_probs"]})
        monitor.update({"loss": torch.tensor(0.5)}, list(good.values()))
        monitor.update(good)
    messages = [str(w.message) for w in record if issubclass(w.category, RolloutDebugWarning)]
    assert len(messages) == 2, messages
    assert messages[0].startswith("RolloutDebugMonitor: ") and "old_log_probs" in messages[0]
    assert "The batch is a list" in messages[1] and "what was given before it" in messages[1]
    assert monitor.batches_in_window == 4
    assert_metrics_close(
        unprefixed(monitor.log(0)), expected(window_reference([good]), default_groups())
    )

    strict = RolloutDebugMonitor(strict=True)
    with pytest.raises(BatchError, match="old_log_probs"):
        strict.update({"rollout_log_probs": good["rollout_log_probs"]})
    with pytest.raises(TypeError, match="takes the batch"):
        strict.update()


def test_every_invalid_argument_is_reported_at_once() -> None:
    with pytest.raises(ValueError, match="Invalid RolloutDebugMonitor arguments") as info:
        RolloutDebugMonitor(
            prefix=None,
            strict="no",
            is_threshold=0.5,
            groups=["bogus"],
            worst_tokens_k=-1,
            on_alert="panic",
            process_group=lambda: None,
        )
    message = str(info.value)
    for fragment in ("prefix", "strict", "is_threshold", "['bogus']", "worst_tokens_k", "on_alert"):
        assert fragment in message, (fragment, message)
    assert "got a callable" in message
    assert message.count("\n- ") == 7


@pytest.mark.parametrize("group", [5, "world", object()])
def test_a_process_group_that_is_none_of_the_kinds_is_refused(group: object) -> None:
    with pytest.raises(ValueError, match=r"`process_group` must be None \(every rank\) or a torch"):
        RolloutDebugMonitor(process_group=group)


def test_bad_log_arguments_keep_the_window() -> None:
    monitor = RolloutDebugMonitor(alert_ranges={})
    monitor.update(make_batch(seed=37))
    with pytest.raises(ValueError, match="`step` must be an int >= 0, got -1"):
        monitor.log(-1)
    with pytest.raises(TypeError, match="`loggers` must be a logger or a list of loggers"):
        monitor.log(0, ["not a logger"])
    for wrong in ("notalogger", 3):  # named whole, not as its letters
        with pytest.raises(TypeError, match=f"got {wrong!r}.$"):
            monitor.log(0, wrong)
    with pytest.raises(TypeError, match=r"`fabric` must be the lightning Fabric .* got a object"):
        monitor.log(0, fabric=object())
    with pytest.raises(TypeError, match=r"takes a torch\.nn\.Module, got a str"):
        monitor.check_dropout("model")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="MismatchStats or a packed state tensor, got a int"):
        MismatchStats().merge(5)  # type: ignore[arg-type]
    assert monitor.batches_in_window == 1
    assert monitor.log(0)[f"{PREFIX}rollout_sequences"] == 3


# ---------------------------------------------------------------------- alerts
def test_alerts_warn_once_per_episode_stop_and_raise() -> None:
    calm, wild = make_batch(4, 16, seed=38, noise=1e-4), make_batch(4, 16, seed=39, noise=0.2)
    ranges = {"rollout_probs_diff_mean": (None, 0.01)}
    monitor = RolloutDebugMonitor(alert_ranges=ranges)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for step, batch in enumerate([wild, wild, calm, wild]):
            monitor.update(batch)
            monitor.log(step)
    messages = [str(w.message) for w in record if issubclass(w.category, RolloutAlertWarning)]
    assert [m.split(":")[0] for m in messages] == [
        "RolloutDebugMonitor at step 0",
        "RolloutDebugMonitor at step 3",
    ]
    assert not monitor.should_stop

    stopping = RolloutDebugMonitor(alert_ranges=ranges, on_alert="stop")
    stopping.update(calm)
    stopping.log(0)
    assert not stopping.should_stop
    stopping.update(wild)
    with pytest.warns(RolloutAlertWarning, match="stopping the training"):
        stopping.log(1)
    assert stopping.should_stop
    stopping.reset()
    assert not stopping.should_stop

    raising = RolloutDebugMonitor(alert_ranges=ranges, on_alert="raise")
    raising.update(wild)
    with pytest.raises(RolloutAlertError, match="RolloutDebugMonitor at step 7: `training/"):
        raising.log(7)


# ---------------------------------------------------------------------- checkpoints
def test_state_dict_round_trip_continues_the_window(tmp_path: Path) -> None:
    batches = make_batches(3, seed=40, token_ids=True)
    monitor = RolloutDebugMonitor(token_ids_keys=IDS, worst_tokens_k=3)
    monitor.update(batches[0])
    monitor.update(batches[1])
    path = tmp_path / "monitor.pt"
    torch.save(monitor.state_dict(), path)
    state = torch.load(path, weights_only=True)
    assert state["batches_in_window"] == 2 and state["window"].dtype == torch.float64

    restored = RolloutDebugMonitor(token_ids_keys=IDS, worst_tokens_k=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RolloutDebugWarning)
        restored.load_state_dict(state)
    assert restored.batches_in_window == 2
    restored.update(batches[2])
    logger = PYTORCH_LIGHTNING.fabric.loggers.TensorBoardLogger(tmp_path, name="tb", version=0)
    logged = restored.log(4, logger)
    logger.finalize("success")
    assert_metrics_close(unprefixed(logged), expected(window_reference(batches, True), GROUPS))
    (histogram,) = tensorboard(logger.log_dir).Histograms(HISTOGRAM)
    assert histogram.histogram_value.num == logged[f"{PREFIX}rollout_tokens"]

    other = RolloutDebugMonitor(token_ids_keys=IDS, worst_tokens_k=3, is_threshold=3.0)
    with pytest.warns(RolloutDebugWarning, match="checkpoint was written with"):
        other.load_state_dict(state)


STATISTICS = ("seed", "log_space", "kl", "importance_ratio", "sequence", "health")
"""Every group of the statistics' state but the token ids (counted over their own updates)."""


@pytest.mark.parametrize(
    ("saved", "unmatched"),
    [
        ({"groups": ["seed", "kl", "health"]}, ["log_space", "importance_ratio", "sequence"]),
        ({"is_threshold": 1.5}, ["importance_ratio"]),
        ({"seq_ratio_bounds": (0.9, 1.1)}, ["sequence"]),
    ],
    ids=["fewer-groups", "another-threshold", "other-bounds"],
)
@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
def test_a_window_counted_otherwise_starts_empty(
    saved: dict[str, Any], unmatched: list[str], strict: bool
) -> None:
    """A window whose sums of some groups were not counted as they are now would count its
    tokens in every mean but not in those sums: it starts empty, with one warning (another
    configuration, not damage: ``strict`` warns too), and the drift baselines carry on."""
    batches = make_batches(3, seed=47)
    config = {"groups": STATISTICS, "alert_ranges": {}, "drift_baseline": 2}
    saver = RolloutDebugMonitor(**{**config, **saved})
    saver.update(batches[0])
    saver.log(0)
    saver.update(batches[1])
    state = saver.state_dict()
    restored = RolloutDebugMonitor(**config, strict=strict)
    with pytest.warns(RolloutDebugWarning, match="starts empty") as caught:
        restored.load_state_dict(state)
    (message,) = [str(w.message) for w in caught]
    assert f"sums of groups {unmatched}" in message, message
    assert restored.batches_in_window == 0
    assert restored.state_dict()["drift"] == state["drift"]
    restored.update(batches[2])
    logged = restored.log(1)
    assert_metrics_close(unprefixed(logged), expected(window_reference(batches[2:]), STATISTICS))


def test_a_window_of_more_groups_carries_on() -> None:
    """Sums of groups that are no longer computed do no harm: the window carries on."""
    batches = make_batches(2, seed=48)
    saver = RolloutDebugMonitor(groups=STATISTICS, alert_ranges={}, is_threshold=1.5)
    saver.update(batches[0])
    state = saver.state_dict()
    groups = ["seed", "kl", "health"]
    restored = RolloutDebugMonitor(groups=groups, alert_ranges={})
    with pytest.warns(RolloutDebugWarning, match="written with another") as caught:
        restored.load_state_dict(state)
    assert not any("starts empty" in str(w.message) for w in caught)
    assert restored.batches_in_window == 1
    restored.update(batches[1])
    logged = restored.log(1)
    assert_metrics_close(unprefixed(logged), expected(window_reference(batches), groups))


@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
def test_a_damaged_state_starts_an_empty_window(strict: bool) -> None:
    monitor = RolloutDebugMonitor(alert_ranges={})
    monitor.update(make_batch(seed=41))
    state = monitor.state_dict()
    state["window"] = state["window"][:-1]
    restored = RolloutDebugMonitor(alert_ranges={}, strict=strict)
    restored.update(make_batch(seed=42))
    if strict:
        with pytest.raises(ValueError, match="checkpoint's state cannot be restored"):
            restored.load_state_dict(state)
        return
    with pytest.warns(RolloutDebugWarning, match=r"RolloutDebugMonitor\(prefix='training/'\)"):
        restored.load_state_dict(state)
    assert restored.batches_in_window == 0
    assert restored.log(0)[f"{PREFIX}rollout_probs_diff_valid"] == 0


def _without_threshold(config: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in config.items() if key != "is_threshold"}


SETTINGS = "`is_threshold`, `seq_ratio_bounds`, `groups`"


@pytest.mark.parametrize(
    ("damage", "differences", "unrecorded"),
    [
        (lambda state: state.pop("config"), "(it records none: no `config`)", SETTINGS),
        (lambda state: state.update(config={}), "(it records none: no `config`)", SETTINGS),
        (
            lambda state: state.update(config=_without_threshold(state["config"])),
            "(`is_threshold` None, now 2.0)",
            "`is_threshold`",
        ),
    ],
    ids=["no-config", "empty-config", "no-threshold"],
)
@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
def test_a_state_that_records_no_configuration_starts_a_fresh_window(
    damage: Any, differences: str, unrecorded: str, strict: bool
) -> None:
    """A state that does not record the settings its sums were counted with is read as one
    of other settings: the warning of another configuration (not damage: ``strict`` warns
    too), and a fresh window. Merged in, the window of ``is_threshold=1.01`` gave a
    ``frac_high`` the new window does not have."""
    batches = make_batches(2, seed=49)
    config = {"groups": STATISTICS, "alert_ranges": {}}
    saver = RolloutDebugMonitor(**config, is_threshold=1.01)
    saver.update(batches[0])
    assert saver.log(0)[f"{PREFIX}rollout_is_ratio_frac_high"] > 0.2
    saver.update(batches[0])
    state = saver.state_dict()
    damage(state)
    restored = RolloutDebugMonitor(**config, strict=strict)
    with pytest.warns(RolloutDebugWarning, match="written with another configuration") as caught:
        restored.load_state_dict(state)
    (message,) = [str(w.message) for w in caught]
    assert differences in message, message
    consequence = f"It does not record the {unrecorded} its sums were counted with: its window"
    assert f"{consequence} starts empty." in message, message
    assert restored.batches_in_window == 0
    restored.update(batches[1])
    logged = unprefixed(restored.log(1))
    want = expected(window_reference(batches[1:]), STATISTICS)
    assert want["rollout_is_ratio_frac_high"] == 0.0 == logged["rollout_is_ratio_frac_high"]
    assert_metrics_close(logged, want)


@pytest.mark.parametrize(
    ("part", "slot", "value", "kind"),
    [
        ("window", "kl_k3", math.inf, "sum"),
        ("window", "log_ratio", math.nan, "sum"),
        ("window", "prob_actor", math.nan, "mean"),
        ("window", "prob_actor*prob_rollout", -math.inf, "co-moment"),
        ("extras_window", "rollout_log_ratio_hist.sum", math.inf, "sum"),
    ],
    ids=["inf-sum", "nan-sum", "nan-mean", "inf-comoment", "inf-histogram-sum"],
)
@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
def test_an_infinite_or_nan_sum_or_mean_is_damage(
    part: str, slot: str, value: float, kind: str, strict: bool
) -> None:
    """Sums, means and co-moments of real tokens are finite (only an empty window's extremes
    are infinite): a NaN or an infinity there is refused like any damage, and the window
    starts empty. Read in, a NaN mean left the correlation out of the log and an infinite
    ``kl_k3`` sum logged ``kl_k3 = inf``."""
    batches = make_batches(2, seed=50)
    config = {"groups": STATISTICS, "alert_ranges": {}}
    saver = RolloutDebugMonitor(**config)
    saver.update(batches[0])
    state = saver.state_dict()
    restored = RolloutDebugMonitor(**config, strict=strict)
    layout = STATE if part == "window" else restored._extras.layout  # type: ignore[union-attr]
    state[part][layout.at[slot]] = value
    what = "the window" if part == "window" else "the extras window"
    problem = f"the {kind} `{slot}` of {what} is {value!r}; expected a finite number"
    if strict:
        with pytest.raises(ValueError, match=re.escape(problem)):
            restored.load_state_dict(state)
        return
    with pytest.warns(RolloutDebugWarning, match="state cannot be restored") as caught:
        restored.load_state_dict(state)
    (message,) = [str(w.message) for w in caught]
    assert problem in message, message
    restored.update(batches[1])
    logged = unprefixed(restored.log(1))
    fresh = batches[1:] if part == "window" else batches  # damaged extras: the statistics carry on
    assert_metrics_close(logged, expected(window_reference(fresh), STATISTICS))


@pytest.mark.parametrize(
    ("saved", "now", "kept"),
    [
        ({"worst_tokens_k": 3}, {"worst_tokens_k": 5}, "worst_tokens_k=3, profile=True"),
        ({"histograms": False, "worst_tokens_k": 0}, {}, "histograms=False, worst_tokens_k=0"),
        (
            {"histograms": False, "worst_tokens_k": 0, "profile_images": False},
            {},
            "kept no histograms, worst tokens or profile",
        ),
    ],
    ids=["another-k", "no-histograms", "no-extras"],
)
@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
def test_extras_kept_with_other_settings_start_empty_with_a_warning(
    tmp_path: Path, saved: dict[str, Any], now: dict[str, Any], kept: str, strict: bool
) -> None:
    """The statistics carry on; the histograms, worst tokens and profile of the restored
    window cannot, and the warning says the first log after the resume shows part of them
    (another configuration, not damage: ``strict`` warns too)."""
    batches = make_batches(2, seed=44)
    groups = ["seed", "kl"]
    saver = RolloutDebugMonitor(groups=groups, alert_ranges={}, **saved)
    saver.update(batches[0])
    state = saver.state_dict()
    restored = RolloutDebugMonitor(groups=groups, alert_ranges={}, strict=strict, **now)
    with pytest.warns(RolloutDebugWarning, match="its extras start empty") as caught:
        restored.load_state_dict(state)
    (message,) = [str(w.message) for w in caught]
    assert kept in message and "new tokens only, and no quantiles or pictures" in message
    assert restored.batches_in_window == 1
    restored.update(batches[1])
    logger = PYTORCH_LIGHTNING.fabric.loggers.TensorBoardLogger(tmp_path, name="tb", version=0)
    logged = restored.log(1, logger)
    logger.finalize("success")
    assert_metrics_close(unprefixed(logged), expected(window_reference(batches), groups))
    (histogram,) = tensorboard(logger.log_dir).Histograms(HISTOGRAM)
    assert histogram.histogram_value.num == window_reference(batches[1:])["rollout_tokens"]
    assert restored.profile is None  # a profile of part of the window: not shown


def test_a_state_that_names_no_extras_settings_is_read_by_its_shape() -> None:
    """A state of an earlier version: extras of this layout carry on, others start empty."""
    batches = make_batches(2, seed=46)
    saver = RolloutDebugMonitor(worst_tokens_k=3, alert_ranges={})
    saver.update(batches[0])
    state = saver.state_dict()
    del state["extras_settings"]
    same = RolloutDebugMonitor(worst_tokens_k=3, alert_ranges={})
    with warnings.catch_warnings():
        warnings.simplefilter("error", RolloutDebugWarning)
        same.load_state_dict(state)
    same.update(batches[1])
    same.log(1)
    assert same.profile is not None
    assert same.profile.tokens == window_reference(batches)["rollout_tokens"]
    other = RolloutDebugMonitor(worst_tokens_k=4, alert_ranges={})
    size = state["extras_window"].numel()
    with pytest.warns(RolloutDebugWarning, match=rf"another layout \({size} values\)"):
        other.load_state_dict(state)


def test_a_configuration_read_back_with_lists_is_the_same(tmp_path: Path) -> None:
    """A state converted through a format without tuples (JSON, say) restores silently."""
    monitor = RolloutDebugMonitor(token_ids_keys=IDS, seq_ratio_bounds=(0.9, 1.1))
    monitor.update(make_batches(1, seed=45, token_ids=True)[0])
    state = monitor.state_dict()
    listed = {key: list(value) if isinstance(value, tuple) else value
              for key, value in state["config"].items()}  # fmt: skip
    assert listed != state["config"]
    state = {**state, "config": listed}
    restored = RolloutDebugMonitor(token_ids_keys=IDS, seq_ratio_bounds=(0.9, 1.1))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RolloutDebugWarning)
        restored.load_state_dict(state)
    assert restored.batches_in_window == 1


# ---------------------------------------------------------------------- Fabric
@pytest.mark.parametrize(
    "lit",
    [
        pytest.param(PYTORCH_LIGHTNING, id="lightning_fabric"),
        pytest.param(LIGHTNING, id="lightning.fabric", marks=NEEDS_LIGHTNING),
    ],
)
def test_one_fabric_process_logs_to_the_fabric_loggers(tmp_path: Path, lit: Lightning) -> None:
    logger = lit.fabric.loggers.TensorBoardLogger(tmp_path, name="tb", version=0)
    fabric = lit.fabric.Fabric(accelerator="cpu", devices=1, loggers=[logger])
    fabric.launch()
    batches = make_batches(2, seed=43)
    monitor = RolloutDebugMonitor(alert_ranges={})
    for batch in batches:
        monitor.update(fabric.to_device(batch))
    logged = monitor.log(1, fabric=fabric)
    fabric.logger.finalize("success")
    assert_metrics_close(unprefixed(logged), expected(window_reference(batches), default_groups()))
    series = read_scalars(logger.log_dir)
    assert series[f"{PREFIX}rollout_tokens"] == {1: logged[f"{PREFIX}rollout_tokens"]}
    assert [e.step for e in tensorboard(logger.log_dir).Histograms(HISTOGRAM)] == [1]
    # The profile pictures, through Fabric's TensorBoard logger, and the numbers behind them.
    pictures = EventAccumulator(logger.log_dir, size_guidance={"images": 0})
    pictures.Reload()
    kinds = ("by_position", "by_probability", "joint")
    assert sorted(pictures.Tags()["images"]) == [f"{PREFIX}rollout_profile/{k}" for k in kinds]
    assert_profile(monitor.profile.as_dict(), reference_profile(batches))  # type: ignore[union-attr]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _fabric_rank(
    rank: int, package: str, port: int, out: str, batches: list[dict[str, torch.Tensor]]
) -> None:
    """One of two processes of a Fabric DDP loop (gloo); writes what it logged to ``out``."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE="2",
        NODE_RANK="0",
        LOCAL_RANK=str(rank),
        RANK=str(rank),
    )
    lit = PYTORCH_LIGHTNING if package == "pytorch_lightning" else LIGHTNING
    assert lit is not None
    logger = lit.fabric.loggers.TensorBoardLogger(out, name="tb", version=0)
    fabric = lit.fabric.Fabric(accelerator="cpu", devices=2, strategy="ddp", loggers=[logger])
    fabric.launch()
    try:
        mine = batches[rank::2]
        monitor = RolloutDebugMonitor(worst_tokens_k=4, alert_ranges={})
        monitor.update(mine[0])
        monitor.update(mine[1])
        first = monitor.log(1, fabric=fabric)
        profiles = [monitor.profile.as_dict()]  # type: ignore[union-attr]
        monitor.update(mine[2])
        fabric.save(Path(out, "checkpoint.pt"), {"monitor": monitor})  # merges both windows
        restored = RolloutDebugMonitor(worst_tokens_k=4, alert_ranges={})
        fabric.load(Path(out, "checkpoint.pt"), {"monitor": restored})
        carried = restored.batches_in_window
        restored.update(mine[3])
        second = restored.log(3)  # over the default process group, to no logger
        profiles.append(restored.profile.as_dict())  # type: ignore[union-attr]
        # A log-prob above 0 on rank 0 alone: the merged window is warned about once.
        positive = {key: value.clone() for key, value in mine[0].items()}
        if rank == 0:
            positive["old_log_probs"][0, 0] = 0.5
            positive["response_mask"][0, 0] = 1
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            restored.update(positive)
            restored.log(5)
        signs = sum("holds values up to 0.5" in str(warning.message) for warning in caught)
        # Rank 1 alone updates (a last pipeline stage): the saved window holds its batch,
        # and the first rank, with no update of its own, carries it on.
        if rank == 1:
            restored.update(mine[4])
        fabric.save(Path(out, "second.pt"), {"monitor": restored})
        staged = RolloutDebugMonitor(worst_tokens_k=4, alert_ranges={})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fabric.load(Path(out, "second.pt"), {"monitor": staged})
        said = [
            str(warning.message) for warning in caught if "RolloutDebug" in str(warning.message)
        ]
        staged_carried = staged.batches_in_window
        third = staged.log(7)
        logger.finalize("success")
        Path(out, f"rank{rank}.json").write_text(
            json.dumps(
                {
                    "first": first,
                    "second": second,
                    "carried": carried,
                    "profiles": profiles,
                    "signs": signs,
                    "third": third,
                    "staged_carried": staged_carried,
                    "said": said,
                }
            )
        )
    finally:
        torch.distributed.destroy_process_group()  # see ReleaseProcessGroups


@pytest.mark.slow
@pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with the gloo backend",
)
@pytest.mark.parametrize(
    "package",
    ["pytorch_lightning", pytest.param("lightning", marks=NEEDS_LIGHTNING)],
)
def test_two_fabric_processes_merge_exactly(tmp_path: Path, package: str) -> None:
    batches = make_batches(10, batch_size=[3, 4] * 5, width=[5, 7, 6, 4, 5] * 2, seed=44)
    torch.multiprocessing.spawn(
        _fabric_rank, args=(package, _free_port(), str(tmp_path), batches), nprocs=2, join=True
    )
    results = [json.loads(Path(tmp_path, f"rank{r}.json").read_text()) for r in (0, 1)]
    # Rank r trains on batches r, r + 2, ...: the first window holds batches 0-3, the
    # second the restored batches 4, 5 (carried by rank 0 alone) and 6, 7.
    for index, (name, window) in enumerate((("first", batches[:4]), ("second", batches[4:8]))):
        want = expected(window_reference(window), default_groups())
        for result in results:
            assert_metrics_close(unprefixed(result[name]), want)
            # Quantiles, profiles and joint counts over the tokens of both ranks.
            assert_profile(result["profiles"][index], reference_profile(window))
        assert results[0][name] == results[1][name]
    assert [result["carried"] for result in results] == [1, 1]
    assert [result["signs"] for result in results] == [1, 0]  # rank 0 alone warns
    # Batch 9, of rank 1 alone, saved while rank 0 had no update in the window.
    for result in results:
        assert result["said"] == []
        assert result["staged_carried"] == 1
        assert_metrics_close(
            unprefixed(result["third"]), expected(window_reference(batches[9:]), default_groups())
        )
    log_dir = tmp_path / "tb" / "version_0"
    series = read_scalars(log_dir)
    assert sorted(series[f"{PREFIX}rollout_tokens"]) == [1]
    assert series[f"{PREFIX}rollout_tokens"][1] == results[0]["first"][f"{PREFIX}rollout_tokens"]
    (text,) = tensorboard(log_dir).Tensors(TEXT)
    assert "| rank |" in text.tensor_proto.string_val[0].decode()


def _rank_outside_the_group(rank: int, port: int, out: str, batches: list[Any]) -> None:
    """One of two plain gloo processes merging over a group of rank 0 alone."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        group = torch.distributed.new_group([0])  # every rank calls it; rank 1 is outside
        monitor = RolloutDebugMonitor(process_group=group, alert_ranges={})
        mine = batches[rank::2]
        monitor.update(mine[0])
        monitor.update(mine[1])
        first = monitor.log(1)
        monitor.update(mine[2])
        saved = monitor.state_dict()["batches_in_window"]
        second = monitor.log(2)
        Path(out, f"rank{rank}.json").write_text(
            json.dumps({"first": first, "second": second, "saved": saved})
        )
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
@pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with the gloo backend",
)
def test_a_rank_outside_the_process_group_keeps_its_own_window(tmp_path: Path) -> None:
    batches = make_batches(6, batch_size=[3, 4] * 3, width=[5, 7, 6] * 2, seed=45)
    torch.multiprocessing.spawn(
        _rank_outside_the_group,
        args=(_free_port(), str(tmp_path), batches),
        nprocs=2,
        join=True,
    )
    for rank in (0, 1):
        result = json.loads(Path(tmp_path, f"rank{rank}.json").read_text())
        mine = batches[rank::2]
        for name, window in (("first", mine[:2]), ("second", mine[2:])):
            want = expected(window_reference(window), default_groups())
            assert_metrics_close(unprefixed(result[name]), want)
        assert result["saved"] == 1


# ---------------------------------------------------------------------- the example
@pytest.mark.slow
def test_the_fabric_example_writes_tensorboard_logs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))
    for name in ("grpo_mismatch", "grpo_mismatch_fabric"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    import grpo_mismatch_fabric

    log_dir = grpo_mismatch_fabric.main(["--max-steps", "3", "--logdir", str(tmp_path)])
    assert log_dir.is_relative_to(tmp_path)
    series = read_scalars(log_dir)
    for tag in (f"{PREFIX}rollout_probs_diff_mean", f"{PREFIX}rollout_actor_kl_k3", "train/reward"):
        assert sorted(series[tag]) == [0, 1, 2], (tag, series.get(tag))
    assert 0 < series[f"{PREFIX}rollout_probs_diff_mean"][2] < 0.05  # bfloat16 rounding
    assert [e.step for e in tensorboard(log_dir).Histograms(HISTOGRAM)] == [0, 1, 2]


# ---------------------------------------------------------------------- the settings
def test_the_monitor_and_the_callback_take_every_setting_with_its_default() -> None:
    """Each field of ``RolloutDebugConfig`` is a parameter of both constructors, in the same
    order and with the same default; the callback adds only its own three."""
    fields = [(f.name, f.default) for f in dataclasses.fields(RolloutDebugConfig)]
    for owner, own in (
        (RolloutDebugMonitor, {"process_group"}),
        (RolloutDebugCallback, {"log_every_n_steps", "process_group", "warn_dropout"}),
    ):
        parameters = list(inspect.signature(owner.__init__).parameters.values())[1:]
        shared = [(p.name, p.default) for p in parameters if p.name not in own]
        assert shared == fields, owner.__name__
        assert {p.name for p in parameters} - {name for name, _ in fields} == own


def test_every_problem_of_the_settings_is_named_at_once() -> None:
    with pytest.raises(ValueError) as raised:
        RolloutDebugCallback(prefix=3, on_alert="shout", log_every_n_steps=0)
    message = str(raised.value)
    assert message.startswith("Invalid RolloutDebugCallback arguments:")
    for name in ("`prefix`", "`on_alert`", "`log_every_n_steps`"):
        assert name in message
    config = RolloutDebugMonitor(groups=iter(["kl", "seed"]), worst_tokens_k=2).config
    assert config.groups == ("seed", "kl")  # an iterator read once, in the catalog's order
    assert config == RolloutDebugConfig(groups=["seed", "kl"], worst_tokens_k=2)
