"""Exact metrics across ranks: two CPU processes (``ddp_spawn``, gloo) and simulated ranks.

Every Trainer run here spawns two processes. The ranks see batches of different sizes
and widths (the dataset interleaves the batches of rank 0 and rank 1, and a
``DistributedSampler`` deals them out in order), some windows are empty on one rank or on
both, and what rank 0 writes to TensorBoard must equal the float64 reference over the
tokens of *both* ranks in each window. Spawned processes report back through files in
``tmp_path`` written by :class:`Recorder`; everything they unpickle is defined at module
level.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import json
import math
import random
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from lightning_helpers import (
    ListDataset,
    ReleaseProcessGroups,
    RolloutModule,
    make_batch,
    read_scalars,
)
from pytorch_lightning.callbacks import Callback, EarlyStopping, ModelCheckpoint
from pytorch_lightning.loggers import TensorBoardLogger
from pytorch_lightning.strategies import DDPStrategy
from reference import Reference, assert_metrics_close, reference_metrics
from torch.utils.data import DataLoader, DistributedSampler

import lightning_rollout_debug
from lightning_rollout_debug import METRIC_NAMES, MismatchStats, RolloutDebugCallback
from lightning_rollout_debug.loop.agreement import WIDTH, encoded, shaping_settings
from lightning_rollout_debug.loop.config import InvalidSettings
from lightning_rollout_debug.loop.ranks import Ranks
from lightning_rollout_debug.metrics.layout import STATE_SIZE, identity_state, merge_states

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with the gloo backend",
)

PREFIX = "training/"
WORLD = 2
GROUPS = ("seed", "log_space", "kl", "importance_ratio", "sequence", "health")
NAMES = tuple(name for group in GROUPS for name in METRIC_NAMES[group])
ALL_NAMES = tuple(name for names in METRIC_NAMES.values() for name in names)
PACKAGE_DIR = str(Path(lightning_rollout_debug.__file__).resolve().parent) + "/"
COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "monitored_barrier",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "send",
    "recv",
    "isend",
    "irecv",
)
"""The ``torch.distributed`` functions counted while the callback runs."""

Batch = dict[str, torch.Tensor]


# ---------------------------------------------------------------------- data
def rank_batch(rows: int, width: int, seed: int, *, mask: str = "random", **kwargs: Any) -> Batch:
    """A batch of the shared helpers; ``index`` (the seed) names it, unless it has no rows."""
    batch = make_batch(rows, width, seed=seed, index=seed, mask=mask, **kwargs)
    if rows == 0:
        del batch["index"]
    return batch


def with_nonfinite(batch: Batch, count: int, seed: int) -> Batch:
    """Put NaN, +inf and -inf into ``count`` masked positions (and NaN into an unmasked one)."""
    batch = dict(batch)
    rng = random.Random(seed)
    rollout = batch["rollout_log_probs"].clone()
    old = batch["old_log_probs"].clone()
    masked = batch["response_mask"].nonzero().tolist()
    specials = (math.nan, math.inf, -math.inf)
    for i, (row, col) in enumerate(rng.sample(masked, min(count, len(masked)))):
        target = rollout if i % 2 else old
        target[row, col] = specials[i % 3]
    unmasked = (batch["response_mask"] == 0).nonzero().tolist()
    if unmasked:
        row, col = unmasked[0]
        rollout[row, col] = math.nan
    batch["rollout_log_probs"], batch["old_log_probs"] = rollout, old
    return batch


def interleave(per_rank: Sequence[Sequence[Any]]) -> list[Any]:
    """One list whose item ``i`` is batch ``i // WORLD`` of rank ``i % WORLD``.

    :class:`RankModule` loads it through ``DistributedSampler(shuffle=False)``, which gives
    rank ``r`` the items ``r, r + WORLD, ...``: each rank sees its own batches in order.
    """
    assert len({len(batches) for batches in per_rank}) == 1, "every rank needs as many batches"
    return [batch for step in zip(*per_rank, strict=True) for batch in step]


def reference(batches: Sequence[Batch], names: Sequence[str] = NAMES) -> Reference:
    """The float64 reference over the concatenation of ``batches`` (``names`` only)."""
    return reference_metrics(
        [b["rollout_log_probs"] for b in batches],
        [b["old_log_probs"] for b in batches],
        [b["response_mask"] for b in batches],
    ).select(names)


def logged_at(scalars: Mapping[str, Mapping[int, float]], step: int, prefix: str) -> dict:
    """Every metric name at ``step``, NaN where the callback left it out."""
    return {
        prefix + name: float(scalars.get(prefix + name, {}).get(step, math.nan)) for name in NAMES
    }


def complete(metrics: Mapping[str, float], prefix: str) -> dict[str, float]:
    """``callback_metrics`` of our names, NaN where left out."""
    return {prefix + name: float(metrics.get(prefix + name, math.nan)) for name in NAMES}


# ---------------------------------------------------------------------- spawned side
class RankModule(RolloutModule):
    """The shared tiny model; ``epochs`` (optional) gives each epoch its own batch list."""

    def __init__(self, batches: Sequence[Batch], epochs: Sequence[Sequence[Batch]] = ()) -> None:
        super().__init__(batches, log_loss=False)
        self.epochs = [list(epoch) for epoch in epochs]

    def train_dataloader(self) -> DataLoader:
        if self.epochs:
            self.batches = self.epochs[self.current_epoch]
        dataset = ListDataset(self.batches)
        # Lightning's own sampler would shuffle the training items; this one deals them in order.
        sampler = DistributedSampler(
            dataset, num_replicas=self.trainer.world_size, rank=self.global_rank, shuffle=False
        )
        return DataLoader(dataset, batch_size=None, sampler=sampler)

    def _loss(self, data: Mapping[str, Any]) -> torch.Tensor:
        # A sum, so that a batch without rows gives a zero (not NaN) loss.
        return self.layer(data["x"].float()).pow(2).sum() / max(1, data["x"].shape[0])


_WORKER: dict[str, Any] = {"label": None, "collectives": [], "strategy_calls": []}
"""Per-process record of the spawned side (each spawned process has its own copy)."""


def _from_package() -> bool:
    """Whether the current call stack passes through the package under test."""
    frame = sys._getframe(2)
    while frame is not None:
        if PACKAGE_DIR in frame.f_code.co_filename.replace("\\", "/"):
            return True
        frame = frame.f_back
    return False


def _counted(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _from_package():
            _WORKER["collectives"].append([_WORKER["label"], name])
        return function(*args, **kwargs)

    wrapper.__wrapped_collective__ = function  # type: ignore[attr-defined]
    return wrapper


def _install_collective_counters() -> None:
    for name in COLLECTIVES:
        function = getattr(torch.distributed, name, None)
        if function is not None and not hasattr(function, "__wrapped_collective__"):
            setattr(torch.distributed, name, _counted(name, function))


class CountingDDPStrategy(DDPStrategy):
    """``ddp_spawn`` that records which of its collectives the package calls."""

    def _note(self, name: str) -> None:
        if _from_package():
            _WORKER["strategy_calls"].append([_WORKER["label"], name])

    def all_gather(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self._note("all_gather")
        return super().all_gather(tensor, *args, **kwargs)

    def reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        self._note("reduce")
        return super().reduce(tensor, *args, **kwargs)

    def broadcast(self, obj: Any, *args: Any, **kwargs: Any) -> Any:
        self._note("broadcast")
        return super().broadcast(obj, *args, **kwargs)

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self._note("barrier")
        return super().barrier(*args, **kwargs)


class Recorder(Callback):
    """Writes what one rank saw to ``out_dir / f"rank{rank}.json"`` at the end of fit.

    Put it after the :class:`RolloutDebugCallback`\\ s so its batch-end snapshot of
    ``callback_metrics`` is taken after theirs. Collectives the package calls are
    labelled with the batch (``"epoch:batch"``) or ``"end"`` (after the last batch).
    """

    def __init__(self, out_dir: str, prefixes: Sequence[str] = (PREFIX,)) -> None:
        self.out_dir = out_dir
        self.prefixes = tuple(prefixes)
        self.snapshots: dict[str, dict[str, float]] = {}

    def _metrics(self, trainer: pl.Trainer) -> dict[str, float]:
        return {
            name: float(value)
            for name, value in trainer.callback_metrics.items()
            if name.startswith(self.prefixes)
        }

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        _install_collective_counters()
        _WORKER["label"] = "setup"

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        _WORKER["label"] = f"{trainer.current_epoch}:{batch_idx}"

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self.snapshots[f"{trainer.current_epoch}:{batch_idx}"] = self._metrics(trainer)
        _WORKER["label"] = "end"

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        early = [cb for cb in trainer.callbacks if isinstance(cb, EarlyStopping)]
        record = {
            "rank": trainer.global_rank,
            "seen": list(getattr(pl_module, "seen", [])),
            "snapshots": self.snapshots,
            "final": self._metrics(trainer),
            "collectives": _WORKER["collectives"],
            "strategy_calls": _WORKER["strategy_calls"],
            "global_step": trainer.global_step,
            "current_epoch": trainer.current_epoch,
            "early_stopping": [
                {
                    "best_score": float(cb.best_score),
                    "wait_count": cb.wait_count,
                    "stopped_epoch": cb.stopped_epoch,
                }
                for cb in early
            ],
        }
        path = Path(self.out_dir) / f"rank{trainer.global_rank}.json"
        path.write_text(json.dumps(record))


def fit(
    tmp_path: Path,
    module: pl.LightningModule,
    callbacks: Sequence[Callback],
    *,
    strategy: Any = "ddp_spawn",
    ckpt_path: str | None = None,
    **trainer_kwargs: Any,
) -> tuple[dict[str, dict[int, float]], list[dict[str, Any]]]:
    """Fit on two CPU processes; return rank 0's TensorBoard scalars and each rank's record."""
    out_dir = tmp_path / "records"
    out_dir.mkdir(parents=True)
    prefixes = [cb.config.prefix for cb in callbacks if isinstance(cb, RolloutDebugCallback)]
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": WORLD,
        "strategy": strategy,
        "logger": TensorBoardLogger(str(tmp_path), name="tb", version=0),
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "num_sanity_val_steps": 0,
        **trainer_kwargs,
    }
    trainer = pl.Trainer(
        callbacks=[*callbacks, Recorder(str(out_dir), prefixes), ReleaseProcessGroups()],
        **options,
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    records = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert [record["rank"] for record in records] == list(range(WORLD))
    return read_scalars(tmp_path / "tb" / "version_0"), records


# ---------------------------------------------------------------------- the main run
# Windows of two batches (log_every_n_steps=2) and a last one-batch window logged at the
# end of training. (rows, width, mask) per batch; "nf" adds non-finite masked tokens.
SCHEDULE: dict[int, list[list[tuple[int, int, str]]]] = {
    # both ranks hold tokens, in batches of different shapes
    0: [[(3, 7, "random"), (2, 5, "random")], [(4, 11, "random"), (1, 3, "ones")]],
    # rank 1 is empty for the whole window, rank 0 for one of its batches
    1: [[(4, 6, "zeros"), (1, 9, "random")], [(2, 4, "zeros"), (3, 5, "zeros")]],
    # both ranks are empty (rank 0 even has a batch without rows)
    2: [[(2, 4, "zeros"), (0, 5, "random")], [(3, 3, "zeros"), (1, 2, "zeros")]],
    # rank 0 is empty; rank 1 holds tokens, some of them non-finite
    3: [[(2, 8, "zeros"), (1, 3, "zeros")], [(6, 10, "random"), (2, 12, "nf")]],
    # one counting token over both ranks: std and Pearson undefined, left out
    4: [[(1, 4, "single"), (1, 1, "zeros")], [(2, 3, "zeros"), (2, 3, "nf-only")]],
    # the window that on_train_end logs
    5: [[(2, 2, "random")], [(3, 6, "random")]],
}


def build_batch(rows: int, width: int, kind: str, seed: int) -> Batch:
    if kind == "nf":
        return with_nonfinite(rank_batch(rows, width, seed), 4, seed)
    if kind == "nf-only":  # every masked token non-finite: nothing counts
        batch = rank_batch(rows, width, seed, mask="ones")
        batch["old_log_probs"] = torch.full_like(batch["old_log_probs"], math.nan)
        return batch
    if kind == "single":
        mask = torch.zeros(rows, width, dtype=torch.int64)
        mask[0, width // 2] = 1
        return rank_batch(rows, width, seed, mask=mask)
    return rank_batch(rows, width, seed, mask=kind)


def main_batches() -> list[list[Batch]]:
    """``[rank][batch]``: the batches of each rank in order."""
    per_rank: list[list[Batch]] = [[] for _ in range(WORLD)]
    for window, ranks in SCHEDULE.items():
        for rank, shapes in enumerate(ranks):
            for i, (rows, width, kind) in enumerate(shapes):
                seed = 1000 * window + 100 * rank + i
                per_rank[rank].append(build_batch(rows, width, kind, seed))
    # One rank-1 batch in float64, the rest float32: the dtype may differ between ranks.
    per_rank[1][1] = {
        key: value.double() if value.is_floating_point() and key != "x" else value
        for key, value in per_rank[1][1].items()
    }
    return per_rank


def main_windows(per_rank: Sequence[Sequence[Batch]]) -> list[list[list[Batch]]]:
    """``[window][rank]``: the batches of each rank in each window."""
    windows = []
    start = 0
    for ranks in SCHEDULE.values():
        size = len(ranks[0])
        windows.append([list(batches[start : start + size]) for batches in per_rank])
        start += size
    return windows


@pytest.fixture(scope="module")
def main_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp_path = tmp_path_factory.mktemp("main")
    per_rank = main_batches()
    scalars, records = fit(
        tmp_path,
        RankModule(interleave(per_rank)),
        [RolloutDebugCallback(log_every_n_steps=2)],
        strategy=CountingDDPStrategy(start_method="spawn"),
        max_epochs=1,
    )
    return {"per_rank": per_rank, "scalars": scalars, "records": records}


def test_the_ranks_see_batches_of_different_shapes(main_run: dict[str, Any]) -> None:
    shapes = [
        [tuple(b["response_mask"].shape) for b in batches] for batches in main_run["per_rank"]
    ]
    assert all(left != right for left, right in zip(*shapes, strict=True))
    # Each rank trained on exactly its own batches, in order (the model records their index).
    for record, batches in zip(main_run["records"], main_run["per_rank"], strict=True):
        assert record["seen"] == [int(b["index"][0]) for b in batches if "index" in b]


def test_logged_values_equal_the_reference_over_both_ranks(main_run: dict[str, Any]) -> None:
    scalars = main_run["scalars"]
    windows = main_windows(main_run["per_rank"])
    steps = sorted(scalars[PREFIX + "rollout_tokens"])
    assert len(steps) == len(windows), steps
    assert steps[:-1] == [1, 3, 5, 7, 9], steps  # every second batch; the rest at the end
    for step, ranks in zip(steps, windows, strict=True):
        want = reference([batch for batches in ranks for batch in batches])
        got = logged_at(scalars, step, PREFIX)
        assert_metrics_close(got, want, prefix=PREFIX)
    # The windows cover what the schedule promises.
    tokens = [scalars[PREFIX + "rollout_tokens"][step] for step in steps]
    assert tokens[2] == 0 and tokens[4] == 1 and all(t > 1 for t in tokens[:2] + tokens[3:4])
    assert scalars[PREFIX + "rollout_probs_diff_valid"][steps[2]] == 0.0
    assert steps[2] not in scalars[PREFIX + "rollout_probs_diff_mean"]
    assert steps[4] not in scalars[PREFIX + "rollout_probs_diff_std"]
    assert scalars[PREFIX + "rollout_nonfinite_tokens"][steps[3]] > 0
    # A rank-local value would differ: rank 1 alone in window 0 is not what was logged.
    local = reference(windows[0][1])
    merged = scalars[PREFIX + "rollout_tokens"][steps[0]]
    assert merged != local["rollout_tokens"]


def test_callback_metrics_are_the_same_on_every_rank(main_run: dict[str, Any]) -> None:
    records = main_run["records"]
    windows = main_windows(main_run["per_rank"])
    first, second = records
    assert first["snapshots"] == second["snapshots"]  # bit for bit, at every batch
    assert first["final"] == second["final"]
    # And they are the reference values (float64, not rounded like TensorBoard's).
    logged_batches = ["0:1", "0:3", "0:5", "0:7", "0:9"]
    finals = [first["snapshots"][key] for key in logged_batches] + [first["final"]]
    for metrics, ranks in zip(finals, windows, strict=True):
        want = reference([batch for batches in ranks for batch in batches])
        assert_metrics_close(complete(metrics, PREFIX), want, prefix=PREFIX)


def test_one_collective_per_logged_step_and_none_otherwise(main_run: dict[str, Any]) -> None:
    """One per logged step, and one more before the first merge: the ranks' settings."""
    logged = ["0:1", "0:1", "0:3", "0:5", "0:7", "0:9", "end"]
    for record in main_run["records"]:
        for calls in (record["collectives"], record["strategy_calls"]):
            labels = [label for label, _ in calls]
            assert sorted(labels) == sorted(logged), calls
        assert {name for _, name in record["strategy_calls"]} == {"all_gather"}
        assert {name for _, name in record["collectives"]} == {"all_gather"}


# ---------------------------------------------------------------------- early stopping
# Per epoch, two batches per rank; the monitored value is the window of the epoch's last
# batch. Rank 0 holds 16x the tokens of rank 1 and improves every epoch; rank 1 gets worse
# from epoch 1 on and explodes in epoch 3, which makes the merged value worse there.
ES_NOISE = ([0.4, 0.3, 0.2, 0.19, 0.18], [0.05, 0.2, 0.25, 2.0, 2.0])
ES_MONITOR = PREFIX + "rollout_actor_kl_k3"


def es_batches() -> list[list[list[Batch]]]:
    """``[epoch][rank][batch]``."""
    shapes = ((8, 16), (1, 8))
    return [
        [
            [
                rank_batch(
                    *shapes[rank],
                    10_000 * epoch + 100 * rank + i,
                    mask="ones",
                    noise=ES_NOISE[rank][epoch],
                )
                for i in range(2)
            ]
            for rank in range(WORLD)
        ]
        for epoch in range(len(ES_NOISE[0]))
    ]


def stop_epoch(values: Sequence[float], patience: int = 1) -> int | None:
    """The epoch EarlyStopping(mode="min", patience) stops after, for these epoch values."""
    best, wait = math.inf, 0
    for epoch, value in enumerate(values):
        if value < best:
            best, wait = value, 0
        else:
            wait += 1
            if wait >= patience:
                return epoch
    return None


def test_early_stopping_decides_on_the_merged_value_on_every_rank(tmp_path: Path) -> None:
    epochs = es_batches()
    merged = [reference([e[0][-1], e[1][-1]])["rollout_actor_kl_k3"] for e in epochs]
    rank1_alone = [reference([e[1][-1]])["rollout_actor_kl_k3"] for e in epochs]
    # The data is built so that the merged values stop after epoch 3 and rank 1's alone
    # would stop after epoch 1 (and EarlyStopping stops every rank when any rank says so).
    assert stop_epoch(merged) == 3 and stop_epoch(rank1_alone) == 1

    _, records = fit(
        tmp_path,
        RankModule([], epochs=[interleave(epoch) for epoch in epochs]),
        [
            RolloutDebugCallback(log_every_n_steps=1),
            EarlyStopping(ES_MONITOR, mode="min", patience=1, check_on_train_epoch_end=True),
        ],
        max_epochs=len(epochs),
        reload_dataloaders_every_n_epochs=1,
    )
    for record in records:
        (early,) = record["early_stopping"]
        assert early["stopped_epoch"] == 3 and early["wait_count"] == 1
        assert record["global_step"] == 4 * 2  # four epochs of two steps, not five
        assert early["best_score"] == pytest.approx(merged[2], rel=1e-5)
    assert records[0]["early_stopping"] == records[1]["early_stopping"]
    assert records[0]["snapshots"] == records[1]["snapshots"]


# ---------------------------------------------------------------------- groups, checkpoints
# One run that stops at the end of its first epoch with a checkpoint, and one that resumes
# from it. Three callbacks watch the same batches:
# - "all/" reduces over the world; the ranks hold different tokens.
# - "tp/" reads keys that hold the same tokens on both ranks, as under tensor parallelism,
#   and reduces over each rank's data-parallel group (the rank itself); reducing over the
#   world would count every token twice.
# - "first/" reduces over a group of rank 0 alone; rank 1 is outside it.
TP_KEYS = {
    "rollout_log_probs_key": "tp_rollout",
    "old_log_probs_key": "tp_old",
    "response_mask_key": "tp_mask",
}


def first_rank_group(trainer: pl.Trainer) -> Any:
    """A process group holding rank 0 alone (every rank takes part in creating it)."""
    return torch.distributed.new_group(ranks=[0])


def own_rank_group(trainer: pl.Trainer) -> Any:
    """This rank's data-parallel group when tensor parallelism spans all ranks: itself."""
    group, _ = torch.distributed.new_subgroups_by_enumeration(
        [[rank] for rank in range(trainer.world_size)]
    )
    return group


def group_batches(start: int, count: int) -> list[list[Batch]]:
    """``[rank][batch]``; ``tp_*`` hold the same tensors on both ranks."""
    per_rank = []
    for rank in range(WORLD):
        batches = []
        for i in range(start, start + count):
            batch = rank_batch(2 + rank + i % 3, 3 + 2 * rank + i % 4, 100 * rank + i)
            shared = rank_batch(2 + i % 2, 4 + i % 3, 5000 + i)
            batch["tp_rollout"] = shared["rollout_log_probs"]
            batch["tp_old"] = shared["old_log_probs"]
            batch["tp_mask"] = shared["response_mask"]
            batches.append(batch)
        per_rank.append(batches)
    return per_rank


def tp_view(batches: Sequence[Batch]) -> list[Batch]:
    return [
        {
            "rollout_log_probs": b["tp_rollout"],
            "old_log_probs": b["tp_old"],
            "response_mask": b["tp_mask"],
        }
        for b in batches
    ]


def group_callbacks() -> list[Callback]:
    return [
        RolloutDebugCallback(prefix="all/", log_every_n_steps=4),
        RolloutDebugCallback(
            prefix="tp/", log_every_n_steps=4, process_group=own_rank_group, **TP_KEYS
        ),
        RolloutDebugCallback(prefix="first/", log_every_n_steps=4, process_group=first_rank_group),
    ]


@pytest.fixture(scope="module")
def group_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp_path = tmp_path_factory.mktemp("groups")
    before, after = group_batches(0, 3), group_batches(3, 3)
    # One epoch of three batches: the callbacks (every fourth step) log nothing during it,
    # the checkpoint at its end holds a window of three batches, and on_train_end logs it.
    checkpoint = ModelCheckpoint(
        dirpath=str(tmp_path / "ckpt"), filename="last", save_on_train_epoch_end=True
    )
    first = fit(
        tmp_path / "first",
        RankModule(interleave(before)),
        [*group_callbacks(), checkpoint],
        max_epochs=1,
        enable_checkpointing=True,
    )
    # Resume for a second epoch: its first batch is step 4, which closes the window.
    second = fit(
        tmp_path / "second",
        RankModule(interleave(after)),
        group_callbacks(),
        max_epochs=2,
        ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"),
    )
    return {"before": before, "after": after, "first": first, "second": second}


def test_process_group_reduces_over_its_members_only(group_runs: dict[str, Any]) -> None:
    before = group_runs["before"]
    scalars, records = group_runs["first"]
    # logged by on_train_end, at the step of the window's last batch
    assert sorted(scalars["all/rollout_tokens"]) == [2]
    both = reference(before[0] + before[1])
    once = reference(tp_view(before[0]))
    assert once["rollout_tokens"] < reference(tp_view(before[0] + before[1]))["rollout_tokens"]
    for prefix, want in (("all/", both), ("tp/", once), ("first/", reference(before[0]))):
        assert_metrics_close(logged_at(scalars, 2, prefix), want, prefix=prefix)
        assert_metrics_close(complete(records[0]["final"], prefix), want, prefix=prefix)
    # Rank 1 is outside the group of "first/": it keeps its own window.
    want = reference(before[1])
    assert_metrics_close(complete(records[1]["final"], "first/"), want, prefix="first/")
    for prefix in ("all/", "tp/"):
        assert complete(records[0]["final"], prefix) == complete(records[1]["final"], prefix)
    # A collective for each callback whose group holds the rank, at the checkpoint (end of
    # the epoch) and at on_train_end, and one before the first (the settings); rank 1
    # exchanges nothing for "first/".
    assert sorted(name for _, name in records[0]["collectives"]) == ["all_gather"] * 9
    assert sorted(name for _, name in records[1]["collectives"]) == ["all_gather"] * 6


def test_checkpoint_keeps_the_merged_window_across_a_resume(group_runs: dict[str, Any]) -> None:
    before, after = group_runs["before"], group_runs["after"]
    scalars, records = group_runs["second"]
    steps = sorted(scalars["all/rollout_tokens"])
    assert steps[0] == 3 and len(steps) == 2, steps  # the fourth batch, then on_train_end
    # The first window after the resume: the three saved batches of both ranks and one new.
    windows = [[b + a[:1] for b, a in zip(before, after, strict=True)], [a[1:] for a in after]]
    for step, key, ranks in zip(steps, ["1:0", None], windows, strict=True):
        expected = {
            "all/": reference(ranks[0] + ranks[1]),
            "tp/": reference(tp_view(ranks[0])),
            "first/": reference(ranks[0]),
        }
        for prefix, want in expected.items():
            assert_metrics_close(logged_at(scalars, step, prefix), want, prefix=prefix)
        for record in records:
            metrics = record["snapshots"][key] if key else record["final"]
            for prefix in ("all/", "tp/"):  # identical on both ranks
                assert_metrics_close(complete(metrics, prefix), expected[prefix], prefix=prefix)
    # Rank 1, outside the group of "first/", carries no saved window on.
    first_on_rank1 = complete(records[1]["snapshots"]["1:0"], "first/")
    assert_metrics_close(first_on_rank1, reference(after[1][:1]), prefix="first/")


# ---------------------------------------------------------------------- ranks that disagree
class PerRankCallback(RolloutDebugCallback):
    """A callback of the settings ``per_rank[rank]`` on each rank (``ddp_spawn`` pickles one
    callback to every process), as a launcher script that builds it from the rank would.

    With ``out_dir``, what a rank raises at a batch's end is written to
    ``out_dir / f"rank{rank}.txt"`` first, and the rank waits (at most a minute) for the
    other ranks' files before it raises: the first rank to exit ends the others.
    """

    def __init__(self, per_rank: Sequence[Mapping[str, Any]], out_dir: str | None = None) -> None:
        super().__init__(**per_rank[0])
        self.per_rank = [dict(settings) for settings in per_rank]
        self.out_dir = out_dir

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        RolloutDebugCallback.__init__(self, **self.per_rank[trainer.global_rank])
        super().setup(trainer, pl_module, stage)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        try:
            super().on_train_batch_end(trainer, *args)
        except Exception as error:
            if self.out_dir is None:
                raise
            out = Path(self.out_dir)
            (out / f"rank{trainer.global_rank}.txt").write_text(f"{type(error).__name__}: {error}")
            deadline = time.monotonic() + 60.0
            while len(list(out.glob("rank*.txt"))) < WORLD and time.monotonic() < deadline:
                time.sleep(0.05)
            raise


DISAGREEMENTS = {
    "histograms": (
        [{"histograms": True}, {"histograms": False}],
        "`histograms` differs between the ranks: True on rank 0, False on rank 1",
    ),
    "groups": (
        [{"groups": ["seed", "kl"]}, {"groups": ["seed"]}],
        "`groups` differs between the ranks: ('seed', 'kl') on rank 0, ('seed',) on rank 1",
    ),
    "worst_tokens_k": (
        [{"worst_tokens_k": 10}, {"worst_tokens_k": 3}],
        "`worst_tokens_k` differs between the ranks: 10 on rank 0, 3 on rank 1",
    ),
}


@pytest.mark.parametrize("setting", list(DISAGREEMENTS))
def test_ranks_built_with_other_settings_raise_on_every_rank(tmp_path: Path, setting: str) -> None:
    """Settings that lay the merged window out differ between the ranks: before the first
    merge (which gloo would answer with an abort on one rank and "Connection reset by
    peer" on the other), every rank raises the same ``InvalidSettings``, naming the
    setting and each rank's value, whatever ``strict`` says: a configuration error."""
    per_rank, line = DISAGREEMENTS[setting]
    batches = [[rank_batch(3, 5, 10 * rank + i) for i in range(2)] for rank in range(WORLD)]
    callback = PerRankCallback(
        [{**settings, "log_every_n_steps": 1} for settings in per_rank], str(tmp_path)
    )
    trainer = pl.Trainer(
        callbacks=[callback],
        accelerator="cpu",
        devices=WORLD,
        strategy="ddp_spawn",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        max_epochs=1,
    )
    with pytest.raises(Exception, match="InvalidSettings"):
        trainer.fit(RankModule(interleave(batches)))
    for rank in range(WORLD):
        message = (tmp_path / f"rank{rank}.txt").read_text()
        assert message.startswith("InvalidSettings: Invalid RolloutDebugCallback arguments:")
        assert f"{line}; expected the same on every rank" in message, message
        assert "packed window" not in message  # its length follows from the setting


def test_ranks_built_alike_with_other_than_the_defaults_merge(tmp_path: Path) -> None:
    """The check passes ranks of the same settings, defaults or not: the merge is exact."""
    per_rank = [[rank_batch(3, 5, 10 * rank + i) for i in range(2)] for rank in range(WORLD)]
    settings = {"groups": ["seed", "kl"], "histograms": False, "worst_tokens_k": 3}
    callback = PerRankCallback([{**settings, "log_every_n_steps": 2}] * WORLD)
    scalars, records = fit(tmp_path, RankModule(interleave(per_rank)), [callback], max_epochs=1)
    names = [name for group in ("seed", "kl") for name in METRIC_NAMES[group]]
    want = reference([batch for batches in per_rank for batch in batches], names)
    got = {PREFIX + name: scalars[PREFIX + name][1] for name in names}
    assert_metrics_close(got, want, prefix=PREFIX)
    for record in records:
        assert [label for label, _ in record["collectives"]] == ["0:1", "0:1"]


@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
def test_the_settings_are_compared_once_before_the_first_merge(strict: bool) -> None:
    """Simulated ranks: the check sends the same few values whatever the settings, names
    every setting that differs with the ranks of each value (the length of the window only
    where no setting explains it), in either mode, and runs before the first merge only."""
    window = RolloutDebugCallback(strict=strict).monitor._window
    sent: list[torch.Tensor] = []
    others: list[torch.Tensor] = []

    def gather(vector: torch.Tensor) -> torch.Tensor:
        sent.append(vector)
        return torch.stack([vector, *(others if len(sent) == 1 else [vector] * 2)])

    mine = shaping_settings(
        window.stats, window.extras, window.series, window.shifts, window.segments
    )
    theirs = {**mine, "histograms": False, "profile": False, "is_threshold": 3.0}
    others[:] = [encoded(theirs), encoded(mine)]
    ranks = Ranks(3, True, gather)
    with pytest.raises(InvalidSettings) as error:
        window.merged(ranks)
    assert str(error.value).splitlines() == [
        "Invalid RolloutDebugCallback arguments:",
        *(
            f"- {setting} differs between the ranks: {values}; expected the same on every "
            "rank (it shapes the window the ranks merge)."
            for setting, values in [
                ("`is_threshold`", "2.0 on ranks 0 and 2, 3.0 on rank 1"),
                ("`histograms`", "True on ranks 0 and 2, False on rank 1"),
                (
                    "the profile (`profile_images`, or the `quantiles` group)",
                    "True on ranks 0 and 2, False on rank 1",
                ),
            ]
        ),
    ]
    assert [len(vector) for vector in sent] == [WIDTH] and not window.agreed
    sizes = {**mine, "state_size": mine["state_size"] + 1}  # another version of the package
    others[:] = [encoded(sizes)] * 2
    sent.clear()
    with pytest.raises(InvalidSettings, match=r"the length of the packed window \(another"):
        window.merged(ranks)
    others[:] = [encoded(mine)] * 2
    sent.clear()
    window.merged(ranks)
    window.merged(ranks)
    assert [len(vector) for vector in sent] == [WIDTH, mine["state_size"], mine["state_size"]]


# ---------------------------------------------------------------------- many simulated ranks
def simulated_rank(rng: np.random.Generator, rank: int) -> list[Batch]:
    """A few batches of random shapes; about one rank in eight holds no tokens at all."""
    empty = rng.random() < 0.125
    batches = []
    for i in range(int(rng.integers(0, 4))):
        rows, width = int(rng.integers(0, 6)), int(rng.integers(1, 30))
        kind = "zeros" if empty else str(rng.choice(["random", "random", "ones", "zeros"]))
        batch = rank_batch(
            rows,
            width,
            1000 * rank + i,
            mask=kind,
            noise=float(rng.choice([1e-3, 0.05, 0.5, 3.0])),
            dtype=torch.float64 if rng.random() < 0.3 else torch.float32,
        )
        if rng.random() < 0.2:
            batch = with_nonfinite(batch, 2, 1000 * rank + i)
        batches.append(batch)
    return batches


def rank_state(batches: Sequence[Batch]) -> torch.Tensor:
    stats = MismatchStats()
    for batch in batches:
        stats.update(batch["rollout_log_probs"], batch["old_log_probs"], batch["response_mask"])
    return stats.state


def assert_states_match(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to the float64 rounding of the merge order; the token count exactly."""
    same = torch.isclose(got, want, rtol=1e-12, atol=1e-12) | (got == want)
    assert bool(same.all()), (got - want)[~same]
    assert got[0] == want[0]


def test_merge_of_many_ranks_is_exact_in_any_order(rng: np.random.Generator) -> None:
    ranks = [simulated_rank(rng, rank) for rank in range(64)]
    states = [rank_state(batches) for batches in ranks]
    assert states[0].shape == (STATE_SIZE,)
    everything = [batch for batches in ranks for batch in batches]
    want = reference(everything, ALL_NAMES)
    assert want["rollout_tokens"] > 100 and want["rollout_nonfinite_tokens"] > 0
    assert any(s[0] == 0 for s in states), "some simulated rank should be empty"

    flat = merge_states(torch.stack(states))
    order = rng.permutation(64)
    shuffled = merge_states(torch.stack([states[i] for i in order]))
    tree = merge_states(
        torch.stack([merge_states(torch.stack(states[i : i + 8])) for i in range(0, 64, 8)])
    )
    cuts = sorted({0, 64, *(int(c) for c in rng.integers(1, 64, 7))})
    uneven = merge_states(
        torch.stack(
            [
                merge_states(torch.stack([states[i] for i in order[a:b]]))
                for a, b in itertools.pairwise(cuts)
            ]
            + [identity_state()]  # an extra empty rank changes nothing
        )
    )
    folded = MismatchStats()
    for state in states:
        folded.merge(state)
    one_window = rank_state(everything)
    # What the callback does: gather every rank's state (here: already stacked), merge.
    synced = MismatchStats().synced(lambda state: torch.stack(states)).state

    for got in (shuffled, tree, uneven, folded.state, one_window, synced):
        assert_states_match(got, flat)
    for state in (flat, shuffled, tree, uneven, folded.state, synced):
        got = MismatchStats.from_state(state).compute()
        assert_metrics_close(got, want)


def test_merge_of_empty_ranks_is_empty() -> None:
    states = torch.stack([identity_state()] * 64)
    metrics = MismatchStats.from_state(merge_states(states)).compute()
    assert metrics["rollout_tokens"] == 0 and metrics["rollout_probs_diff_valid"] == 0
    assert torch.equal(merge_states(states), identity_state())


def test_docs_state_the_size_of_the_collective() -> None:
    """docs/distributed.md quotes the vector sizes: keep them in step with the code."""
    from lightning_rollout_debug.metrics.extras import TokenExtras

    text = (Path(__file__).resolve().parents[1] / "docs" / "distributed.md").read_text()
    text = " ".join(text.split())  # as a reader reads it, whatever the line breaks
    extras = TokenExtras(histograms=True, worst_tokens_k=10, profile=True).size
    assert f"`STATE_SIZE = {STATE_SIZE}` values, **{STATE_SIZE * 8} bytes per rank**" in text
    window = RolloutDebugCallback().monitor._window
    sizes = [part.numel() for part in window.parts(torch.device("cpu")) if part is not None]
    assert sizes[1] == extras and f"pictures: {sizes[1]:,} values)" in text
    total = sum(sizes)
    assert f"{total:,} values or {total * 8:,} bytes" in text
    without = total - extras + TokenExtras(histograms=True, worst_tokens_k=10).size
    assert f"{without:,} values or {without * 8:,} bytes" in text
    assert f"all_gather` of {WIDTH} float64 values** ({WIDTH * 8} bytes" in text
    # ... for the defaults: histograms on, the 10 worst tokens and the profile.
    parameters = inspect.signature(RolloutDebugCallback).parameters
    assert parameters["histograms"].default is True
    assert parameters["worst_tokens_k"].default == 10
    assert parameters["profile_images"].default is True
    assert RolloutDebugCallback().monitor._extras.size == extras  # type: ignore[union-attr]
