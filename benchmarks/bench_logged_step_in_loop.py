"""A logged step inside a loop of updates, part by part: the defaults against no profile.

Two ``RolloutDebugMonitor`` take turns: each gets a window of ``--updates`` batches (the
batch of ``bench_trainer.py``) and then logs it to a ``TensorBoardLogger``, so that a
logged step finds the caches as a training loop leaves them (``bench_logged_step.py``
times the same parts back to back, warm). The parts of the logged step are timed where
the monitor calls them:

* **pictures**: the profile's pictures written (their views, drawing, PNGs and events);
* **summary**: the extras' summary read from the host copy (with the profile: its block
  and quantiles);
* **merge**: the window's waiting states merged (those of the last fold, 32, and the
  rest);
* **rest**: everything else of the logged step (the host copy, metrics, scalars,
  histograms, worst tokens, diagnoses, alerts);

and, beside them, an update, and a whole window: its updates and its logged step.
Medians over the windows after the first two (which warm up).

    python benchmarks/bench_logged_step_in_loop.py [--rows 64 --width 2048 --windows 24]
                                                   [--updates 49] [--mask random|padded]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from pytorch_lightning.loggers import TensorBoardLogger

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_metrics import kernel_width
from bench_trainer import QUIET, RolloutBatches
from configurations import NO_PROFILE

from lightning_rollout_debug import RolloutDebugMonitor
from lightning_rollout_debug.loop import logs
from lightning_rollout_debug.loop.window import DeviceWindow
from lightning_rollout_debug.metrics.extras import TokenExtras

CONFIGURATIONS: dict[str, dict[str, Any]] = {"defaults": {}, "no profile": dict(NO_PROFILE)}
PARTS = {
    "pictures": (logs, "write_profile"),
    "summary": (TokenExtras, "summary"),
    "merge": (DeviceWindow, "merged"),
}


@contextlib.contextmanager
def timed(owner: Any, name: str, seconds: list[float]) -> Iterator[None]:
    """``owner.name`` appends the wall time of each call to ``seconds`` while inside."""
    original: Callable[..., Any] = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - start)

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        setattr(owner, name, original)


def measure(args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    """Per configuration, per part: the seconds of each window's logged step."""
    batch = RolloutBatches(args.rows, args.width, 1, args.mask).batch
    monitors = {
        name: RolloutDebugMonitor(**QUIET, **kwargs) for name, kwargs in CONFIGURATIONS.items()
    }
    found: dict[str, dict[str, list[float]]] = {
        name: {part: [] for part in [*PARTS, "rest", "logged step", "update", "window"]}
        for name in monitors
    }
    step = 0
    with tempfile.TemporaryDirectory() as folder:
        logger = TensorBoardLogger(folder, name="bench", version=0)
        for _ in range(args.windows):
            for name, monitor in monitors.items():
                times = found[name]
                updates = 0.0
                for _ in range(args.updates):
                    start = time.perf_counter()
                    monitor.update(batch)
                    times["update"].append(time.perf_counter() - start)
                    updates += times["update"][-1]
                step += args.updates + 1
                spent: dict[str, list[float]] = {part: [] for part in PARTS}
                with contextlib.ExitStack() as stack:
                    for part, (owner, attribute) in PARTS.items():
                        stack.enter_context(timed(owner, attribute, spent[part]))
                    start = time.perf_counter()
                    monitor.log(step, [logger])
                    logged = time.perf_counter() - start
                for part, seconds in spent.items():
                    times[part].append(sum(seconds))
                times["rest"].append(logged - sum(map(sum, spent.values())))
                times["logged step"].append(logged)
                times["window"].append(updates + logged)
        logger.finalize("success")
    return found


def main(argv: list[str] | None = None) -> None:
    """Print each part's median per configuration, in milliseconds."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--windows", type=int, default=24, help="windows per configuration")
    parser.add_argument("--updates", type=int, default=49, help="updates a window")
    parser.add_argument("--mask", default="random", choices=("random", "padded"))
    args = parser.parse_args(argv)
    if args.windows < 3:
        parser.error(f"--windows must be at least 3 (two warm up), got {args.windows}")
    warnings.filterwarnings("ignore")
    found = measure(args)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {kernel_width()}; "
        f"windows of {args.updates} updates of {args.rows}x{args.width}, {args.mask} mask, "
        f"then a logged step; medians of {args.windows - 2} windows, ms"
    )
    names = list(found)
    print(f"  {'':12}" + "".join(f"{name:>13}" for name in names))
    for part in found[names[0]]:
        first = 2 * args.updates if part == "update" else 2  # after two windows
        medians = [statistics.median(found[name][part][first:]) * 1e3 for name in names]
        print(f"  {part:12}" + "".join(f"{value:13.3f}" for value in medians))


if __name__ == "__main__":
    main()
