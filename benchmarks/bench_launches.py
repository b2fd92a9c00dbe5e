"""How many operations one update costs: kernel launches on a GPU, torch operations on a CPU.

Each launch (or dispatched operation) carries a fixed cost, so their number is what a
small batch pays. For each shape, one training batch goes through the callback's update
with scalars only and with its defaults (histograms, worst tokens, profile), under the torch
profiler, after warm-up updates (compilation included):

* on CUDA: the kernels launched (``--device cuda``);
* on the CPU: the top-level torch operations dispatched (the native kernel itself is
  one call outside torch).

    python benchmarks/bench_launches.py [--device cuda] [--shapes 4x256,64x2048,256x4096] [--names]

``--names`` lists what one update with the defaults runs, by name and count.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_metrics import make_batch
from configurations import SCALARS_ONLY

from lightning_rollout_debug import RolloutDebugCallback


def update_of(batch: dict[str, torch.Tensor], **options: object) -> Callable[[], None]:
    """One training batch through the callback's update (no logging)."""
    callback = RolloutDebugCallback(alert_ranges={}, **options)  # type: ignore[arg-type]

    def update() -> None:
        callback.monitor.batches_in_window = 1
        callback._update({}, batch)

    return update


def launched(update: Callable[[], None], device: str) -> list[str]:
    """The kernels (CUDA) or top-level torch operations (CPU) of one update, by name."""
    for _ in range(3):
        update()
    if device == "cuda":
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            update()
            torch.cuda.synchronize()
        cuda = torch.autograd.DeviceType.CUDA
        return [e.name for e in prof.events() if e.device_type == cuda]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        update()
    return [e.name for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None]


def count(update: Callable[[], None], device: str) -> int:
    """Kernels launched (CUDA) or top-level torch operations (CPU) by one update."""
    return len(launched(update, device))


def main() -> None:
    """Print the counts per shape."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--shapes", default="4x256,64x2048,256x4096")
    parser.add_argument("--names", action="store_true", help="list the defaults' launches")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    what = "kernel launches" if args.device == "cuda" else "torch operations"
    print(f"torch {torch.__version__}, {args.device}: {what} per update")
    print(f"{'shape':>11} {'scalars only':>13} {'defaults':>9}")
    for text in args.shapes.split(","):
        shape = tuple(int(n) for n in text.split("x"))
        batch = make_batch(shape, torch.float32, args.device)
        scalars = count(update_of(batch, **SCALARS_ONLY), args.device)
        defaults = count(update_of(batch), args.device)
        print(f"{text:>11} {scalars:>13} {defaults:>9}")
        if args.names:
            for name, times in Counter(launched(update_of(batch), args.device)).items():
                print(f"{'':>11} {times:>3} x {name[:100]}")


if __name__ == "__main__":
    main()
