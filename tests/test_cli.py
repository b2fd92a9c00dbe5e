"""RolloutDebugCallback configured through LightningCLI (YAML and command line)."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from lightning_helpers import PACKAGES, Lightning, read_scalars, split_windows
from reference import NAMES, assert_metrics_close, reference_metrics

from lightning_rollout_debug import RolloutDebugCallback

pytest.importorskip("jsonargparse")

pytestmark = [
    pytest.mark.filterwarnings("ignore:The '.*dataloader' does not have many workers"),
    pytest.mark.filterwarnings("ignore:The number of training batches .* is smaller than"),
    pytest.mark.filterwarnings("ignore:`isinstance.treespec, LeafSpec.` is deprecated"),
    # Lightning's own use of jsonargparse APIs deprecated in jsonargparse 4.49.
    pytest.mark.filterwarnings("ignore::DeprecationWarning:pytorch_lightning.cli"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:lightning.pytorch.cli"),
    pytest.mark.filterwarnings("ignore:RolloutDebugCallback at step .* is outside"),
]


@pytest.fixture(autouse=True)
def _no_pytest_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    # LightningCLI warns when both `args` and pytest's own command line are present.
    monkeypatch.setattr(sys, "argv", ["lightning-cli"])


CALLBACK_ARGS: dict[str, Any] = {
    "rollout_log_probs_key": "rollout_log_probs",
    "old_log_probs_key": "old_log_probs",
    "response_mask_key": "response_mask",
    "prefix": "rl/",
    "log_every_n_steps": 2,
    "strict": True,
    "is_threshold": 1.5,
    "seq_ratio_bounds": [0.95, 1.05],
    "token_ids_keys": ["rollout_token_ids", "trainer_token_ids"],
    "groups": ["seed", "kl", "token_ids", "health"],
}


def write_config(tmp_path: Path, callback_args: dict[str, Any], lit: Lightning) -> Path:
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "max_epochs": 1,
            "log_every_n_steps": 50,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "enable_checkpointing": False,
            "default_root_dir": str(tmp_path),
            "logger": {
                "class_path": f"{lit.pytorch.__name__}.loggers.TensorBoardLogger",
                "init_args": {"save_dir": str(tmp_path), "name": "tb", "version": 0},
            },
            "callbacks": [
                {
                    "class_path": "lightning_rollout_debug.RolloutDebugCallback",
                    "init_args": callback_args,
                }
            ],
        },
        "model": {"learning_rate": 0.05},
        "data": {"n_batches": 4, "batch_size": 3, "width": 5, "seed": 3, "token_ids": True},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def make_cli(lit: Lightning, args: list[str], run: bool = True) -> Any:
    """The ``LightningCLI`` of ``lit``'s package, with the test model and data."""
    return lit.LightningCLI(
        lit.TinyModel,
        lit.RolloutDataModule,
        args=args,
        run=run,
        save_config_kwargs={"overwrite": True},
    )


def the_callback(cli: Any) -> RolloutDebugCallback:
    (callback,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, RolloutDebugCallback)]
    return callback


def assert_logged_like_the_reference(log_dir: Path, datamodule: Any) -> None:
    series = read_scalars(log_dir)
    batches = datamodule.batches
    windows = split_windows(batches, [0, 1, 2, 3], [1, 3])
    assert sorted(series["rl/rollout_probs_diff_valid"]) == [1, 3]
    groups = ("seed", "kl", "health", "token_ids")
    for step, window in windows.items():
        want = reference_metrics(
            [b["rollout_log_probs"] for b in window],
            [b["old_log_probs"] for b in window],
            [b["response_mask"] for b in window],
            is_threshold=1.5,
            seq_ratio_bounds=(0.95, 1.05),
            rollout_ids=[b["rollout_token_ids"] for b in window],
            trainer_ids=[b["trainer_token_ids"] for b in window],
        )
        want = want.select([n for g in groups for n in NAMES[g] if not math.isnan(want[n])])
        got = {
            name[3:]: values[step]
            for name, values in series.items()
            if name.startswith("rl/") and step in values
        }
        assert_metrics_close(got, want)


@pytest.mark.parametrize("lit", PACKAGES)
def test_the_help_lists_the_package_s_callback_alone(
    lit: Lightning, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--help`` names the known subclasses of ``Callback``: of this package only the
    public callback, not the base it derives from."""
    with pytest.raises(SystemExit):
        make_cli(lit, ["fit", "--help"], run=True)
    known = capsys.readouterr().out
    listed = set(re.findall(r"lightning_rollout_debug[\w.]*", known))
    assert listed and all(name.endswith("RolloutDebugCallback") for name in listed), listed


@pytest.mark.parametrize("lit", PACKAGES)
def test_callback_from_yaml_gets_every_init_arg(tmp_path: Path, lit: Lightning) -> None:
    config = write_config(tmp_path, CALLBACK_ARGS, lit)
    cli = make_cli(lit, ["--config", str(config)], run=False)
    assert isinstance(cli.trainer, lit.Trainer)
    assert isinstance(cli.trainer.logger, lit.loggers.TensorBoardLogger)

    callback = the_callback(cli)
    assert callback.config.rollout_log_probs_key == "rollout_log_probs"
    assert callback.config.old_log_probs_key == "old_log_probs"
    assert callback.config.response_mask_key == "response_mask"
    assert callback.config.prefix == "rl/"
    assert callback.log_every_n_steps == 2
    assert callback.config.strict is True
    assert callback.config.token_ids_keys == ("rollout_token_ids", "trainer_token_ids")
    assert callback.config.groups == ("seed", "kl", "health", "token_ids")
    assert callback.monitor._stats.is_threshold == 1.5
    assert tuple(callback.monitor._stats.seq_ratio_bounds) == (0.95, 1.05)
    assert callback.process_group is None

    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert_logged_like_the_reference(tmp_path / "tb" / "version_0", cli.datamodule)
    assert "rl/rollout_probs_diff_mean" in cli.trainer.callback_metrics


@pytest.mark.parametrize("lit", PACKAGES)
def test_fit_subcommand_runs_with_the_yaml_callback(tmp_path: Path, lit: Lightning) -> None:
    config = write_config(tmp_path, CALLBACK_ARGS, lit)
    cli = make_cli(lit, ["fit", "--config", str(config)])

    assert cli.trainer.global_step == 4
    assert_logged_like_the_reference(tmp_path / "tb" / "version_0", cli.datamodule)


@pytest.mark.parametrize("lit", PACKAGES)
def test_callback_from_the_command_line(tmp_path: Path, lit: Lightning) -> None:
    config = write_config(tmp_path, {"prefix": "unused/"}, lit)
    args = [
        "--config",
        str(config),
        "--trainer.callbacks=lightning_rollout_debug.RolloutDebugCallback",
        "--trainer.callbacks.prefix=cmd/",
        "--trainer.callbacks.seq_ratio_bounds=[0.9, 1.1]",
        "--trainer.callbacks.groups=[seed]",
    ]
    cli = make_cli(lit, args, run=False)
    callback = the_callback(cli)
    assert callback.config.prefix == "cmd/"
    assert callback.config.groups == ("seed",)
    assert tuple(callback.monitor._stats.seq_ratio_bounds) == (0.9, 1.1)


@pytest.mark.parametrize("lit", PACKAGES)
def test_invalid_init_args_in_yaml_are_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], lit: Lightning
) -> None:
    config = write_config(tmp_path, {"groups": ["seed", "bogus"], "is_threshold": 0.5}, lit)
    # jsonargparse raises the ValueError under pytest and exits with it printed otherwise.
    with pytest.raises((ValueError, SystemExit)) as info:
        make_cli(lit, ["--config", str(config)], run=False)
    error = str(info.value) + capsys.readouterr().err
    # jsonargparse shows the callback's own message: both problems, and the valid groups.
    assert "`is_threshold` must be a finite number greater than 1, got 0.5" in error
    assert "Unknown metric groups ['bogus']; valid groups are ['seed', 'log_space'" in error
