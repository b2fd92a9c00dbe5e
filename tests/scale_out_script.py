"""Scale-out Trainer runs for ``tests/test_scale_out.py``, one process per rank.

``python tests/scale_out_script.py MODE DATA OUT_DIR`` fits :class:`RolloutDebugCallback`
on CPU with gloo, in one of two layouts:

- ``fsdp2``: ``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)`` on
  ``devices=2``; ``configure_model`` applies FSDP2's ``fully_shard`` to a small model.
  Started once; Lightning's subprocess launcher runs this script again as rank 1 (with
  ``LOCAL_RANK=1``), which is why the run cannot live inside the pytest process.
- ``nodes``: ``strategy="ddp"``, ``num_nodes=2``, ``devices=1``. Started once per simulated
  node by the test, with ``NODE_RANK`` 0 or 1, ``LOCAL_RANK=0``, ``WORLD_SIZE=2`` and a
  shared ``MASTER_ADDR``/``MASTER_PORT``; no launcher is involved.

``DATA`` holds the batches of every rank (``[rank][batch]``, saved by the test with
``torch.save``), so the processes train on exactly the tensors the test computes its
reference from; a ``DistributedSampler`` deals them out, rank ``r`` getting its own list in
order. Rank 0 writes TensorBoard to ``OUT_DIR/tb/version_0``; every rank writes what it
saw to ``OUT_DIR/records/rank{global_rank}.json``. Importing this module has no side
effects.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from lightning_helpers import (
    FEATURES,
    TRAINER_DEFAULTS,
    ListDataset,
    ReleaseProcessGroups,
    RolloutModule,
)
from pytorch_lightning.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from lightning_rollout_debug import RolloutDebugCallback

WORLD = 2
PREFIX = "training/"
LOG_EVERY = 2
MODES = ("fsdp2", "nodes")
CHILD_TIMEOUT_S = 120
"""How long the launching process waits for the ranks it started once its own fit is done."""

Batch = dict[str, torch.Tensor]


def load_batches(path: Path) -> list[list[Batch]]:
    """``[rank][batch]``, as the test saved them with ``torch.save``."""
    per_rank = torch.load(path, weights_only=True)
    assert len(per_rank) == WORLD and len({len(b) for b in per_rank}) == 1, "one list per rank"
    return per_rank


def interleave(per_rank: Sequence[Sequence[Batch]]) -> list[Batch]:
    """Item ``i`` is batch ``i // WORLD`` of rank ``i % WORLD`` (``DistributedSampler`` order)."""
    return [batch for step in zip(*per_rank, strict=True) for batch in step]


class RankModule(RolloutModule):
    """The shared tiny model, its batches dealt out to the ranks by a ``DistributedSampler``."""

    def __init__(self, per_rank: Sequence[Sequence[Batch]]) -> None:
        super().__init__(interleave(per_rank), log_loss=False)

    def train_dataloader(self) -> DataLoader:
        dataset = ListDataset(self.batches)
        # Lightning's own sampler would shuffle; this one deals the items out in order.
        sampler = DistributedSampler(
            dataset, num_replicas=self.trainer.world_size, rank=self.global_rank, shuffle=False
        )
        return DataLoader(dataset, batch_size=None, sampler=sampler)


def _fully_shard() -> Any:
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


class ShardedModule(RankModule):
    """Two linear layers, each sharded with FSDP2 over the data-parallel mesh.

    Every parameter's first dimension is even, so each rank holds half of every parameter.
    """

    def __init__(self, per_rank: Sequence[Sequence[Batch]]) -> None:
        super().__init__(per_rank)
        self.layer = nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, 2))

    def configure_model(self) -> None:
        fully_shard = _fully_shard()
        mesh = self.device_mesh["data_parallel"]
        for module in self.layer:
            if isinstance(module, nn.Linear):
                fully_shard(module, mesh=mesh)
        fully_shard(self.layer, mesh=mesh)


def _parameters(module: nn.Module) -> dict[str, dict[str, Any]]:
    """Each parameter's class, global and local shape, and placements (if a DTensor)."""
    out = {}
    for name, parameter in module.named_parameters():
        local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
        out[name] = {
            "type": type(parameter).__name__,
            "shape": list(parameter.shape),
            "local_shape": list(local.shape),
            "placements": [str(p) for p in getattr(parameter, "placements", ())],
            "mesh_size": parameter.device_mesh.size() if hasattr(parameter, "device_mesh") else 0,
        }
    return out


class Recorder(pl.Callback):
    """Writes what one rank saw to ``out_dir / f"rank{global_rank}.json"`` after training.

    Listed after the :class:`RolloutDebugCallback`, so ``final`` holds the metrics of the
    window its own ``on_train_end`` has just logged.
    """

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.logged: dict[int, dict[str, float]] = {}

    def _metrics(self, trainer: pl.Trainer) -> dict[str, float]:
        return {
            name: float(value)
            for name, value in trainer.callback_metrics.items()
            if name.startswith(PREFIX)
        }

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if (batch_idx + 1) % LOG_EVERY == 0:
            self.logged[batch_idx] = self._metrics(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        record = {
            "global_rank": trainer.global_rank,
            "local_rank": trainer.local_rank,
            "node_rank": trainer.node_rank,
            "world_size": trainer.world_size,
            "strategy": type(trainer.strategy).__name__,
            "backend": torch.distributed.get_backend(),
            "distributed_world_size": torch.distributed.get_world_size(),
            "pid": os.getpid(),
            "seen": list(pl_module.seen),
            "parameters": _parameters(pl_module),
            "logged": {str(key): value for key, value in self.logged.items()},
            "final": self._metrics(trainer),
        }
        path = Path(self.out_dir) / f"rank{trainer.global_rank}.json"
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(record))
        os.replace(partial, path)  # the test never reads half a record


def fit(mode: str, data: Path, out_dir: Path) -> None:
    """One rank's part of the run of ``mode`` on the batches saved in ``data``."""
    per_rank = load_batches(data)
    records = out_dir / "records"
    records.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(0, verbose=False)
    options: Mapping[str, Any]
    if mode == "fsdp2":
        from pytorch_lightning.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(
            data_parallel_size=WORLD, tensor_parallel_size=1, process_group_backend="gloo"
        )
        module: RankModule = ShardedModule(per_rank)
        options = {"strategy": strategy, "devices": WORLD, "num_nodes": 1}
    else:
        module = RankModule(per_rank)
        options = {"strategy": "ddp", "devices": 1, "num_nodes": WORLD}
    trainer = pl.Trainer(
        **{**TRAINER_DEFAULTS, **options},
        logger=TensorBoardLogger(str(out_dir), name="tb", version=0),
        callbacks=[
            RolloutDebugCallback(log_every_n_steps=LOG_EVERY),
            Recorder(str(records)),
            ReleaseProcessGroups(),
        ],
        max_epochs=1,
        log_every_n_steps=LOG_EVERY,
        use_distributed_sampler=False,
    )
    trainer.fit(module)
    # Lightning's subprocess launcher (fsdp2) does not wait for the ranks it started; this
    # process does, so that it ends only after every rank has written its record.
    children = getattr(trainer.strategy.launcher, "procs", [])
    codes = [child.wait(timeout=CHILD_TIMEOUT_S) for child in children]
    if any(codes):
        raise SystemExit(f"a rank started by the launcher failed: exit codes {codes}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=MODES)
    parser.add_argument("data", type=Path, help="[rank][batch] lists saved with torch.save")
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    fit(args.mode, args.data, args.out_dir)
    # A rank ends here without the interpreter's shutdown. FSDP2's parameter groups keep
    # their gloo group alive after ``destroy_process_group``, so without this the group
    # would be freed during shutdown; a gloo worker thread that drops a tensor's last
    # reference then needs the GIL, Python ends that thread with a forced unwind, and
    # ``std::terminate`` aborts the rank (rarely: it is a race). Everything the test reads
    # is on disk by now: the records are replaced atomically, the logger is closed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
