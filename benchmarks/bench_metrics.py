"""Time and memory of the mismatch metrics, side by side with the original algorithm.

Run ``python benchmarks/bench_metrics.py`` (add ``--quick`` for a smaller run). For each
batch shape and dtype, on the CPU and on CUDA when present, it times interleaved, in one
process:

- ``seed``: the original algorithm (``seed_baseline.py``);
- ``ours``: ``calculate_debug_metrics`` (the same five metrics, through the statistics);
- ``catalog``: ``mismatch_metrics`` (every metric);
- ``no quantiles``: every metric but the quantiles (whose profile the catalog fills too),
  through ``MismatchStats``;
- ``read``: summing the three input tensors once, the floor any method must pay;

and prints medians and the ratios. ``read`` and ``ours`` are also timed on their own first
(the ``quiet`` columns): the seed's allocations slow every call that follows them, the
read most. Peak extra memory of one call: on the CPU, Linux's
peak resident memory above the inputs, in a fresh subprocess; on CUDA, the caching
allocator's peak above the inputs. ``--updates`` adds the peaks of one monitor update
(not timed): with the defaults and with scalars only.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from configurations import SCALARS_ONLY
from seed_baseline import seed_calculate_debug_metrics

from lightning_rollout_debug import GROUPS, RolloutDebugMonitor
from lightning_rollout_debug.functional import (
    calculate_debug_metrics,
    mismatch_metrics,
)
from lightning_rollout_debug.metrics import native
from lightning_rollout_debug.metrics.stats import MismatchStats

SHAPES = ((256, 4096), (512, 8192))
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def use_lanes(lanes: int | None) -> None:
    """Run the native kernel's build of ``lanes`` float32 lanes, as on a CPU whose widest
    vectors hold that many (``None``: the widest this CPU runs). Call it before the first
    update."""
    if lanes is not None:
        native.load(lanes)


def kernel_width() -> str:
    """The native CPU kernel's vector width (it follows the CPU), for a table's header."""
    lanes = native.vector_lanes()
    return "no native kernel" if lanes is None else f"native kernel of {lanes} lanes"


def make_batch(shape: tuple[int, int], dtype: torch.dtype, device: str) -> dict[str, torch.Tensor]:
    """A realistic batch: log-probs of sampled tokens, a small mismatch, padded rows.

    Filled in place, so making it leaves no freed temporaries behind that a later
    allocation could reuse unseen by the memory probe.
    """
    generator = torch.Generator().manual_seed(0)
    rows, width = shape
    options = {"dtype": dtype}
    rollout = torch.empty(shape, **options).uniform_(1e-6, 1.0, generator=generator).log_()
    old = torch.empty(shape, **options).normal_(0.0, 1e-2, generator=generator)
    old.add_(rollout).clamp_(max=0.0)
    lengths = torch.randint(width // 4, width + 1, (rows, 1), generator=generator)
    mask = (torch.arange(width).unsqueeze(0) < lengths).to(torch.int64)
    return {
        "rollout_log_probs": rollout.to(device),
        "old_log_probs": old.to(device),
        "response_mask": mask.to(device),
    }


def methods(batch: dict[str, torch.Tensor]) -> dict[str, Callable[[], object]]:
    """The functions to time, each a closure over ``batch``."""
    tensors = (batch["rollout_log_probs"], batch["old_log_probs"], batch["response_mask"])
    return {
        "read": lambda: torch.stack([t.sum().double() for t in tensors]).sum().item(),
        "seed": lambda: seed_calculate_debug_metrics(batch),
        "ours": lambda: calculate_debug_metrics(batch),
        "catalog": lambda: mismatch_metrics(*tensors),
        "no quantiles": lambda: all_but_the_quantiles(*tensors),
    }


UPDATES = {"update": {}, "update scalars": SCALARS_ONLY}
"""Monitor updates whose memory ``--updates`` measures: the defaults and scalars only."""


def probes(batch: dict[str, torch.Tensor]) -> dict[str, Callable[[], object]]:
    """What the memory probes measure: the methods and one update of a new monitor each."""
    monitors = {
        name: RolloutDebugMonitor(alert_ranges={}, **options) for name, options in UPDATES.items()
    }
    updates = {name: functools.partial(m.update, batch) for name, m in monitors.items()}
    return {**methods(batch), **updates}


def all_but_the_quantiles(*tensors: torch.Tensor) -> dict[str, float]:
    """Every metric of the catalog but the quantiles (no profile to fill)."""
    stats = MismatchStats(groups=[g for g in GROUPS if g not in ("quantiles", "token_ids")])
    stats.update(*tensors)
    return stats.compute()


def time_interleaved(
    calls: dict[str, Callable[[], object]], repeats: int, device: str
) -> dict[str, float]:
    """Median milliseconds of each call, taking turns so machine noise hits all alike."""

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    for call in calls.values():  # warm-up (and compilation, where it happens)
        call()
        call()
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            sync()
            start = time.perf_counter()
            call()
            sync()
            samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(values) for name, values in samples.items()}


def peak_memory_mb(method: str, shape: tuple[int, int], dtype: str, device: str) -> float:
    """Peak extra memory of one call of ``method``.

    On CUDA the caching allocator keeps its own high-water mark, so this process measures
    it; the CPU's resident-memory peak needs a fresh subprocess.
    """
    if device == "cuda":
        call = probes(make_batch(shape, DTYPES[dtype], device))[method]
        call()  # warm-up (and compilation, where it happens)
        return cuda_peak_mb(call)
    result = subprocess.run(
        [sys.executable, __file__, "--memory-probe", method, *map(str, shape), dtype, device],
        capture_output=True,
        text=True,
        check=True,
        # Large blocks straight from the kernel, so the resident peak sees every allocation
        # (glibc would otherwise recycle freed heap pages, which the peak cannot see).
        env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"},
    )
    return float(result.stdout.strip().splitlines()[-1])


def memory_probe(method: str, rows: int, width: int, dtype: str, device: str) -> None:
    """Print the peak extra memory (MB) of ``method``; run in a fresh process."""
    probes(make_batch((64, 1024), DTYPES[dtype], device))[method]()  # load, warm up, compile
    batch = make_batch((rows, width), DTYPES[dtype], device)
    call = probes(batch)[method]
    if device == "cuda":
        print(cuda_peak_mb(call))
        return
    # Linux's high-water mark of resident memory, reset just before the one call on the big
    # batch (``ru_maxrss`` would not do: a child inherits its parent's across fork and exec).
    Path("/proc/self/clear_refs").write_text("5")
    before = status_kib("VmRSS")
    call()
    print(max(status_kib("VmHWM") - before, 0) / 1024)


def status_kib(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status``."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def cuda_peak_mb(call: Callable[[], object]) -> float:
    """The CUDA allocator's peak above what was allocated before ``call``, in MB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    call()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def input_megabytes(batch: dict[str, torch.Tensor]) -> float:
    """Bytes of the three input tensors, in MB."""
    return sum(t.numel() * t.element_size() for t in batch.values()) / 2**20


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and print a table of medians and ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, few repeats")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds per method")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory probes")
    parser.add_argument(
        "--updates", action="store_true", help="also the peak memory of one monitor update"
    )
    parser.add_argument(
        "--device",
        action="append",
        choices=["cpu", "cuda"],
        help="where to run (repeatable; default: the CPU, and CUDA when present)",
    )
    parser.add_argument("--memory-probe", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_probe:
        method, rows, width, dtype, device = args.memory_probe
        memory_probe(method, int(rows), int(width), dtype, device)
        return

    shapes = ((64, 1024), (128, 2048)) if args.quick else SHAPES
    devices = args.device or ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    rows_out = []
    header = (
        f"{'device':6} {'shape':>10} {'dtype':9} {'read ms':>8} {'seed ms':>8} {'ours ms':>8} "
        f"{'catalog':>8} {'seed/ours':>9} {'ours/read':>9} {'cat/ours':>8} {'noq/ours':>8} "
        f"{'quiet read':>10} "
        f"{'quiet ours':>10} {'ours/read':>9} {'mem ours/in':>11} {'mem seed/in':>11}"
    )
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {kernel_width()}")
    print(header)
    for device in devices:
        for shape in shapes:
            for dtype_name, dtype in DTYPES.items():
                batch = make_batch(shape, dtype, device)
                calls = methods(batch)
                # First read and ours alone: the seed's allocations slow every call after
                # them, the read most.
                quiet = time_interleaved(
                    {name: calls[name] for name in ("read", "ours")}, args.repeats, device
                )
                ms = time_interleaved(calls, args.repeats, device)
                inputs_mb = input_megabytes(batch)
                mem = {}
                if not args.no_memory:
                    for method in ("seed", "ours", *list(UPDATES) * args.updates):
                        mem[method] = peak_memory_mb(method, shape, dtype_name, device) / inputs_mb
                row = {
                    "device": device,
                    "shape": list(shape),
                    "dtype": dtype_name,
                    "ms": ms,
                    "seed_over_ours": ms["seed"] / ms["ours"],
                    "ours_over_read": ms["ours"] / ms["read"],
                    "quiet_ms": quiet,
                    "quiet_ours_over_read": quiet["ours"] / quiet["read"],
                    "catalog_over_ours": ms["catalog"] / ms["ours"],
                    "no_quantiles_over_ours": ms["no quantiles"] / ms["ours"],
                    "memory_over_inputs": mem,
                }
                rows_out.append(row)
                print(
                    f"{device:6} {shape[0]:>4}x{shape[1]:<5} {dtype_name:9} {ms['read']:8.2f} "
                    f"{ms['seed']:8.2f} {ms['ours']:8.2f} {ms['catalog']:8.2f} "
                    f"{row['seed_over_ours']:9.1f} {row['ours_over_read']:9.2f} "
                    f"{row['catalog_over_ours']:8.2f} {row['no_quantiles_over_ours']:8.2f} "
                    f"{quiet['read']:10.2f} {quiet['ours']:10.2f} "
                    f"{row['quiet_ours_over_read']:9.2f} {mem.get('ours', float('nan')):11.3f} "
                    f"{mem.get('seed', float('nan')):11.3f}"
                )
                if "update" in mem:
                    print(
                        f"{'':18} peak of one update / inputs: the defaults "
                        f"{mem['update']:.2f}, scalars only {mem['update scalars']:.2f}"
                    )
    if args.json:
        args.json.write_text(json.dumps(rows_out, indent=2))


if __name__ == "__main__":
    main()
