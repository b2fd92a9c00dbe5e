"""What the callback costs a real training run: the same run with and without it.

A small Lightning model trains on batches that carry ``[rows, width]`` rollout tensors;
the run is repeated without the callback and with it, logging every step (the worst
case), every 10 steps and every 50 (the Trainer's default), each with the defaults, with
the defaults less the profile (no quantiles, no pictures: the defaults before them) and
with scalars only; and with the pictures at every logged step, logging every step.
The cost of a step is amortized: the wall time from the start of the first step after
warm-up (which includes compilation where it happens) to the start of the last, over
the steps in between, so a logged step's cost is spread over its window, and so is the
work TensorBoard's writer thread does between steps. Runs alternate; the median over
rounds of each configuration is printed, with the overhead per step against the run
without the callback. That overhead is the difference of two noisy totals, so a
second figure times the callback itself: the wall time of its ``on_train_batch_end``
(the update, and on a logged step the merge, the host copy, the metrics and the
writes), averaged over the steps after warm-up. It leaves out only what TensorBoard's
writer thread does after the hook has returned. Beside it are the medians of the hook
of a step that does not log (the update, inside a training step) and of one that logs.

    python benchmarks/bench_trainer.py [--rows 64 --width 2048 --steps 200 --rounds 3]
                                       [--accelerator gpu] [--mask random|padded]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_metrics import kernel_width, make_batch
from configurations import NO_PROFILE, SCALARS_ONLY

from lightning_rollout_debug import RolloutDebugCallback

WARMUP = 5
QUIET = {"alert_ranges": {}, "drift_factors": {}}
"""No alerts: the batches are the same every step, and warnings are not what is timed."""


class RolloutBatches(Dataset):
    """The same rollout batch, ``steps`` times (data loading is not what is measured).

    ``mask="random"``: a random 80% of the tokens count, scattered (every vector of the
    kernel holds tokens that count and tokens that do not). ``mask="padded"``: the
    right-padded responses of random lengths of the other benchmarks
    (``bench_metrics.make_batch``, about 62% of the tokens counted), the layout of an RL
    batch, where the padding fills whole vectors. Both masks are bool.
    """

    def __init__(self, rows: int, width: int, steps: int, mask: str = "random") -> None:
        generator = torch.Generator().manual_seed(0)
        self.batch = {"x": torch.randn(rows, 256, generator=generator)}
        if mask == "padded":
            padded = make_batch((rows, width), torch.float32, "cpu")
            padded["response_mask"] = padded["response_mask"].bool()  # as "random"'s
            self.batch.update(padded)
        elif mask == "random":
            rollout = torch.log(torch.rand(rows, width, generator=generator).clamp(min=1e-6))
            self.batch.update(
                rollout_log_probs=rollout,
                old_log_probs=(rollout + 0.01 * torch.randn(rows, width)).clamp(max=0.0),
                response_mask=torch.rand(rows, width, generator=generator) > 0.2,
            )
        else:
            raise ValueError(f"`mask` must be 'random' or 'padded', got {mask!r}.")
        self.steps = steps

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.batch


class TimedCallback(RolloutDebugCallback):
    """The callback, with the wall time of each ``on_train_batch_end``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seconds: list[float] = []
        self.logged: list[bool] = []

    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        super().on_train_batch_end(*args, **kwargs)
        self.seconds.append(time.perf_counter() - start)
        self.logged.append(self.monitor.batches_in_window == 0)  # a logged step empties it

    def mean_ms(self) -> float:
        """Milliseconds the hook takes per step after warm-up, logged steps included."""
        return statistics.fmean(self.seconds[WARMUP:]) * 1e3

    def median_ms(self, *, logged: bool) -> float:
        """The median milliseconds of the hook of the steps after warm-up that log (or not)."""
        steps = zip(self.seconds[WARMUP:], self.logged[WARMUP:], strict=True)
        found = [seconds for seconds, did in steps if did == logged]
        return statistics.median(found) * 1e3 if found else math.nan


class Model(pl.LightningModule):
    """A two-layer MLP: a stand-in for the policy's training step, timed per step."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 1))
        self.step_starts: list[float] = []

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._synchronize()
        self.step_starts.append(time.perf_counter())

    def _synchronize(self) -> None:
        if self.device.type == "cuda":  # time the work, not its queueing
            torch.cuda.synchronize(self.device)

    def amortized_ms(self) -> float:
        """Milliseconds per step from the first step after warm-up to the last."""
        starts = self.step_starts[WARMUP:]
        return (starts[-1] - starts[0]) / (len(starts) - 1) * 1e3

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.net(batch["x"]).pow(2).mean()
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def run(callbacks: list[pl.Callback], every: int, args: argparse.Namespace) -> list[float]:
    """Milliseconds after warm-up: the amortized step, the hook (mean), and the median hook
    of a step that does not log and of one that logs."""
    model = Model()
    with tempfile.TemporaryDirectory() as logdir:
        trainer = pl.Trainer(
            accelerator=args.accelerator,
            devices=1,
            max_steps=args.steps,
            log_every_n_steps=every,
            logger=TensorBoardLogger(logdir, max_queue=args.max_queue),
            callbacks=callbacks,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )
        data = RolloutBatches(args.rows, args.width, args.steps, args.mask)
        trainer.fit(model, DataLoader(data, batch_size=None))
    timed = [c for c in callbacks if isinstance(c, TimedCallback)]
    hook = sum(c.mean_ms() for c in timed)
    quiet = sum(c.median_ms(logged=False) for c in timed)
    logged = sum(c.median_ms(logged=True) for c in timed)
    return [model.amortized_ms(), hook, quiet, logged]


def main(argv: list[str] | None = None) -> None:
    """Time the configurations and print the overhead per step."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--accelerator", default="cpu", help="Lightning accelerator: cpu, gpu")
    parser.add_argument(
        "--mask",
        default="random",
        choices=("random", "padded"),
        help="a scattered 80%% of the tokens counted, or right-padded responses",
    )
    parser.add_argument(
        "--max-queue",
        type=int,
        default=10,
        help="events the SummaryWriter queues before a write waits (10: its default)",
    )
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    cadences = {"every step": 1, "every 10 steps": 10, "every 50 steps": 50}
    configurations: dict[str, tuple[Callable[[], list[pl.Callback]], int]] = {
        "without the callback": (list, 1)
    }
    for name, every in cadences.items():
        configurations[f"defaults, {name}"] = (lambda: [TimedCallback(**QUIET)], every)
        configurations[f"no profile, {name}"] = (
            lambda: [TimedCallback(**NO_PROFILE, **QUIET)],
            every,
        )
        configurations[f"scalars only, {name}"] = (
            lambda: [TimedCallback(**SCALARS_ONLY, **QUIET)],
            every,
        )
    configurations["pictures at every logged step, every step"] = (
        lambda: [TimedCallback(profile_images_every_n_steps=1, **QUIET)],
        1,
    )
    rounds: dict[str, list[list[float]]] = {name: [] for name in configurations}
    for _ in range(args.rounds):
        for name, (make, every) in configurations.items():
            rounds[name].append(run(make(), every, args))
    # The median over rounds of each figure: amortized, hook, quiet step, logged step.
    medians = {
        name: [statistics.median(figures) for figures in zip(*values, strict=True)]
        for name, values in rounds.items()
    }
    threads = torch.get_num_threads()
    print(
        f"torch {torch.__version__}, {args.accelerator}, {threads} threads, {kernel_width()}, "
        f"batch {args.rows}x{args.width}, {args.mask} mask, {args.steps} steps, "
        "amortized per step"
    )
    base = medians["without the callback"][0]
    overhead, hook, quiet = {}, {}, {}
    for name, (ms, mean_hook, quiet_hook, logged_hook) in medians.items():
        overhead[name], hook[name], quiet[name] = ms - base, mean_hook, quiet_hook
        print(
            f"{name:42} {ms:8.2f} ms/step   overhead {ms - base:+7.2f} ms/step   "
            f"hook {mean_hook:6.2f} ms/step   (a step that does not log {quiet_hook:5.2f} ms, "
            f"one that logs {logged_hook:6.2f} ms)"
        )
    for name in ("no profile", "defaults"):
        against = "scalars only" if name == "no profile" else "no profile"
        ratio = quiet[f"{name}, every 50 steps"] / quiet[f"{against}, every 50 steps"]
        print(f"hook of a step that does not log: {name} / {against}: {ratio:.2f}x")
    for what, cost in (("overhead", overhead), ("hook", hook)):
        for name in cadences:
            ratio = cost[f"no profile, {name}"] / cost[f"scalars only, {name}"]
            print(f"{what}: no profile / scalars only, logging {name}: {ratio:.2f}x (goal: 1.5x)")
        for name in cadences:
            ratio = cost[f"defaults, {name}"] / cost[f"no profile, {name}"]
            print(f"{what}: defaults / no profile, logging {name}: {ratio:.2f}x (goal: 1.3x)")
        pictures = cost["pictures at every logged step, every step"]
        ratio = pictures / cost["no profile, every step"]
        print(f"{what}: pictures at every logged step / no profile, every step: {ratio:.2f}x")


if __name__ == "__main__":
    main()
