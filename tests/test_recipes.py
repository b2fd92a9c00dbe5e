"""The recipes of the documentation, run in a real Trainer.

- the ``ModelCheckpoint`` block of ``docs/usage.md`` (marked ``<!-- test: modelcheckpoint
  -->``) writes its checkpoints straight into ``dirpath``, named after a ``training/...``
  metric; Lightning's default ``auto_insert_metric_name=True`` would make a ``training/``
  subfolder instead, which is why the recipe turns it off.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
from lightning_helpers import TRAINER_DEFAULTS, RolloutModule, make_batches
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger

from lightning_rollout_debug import RolloutDebugCallback

ROOT = Path(__file__).resolve().parents[1]
MARKED_BLOCK = re.compile(
    r"<!-- test: (?P<kind>[\w-]+) -->\s*\n```(?P<lang>\w+)\n(?P<code>.*?)\n```", re.DOTALL
)
MONITOR = "training/rollout_actor_kl_k3"
LOG_EVERY = 4


def documented_checkpoint() -> ModelCheckpoint:
    """The ``checkpoint`` the block of ``docs/usage.md`` builds (paths relative to the cwd)."""
    text = (ROOT / "docs" / "usage.md").read_text(encoding="utf-8")
    (code,) = [m["code"] for m in MARKED_BLOCK.finditer(text) if m["kind"] == "modelcheckpoint"]
    namespace: dict[str, Any] = {"__name__": "docs"}
    exec(compile(code, "docs/usage.md (ModelCheckpoint recipe)", "exec"), namespace)
    return namespace["checkpoint"]


def fit(
    checkpoint: ModelCheckpoint, log_dir: Path, callback: RolloutDebugCallback | None = None
) -> pl.Trainer:
    trainer = pl.Trainer(
        **{**TRAINER_DEFAULTS, "enable_checkpointing": True},
        max_steps=8,
        log_every_n_steps=LOG_EVERY,
        logger=CSVLogger(log_dir),
        callbacks=[callback or RolloutDebugCallback(), checkpoint],
    )
    trainer.fit(RolloutModule(make_batches(8, seed=3, noise=0.005)))
    return trainer


def test_the_modelcheckpoint_recipe_saves_into_dirpath(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    checkpoint = documented_checkpoint()
    assert checkpoint.monitor == MONITOR and not checkpoint.auto_insert_metric_name
    trainer = fit(checkpoint, tmp_path / "logs")

    dirpath = Path(checkpoint.dirpath)
    assert dirpath.is_relative_to(tmp_path)
    assert [p for p in dirpath.rglob("*") if p.is_dir()] == [], "a subfolder was made"
    saved = sorted(p.name for p in dirpath.iterdir())
    pattern = re.compile(r"step=(\d+)-kl_k3=(\d\.\d{2}e[+-]\d{2})\.ckpt")
    assert saved and all(pattern.fullmatch(name) for name in saved), saved
    steps = sorted(int(pattern.fullmatch(name)[1]) for name in saved)
    assert steps == [4, 8]  # the two logged windows (save_top_k=2 keeps both)
    # The file name carries the value the callback published for the window.
    best = Path(checkpoint.best_model_path)
    assert best.parent == dirpath and best.name in saved
    value = float(pattern.fullmatch(best.name)[2])
    assert value == pytest.approx(float(checkpoint.best_model_score), rel=0.01)
    assert float(trainer.callback_metrics[MONITOR]) > 0


def test_the_default_metric_name_insertion_makes_a_subfolder(tmp_path: Path) -> None:
    """What the recipe avoids: ``training/rollout_actor_kl_k3=...`` is a path."""
    dirpath = tmp_path / "checkpoints"
    checkpoint = ModelCheckpoint(
        dirpath=dirpath,
        monitor=MONITOR,
        every_n_train_steps=LOG_EVERY,
        filename="{step}-{training/rollout_actor_kl_k3:.2e}",
    )
    fit(checkpoint, tmp_path / "logs")
    best = Path(checkpoint.best_model_path)
    assert best.parent.parent == dirpath and best.parent.name.endswith("-training"), best
    assert best.name.startswith("rollout_actor_kl_k3=")


def test_a_prefix_without_a_slash_needs_no_recipe(tmp_path: Path) -> None:
    dirpath = tmp_path / "checkpoints"
    checkpoint = ModelCheckpoint(
        dirpath=dirpath,
        monitor="rollout.rollout_actor_kl_k3",
        every_n_train_steps=LOG_EVERY,
        filename="{step}-{rollout.rollout_actor_kl_k3:.2e}",
    )
    fit(checkpoint, tmp_path / "logs", RolloutDebugCallback(prefix="rollout."))
    best = Path(checkpoint.best_model_path)
    assert best.parent == dirpath, best
    assert re.fullmatch(
        r"step=\d+-rollout\.rollout_actor_kl_k3=\d\.\d{2}e[+-]\d{2}\.ckpt", best.name
    )
