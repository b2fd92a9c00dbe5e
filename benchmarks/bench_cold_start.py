"""The first training step of a new process against a later one, on the CPU.

Each run is a fresh process with an empty inductor cache (``TORCHINDUCTOR_CACHE_DIR``), so
whatever the callback loads or compiles on its first batch is paid in the first step, as
on a new machine. It trains 51 steps, each of which logs: the first step's wall time is
compared with the 51st's, which draws the profile's pictures again as the first does
(every 50 steps), and the third's shows a step without them.
The configurations (the callback's defaults, scalars only, no callback) alternate, and the
medians are printed with the ratio of the first step to a later one, and the callback's
share of each: the first step, less the start-up that a run without the callback pays
too, against a later step.

    python benchmarks/bench_cold_start.py [--rows 64 --width 2048 --rounds 3]
                                          [--first-batch-seconds 0]

``--first-batch-seconds S`` makes the first training step wait ``S`` seconds (a rollout
sampled on an accelerator).
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

CONFIGURATIONS = ("without the callback", "defaults", "scalars only")


def first_step(
    configuration: str, rows: int, width: int, first_batch_seconds: float
) -> tuple[float, float]:
    """In this process: train 51 steps; the seconds of the first, the 51st and the third."""
    import pytorch_lightning as pl
    import torch
    from configurations import SCALARS_ONLY  # the script's folder is on sys.path
    from torch import nn
    from torch.utils.data import DataLoader

    from lightning_rollout_debug import RolloutDebugCallback

    warnings.filterwarnings("ignore")
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
        "scalars only": [RolloutDebugCallback(**SCALARS_ONLY, alert_ranges={})],
    }[configuration]
    model = Model()
    with tempfile.TemporaryDirectory() as logdir:
        trainer = pl.Trainer(
            accelerator="cpu",
            max_steps=51,
            log_every_n_steps=1,
            logger=pl.loggers.TensorBoardLogger(logdir),
            callbacks=callbacks,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )
        trainer.fit(model, DataLoader([batch] * 51, batch_size=None))
    return model.seconds[0], model.seconds[50], model.seconds[2]


def fresh_process(
    configuration: str, rows: int, width: int, first_batch_seconds: float
) -> tuple[float, float, float]:
    """:func:`first_step` in a new process with an empty inductor cache."""
    with tempfile.TemporaryDirectory() as inductor:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": inductor}
        command = [sys.executable, __file__, "--child", configuration, str(rows), str(width)]
        command.append(str(first_batch_seconds))
        result = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    first, again, plain = json.loads(result.stdout.strip().splitlines()[-1])
    return first, again, plain


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
    runs: dict[str, list[tuple[float, float, float]]] = {name: [] for name in CONFIGURATIONS}
    for _ in range(args.rounds):
        for name in CONFIGURATIONS:
            runs[name].append(fresh_process(name, args.rows, args.width, args.first_batch_seconds))
    print(
        f"training steps of a new process, batch {args.rows}x{args.width}, the first batch "
        f"made in {args.first_batch_seconds:g} s; medians of {args.rounds} processes (ms):"
    )
    median = {
        name: [statistics.median(run[i] for run in found) for i in range(3)]
        for name, found in runs.items()
    }
    for name in CONFIGURATIONS:
        first, again, plain = median[name]
        print(
            f"{name:22} step 1 {first * 1e3:7.1f}  step 51 {again * 1e3:6.1f}  "
            f"step 3 {plain * 1e3:6.1f}  step 1 / step 51 {first / again:5.2f}x"
        )
    alone = median["without the callback"]
    start_up = alone[0] - alone[1]  # what a first step costs more without the callback
    for name in ("defaults", "scalars only"):
        first, again, _ = median[name]
        print(
            f"{name}: the first step less the start-up a run without the callback pays too "
            f"({start_up * 1e3:.1f} ms) is {(first - start_up) / again:.2f}x step 51"
        )


if __name__ == "__main__":
    main()
