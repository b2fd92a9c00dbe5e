"""Every warning of the package points at the user's code, not into the package or Lightning.

In a Trainer run the first frame outside the package, Lightning and torch is the line that
called ``trainer.fit``; with the monitor and the one-shot functions, the line that called
them: here, this file.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from lightning_helpers import PYTORCH_LIGHTNING, make_batch, make_batches

from lightning_rollout_debug import (
    RolloutAlertWarning,
    RolloutDebugCallback,
    RolloutDebugMonitor,
    RolloutDebugWarning,
)
from lightning_rollout_debug.functional import calculate_debug_metrics

lit = PYTORCH_LIGHTNING


def caught(call: Callable[[], Any]) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as found:
        warnings.simplefilter("always")
        call()
    return found


def ours(found: list[warnings.WarningMessage], category: type[Warning]) -> list[Any]:
    return [w for w in found if issubclass(w.category, category)]


def fit(callback: RolloutDebugCallback, batches: list[dict[str, torch.Tensor]], **kw: Any) -> None:
    trainer = lit.Trainer(
        max_epochs=1,
        accelerator="cpu",
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[callback],
        **kw,
    )
    trainer.fit(lit.RolloutModule(batches))


def test_a_trainer_run_s_warnings_point_at_the_line_that_called_fit(tmp_path: Any) -> None:
    batches = make_batches(4, batch_size=3, width=6)
    batches[2] = {key: value for key, value in batches[2].items() if key != "old_log_probs"}
    callback = RolloutDebugCallback(
        log_every_n_steps=1, alert_ranges={"rollout_probs_diff_mean": (None, 0.0)}
    )
    found = caught(lambda: fit(callback, batches, logger=False))
    for category, words in (
        (RolloutDebugWarning, "has no logger"),
        (RolloutDebugWarning, "old_log_probs"),
        (RolloutAlertWarning, "is outside"),
    ):
        matching = [w for w in ours(found, category) if words in str(w.message)]
        assert matching, (category, words, [str(w.message) for w in found])
        assert {w.filename for w in matching} == {__file__}, [w.filename for w in matching]


def test_the_monitor_s_warnings_point_at_its_caller() -> None:
    monitor = RolloutDebugMonitor(alert_ranges={"rollout_probs_diff_mean": (None, 0.0)})
    batch = make_batch(3, 6)
    broken = {key: value for key, value in batch.items() if key != "rollout_log_probs"}
    found = caught(lambda: (monitor.update(broken), monitor.update(batch), monitor.log(step=1)))
    assert ours(found, RolloutDebugWarning) and ours(found, RolloutAlertWarning)
    assert {w.filename for w in ours(found, UserWarning)} == {__file__}


@pytest.mark.filterwarnings("always")
def test_a_one_shot_function_s_warning_points_at_its_caller() -> None:
    batch = make_batch(2, 4)
    del batch["response_mask"]  # all ones, with a warning
    found = caught(lambda: calculate_debug_metrics(batch))
    assert found and {w.filename for w in found} == {__file__}, [str(w.message) for w in found]


def test_a_window_of_nothing_but_skipped_batches_says_so() -> None:
    """Every batch of a logged window skipped: the logged step warns, naming the number of
    batches and why the last was skipped, at most once per 100 steps."""
    monitor = RolloutDebugMonitor(alert_ranges={})
    broken = {key: value for key, value in make_batch(3, 6).items() if key != "old_log_probs"}

    def window(step: int, batches: list[dict[str, torch.Tensor]]) -> list[str]:
        def run() -> None:
            for batch in batches:
                monitor.update(batch)
            monitor.log(step=step)

        found = ours(caught(run), RolloutDebugWarning)
        assert {w.filename for w in found} <= {__file__}
        return [str(w.message) for w in found if "was skipped" in str(w.message)]

    said = window(5, [broken, broken, broken])
    assert len(said) == 1
    assert "every one of the 3 batches of the window logged at step 5" in said[0]
    assert "old_log_probs" in said[0].split("the last because:")[1]
    assert window(6, [broken]) == []  # within 100 steps of the last
    assert window(7, [broken, make_batch(3, 6)]) == []  # a batch was read
    assert len(window(105, [broken, broken])) == 1
    assert window(106, []) == []  # no batch: nothing skipped
