"""The first training step with fresh caches: the callback's defaults against scalars only.

Each run is a fresh process with an empty kernel cache (``LIGHTNING_ROLLOUT_DEBUG_CACHE``)
and an empty inductor cache (``TORCHINDUCTOR_CACHE_DIR``), so whatever the callback builds
or compiles on its first large batch is paid in the first step, as on a new machine. The
configurations alternate, and the medians of the first step's wall time are printed
with their ratio. A reference run without the callback shows what the step costs alone.

The callback starts the kernel's build at the Trainer's ``setup``, so that it goes on
while the first batch is made. ``--first-batch-seconds S`` makes the first training step
wait ``S`` seconds (a rollout sampled on an accelerator, which leaves the CPU free), and
a fourth configuration, the defaults with the build left to the first update (as before
the early start), shows what the early start saves.

    python benchmarks/bench_cold_start.py [--rows 64 --width 2048 --rounds 3]
                                          [--first-batch-seconds 0]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

LATE = "defaults, built at the first update"
CONFIGURATIONS = ("without the callback", "defaults", "scalars only", LATE)


def first_step(configuration: str, rows: int, width: int, first_batch_seconds: float) -> float:
    """In this process: train 3 steps and return the first one's seconds."""
    import pytorch_lightning as pl
    import torch
    from configurations import SCALARS_ONLY  # the script's folder is on sys.path
    from torch import nn
    from torch.utils.data import DataLoader

    import lightning_rollout_debug.callback
    from lightning_rollout_debug import RolloutDebugCallback

    warnings.filterwarnings("ignore")
    if configuration == LATE:  # no early start: the first update builds the kernel
        lightning_rollout_debug.callback.prepare_native = lambda compile: False
    generator = torch.Generator().manual_seed(0)
    rollout = torch.log(torch.rand(rows, width, generator=generator).clamp(min=1e-6))
    batch = {
        "x": torch.randn(rows, 16, generator=generator),
        "rollout_log_probs": rollout,
        "old_log_probs": (rollout + 0.01 * torch.randn(rows, width, generator=generator)).clamp(
            max=0.0
        ),
        "response_mask": torch.rand(rows, width, generator=generator) > 0.2,
    }

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(16, 1)
            self.seconds: list[float] = []

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            self.started = time.perf_counter()

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.seconds.append(time.perf_counter() - self.started)

        def training_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
            if batch_idx == 0:
                time.sleep(first_batch_seconds)  # the first batch being sampled
            return self.net(batch["x"]).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    callbacks = {
        "without the callback": [],
        "defaults": [RolloutDebugCallback(alert_ranges={})],
        LATE: [RolloutDebugCallback(alert_ranges={})],
        "scalars only": [RolloutDebugCallback(**SCALARS_ONLY, alert_ranges={})],
    }[configuration]
    model = Model()
    with tempfile.TemporaryDirectory() as logdir:
        trainer = pl.Trainer(
            accelerator="cpu",
            max_steps=3,
            log_every_n_steps=1,
            logger=pl.loggers.TensorBoardLogger(logdir),
            callbacks=callbacks,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )
        trainer.fit(model, DataLoader([batch] * 3, batch_size=None))
    return model.seconds[0]


def fresh_process(configuration: str, rows: int, width: int, first_batch_seconds: float) -> float:
    """:func:`first_step` in a new process with empty caches."""
    with tempfile.TemporaryDirectory() as kernels, tempfile.TemporaryDirectory() as inductor:
        env = {
            **os.environ,
            "LIGHTNING_ROLLOUT_DEBUG_CACHE": os.path.join(kernels, "cache"),
            "TORCHINDUCTOR_CACHE_DIR": inductor,
        }
        command = [sys.executable, __file__, "--child", configuration, str(rows), str(width)]
        command.append(str(first_batch_seconds))
        result = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    """Alternate fresh processes of each configuration and print the medians."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--first-batch-seconds", type=float, default=0.0)
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        configuration, rows, width, first_batch = args.child
        print(json.dumps(first_step(configuration, int(rows), int(width), float(first_batch))))
        return
    seconds: dict[str, list[float]] = {name: [] for name in CONFIGURATIONS}
    for _ in range(args.rounds):
        for name in CONFIGURATIONS:
            seconds[name].append(
                fresh_process(name, args.rows, args.width, args.first_batch_seconds)
            )
    print(
        f"first training step, fresh caches, batch {args.rows}x{args.width}, "
        f"the first batch made in {args.first_batch_seconds:g} s:"
    )
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    for name, value in medians.items():
        print(f"{name:36} {value:8.2f} s   (runs: {', '.join(f'{v:.2f}' for v in seconds[name])})")
    ratio = medians["defaults"] / medians["scalars only"]
    print(f"defaults / scalars only: {ratio:.2f}x (goal: at most 1.5x)")
    early = medians["defaults"] - medians[LATE]
    print(f"the early start of the build: {early:+.2f} s in the first step")


if __name__ == "__main__":
    main()
