"""What the callback costs a real training run, every configuration side by side in one run.

A small Lightning model trains on batches that carry ``[rows, width]`` rollout tensors.
One Trainer run holds one callback per configuration, and the steps go to them in
blocks: a block of ``--block`` steps (50 by default, a multiple of every cadence and of
the pictures' span) where one configuration's callback works, then a block where none
does. Each round runs every configuration's block once, in a new order each round, after
a round of warm-up. The configurations: the defaults, the defaults less the profile (no
quantiles, no pictures: the defaults before them) and scalars only, each logging every
step (the worst case), every 10 steps and every 50 (the Trainer's default) through the
callback's own ``log_every_n_steps``; and the pictures at every logged step, logging
every step. Load that changes over the run reaches every configuration alike.

Two figures per configuration, per round, then their median over rounds:

* **overhead**: the wall time of its block's steps, plus the first 10 steps of the block
  after it (where TensorBoard's writer thread may still be writing what it logged), less
  the same number of steps at the per-step time of the rest of that idle block; per step
  of its block. It holds everything, the writer thread's work too.
* **hook**: the wall time of its ``on_train_batch_end`` (the update, and on a logged
  step the merge, the host copy, the metrics and the writes), averaged over its steps.
  Beside it are the medians of the hook of a step that does not log (the update, inside
  a training step) and of one that logs.

The ratios the goals name are printed as the ratio of the medians, with the range of the
rounds' own ratios.

    python benchmarks/bench_trainer.py [--rows 64 --width 2048 --block 50 --rounds 6]
                                       [--accelerator gpu] [--mask random|padded]
                                       [--lanes 8]
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_metrics import kernel_width, make_batch, use_lanes
from configurations import NO_PROFILE, SCALARS_ONLY

from lightning_rollout_debug import RolloutDebugCallback

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
    """The callback of one configuration: it works in its own blocks of steps, timed."""

    def __init__(self, name: str, schedule: list[str | None], **kwargs: Any) -> None:
        super().__init__(**QUIET, **kwargs)
        self.name, self.schedule = name, schedule
        self.seconds: dict[int, float] = {}  # step -> wall time of the hook
        self.logged: set[int] = set()

    @property
    def state_key(self) -> str:  # one callback per configuration in one Trainer
        return f"{super().state_key}[{self.name}]"

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self.schedule[batch_idx] != self.name:
            return
        start = time.perf_counter()
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.seconds[batch_idx] = time.perf_counter() - start
        if self.monitor.batches_in_window == 0:  # a logged step empties the window
            self.logged.add(batch_idx)


class Model(pl.LightningModule):
    """A two-layer MLP: a stand-in for the policy's training step, timed per step."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 1))
        self.step_starts: list[float] = []

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.device.type == "cuda":  # time the work, not its queueing
            torch.cuda.synchronize(self.device)
        self.step_starts.append(time.perf_counter())

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.net(batch["x"]).pow(2).mean()
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


CONFIGURATIONS: dict[str, dict[str, Any]] = {}
"""Each configuration's constructor arguments, by name."""
CADENCES = {"every step": 1, "every 10 steps": 10, "every 50 steps": 50}
for _cadence, _every in CADENCES.items():
    CONFIGURATIONS[f"defaults, {_cadence}"] = {"log_every_n_steps": _every}
    CONFIGURATIONS[f"no profile, {_cadence}"] = {**NO_PROFILE, "log_every_n_steps": _every}
    CONFIGURATIONS[f"scalars only, {_cadence}"] = {**SCALARS_ONLY, "log_every_n_steps": _every}
CONFIGURATIONS["pictures at every logged step, every step"] = {
    "profile_images_every_n_steps": 1,
    "log_every_n_steps": 1,
}
SPILL = 10
"""Steps of the idle block after a configuration's block that are counted as its own."""


def schedule_of(names: list[str], block: int, rounds: int) -> list[str | None]:
    """Who works at each step: per round (the first is warm-up), each name's block, then an
    idle block; the order rotates and reverses from round to round."""
    steps: list[str | None] = []
    for index in range(rounds + 1):
        order = names[index % len(names) :] + names[: index % len(names)]
        for name in order[::-1] if index % 2 else order:
            steps += [name] * block + [None] * block
    return steps


def measure(args: argparse.Namespace) -> dict[str, list[list[float]]]:
    """Per configuration, per measured round: overhead, hook, a quiet hook, a logged hook,
    and the step without the callback it was measured against (milliseconds per step)."""
    names = list(CONFIGURATIONS)
    schedule = schedule_of(names, args.block, args.rounds)
    callbacks = [TimedCallback(name, schedule, **CONFIGURATIONS[name]) for name in names]
    model = Model()
    with tempfile.TemporaryDirectory() as logdir:
        trainer = pl.Trainer(
            accelerator=args.accelerator,
            devices=1,
            max_steps=len(schedule),
            logger=TensorBoardLogger(logdir, max_queue=args.max_queue),
            callbacks=callbacks,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )
        data = RolloutBatches(args.rows, args.width, len(schedule), args.mask)
        trainer.fit(model, DataLoader(data, batch_size=None))
    starts = model.step_starts
    step_seconds = [later - earlier for earlier, later in itertools.pairwise(starts)]
    found: dict[str, list[list[float]]] = {name: [] for name in names}
    for callback in callbacks:
        blocks = [i for i, name in enumerate(schedule) if name == callback.name]
        for first in blocks[args.block :: args.block]:  # the first round warms up
            steps = range(first, first + args.block)
            idle = step_seconds[first + args.block + SPILL : first + 2 * args.block]
            spilled = step_seconds[first : first + args.block + SPILL]
            overhead = sum(spilled) - len(spilled) * statistics.fmean(idle)
            hooks = [callback.seconds[step] for step in steps]
            quiet = [callback.seconds[step] for step in steps if step not in callback.logged]
            logged = [callback.seconds[step] for step in steps if step in callback.logged]
            found[callback.name].append(
                [
                    overhead / args.block * 1e3,
                    statistics.fmean(hooks) * 1e3,
                    statistics.median(quiet) * 1e3 if quiet else math.nan,
                    statistics.median(logged) * 1e3 if logged else math.nan,
                    statistics.fmean(idle) * 1e3,
                ]
            )
        every = CONFIGURATIONS[callback.name]["log_every_n_steps"]
        expected = args.rounds * (args.block // every)
        measured = sum(step >= args.block * 2 * len(names) for step in callback.logged)
        if measured != expected:
            raise RuntimeError(f"{callback.name}: {measured} logged steps, expected {expected}")
    return found


def ratio_text(found: dict[str, list[list[float]]], top: str, bottom: str, figure: int) -> str:
    """The ratio of two configurations' medians of a figure, with the range of the rounds'."""
    tops = [values[figure] for values in found[top]]
    bottoms = [values[figure] for values in found[bottom]]
    rounds = sorted(t / b for t, b in zip(tops, bottoms, strict=True))
    ratio = statistics.median(tops) / statistics.median(bottoms)
    return f"{ratio:.2f}x (rounds {rounds[0]:.2f}x to {rounds[-1]:.2f}x)"


def main(argv: list[str] | None = None) -> None:
    """Time the configurations side by side and print their cost and its ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--block", type=int, default=50, help="steps a block, a multiple of 50")
    parser.add_argument("--rounds", type=int, default=6, help="measured rounds, after warm-up")
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
    parser.add_argument(
        "--lanes",
        type=int,
        choices=(4, 8),
        help="run the native kernel's build of this many lanes",
    )
    args = parser.parse_args(argv)
    if args.block < 50 or args.block % 50:
        parser.error(f"--block must be a multiple of 50, got {args.block}")
    use_lanes(args.lanes)
    warnings.filterwarnings("ignore")
    found = measure(args)
    print(
        f"torch {torch.__version__}, {args.accelerator}, {torch.get_num_threads()} threads, "
        f"{kernel_width()}, batch {args.rows}x{args.width}, {args.mask} mask, "
        f"blocks of "
        f"{args.block} steps, medians of {args.rounds} rounds, ms per step"
    )
    idle = statistics.median(values[4] for rounds in found.values() for values in rounds)
    print(f"{'a step without the callback':42} {idle:6.2f}")
    for name, values in found.items():
        overhead, hook, quiet, logged, _ = (statistics.median(v) for v in zip(*values, strict=True))
        print(
            f"{name:42} overhead {overhead:+6.2f}   hook {hook:6.2f}   (a step that does not "
            f"log {quiet:5.2f}, one that logs {logged:6.2f})"
        )
    for name, against in (("no profile", "scalars only"), ("defaults", "no profile")):
        ratio = ratio_text(found, f"{name}, every 50 steps", f"{against}, every 50 steps", 2)
        print(f"hook of a step that does not log: {name} / {against}: {ratio}")
    for figure, what in ((0, "overhead"), (1, "hook")):
        for name, against, goal in (
            ("no profile", "scalars only", 1.5),
            ("defaults", "no profile", 1.3),
        ):
            for cadence in CADENCES:
                ratio = ratio_text(found, f"{name}, {cadence}", f"{against}, {cadence}", figure)
                print(f"{what}: {name} / {against}, logging {cadence}: {ratio} (goal: {goal}x)")
        ratio = ratio_text(
            found, "pictures at every logged step, every step", "no profile, every step", figure
        )
        print(f"{what}: pictures at every logged step / no profile, every step: {ratio}")


if __name__ == "__main__":
    main()
