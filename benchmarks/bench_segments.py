"""The cost of segment labels: a monitor's default update with and without them.

For each shape, a ``RolloutDebugMonitor(alert_ranges={})`` with its defaults updates the
same float32 batch (a small mismatch, right-padded rows) without labels and with each
kind of labels, interleaved in one process:

- ``none``: no ``segment_ids``;
- ``turns``: ``[B, T]`` labels of 16 turn-like runs a row (16 equal spans);
- ``uneven``: 16 turns a row of random lengths (their ends anywhere in a vector);
- ``random``: ``[B, T]`` labels, one of 16 drawn at random for every token;
- ``rows``: ``[B]`` labels, one of 16 a sequence.

Each round times ``--updates`` consecutive updates of each (their folds included); printed
per kind: the median over the rounds of the mean update, the median and range of the
per-round ratios to ``none``, and the ratio of the fastest rounds (``fastest``: on a
shared machine, the least disturbed).

``--compile false`` times the eager torch road (what an accelerator runs without
``torch.compile``), ``--compile true`` the compiled one where the kernel does not apply.
``--device cuda`` times the accelerator's road (compiled by default), the device
synchronised at the end of each round's updates.

    OMP_NUM_THREADS=1 python benchmarks/bench_segments.py [--rounds 7] [--updates 32]
        [--compile none|false|true] [--kinds none,turns,...] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_metrics import kernel_width, make_batch

from lightning_rollout_debug import RolloutDebugMonitor

SHAPES = ((64, 2048), (256, 4096))
SEGMENTS = 16


def labels(kind: str, rows: int, width: int) -> torch.Tensor | None:
    """The ``segment_ids`` of ``kind`` for a ``[rows, width]`` batch (``None``: none)."""
    generator = torch.Generator().manual_seed(1)
    if kind == "turns":
        turns = torch.arange(width).mul(SEGMENTS).div(width, rounding_mode="floor")
        return turns.expand(rows, width).contiguous()
    if kind == "uneven":
        ends = torch.rand(rows, SEGMENTS - 1, generator=generator).mul(width).long().sort(1)[0]
        return torch.searchsorted(ends, torch.arange(width).expand(rows, width), right=True)
    if kind == "random":
        return torch.randint(0, SEGMENTS, (rows, width), generator=generator)
    if kind == "rows":
        return torch.randint(0, SEGMENTS, (rows,), generator=generator)
    return None


def seconds_per_update(monitor: RolloutDebugMonitor, batch: dict, updates: int) -> float:
    """The mean time of ``updates`` consecutive updates of ``batch``, then a fresh window."""
    cuda = batch["response_mask"].is_cuda
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(updates):
        monitor.update(batch)
    if cuda:
        torch.cuda.synchronize()
    elapsed = (time.perf_counter() - start) / updates
    monitor.reset()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--updates", type=int, default=32)
    parser.add_argument("--kinds", default="none,turns,uneven,random,rows")
    parser.add_argument("--compile", choices=("none", "false", "true"), default="none")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    compile = {"none": None, "false": False, "true": True}[args.compile]
    kinds = args.kinds.split(",")
    warnings.simplefilter("ignore")
    device = torch.cuda.get_device_name() if args.device == "cuda" else kernel_width()
    print(f"torch threads: {torch.get_num_threads()}, {device}, compile={compile}")
    for rows, width in SHAPES:
        base = make_batch((rows, width), torch.float32, args.device)
        batches = {}
        for kind in kinds:
            found = labels(kind, rows, width)
            batches[kind] = (
                base if found is None else {**base, "segment_ids": found.to(args.device)}
            )
        monitors = {kind: RolloutDebugMonitor(alert_ranges={}, compile=compile) for kind in kinds}
        for kind in kinds:  # warm up: the kernel loaded, the workspaces made
            seconds_per_update(monitors[kind], batches[kind], 2)
        times: dict[str, list[float]] = {kind: [] for kind in kinds}
        for _ in range(args.rounds):
            for kind in kinds:
                times[kind].append(seconds_per_update(monitors[kind], batches[kind], args.updates))
        for kind in kinds:
            median = statistics.median(times[kind]) * 1e3
            ratio = ""
            if "none" in times:
                pairs = zip(times[kind], times["none"], strict=True)
                ratios = [mine / base for mine, base in pairs]
                low, high = min(ratios), max(ratios)
                fastest = min(times[kind]) / min(times["none"])
                ratio = f"  {statistics.median(ratios):6.2f}x ({low:.2f} to {high:.2f})"
                ratio += f", fastest {fastest:.2f}x"
            print(f"{rows}x{width} {kind:>7}: {median:9.3f} ms{ratio}")


if __name__ == "__main__":
    main()
