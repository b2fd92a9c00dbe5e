"""What the callback costs a real training run: the same run with and without it.

A small Lightning model trains on batches that carry ``[rows, width]`` rollout tensors;
the run is repeated without the callback, with the callback logging every step (the
worst case: every step is a logged step) and with the callback logging every 10 steps,
each with the defaults and with the defaults less the profile (no quantiles, no
pictures), and with scalars only.
Runs alternate, and the median time per training step of each configuration (after
warm-up steps, which include compilation where it happens) is printed, with the
overhead per step against the run without the callback.

    python benchmarks/bench_trainer.py [--rows 64 --width 2048 --steps 40 --rounds 3]
                                       [--accelerator gpu]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_rollout_debug import GROUPS, RolloutDebugCallback

WARMUP = 5


class RolloutBatches(Dataset):
    """The same rollout batch, ``steps`` times (data loading is not what is measured)."""

    def __init__(self, rows: int, width: int, steps: int) -> None:
        generator = torch.Generator().manual_seed(0)
        rollout = torch.log(torch.rand(rows, width, generator=generator).clamp(min=1e-6))
        self.batch = {
            "x": torch.randn(rows, 256, generator=generator),
            "rollout_log_probs": rollout,
            "old_log_probs": (rollout + 0.01 * torch.randn(rows, width)).clamp(max=0.0),
            "response_mask": torch.rand(rows, width, generator=generator) > 0.2,
        }
        self.steps = steps

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.batch


class Model(pl.LightningModule):
    """A two-layer MLP: a stand-in for the policy's training step, timed per step."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 1))
        self.step_seconds: list[float] = []
        self._started = 0.0

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._synchronize()
        self._started = time.perf_counter()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        # Runs after the callbacks' on_train_batch_end: the step including the callback.
        self._synchronize()
        self.step_seconds.append(time.perf_counter() - self._started)

    def _synchronize(self) -> None:
        if self.device.type == "cuda":  # time the work, not its queueing
            torch.cuda.synchronize(self.device)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.net(batch["x"]).pow(2).mean()
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def run(callbacks: list[pl.Callback], args: argparse.Namespace) -> float:
    """Median milliseconds per training step after warm-up."""
    model = Model()
    with tempfile.TemporaryDirectory() as logdir:
        trainer = pl.Trainer(
            accelerator=args.accelerator,
            devices=1,
            max_steps=args.steps,
            log_every_n_steps=1,
            logger=TensorBoardLogger(logdir, max_queue=args.max_queue),
            callbacks=callbacks,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )
        data = RolloutBatches(args.rows, args.width, args.steps)
        trainer.fit(model, DataLoader(data, batch_size=None))
    return statistics.median(model.step_seconds[WARMUP:]) * 1e3


def main(argv: list[str] | None = None) -> None:
    """Time the configurations and print the overhead per step."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--accelerator", default="cpu", help="Lightning accelerator: cpu, gpu")
    parser.add_argument(
        "--max-queue",
        type=int,
        default=10,
        help="events the SummaryWriter queues before a write waits (10: its default)",
    )
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    # The defaults before the profile: histograms and worst tokens, no quantiles or pictures.
    no_profile = {"groups": [g for g in GROUPS if g not in ("quantiles", "token_ids")]}
    no_profile["profile_images"] = False
    configurations = {
        "without the callback": lambda: [],
        "callback, logging every step": lambda: [RolloutDebugCallback(alert_ranges={})],
        "callback, logging every 10 steps": lambda: [
            RolloutDebugCallback(log_every_n_steps=10, alert_ranges={})
        ],
        "no profile, every step": lambda: [RolloutDebugCallback(**no_profile, alert_ranges={})],
        "no profile, every 10 steps": lambda: [
            RolloutDebugCallback(**no_profile, log_every_n_steps=10, alert_ranges={})
        ],
        "callback, scalars only, every step": lambda: [
            RolloutDebugCallback(
                histograms=False,
                worst_tokens_k=0,
                dashboard_layout=False,
                alert_ranges={},
                **no_profile,
            )
        ],
    }
    times: dict[str, list[float]] = {name: [] for name in configurations}
    for _ in range(args.rounds):
        for name, make in configurations.items():
            times[name].append(run(make(), args))
    threads = torch.get_num_threads()
    print(
        f"torch {torch.__version__}, {args.accelerator}, {threads} threads, "
        f"batch {args.rows}x{args.width}"
    )
    base = statistics.median(times["without the callback"])
    overhead = {}
    for name, values in times.items():
        ms = statistics.median(values)
        overhead[name] = ms - base
        print(f"{name:36} {ms:8.2f} ms/step   overhead {ms - base:+7.2f} ms/step")
    scalars = overhead["callback, scalars only, every step"]
    ratio = overhead["no profile, every step"] / scalars
    print(f"no profile / scalars only, overhead per step: {ratio:.2f}x (goal: at most 1.5x)")
    for every in ("every step", "every 10 steps"):
        ratio = overhead[f"callback, logging {every}"] / overhead[f"no profile, {every}"]
        print(f"defaults / no profile, logging {every}: {ratio:.2f}x (goal: at most 1.3x)")


if __name__ == "__main__":
    main()
