"""What the TensorBoard extras (histograms, worst tokens, layout) add to a logged step.

A real Trainer logs every step to a TensorBoardLogger; the batch is ``[256, 4096]``
float32 log-probs with a random response mask. The callback's ``on_train_batch_end``
(update + reduce + compute + write, i.e. a whole logged step of the callback) is timed
with the extras on (defaults) and off, alternating runs, and the medians of the process
CPU time (robust to other load on the machine) and of the wall time are reported. Also
timed: the update alone of the statistics and of the extras.

    python benchmarks/bench_tensorboard_extras.py [--rows 256 --width 4096 --steps 12 --threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
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
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_metrics import status_kib
from configurations import SCALARS_ONLY

from lightning_rollout_debug import MismatchStats, RolloutDebugCallback
from lightning_rollout_debug.metrics.extras import TokenExtras


class Timed(RolloutDebugCallback):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seconds: list[tuple[float, float]] = []

    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        super().on_train_batch_end(*args, **kwargs)
        self.seconds.append((time.perf_counter() - wall, time.process_time() - cpu))


class Module(pl.LightningModule):
    def __init__(self, batch: dict[str, torch.Tensor], steps: int) -> None:
        super().__init__()
        self.layer = nn.Linear(1, 1)
        self.batch, self.steps = batch, steps

    def train_dataloader(self) -> DataLoader:
        return DataLoader([self.batch] * self.steps, batch_size=None)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.layer(torch.ones(1, 1)).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def make_batch(rows: int, width: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    rollout = torch.log(torch.rand(rows, width, generator=generator) * 0.99 + 0.005)
    old = (rollout + 0.01 * torch.randn(rows, width, generator=generator)).clamp(max=0.0)
    lengths = torch.randint(width // 4, width + 1, (rows, 1), generator=generator)
    return {
        "rollout_log_probs": rollout,
        "old_log_probs": old,
        "response_mask": (torch.arange(width) < lengths).long(),
        "responses": torch.randint(0, 150_000, (rows, width), generator=generator),
    }


def logged_step_seconds(
    batch: dict[str, torch.Tensor], steps: int, extras: bool
) -> tuple[list[tuple[float, float]], float]:
    """(wall, CPU) seconds of each logged step but the first, and event bytes per step."""
    options: dict[str, Any] = {"alert_ranges": {}}
    if not extras:
        options.update(SCALARS_ONLY)
    callback = Timed(**options)
    with tempfile.TemporaryDirectory() as logdir:
        trainer = pl.Trainer(
            accelerator="cpu",
            max_steps=steps,
            log_every_n_steps=1,
            logger=TensorBoardLogger(logdir, name="bench"),
            callbacks=[callback],
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )
        trainer.fit(Module(batch, steps))
        trainer.logger.experiment.flush()
        written = sum(path.stat().st_size for path in Path(logdir).rglob("events.out.*"))
    return callback.seconds[1:], written / steps  # the first step also creates the writer


def update_seconds(batch: dict[str, torch.Tensor], target: Any, repeats: int) -> float:
    """Median CPU time of one update of ``target`` with the batch."""
    args = (batch["rollout_log_probs"], batch["old_log_probs"], batch["response_mask"])
    if isinstance(target, TokenExtras):
        args = (*args, batch["responses"])
    target.update(*args)
    times = []
    for _ in range(repeats):
        target.reset()
        start = time.process_time()
        target.update(*args)
        times.append(time.process_time() - start)
    return statistics.median(times)


def memory_probe(configuration: str, rows: int, width: int) -> None:
    """Print the peak extra memory (MB) of one callback update; run in a fresh process."""
    options: dict[str, Any] = {"alert_ranges": {}}
    if configuration == "scalars":
        options.update(SCALARS_ONLY)
    callback = RolloutDebugCallback(**options)
    callback._update({}, make_batch(16, 512))  # load, build, warm up
    batch = make_batch(rows, width)
    callback.monitor._stats.reset()
    # Linux's high-water mark of resident memory, reset just before the update.
    Path("/proc/self/clear_refs").write_text("5")
    before = status_kib("VmRSS")
    callback._update({}, batch)
    print(max(status_kib("VmHWM") - before, 0) / 1024)


def peak_memory_mb(configuration: str, rows: int, width: int) -> float:
    result = subprocess.run(
        [sys.executable, __file__, "--memory-probe", configuration, str(rows), str(width)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"},
    )
    return float(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--memory-probe", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_probe:
        configuration, rows, width = args.memory_probe
        memory_probe(configuration, int(rows), int(width))
        return
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    batch = make_batch(args.rows, args.width)
    tokens = int(batch["response_mask"].sum())
    print(
        f"batch [{args.rows}, {args.width}], {tokens} counting tokens, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    times: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    written: dict[bool, float] = {}
    for _ in range(args.rounds):
        for extras in (False, True):
            seconds, written[extras] = logged_step_seconds(batch, args.steps, extras)
            times[extras] += seconds
    for column, label in ((1, "CPU time"), (0, "wall time")):
        off = statistics.median(t[column] for t in times[False])
        on = statistics.median(t[column] for t in times[True])
        print(
            f"logged step ({label}, median of {len(times[True])}): extras off {off * 1e3:.0f} ms, "
            f"on {on * 1e3:.0f} ms, extras add {(on - off) * 1e3:.0f} ms ({on / off - 1:+.0%})"
        )
    print(
        f"TensorBoard event bytes per logged step: extras off {written[False]:.0f}, "
        f"on {written[True]:.0f} (the layout and a set of pictures once per run)"
    )
    stats_update = update_seconds(batch, MismatchStats(), 5)
    extras_update = update_seconds(batch, TokenExtras(), 5)
    print(f"update alone (CPU time): MismatchStats {stats_update * 1e3:.0f} ms, ", end="")
    print(f"TokenExtras {extras_update * 1e3:.0f} ms")
    inputs = sum(t.numel() * t.element_size() for t in batch.values()) / 2**20
    peaks = {name: peak_memory_mb(name, args.rows, args.width) for name in ("scalars", "extras")}
    print(
        f"peak extra memory of a callback update: scalars only {peaks['scalars']:.2f} MB, "
        f"with the extras {peaks['extras']:.2f} MB; the extras add "
        f"{(peaks['extras'] - peaks['scalars']) / inputs:.3f}x the inputs ({inputs:.0f} MB)"
    )


if __name__ == "__main__":
    main()
