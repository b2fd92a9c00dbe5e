"""Where the mismatch lives: quantiles, profiles and joint counts against a float64 reference.

The reference is written from the definitions in ``docs/metrics.md`` with NumPy in
float64; bucket edges are recomputed here from their formulas, not imported.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from lightning_helpers import PYTORCH_LIGHTNING, TRAINER_DEFAULTS, make_batch
from reference import (
    NAMES,
    assert_profile,
    quantile_close,
    reference_metrics,
    reference_profile,
)
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_rollout_debug import GROUPS, RolloutDebugCallback, RolloutDebugMonitor
from lightning_rollout_debug.functional import mismatch_metrics, mismatch_profile
from lightning_rollout_debug.metrics.extras import TokenExtras
from lightning_rollout_debug.metrics.layout import STATE_SIZE
from lightning_rollout_debug.metrics.profile import PROFILE_SIZE, read_profile

KEYS = ("rollout_log_probs", "old_log_probs", "response_mask")

pytestmark = [
    pytest.mark.filterwarnings("ignore:The '.*dataloader' does not have many workers"),
    pytest.mark.filterwarnings("ignore:RolloutDebugCallback at step .* is outside"),
]


def skewed_batch(seed: int, rows: int = 6, width: int = 300, **kwargs: Any) -> dict[str, Any]:
    """A batch whose mismatch grows along the response and at low probability."""
    data = make_batch(rows, width, seed=seed, noise=0.0, **kwargs)
    generator = torch.Generator().manual_seed(seed + 1)
    rollout = data["rollout_log_probs"]
    growth = 1e-3 * (1 + torch.arange(width, dtype=torch.float64)) ** 0.5
    low_probability = 1 + (-rollout).clamp(min=0) ** 1.5
    noise = torch.randn(rollout.shape, generator=generator, dtype=torch.float64)
    data["old_log_probs"] = (rollout + noise * growth * low_probability).clamp(max=0.0)
    return data


# ---------------------------------------------------------------------- functional
@pytest.mark.parametrize("width", [1, 17, 33, 300, 5000])
def test_profile_matches_the_reference(width: int) -> None:
    rows = max(1, 20_000 // width)
    data = skewed_batch(width, rows=rows, width=width)
    got = mismatch_profile(data["rollout_log_probs"], data["old_log_probs"], data["response_mask"])
    assert_profile(got, reference_profile([data]))


@pytest.mark.parametrize(
    "groups",
    [[group for group in GROUPS if group != "token_ids"], ["seed", "quantiles"]],
    ids=["every group", "seed"],
)
def test_the_eager_update_profile_matches_the_reference(groups: list[str]) -> None:
    """The torch pass's profile, float32 as the callback gets it: with every group, the
    health group's float64 planes lend the sums by probability their room; with the seed
    group alone, a buffer of their own does."""
    batches = [skewed_batch(seed, rows=5, width=333) for seed in (3, 4)]
    for data in batches:
        data["old_log_probs"] = data["old_log_probs"].float()
    monitor = RolloutDebugMonitor(alert_ranges={}, groups=groups, compile=False)
    for data in batches:
        monitor.update(data)
    monitor.log(1)
    assert monitor.profile is not None
    assert_profile(monitor.profile.as_dict(), reference_profile(batches))


def test_a_profile_reads_its_views_from_its_own_copy_of_the_block() -> None:
    """The buckets and the joint histogram are read on first use: from the block as it
    was when the profile was made, whatever becomes of the caller's array."""
    data = skewed_batch(7, rows=8, width=300)
    extras = TokenExtras(histograms=False, worst_tokens_k=0, profile=True)
    extras.update(data["rollout_log_probs"], data["old_log_probs"], data["response_mask"])
    block = extras.state[-PROFILE_SIZE:].numpy().copy()
    profile = read_profile(block)
    block[:] = 0.0  # the caller reuses its array before the views are asked for
    assert profile.as_dict() == read_profile(extras.state[-PROFILE_SIZE:].tolist()).as_dict()
    assert_profile(profile.as_dict(), reference_profile([data]))
    assert profile.tokens == float(data["response_mask"].sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_profile_of_every_dtype(dtype: torch.dtype) -> None:
    data = skewed_batch(3, rows=8, width=257)
    cast = {
        key: value.to(dtype) if value.is_floating_point() else value for key, value in data.items()
    }
    cast["response_mask"] = data["response_mask"]
    got = mismatch_profile(cast["rollout_log_probs"], cast["old_log_probs"], cast["response_mask"])
    assert_profile(got, reference_profile([cast]))


def test_special_tokens_count_as_in_the_statistics() -> None:
    data = skewed_batch(5, rows=4, width=40)
    rollout, old, mask = data["rollout_log_probs"], data["old_log_probs"], data["response_mask"]
    old[0, 1] = math.nan  # dropped
    rollout[1, 2] = math.inf  # dropped
    old[2, 3] = -math.inf  # floored to -20
    rollout[3, 4] = -45.0  # floored to -20
    old[3, 5] = 0.0  # probability 1: the top buckets
    mask[:, :6] = 1
    got = mismatch_profile(rollout, old, mask)
    assert_profile(got, reference_profile([data]))
    assert sum(b["tokens"] for b in got["by_position"]) == float(
        reference_metrics(rollout, old, mask)["rollout_tokens"]
    )


def test_identical_log_probs_give_exact_zero_quantiles_and_a_diagonal() -> None:
    data = make_batch(16, 64, seed=2)
    rollout = data["rollout_log_probs"]
    got = mismatch_profile(rollout, rollout.clone(), data["response_mask"])
    assert all(value == 0.0 for value in got["quantiles"].values())
    counts = np.array(got["joint_histogram"]["counts"])
    assert counts.sum() == float((data["response_mask"] != 0).sum())
    assert counts.sum() == np.trace(counts)


def test_empty_mask_gives_nan_quantiles_and_no_tokens() -> None:
    data = make_batch(3, 9, seed=1, mask="zeros")
    got = mismatch_profile(data["rollout_log_probs"], data["old_log_probs"], data["response_mask"])
    assert all(math.isnan(value) for value in got["quantiles"].values())
    assert all(bucket["tokens"] == 0 for bucket in got["by_position"])
    assert all(math.isnan(bucket["probs_diff_mean"]) for bucket in got["by_probability"])


def test_quantile_accuracy_over_many_magnitudes() -> None:
    """Values spread over 1e-9 ... 1: every quantile within 3% (or the sub-1e-8 rule)."""
    generator = torch.Generator().manual_seed(7)
    rollout = torch.log(torch.rand(64, 512, generator=generator, dtype=torch.float64) * 0.9 + 0.05)
    scale = 10.0 ** (-9 * torch.rand(64, 512, generator=generator, dtype=torch.float64))
    old = (rollout + scale * torch.randn(64, 512, generator=generator, dtype=torch.float64)).clamp(
        max=0.0
    )
    data = {
        "rollout_log_probs": rollout,
        "old_log_probs": old,
        "response_mask": torch.ones(64, 512),
    }
    got = mismatch_profile(rollout, old, data["response_mask"])
    want = reference_profile([data])["quantiles"]
    for name, value in want.items():
        assert quantile_close(got["quantiles"][name], value), (name, got["quantiles"][name], value)


def test_mismatch_metrics_include_the_quantiles() -> None:
    data = skewed_batch(11)
    got = mismatch_metrics(data["rollout_log_probs"], data["old_log_probs"], data["response_mask"])
    want = reference_metrics(
        data["rollout_log_probs"], data["old_log_probs"], data["response_mask"]
    )
    for name in NAMES["quantiles"]:
        assert quantile_close(got[f"training/{name}"], want[name]), name


# ---------------------------------------------------------------------- windows and ranks
def test_windows_and_ranks_merge_exactly() -> None:
    """Batches of several widths, split over two 'ranks', merged: the profile of all tokens."""
    batches = [
        skewed_batch(seed, rows=3 + seed, width=width) for seed, width in enumerate((40, 700, 9))
    ]
    ranks = [TokenExtras(histograms=False, worst_tokens_k=0, profile=True) for _ in range(2)]
    ranks[0].update(
        *(batches[0][k] for k in ("rollout_log_probs", "old_log_probs", "response_mask"))
    )
    for data in batches[1:]:
        ranks[1].update(data["rollout_log_probs"], data["old_log_probs"], data["response_mask"])
    merged = ranks[0].merge_states(torch.stack([extras.state for extras in ranks]))
    profile = ranks[0].summary(merged).profile
    assert profile is not None
    assert_profile(profile.as_dict(), reference_profile(batches))
    assert profile.by_position[-1].stop == 700


@pytest.mark.parametrize("compile", [None, False], ids=["native", "torch"])
def test_a_long_window_and_its_copy_hold_their_own_batches(compile: bool | None) -> None:
    """Past several folds of waiting states, and copied mid-window, each window is exact.

    70 batches (folds at 32 and 64) give the merge of every batch's own state and the
    profile of the float64 reference; a copy taken after 40 goes on with batches of its
    own and leaves the original as it was.
    """
    batches = [skewed_batch(seed, rows=2, width=24 + seed % 5) for seed in range(70)]
    for data in batches:  # float32 both, as the native kernel takes them
        data["old_log_probs"] = data["old_log_probs"].float()
    options: dict[str, Any] = {"worst_tokens_k": 6, "profile": True, "compile": compile}
    window, single = TokenExtras(**options), TokenExtras(**options)
    states = []
    for index, data in enumerate(batches):
        window.update(*(data[key] for key in KEYS), batch_index=index)
        single.reset()
        single.update(*(data[key] for key in KEYS), batch_index=index)
        states.append(single.state)
        if index == 39:
            copied = copy.copy(window)
    own = []
    for index, data in enumerate(batches[:10]):  # the copy's own batches, under new indices
        copied.update(*(data[key] for key in KEYS), batch_index=100 + index)
        single.reset()
        single.update(*(data[key] for key in KEYS), batch_index=100 + index)
        own.append(single.state)

    for got, parts in ((window.state, states[:70]), (copied.state, states[:40] + own)):
        want = window.merge_states(torch.stack(parts))
        assert window.state_problems(got) == []
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
        assert window.summary(got).worst_tokens == window.summary(want).worst_tokens
    profile = window.summary(window.state).profile
    assert profile is not None
    assert_profile(profile.as_dict(), reference_profile(batches))


def test_the_window_stays_within_64_kib() -> None:
    extras = RolloutDebugMonitor()._extras
    assert extras is not None and extras.profile
    assert 8 * (STATE_SIZE + extras.size) <= 64 * 1024


# ---------------------------------------------------------------------- Trainer and TensorBoard
def _fit(tmp_path: Path, batches: list[dict[str, Any]], **callback_args: Any) -> EventAccumulator:
    lit = PYTORCH_LIGHTNING
    logger = lit.loggers.TensorBoardLogger(tmp_path, name="tb", version=0)
    options = {**TRAINER_DEFAULTS, "max_steps": len(batches), "log_every_n_steps": 2}
    trainer = lit.Trainer(
        **options, logger=logger, callbacks=[RolloutDebugCallback(**callback_args)]
    )
    trainer.fit(lit.RolloutModule(batches))
    ea = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0, "images": 0})
    ea.Reload()
    return ea


def test_trainer_logs_quantiles_and_pictures(tmp_path: Path) -> None:
    batches = [skewed_batch(seed, rows=4, width=120) for seed in range(4)]
    ea = _fit(tmp_path, batches)
    windows = [batches[:2], batches[2:]]
    for step, window in zip((1, 3), windows, strict=True):
        want = reference_profile(window)["quantiles"]
        for name, value in want.items():
            events = {event.step: event.value for event in ea.Scalars(f"training/{name}")}
            assert quantile_close(events[step], value), (name, step, events[step], value)
    # Steps 1 and 3 are in the default span [0, 50): pictures at its first logged step.
    assert _picture_steps(ea) == [1]
    assert _picture_steps(_fit(tmp_path / "each", batches, profile_images_every_n_steps=1)) == [
        1,
        3,
    ]


def _picture_steps(ea: EventAccumulator) -> list[int]:
    """The steps of the pictures, the same for the three tags."""
    tags = ea.Tags()["images"]
    steps = []
    for kind in ("by_position", "by_probability", "joint"):
        (tag,) = [tag for tag in tags if kind in tag]
        steps.append([event.step for event in ea.Images(tag)])
    assert steps[0] == steps[1] == steps[2]
    return steps[0]


def test_pictures_at_the_first_logged_step_of_each_span(tmp_path: Path) -> None:
    lit = PYTORCH_LIGHTNING
    logger = lit.loggers.TensorBoardLogger(tmp_path, name="tb", version=0)
    monitor = RolloutDebugMonitor(profile_images_every_n_steps=4, alert_ranges={})
    empty = skewed_batch(0, rows=2, width=30)
    empty["response_mask"] = torch.zeros_like(empty["response_mask"])
    logged = [0, 2, 3, 4, 5, 7, 9, 13, 14]
    for step in logged:
        monitor.update(empty if step == 4 else skewed_batch(step, rows=2, width=30))
        monitor.log(step, logger)
    logger.finalize("success")
    ea = EventAccumulator(logger.log_dir, size_guidance={"images": 0})
    ea.Reload()
    # Spans [0, 4), [4, 8), [8, 12), [12, 16); step 4's window is empty, so 5 draws.
    assert _picture_steps(ea) == [0, 5, 9, 13]


def test_pictures_can_be_turned_off_and_quantiles_stay(tmp_path: Path) -> None:
    batches = [skewed_batch(seed, rows=3, width=50) for seed in range(2)]
    ea = _fit(tmp_path, batches, profile_images=False)
    assert ea.Tags()["images"] == []
    assert "training/rollout_probs_diff_p99" in ea.Tags()["scalars"]


def test_no_profile_without_quantiles_or_pictures() -> None:
    groups = [group for group in NAMES if group not in ("quantiles", "token_ids")]
    monitor = RolloutDebugMonitor(groups=groups, profile_images=False, histograms=False)
    assert monitor._extras is not None and not monitor._extras.profile
    data = skewed_batch(1, rows=2, width=20)
    monitor.update(data)
    logged = monitor.log(step=0)
    assert not any(name.endswith("_p50") for name in logged)
    assert monitor.profile is None


def test_monitor_profile_and_quantile_scalars() -> None:
    monitor = RolloutDebugMonitor()
    batches = [skewed_batch(seed, rows=3, width=64) for seed in range(3)]
    for data in batches:
        monitor.update(data)
    logged = monitor.log(step=5)
    assert monitor.profile is not None
    assert_profile(monitor.profile.as_dict(), reference_profile(batches))
    for name, value in monitor.profile.quantiles.items():
        assert logged[f"training/{name}"] == value


def test_a_window_restored_without_its_profile_logs_no_quantiles_until_the_next() -> None:
    """A checkpoint of a window without the profile (an older version, or the pictures and
    the quantiles off): the restored window would have a profile of part of its tokens."""
    batches = [skewed_batch(seed, rows=3, width=40) for seed in range(3)]
    statistics = [group for group in GROUPS if group not in ("quantiles", "token_ids")]
    saver = RolloutDebugMonitor(groups=statistics, profile_images=False)
    saver.update(batches[0])
    state = saver.state_dict()
    assert state["extras_window"].numel() < RolloutDebugMonitor()._extras.size  # type: ignore[union-attr]
    monitor = RolloutDebugMonitor()
    with pytest.warns(UserWarning, match="written with"):  # another configuration
        monitor.load_state_dict(state)
    monitor.update(batches[1])
    first = monitor.log(step=1)
    assert (
        first["training/rollout_tokens"]
        == reference_metrics(*([batch[key] for batch in batches[:2]] for key in KEYS))[
            "rollout_tokens"
        ]
    )
    assert not any(name.endswith(("_p50", "_p999")) for name in first)
    assert monitor.profile is None
    monitor.update(batches[2])
    second = monitor.log(step=2)
    want = reference_profile(batches[2:])["quantiles"]
    for name, value in want.items():
        assert quantile_close(second[f"training/{name}"], value), name
