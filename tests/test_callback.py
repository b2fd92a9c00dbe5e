"""End-to-end tests of RolloutDebugCallback: real CPU Trainer runs, logs read back from disk.

Every logged window is compared with the float64 NumPy reference (``tests/reference.py``)
over exactly the batches of that window: all batches since the previous logged step.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from lightning_helpers import (
    LIGHTNING,
    NEEDS_LIGHTNING,
    PACKAGES,
    PYTORCH_LIGHTNING,
    TRAINER_DEFAULTS,
    DataProtoLike,
    Lightning,
    RolloutModule,
    assert_batches_equal,
    at_step,
    clone_batches,
    make_batch,
    make_batches,
    read_csv_metrics,
    read_scalars,
    split_windows,
    step_of_batches,
)
from pytorch_lightning.callbacks import Callback
from reference import ALL_NAMES, NAMES, PEARSON, Reference, assert_metrics_close, reference_metrics
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_rollout_debug import GROUPS, BatchError, RolloutDebugCallback, RolloutDebugWarning

pytestmark = [
    pytest.mark.filterwarnings("ignore:The '.*dataloader' does not have many workers"),
    pytest.mark.filterwarnings("ignore:The number of training batches .* is smaller than"),
    pytest.mark.filterwarnings("ignore:.*Checkpoint directory .* exists and is not empty"),
    pytest.mark.filterwarnings("ignore:`isinstance.treespec, LeafSpec.` is deprecated"),
    # Threshold alerts on the (deliberately noisy) test data: not what these tests check.
    pytest.mark.filterwarnings("ignore:RolloutDebugCallback at step .* is outside"),
]

PREFIX = "training/"
VALID = f"{PREFIX}rollout_probs_diff_valid"
MEAN = f"{PREFIX}rollout_probs_diff_mean"
CORR = f"{PREFIX}{PEARSON}"
DEFAULT_GROUPS = tuple(group for group in GROUPS if group != "token_ids")


# ---------------------------------------------------------------------- helpers
def tb_logger(tmp_path: Path, version: int = 0, lit: Lightning = PYTORCH_LIGHTNING) -> Any:
    return lit.loggers.TensorBoardLogger(tmp_path, name="tb", version=version)


def fit(
    module: pl.LightningModule,
    callbacks: Sequence[Callback],
    *,
    logger: Any = False,
    ckpt_path: str | None = None,
    lit: Lightning = PYTORCH_LIGHTNING,
    **trainer_kwargs: Any,
) -> pl.Trainer:
    """A one-epoch CPU run of ``module`` with the Trainer of ``lit``'s package."""
    options = {**TRAINER_DEFAULTS, "max_epochs": 1, **trainer_kwargs}
    trainer = lit.Trainer(logger=logger, callbacks=list(callbacks), **options)
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer


def window_reference(
    batches: Sequence[Mapping[str, torch.Tensor]],
    *,
    rollout_key: str = "rollout_log_probs",
    old_key: str = "old_log_probs",
    mask_key: str = "response_mask",
    token_ids_keys: tuple[str, str] | None = None,
    **kwargs: Any,
) -> Reference:
    """The reference over a window of dict batches."""
    ids: dict[str, Any] = {}
    if token_ids_keys is not None:
        ids = {
            "rollout_ids": [batch[token_ids_keys[0]] for batch in batches],
            "trainer_ids": [batch[token_ids_keys[1]] for batch in batches],
        }
    return reference_metrics(
        [batch[rollout_key] for batch in batches],
        [batch[old_key] for batch in batches],
        [batch[mask_key] for batch in batches],
        **ids,
        **kwargs,
    )


def expected_logged(want: Reference, groups: Iterable[str] = DEFAULT_GROUPS) -> Reference:
    """What a logger receives: the metrics of the enabled groups that are defined."""
    names = [name for group in groups for name in NAMES[group] if not math.isnan(want[name])]
    return want.select(names)


def catalog_at(series: Mapping[str, Mapping[int, float]], step: int, prefix: str = PREFIX):
    """The catalog metrics logged at ``step`` (other scalars, e.g. extras, are ignored)."""
    return {
        name: value for name, value in at_step(series, step, prefix).items() if name in ALL_NAMES
    }


def logged_steps(series: Mapping[str, Mapping[int, float]], tag: str = VALID) -> list[int]:
    return sorted(series.get(tag, {}))


def assert_windows(
    series: Mapping[str, Mapping[int, float]],
    windows: Mapping[int, Sequence[Mapping[str, torch.Tensor]]],
    *,
    prefix: str = PREFIX,
    groups: Iterable[str] = DEFAULT_GROUPS,
    **reference_kwargs: Any,
) -> None:
    """Each logged step holds exactly the reference over its window, and no other step logs."""
    assert logged_steps(series, f"{prefix}rollout_probs_diff_valid") == sorted(windows)
    groups = tuple(groups)
    for step, batches in windows.items():
        got = catalog_at(series, step, prefix)
        want = expected_logged(window_reference(batches, **reference_kwargs), groups)
        try:
            assert_metrics_close(got, want)
        except AssertionError as error:
            raise AssertionError(f"window at step {step}: {error}") from None


def callback_values(trainer: pl.Trainer, prefix: str = PREFIX) -> dict[str, float]:
    return {
        name[len(prefix) :]: float(value)
        for name, value in trainer.callback_metrics.items()
        if name.startswith(prefix) and name[len(prefix) :] in ALL_NAMES
    }


def rollout_warnings(record: Iterable[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, RolloutDebugWarning)]


class MetricsSpy(Callback):
    """Copies ``trainer.callback_metrics`` after every training batch (runs after ours)."""

    def __init__(self) -> None:
        self.snapshots: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.snapshots.append({k: float(v) for k, v in trainer.callback_metrics.items()})


# ---------------------------------------------------------------------- constructor
def test_constructor_keeps_its_arguments() -> None:
    def group(trainer: pl.Trainer) -> None:  # the group made in setup: every rank
        return None

    callback = RolloutDebugCallback(
        rollout_log_probs_key="rlp",
        old_log_probs_key="olp",
        response_mask_key="rmask",
        prefix="rl/",
        log_every_n_steps=3,
        strict=True,
        is_threshold=3.0,
        seq_ratio_bounds=(0.5, 2.0),
        token_ids_keys=("ids_a", "ids_b"),
        groups=["kl", "seed", "token_ids"],
        process_group=group,
    )
    assert callback.config.rollout_log_probs_key == "rlp"
    assert callback.config.old_log_probs_key == "olp"
    assert callback.config.response_mask_key == "rmask"
    assert callback.config.prefix == "rl/"
    assert callback.log_every_n_steps == 3
    assert callback.config.strict is True
    assert callback.config.token_ids_keys == ("ids_a", "ids_b")
    assert callback.config.groups == ("seed", "kl", "token_ids")  # catalog order
    assert callback.process_group is group

    default = RolloutDebugCallback()
    assert default.log_every_n_steps is None
    assert default.config.strict is False
    assert default.config.prefix == PREFIX
    assert default.config.groups == DEFAULT_GROUPS  # token ids need token_ids_keys
    assert RolloutDebugCallback(token_ids_keys=("a", "b")).config.groups == GROUPS


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        (
            {"rollout_log_probs_key": ""},
            "`rollout_log_probs_key` must be a non-empty string, got ''",
        ),
        ({"old_log_probs_key": 3}, "`old_log_probs_key` must be a non-empty string, got 3"),
        ({"response_mask_key": None}, "`response_mask_key` must be a non-empty string, got None"),
        ({"prefix": 1}, "got 1"),
        ({"log_every_n_steps": 0}, "an int >= 1, got 0"),
        ({"log_every_n_steps": True}, "an int >= 1, got True"),
        ({"log_every_n_steps": 2.5}, "an int >= 1, got 2.5"),
        ({"strict": "yes"}, "`strict` must be True or False, got 'yes'"),
        ({"is_threshold": 1.0}, "`is_threshold` must be a finite number greater than 1, got 1.0"),
        ({"is_threshold": math.inf}, "greater than 1, got inf"),
        ({"seq_ratio_bounds": (1.1, 2.0)}, "0 < lo <= 1 <= hi, got (1.1, 2.0)"),
        ({"seq_ratio_bounds": (0.5,)}, "`seq_ratio_bounds` must be (lo, hi)"),
        (
            {"token_ids_keys": "ids"},
            "must be None or a pair of batch keys (rollout_ids_key, trainer_ids_key), got 'ids'",
        ),
        ({"token_ids_keys": ("a", "b", "c")}, "`token_ids_keys` must be None or a pair"),
        (
            {"old_log_probs_key": "rollout_log_probs"},
            "`rollout_log_probs_key` and `old_log_probs_key` name the same batch key "
            "'rollout_log_probs'; each must name its own tensor",
        ),
        (
            {"token_ids_keys": ("old_log_probs", "ids")},
            "`old_log_probs_key` and `token_ids_keys[0]` name the same batch key 'old_log_probs'",
        ),
        (
            {"token_ids_keys": ("response_mask", "response_mask")},
            "`response_mask_key` and `token_ids_keys` name the same batch key 'response_mask'",
        ),
        (
            {"token_ids_keys": ("ids", "response_mask")},
            "`response_mask_key` and `token_ids_keys[1]` name the same batch key",
        ),
        (
            {"groups": ["seed", "nope"]},
            f"Unknown metric groups ['nope']; valid groups are {list(GROUPS)}",
        ),
        ({"groups": ["token_ids"]}, "The `token_ids` group needs `token_ids_keys"),
        ({"groups": 5}, "`groups` must be None (all of them) or a list of group names"),
        ({"groups": [None, 1]}, "Unknown metric groups [1, None]; valid groups are"),
        ({"token_ids_keys": 5}, "`token_ids_keys` must be None or a pair of batch keys"),
        ({"pad_token_id": 2**70}, f"got {2**70} (beyond int64, the token ids' dtype)"),
        ({"pad_token_id": "0"}, "`pad_token_id` must be None or an int token id, got '0'."),
        (
            {"groups": []},
            f"`groups` is empty, so nothing would be logged; choose from {list(GROUPS)}",
        ),
        ({"compile": 1}, "`compile` must be None (auto), True or False, got 1"),
        ({"worst_tokens_k": 10**9}, "`worst_tokens_k` must be an int from 0 (the table off)"),
        (
            {"process_group": "world"},
            "`process_group` must be None (every rank) or a torch.distributed process group, or "
            "a callable that makes one from the Trainer, got 'world'",
        ),
    ],
)
def test_invalid_argument_is_explained(kwargs: dict[str, Any], expected: str) -> None:
    with pytest.raises(ValueError, match="Invalid RolloutDebugCallback arguments") as info:
        RolloutDebugCallback(**kwargs)
    assert expected in str(info.value)


def test_numpy_numbers_and_one_shot_iterables_are_arguments_like_any_other() -> None:
    """A NumPy int or float where an int or a number goes; a generator of groups is read
    once, and the callback keeps what it held."""
    callback = RolloutDebugCallback(
        groups=(group for group in ("seed", "kl")),
        worst_tokens_k=np.int64(3),
        pad_token_id=np.int64(7),
        alert_ranges={"rollout_probs_diff_mean": (np.float32(0.0), np.float64(0.5))},
        token_ids_keys=iter(("ids", "ids")),
    )
    assert callback.config.groups == ("seed", "kl")
    assert callback.monitor.config.token_ids_keys == ("ids", "ids")
    assert (
        type(callback.monitor.config.worst_tokens_k) is int
        and callback.monitor.config.worst_tokens_k == 3
    )
    assert (
        type(callback.monitor.config.pad_token_id) is int
        and callback.monitor.config.pad_token_id == 7
    )
    assert callback.monitor.config.alert_ranges["rollout_probs_diff_mean"] == (0.0, 0.5)


def test_every_invalid_argument_is_reported_at_once() -> None:
    with pytest.raises(ValueError) as info:
        RolloutDebugCallback(
            rollout_log_probs_key="",
            prefix=None,
            log_every_n_steps=-1,
            strict=1,
            is_threshold=0.5,
            seq_ratio_bounds=(2.0, 3.0),
            token_ids_keys=("only-one",),
            groups=("seed", "bogus"),
        )
    message = str(info.value)
    for fragment in (
        "rollout_log_probs_key",
        "prefix",
        "log_every_n_steps",
        "strict",
        "is_threshold",
        "seq_ratio_bounds",
        "token_ids_keys",
        "['bogus']",
    ):
        assert fragment in message, (fragment, message)
    assert str(list(GROUPS)) in message  # the valid groups are listed
    assert message.count("\n- ") == 8


# ---------------------------------------------------------------------- windows
@pytest.mark.parametrize("lit", PACKAGES)
def test_plain_run_logs_each_window_at_the_self_log_steps(tmp_path: Path, lit: Lightning) -> None:
    batches = make_batches(6, seed=1)
    originals = clone_batches(batches)
    module = lit.RolloutModule(batches)
    trainer = fit(
        module,
        [RolloutDebugCallback()],
        logger=tb_logger(tmp_path, lit=lit),
        log_every_n_steps=2,
        lit=lit,
    )

    series = read_scalars(tmp_path / "tb" / "version_0")
    assert logged_steps(series) == logged_steps(series, "loss") == [1, 3, 5]
    windows = split_windows(batches, step_of_batches(6), [1, 3, 5])
    assert [len(w) for w in windows.values()] == [2, 2, 2]
    assert_windows(series, windows)
    # callback_metrics hold the last window, in full precision.
    assert_metrics_close(callback_values(trainer), expected_logged(window_reference(batches[4:])))
    # The batches are untouched, and the callback added or removed no key.
    assert_batches_equal(batches, originals)
    assert module.keys_at_batch_end == [sorted(batch) for batch in batches]


@pytest.mark.parametrize(
    ("accumulate", "every", "n_batches", "via_callback"),
    [(2, 1, 6, False), (3, 2, 12, False), (2, 2, 8, True), (2, 1, 5, False)],
)
def test_gradient_accumulation_windows_hold_every_micro_batch(
    tmp_path: Path, accumulate: int, every: int, n_batches: int, via_callback: bool
) -> None:
    widths = [4 + 2 * (i % 2) for i in range(n_batches)]
    batches = make_batches(n_batches, seed=2, width=widths)
    spy = MetricsSpy()
    fit(
        RolloutModule(batches),
        [RolloutDebugCallback(log_every_n_steps=every if via_callback else None), spy],
        logger=tb_logger(tmp_path),
        log_every_n_steps=50 if via_callback else every,
        accumulate_grad_batches=accumulate,
    )

    series = read_scalars(tmp_path / "tb" / "version_0")
    n_steps = math.ceil(n_batches / accumulate)  # Lightning also steps on the epoch's last batch
    expected_steps = [s for s in range(n_steps) if (s + 1) % every == 0]
    assert logged_steps(series) == expected_steps
    if not via_callback:
        assert logged_steps(series, "loss") == expected_steps
    windows = split_windows(batches, step_of_batches(n_batches, accumulate), expected_steps)
    assert sum(len(w) for w in windows.values()) == n_batches
    assert all(len(w) == accumulate * every for w in list(windows.values())[:-1])
    assert_windows(series, windows)
    # Nothing is computed mid-accumulation: callback_metrics only change on logged steps.
    first_log = accumulate * every - 1
    assert all(VALID not in snapshot for snapshot in spy.snapshots[:first_log])
    assert VALID in spy.snapshots[first_log]


class StopAtBatch(Callback):
    """Stops the run at the end of batch ``index``, as a timer or an alert of another
    callback may, in the middle of an accumulation."""

    def __init__(self, index: int) -> None:
        self.index = index

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if args[-1] == self.index:
            trainer.should_stop = True


@pytest.mark.parametrize("via_callback", [False, True])
def test_a_stop_in_the_middle_of_an_accumulation_logs_no_step_twice(
    tmp_path: Path, via_callback: bool
) -> None:
    batches = make_batches(8, seed=21)
    fit(
        RolloutModule(batches),
        [StopAtBatch(2), RolloutDebugCallback(log_every_n_steps=1 if via_callback else None)],
        logger=tb_logger(tmp_path),
        log_every_n_steps=1,
        accumulate_grad_batches=2,
    )

    series = read_scalars(tmp_path / "tb" / "version_0")
    # Step 0 holds batches 0 and 1; batch 2 belongs to step 1, which never stepped.
    accumulator = EventAccumulator(str(tmp_path / "tb" / "version_0"))
    accumulator.Reload()
    assert [event.step for event in accumulator.Scalars(VALID)] == [0, 1]  # each once
    assert_windows(series, split_windows(batches[:3], step_of_batches(3, 2), [0, 1]))


def test_manual_optimization_with_several_optimizer_steps_per_batch(tmp_path: Path) -> None:
    batches = make_batches(4, seed=3)
    trainer = fit(
        RolloutModule(batches, manual_steps=3),
        [RolloutDebugCallback()],
        logger=tb_logger(tmp_path),
        log_every_n_steps=2,
    )

    assert trainer.global_step == 12  # three optimizer steps per batch
    series = read_scalars(tmp_path / "tb" / "version_0")
    assert logged_steps(series) == logged_steps(series, "loss") == [1, 3]
    assert_windows(series, split_windows(batches, step_of_batches(4), [1, 3]))


def test_log_every_n_steps_of_the_callback_overrides_the_trainer(tmp_path: Path) -> None:
    batches = make_batches(7, seed=4)
    fit(
        RolloutModule(batches),
        [RolloutDebugCallback(log_every_n_steps=3)],
        logger=tb_logger(tmp_path),
        log_every_n_steps=50,
    )

    series = read_scalars(tmp_path / "tb" / "version_0")
    steps = logged_steps(series)
    assert steps[:2] == [2, 5]
    windows = split_windows(batches[:6], step_of_batches(6), [2, 5])
    # The last batch's window never reached a logged step: it is logged once when training
    # ends (at the step Lightning reached), not lost and not merged into another window.
    assert len(steps) == 3 and steps[2] >= 6
    windows[steps[2]] = batches[6:]
    assert_windows(series, windows)


def test_windows_span_epoch_boundaries(tmp_path: Path) -> None:
    batches = make_batches(2, seed=19)
    fit(
        RolloutModule(batches),
        [RolloutDebugCallback()],
        logger=tb_logger(tmp_path),
        log_every_n_steps=4,
        max_epochs=3,
    )

    series = read_scalars(tmp_path / "tb" / "version_0")
    steps = logged_steps(series)
    assert steps[0] == 3 and 3 in series["loss"]
    # Epochs 0 and 1 in the window of step 3; epoch 2 (steps 4, 5) flushed when training ends.
    assert len(steps) == 2 and steps[1] >= 5
    assert_windows(series, {3: batches * 2, steps[1]: batches})


def test_training_step_outputs_take_precedence_over_the_batch(tmp_path: Path) -> None:
    batches = make_batches(4, seed=5)
    for batch in batches:
        batch["true_old_log_probs"] = batch["old_log_probs"]
        batch["old_log_probs"] = torch.zeros_like(batch["old_log_probs"])  # a decoy
    module = RolloutModule(batches, outputs={"old_log_probs": "true_old_log_probs"})
    fit(module, [RolloutDebugCallback()], logger=tb_logger(tmp_path), log_every_n_steps=2)

    series = read_scalars(tmp_path / "tb" / "version_0")
    windows = split_windows(batches, step_of_batches(4), [1, 3])
    assert_windows(series, windows, old_key="true_old_log_probs")
    # The decoy would have given very different numbers.
    decoy = window_reference(windows[1])
    assert abs(decoy["rollout_probs_diff_mean"] - series[MEAN][1]) > 0.1


def test_a_window_without_tokens_logs_valid_zero_and_nothing_stale(tmp_path: Path) -> None:
    batches = [
        make_batch(seed=60, index=0),
        make_batch(seed=61, index=1, mask="zeros"),  # an empty batch inside a window
        make_batch(seed=62, index=2, mask="zeros"),
        make_batch(seed=63, index=3, mask="zeros"),  # a whole window without tokens
        make_batch(seed=64, index=4),
        make_batch(seed=65, index=5),
    ]
    spy = MetricsSpy()
    fit(
        RolloutModule(batches),
        [RolloutDebugCallback(), spy],
        logger=tb_logger(tmp_path),
        log_every_n_steps=2,
    )

    series = read_scalars(tmp_path / "tb" / "version_0")
    assert_windows(series, split_windows(batches, step_of_batches(6), [1, 3, 5]))
    empty = catalog_at(series, 3)
    assert empty == {
        "rollout_probs_diff_valid": 0.0,
        "rollout_tokens": 0.0,
        "rollout_sequences": 0.0,
        "rollout_nonfinite_tokens": 0.0,
        "rollout_zero_log_prob_tokens": 0.0,
        "rollout_stale_period": 0.0,  # the run's series, not the window's
    }
    assert all(math.isfinite(v) for values in series.values() for v in values.values())
    # After the empty window callback_metrics hold no value of the previous window.
    after_empty = spy.snapshots[3]
    assert after_empty[VALID] == 0.0
    assert after_empty[f"{PREFIX}rollout_tokens"] == 0.0
    for name in (MEAN, CORR, f"{PREFIX}rollout_actor_kl_k3", f"{PREFIX}actor_ppl"):
        assert name in spy.snapshots[1] and name not in after_empty, name
    assert all(math.isfinite(value) for snapshot in spy.snapshots for value in snapshot.values())


def test_batches_of_different_widths_dtypes_and_special_values_in_one_window(
    tmp_path: Path,
) -> None:
    batches = [
        make_batch(2, 3, seed=70, index=0),
        make_batch(4, 9, seed=71, index=1, dtype=torch.bfloat16),
        make_batch(1, 1, seed=72, index=2, dtype=torch.float16, mask="ones"),
        make_batch(3, 6, seed=73, index=3, dtype=torch.float64),
    ]
    special = batches[3]
    special["rollout_log_probs"][0, 0] = -math.inf  # counts as -20 nats
    special["old_log_probs"][0, 1] = math.nan  # dropped, counted as non-finite
    special["response_mask"][0, :2] = 1
    originals = clone_batches(batches)
    fit(RolloutModule(batches), [RolloutDebugCallback()], logger=tb_logger(tmp_path))

    series = read_scalars(tmp_path / "tb" / "version_0")
    # The Trainer logs every 50 steps: the single window is flushed when training ends.
    (step,) = logged_steps(series)
    assert_windows(series, {step: batches})
    assert series[f"{PREFIX}rollout_nonfinite_tokens"][step] == 1.0
    assert_batches_equal(batches, originals)


def test_bf16_inputs_match_the_reference_on_the_upcast_values(tmp_path: Path) -> None:
    batches = make_batches(4, seed=8, dtype=torch.bfloat16, batch_size=4, width=8)
    fit(
        RolloutModule(batches),
        [RolloutDebugCallback()],
        logger=tb_logger(tmp_path),
        log_every_n_steps=2,
    )

    series = read_scalars(tmp_path / "tb" / "version_0")
    assert_windows(series, split_windows(batches, step_of_batches(4), [1, 3]))


# ---------------------------------------------------------------------- batch containers
def _as_tensordict(batch: Mapping[str, torch.Tensor]) -> Any:
    tensordict = pytest.importorskip("tensordict")
    return tensordict.TensorDict(dict(batch), batch_size=[batch["x"].shape[0]])


def _as_dataproto_of_tensordict(batch: Mapping[str, torch.Tensor]) -> DataProtoLike:
    return DataProtoLike(_as_tensordict(batch), meta_info={"temperature": 1.0})


@pytest.mark.parametrize("container", ["tensordict", "dataproto", "dataproto_of_tensordict"])
def test_tensordict_and_dataproto_batches(tmp_path: Path, container: str) -> None:
    batches = make_batches(4, seed=9, width=[3, 5, 4, 6])
    originals = clone_batches(batches)
    collate = {
        "tensordict": _as_tensordict,
        "dataproto": DataProtoLike,
        "dataproto_of_tensordict": _as_dataproto_of_tensordict,
    }[container]
    module = RolloutModule(batches, collate_fn=collate)
    fit(module, [RolloutDebugCallback()], logger=tb_logger(tmp_path), log_every_n_steps=2)

    series = read_scalars(tmp_path / "tb" / "version_0")
    assert_windows(series, split_windows(batches, step_of_batches(4), [1, 3]))
    assert module.seen == [0, 1, 2, 3]
    assert_batches_equal(batches, originals)


def test_custom_keys_thresholds_and_attention_mask_fallback(tmp_path: Path) -> None:
    batches = []
    expected = []
    for i in range(4):
        base = make_batch(3, 5, seed=100 + i, index=i, noise=0.5)
        prompt = torch.ones(3, 4, dtype=torch.int64)
        if i % 2:  # no response mask: `attention_mask` cut to the width of `responses`
            mask_entries = {
                "attention_mask": torch.cat([prompt, base["response_mask"]], dim=1),
                "responses": torch.zeros(3, 5, dtype=torch.int64),
            }
        else:
            mask_entries = {"my_mask": base["response_mask"]}
        batches.append(
            {
                "x": base["x"],
                "index": base["index"],
                "rollout_lp": base["rollout_log_probs"],
                "actor_lp": base["old_log_probs"],
                **mask_entries,
            }
        )
        expected.append(base)
    callback = RolloutDebugCallback(
        rollout_log_probs_key="rollout_lp",
        old_log_probs_key="actor_lp",
        response_mask_key="my_mask",
        is_threshold=1.25,
        seq_ratio_bounds=(0.9, 1.2),
    )
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(RolloutModule(batches), [callback], logger=tb_logger(tmp_path), log_every_n_steps=2)

    assert rollout_warnings(record) == []  # the attention-mask fallback is silent
    series = read_scalars(tmp_path / "tb" / "version_0")
    assert_windows(
        series,
        split_windows(expected, step_of_batches(4), [1, 3]),
        is_threshold=1.25,
        seq_ratio_bounds=(0.9, 1.2),
    )
    assert any(series[f"{PREFIX}rollout_is_ratio_frac_high"].values())  # the threshold matters


def test_without_any_mask_every_position_counts_with_one_warning(tmp_path: Path) -> None:
    batches = make_batches(4, seed=18)
    expected = [
        {**batch, "response_mask": torch.ones_like(batch["response_mask"])} for batch in batches
    ]
    for batch in batches:
        del batch["response_mask"]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(
            RolloutModule(batches),
            [RolloutDebugCallback()],
            logger=tb_logger(tmp_path),
            log_every_n_steps=2,
        )

    messages = rollout_warnings(record)
    assert len(messages) == 1, messages
    assert "`response_mask`" in messages[0] and "`attention_mask`" in messages[0]
    series = read_scalars(tmp_path / "tb" / "version_0")
    assert_windows(series, split_windows(expected, step_of_batches(4), [1, 3]))


def test_token_id_group_and_group_selection(tmp_path: Path) -> None:
    batches = make_batches(4, seed=11, token_ids=True)
    groups = ["seed", "token_ids", "health"]
    callback = RolloutDebugCallback(
        prefix="rl/",
        groups=groups,
        token_ids_keys=("rollout_token_ids", "trainer_token_ids"),
    )
    trainer = fit(
        RolloutModule(batches), [callback], logger=tb_logger(tmp_path), log_every_n_steps=2
    )

    series = read_scalars(tmp_path / "tb" / "version_0")
    windows = split_windows(batches, step_of_batches(4), [1, 3])
    assert_windows(
        series,
        windows,
        prefix="rl/",
        groups=("seed", "health", "token_ids"),
        token_ids_keys=("rollout_token_ids", "trainer_token_ids"),
    )
    logged = {name for name in series if name.startswith("rl/") and name[3:] in ALL_NAMES}
    assert logged == {f"rl/{name}" for g in groups for name in NAMES[g]}
    assert series["rl/rollout_token_diff_count"][1] > 0
    assert not any(name.startswith(PREFIX) for name in trainer.callback_metrics)


# ---------------------------------------------------------------------- loggers
@pytest.mark.parametrize("lit", PACKAGES)
def test_every_logger_gets_the_metrics(tmp_path: Path, lit: Lightning) -> None:
    batches = make_batches(4, seed=12)
    csv_logger = lit.loggers.CSVLogger(tmp_path, name="csv", version=0)
    fit(
        lit.RolloutModule(batches),
        [RolloutDebugCallback()],
        logger=[tb_logger(tmp_path, lit=lit), csv_logger],
        log_every_n_steps=2,
        lit=lit,
    )

    windows = split_windows(batches, step_of_batches(4), [1, 3])
    tb_series = read_scalars(tmp_path / "tb" / "version_0")
    csv_series = read_csv_metrics(Path(csv_logger.log_dir) / "metrics.csv")
    assert_windows(tb_series, windows)
    assert_windows(csv_series, windows)
    assert logged_steps(csv_series) == logged_steps(csv_series, "loss") == [1, 3]


@pytest.mark.parametrize("lit", PACKAGES)
def test_without_a_logger_one_warning_and_callback_metrics_still_filled(lit: Lightning) -> None:
    batches = make_batches(4, seed=13)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer = fit(
            lit.RolloutModule(batches),
            [RolloutDebugCallback()],
            logger=False,
            log_every_n_steps=2,
            lit=lit,
        )

    messages = rollout_warnings(record)
    assert len(messages) == 1 and "no logger" in messages[0], messages
    assert_metrics_close(callback_values(trainer), expected_logged(window_reference(batches[2:])))


@pytest.mark.parametrize("lit", PACKAGES)
@pytest.mark.parametrize("setting", ["stopping_threshold", "divergence_threshold"])
def test_early_stopping_on_the_pearson_correlation(
    tmp_path: Path, setting: str, lit: Lightning
) -> None:
    correlated = setting == "stopping_threshold"
    batches = make_batches(4, seed=14, batch_size=4, width=8, independent=not correlated)
    stopper = lit.callbacks.EarlyStopping(monitor=CORR, mode="max", patience=100, **{setting: 0.9})
    trainer = fit(
        lit.RolloutModule(batches),
        [RolloutDebugCallback(), stopper],
        logger=tb_logger(tmp_path, lit=lit),
        log_every_n_steps=2,
        max_epochs=5,
        lit=lit,
    )

    corr = window_reference(batches[2:])[PEARSON]
    assert (corr > 0.9) if correlated else (corr < 0.9)
    assert trainer.should_stop
    assert stopper.stopped_epoch == 0
    assert trainer.global_step == 4  # one epoch of five
    assert float(trainer.callback_metrics[CORR]) == pytest.approx(corr, abs=1e-5)


def test_early_stopping_after_a_window_without_tokens(tmp_path: Path) -> None:
    # The epoch ends on a window without tokens: the correlation is undefined, so it is
    # absent from callback_metrics (never NaN, never the previous window's value).
    batches = [make_batch(seed=21, index=0), make_batch(seed=22, index=1, mask="zeros")]
    strict = PYTORCH_LIGHTNING.callbacks.EarlyStopping(
        monitor=CORR, mode="max", stopping_threshold=0.5
    )
    with pytest.raises(RuntimeError, match="not available"):
        fit(
            RolloutModule(batches),
            [RolloutDebugCallback(), strict],
            logger=tb_logger(tmp_path, 1),
            log_every_n_steps=1,
        )

    lenient = PYTORCH_LIGHTNING.callbacks.EarlyStopping(
        monitor=CORR, mode="max", stopping_threshold=0.5, strict=False
    )
    trainer = fit(
        RolloutModule(batches),
        [RolloutDebugCallback(), lenient],
        logger=tb_logger(tmp_path),
        log_every_n_steps=1,
        max_epochs=2,
    )
    assert trainer.global_step == 4 and not trainer.should_stop
    assert CORR not in trainer.callback_metrics and float(trainer.callback_metrics[VALID]) == 0


@pytest.mark.parametrize("lit", PACKAGES)
def test_model_checkpoint_monitors_a_rollout_metric(tmp_path: Path, lit: Lightning) -> None:
    batches = make_batches(4, seed=15)
    checkpoint = lit.callbacks.ModelCheckpoint(
        dirpath=tmp_path / "ckpt", monitor=CORR, mode="max", save_top_k=1
    )
    fit(
        lit.RolloutModule(batches),
        [RolloutDebugCallback(), checkpoint],
        logger=tb_logger(tmp_path, lit=lit),
        log_every_n_steps=2,
        max_epochs=2,
        enable_checkpointing=True,
        lit=lit,
    )

    assert checkpoint.best_model_path and Path(checkpoint.best_model_path).is_file()
    corr = window_reference(batches[2:])[PEARSON]  # both epochs end on this window
    assert float(checkpoint.best_model_score) == pytest.approx(corr, abs=1e-5)


# ---------------------------------------------------------------------- bad batches
def _bad_batches() -> tuple[list[dict[str, torch.Tensor]], list[int]]:
    batches = make_batches(8, seed=16)
    del batches[1]["old_log_probs"]  # missing key
    batches[2]["response_mask"] = batches[2]["response_mask"][:, :4]  # bad shape
    batches[4]["rollout_log_probs"] = torch.zeros(3, 5, dtype=torch.int64)  # wrong dtype
    del batches[6]["old_log_probs"]  # the same kind again: no second warning
    return batches, [1, 2, 4, 6]


def test_non_strict_skips_bad_batches_with_one_warning_per_kind(tmp_path: Path) -> None:
    batches, bad = _bad_batches()
    originals = clone_batches(batches)
    module = RolloutModule(batches)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer = fit(
            module, [RolloutDebugCallback()], logger=tb_logger(tmp_path), log_every_n_steps=2
        )

    assert trainer.global_step == 8 and module.seen == list(range(8))  # training went on
    messages = rollout_warnings(record)
    assert len(messages) == 3, messages
    missing, shape, dtype = messages
    assert "`old_log_probs`" in missing and "[batch, response_length]" in missing
    assert "`response_mask`" in shape and "(3, 4)" in shape and "(3, 5)" in shape
    assert "`rollout_log_probs`" in dtype and "int64" in dtype and "floating" in dtype
    assert all("skipped" in message for message in messages)

    series = read_scalars(tmp_path / "tb" / "version_0")
    good = [batch if i not in bad else None for i, batch in enumerate(batches)]
    windows = {
        step: [batch for batch in window if batch is not None]
        for step, window in split_windows(good, step_of_batches(8), [1, 3, 5, 7]).items()
    }
    assert_windows(series, windows)
    assert_batches_equal(batches, originals)


@pytest.mark.parametrize(
    ("bad_index", "fragment"),
    [(1, "old_log_probs"), (2, "response_mask"), (4, "rollout_log_probs")],
)
def test_strict_raises_on_a_bad_batch(tmp_path: Path, bad_index: int, fragment: str) -> None:
    batches, _ = _bad_batches()
    good = [b for i, b in enumerate(batches) if i not in (1, 2, 4, 6)]
    module = RolloutModule([*good[:1], batches[bad_index], *good[1:]])
    with pytest.raises(BatchError, match=fragment):
        fit(module, [RolloutDebugCallback(strict=True)], logger=tb_logger(tmp_path))
    assert module.seen == [0, bad_index]


# ---------------------------------------------------------------------- checkpoints
def test_state_dict_round_trip_and_config_mismatch_warning() -> None:
    source = RolloutDebugCallback()
    batch = make_batch(seed=20)
    source._update({}, batch)
    state = source.state_dict()
    assert state["window"].dtype == torch.float64 and state["window"].device.type == "cpu"

    same = RolloutDebugCallback()
    same.load_state_dict(state)
    other = RolloutDebugCallback(is_threshold=3.0)
    with pytest.warns(RolloutDebugWarning, match="checkpoint was written with"):
        other.load_state_dict(state)
    assert torch.equal(same.monitor._stats.state, state["window"])


# The package that writes the checkpoint, and the one that resumes from it.
RESUMES = [
    pytest.param(PYTORCH_LIGHTNING, PYTORCH_LIGHTNING, id="pytorch_lightning"),
    pytest.param(LIGHTNING, LIGHTNING, id="lightning", marks=NEEDS_LIGHTNING),
    pytest.param(
        PYTORCH_LIGHTNING, LIGHTNING, id="pytorch_lightning-then-lightning", marks=NEEDS_LIGHTNING
    ),
]


@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before")
@pytest.mark.parametrize(("lit", "then"), RESUMES)
@pytest.mark.parametrize("ckpt_step", [2, 4])
def test_resuming_mid_window_continues_the_window(
    tmp_path: Path, ckpt_step: int, lit: Lightning, then: Lightning
) -> None:
    batches = make_batches(6, seed=17)
    options = {"log_every_n_steps": 3, "enable_checkpointing": True}

    def checkpoint(name: str, lit: Lightning) -> Any:
        return lit.callbacks.ModelCheckpoint(
            dirpath=tmp_path / name, every_n_train_steps=2, save_top_k=-1
        )

    first = lit.RolloutModule(batches)
    fit(
        first,
        [RolloutDebugCallback(), checkpoint("ckpt", lit)],
        logger=tb_logger(tmp_path, 0, lit),
        lit=lit,
        **options,
    )
    uninterrupted = read_scalars(tmp_path / "tb" / "version_0")
    assert_windows(uninterrupted, split_windows(batches, step_of_batches(6), [2, 5]))

    # Saved after optimizer step `ckpt_step`: the window holds the batches since the last
    # logged step (2 at step 2: batches 0, 1; 4 at step 4: batch 3), not logged yet.
    restored = [batch for i, batch in enumerate(batches[:ckpt_step]) if ckpt_step == 2 or i > 2]
    ckpt = tmp_path / "ckpt" / f"epoch=0-step={ckpt_step}.ckpt"
    saved = torch.load(ckpt, weights_only=False)["callbacks"]
    (state,) = [v for k, v in saved.items() if k.startswith("RolloutDebugCallback")]
    assert state["batches_in_window"] == len(restored)

    resumed = then.RolloutModule(batches)
    fit(
        resumed,
        [RolloutDebugCallback(), checkpoint("ckpt", then)],
        logger=tb_logger(tmp_path, 1, then),
        ckpt_path=str(ckpt),
        lit=then,
        **options,
    )
    series = read_scalars(tmp_path / "tb" / "version_1")
    # Whatever the DataLoader replays after the restart (this one is not resumable, so
    # Lightning starts it over and stops after the remaining count), each window holds
    # the restored batches once plus the batches trained on after the restart.
    after = [batches[i] for i in resumed.seen]
    assert len(after) == 6 - ckpt_step
    steps = [ckpt_step - 1] * len(restored) + [ckpt_step + k for k in range(len(after))]
    expected_steps = [2, 5] if ckpt_step == 2 else [5]
    assert_windows(series, split_windows(restored + after, steps, expected_steps))
    assert logged_steps(series) == logged_steps(series, "loss") == expected_steps
    if resumed.seen == list(range(ckpt_step, 6)):  # a resumable loader: same as uninterrupted
        for step in expected_steps:
            assert catalog_at(series, step) == catalog_at(uninterrupted, step)
