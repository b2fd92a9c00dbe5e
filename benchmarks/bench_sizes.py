"""Every batch size, from a handful of rows to millions of tokens: no size slower than the seed.

For each shape (float32 log-probs, an int64 right-padded mask), interleaved in one
process: the original algorithm (``seed``), ``calculate_debug_metrics`` (``ours``), and
the callback's update with its defaults (statistics, histograms, worst tokens, profile) of
one training batch (``update``). Prints the medians in nanoseconds per token, the seed
against each, and how much the per-token cost of ``ours`` and ``update`` changes from
one shape to the next (a cliff shows as a jump).

    python benchmarks/bench_sizes.py [--repeats 9] [--largest 1024x16384] [--device cuda]

On CUDA every call is timed up to the end of its kernels (a device synchronisation).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_metrics import kernel_width, make_batch
from seed_baseline import seed_calculate_debug_metrics

from lightning_rollout_debug import RolloutDebugCallback
from lightning_rollout_debug.functional import calculate_debug_metrics

SHAPES = (
    (4, 256),
    (8, 512),
    (16, 1024),
    (32, 2047),
    (32, 2048),
    (64, 2048),
    (128, 4096),
    (256, 4096),
    (512, 8192),
    (1024, 16384),
)


def update_of(batch: dict[str, torch.Tensor]) -> Callable[[], object]:
    """One training batch through the callback with its defaults (no logging)."""
    callback = RolloutDebugCallback(alert_ranges={})

    def update() -> None:
        callback.monitor.batches_in_window = 1
        callback._update({}, batch)
        callback.monitor._stats.reset()
        if callback.monitor._extras is not None:
            callback.monitor._extras.reset()

    return update


def finished(call: Callable[[], object], device: str) -> Callable[[], object]:
    """``call``, returning once the device has finished its work."""
    if device != "cuda":
        return call

    def call_and_wait() -> object:
        result = call()
        torch.cuda.synchronize()
        return result

    return call_and_wait


def median_ms(calls: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    for call in calls.values():
        call()
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(values) for name, values in samples.items()}


def main() -> None:
    """Time every shape and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--largest", default="1024x16384", help="skip shapes above this one")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    largest = tuple(int(n) for n in args.largest.split("x"))
    shapes = [s for s in SHAPES if s[0] * s[1] <= largest[0] * largest[1]]
    threads = torch.get_num_threads()
    where = torch.cuda.get_device_name() if args.device == "cuda" else kernel_width()
    print(f"torch {torch.__version__}, {threads} threads, {where}; ns per token")
    print(
        f"{'shape':>11} {'seed':>8} {'ours':>8} {'update':>8} {'seed/ours':>9} "
        f"{'seed/update':>11} {'ours step':>9} {'update step':>11}"
    )
    previous: dict[str, float] = {}
    for shape in shapes:
        batch = make_batch(shape, torch.float32, args.device)
        calls = {
            "seed": lambda b=batch: seed_calculate_debug_metrics(b),
            "ours": lambda b=batch: calculate_debug_metrics(b),
            "update": update_of(batch),
        }
        calls = {name: finished(call, args.device) for name, call in calls.items()}
        repeats = args.repeats if shape[0] * shape[1] < 1 << 22 else max(3, args.repeats // 3)
        ms = median_ms(calls, repeats)
        tokens = shape[0] * shape[1]
        ns = {name: value * 1e6 / tokens for name, value in ms.items()}
        steps = {
            name: ns[name] / previous[name] if name in previous else float("nan")
            for name in ("ours", "update")
        }
        print(
            f"{shape[0]:>5}x{shape[1]:<5} {ns['seed']:8.1f} {ns['ours']:8.1f} "
            f"{ns['update']:8.1f} {ns['seed'] / ns['ours']:9.2f} "
            f"{ns['seed'] / ns['update']:11.2f} {steps['ours']:9.2f} {steps['update']:11.2f}"
        )
        previous = ns


if __name__ == "__main__":
    main()
