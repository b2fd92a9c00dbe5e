"""What segments add to the callback's update, as ratios to the update without them.

One training batch goes through the callback's update (no logging) on each CPU road:
``compile=False`` (eager torch arithmetic), ``compile=True`` (``torch.compile`` on the
CPU) and the default (the native kernel; with segments the batch takes the eager torch
road). Each road runs the batch without segments, with 16 turn-like segments (each row
cut into 16 contiguous runs) and with 16 random labels per token (the default
``max_segments`` and segment metrics); every configuration takes its turn in each round,
and the medians are printed with their ratios: to the same road without segments, and to
the default update without segments (what a run pays today). Beside them, the seed's
algorithm (``seed_baseline.py``: its five metrics) run once per segment on the segment's
mask, as one would measure segments without the feature.

The batch is that of the other benchmarks: right-padded rows of random lengths, about 62%
of the tokens counted, float32.

    python benchmarks/bench_segments.py [--shapes 64x2048,256x4096] [--rounds 20]
                                        [--roads eager,compiled,default] [--lanes 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_launches import update_of
from bench_metrics import kernel_width, make_batch, use_lanes
from seed_baseline import seed_calculate_debug_metrics

SEGMENTS = 16
ROADS: dict[str, bool | None] = {"eager": False, "compiled": True, "default": None}
"""The CPU roads, by the ``compile`` that takes them."""
LABELS = ("none", "turns", "random")


def turn_labels(mask: torch.Tensor, count: int = SEGMENTS, seed: int = 0) -> torch.Tensor:
    """``[B, T]`` int64 labels: each row cut into ``count`` contiguous runs of random
    lengths, labelled ``0 .. count - 1`` in order."""
    generator = torch.Generator().manual_seed(seed)
    rows, width = mask.shape
    cuts = torch.randint(0, width + 1, (rows, count - 1), generator=generator).sort(dim=1).values
    columns = torch.arange(width).view(1, width, 1)
    return (columns >= cuts.unsqueeze(1)).sum(dim=2)


def random_labels(mask: torch.Tensor, count: int = SEGMENTS, seed: int = 0) -> torch.Tensor:
    """``[B, T]`` int64 labels drawn uniformly from ``0 .. count - 1`` for each token."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, count, tuple(mask.shape), generator=generator)


def labelled(batch: dict[str, torch.Tensor], labels: str) -> dict[str, torch.Tensor]:
    """The batch with ``segment_ids`` of ``labels`` (``"none"``: the batch itself)."""
    if labels == "none":
        return batch
    make = turn_labels if labels == "turns" else random_labels
    return {**batch, "segment_ids": make(batch["response_mask"])}


def seed_per_segment(batch: dict[str, torch.Tensor]) -> Callable[[], None]:
    """The seed's algorithm once per segment with tokens, on the mask cut to its tokens."""
    labels = batch["segment_ids"]

    def call() -> None:
        for segment in range(SEGMENTS):
            mask = batch["response_mask"] * (labels == segment)
            if mask.any():  # the seed's max() refuses a segment without tokens
                seed_calculate_debug_metrics({**batch, "response_mask": mask})

    return call


def median_ms(calls: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median milliseconds of each call over interleaved rounds, after warm-up (and the
    compilations, which happen in the first calls)."""
    for call in calls.values():
        for _ in range(3):
            call()
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(values) for name, values in samples.items()}


def main() -> None:
    """Print the medians and ratios per shape."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="64x2048,256x4096")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--roads", default=",".join(ROADS))
    parser.add_argument("--no-seed", action="store_true", help="leave out the seed per segment")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    parser.add_argument(
        "--lanes", type=int, choices=(4, 8), help="run the native kernel's build of this many lanes"
    )
    args = parser.parse_args()
    use_lanes(args.lanes)
    warnings.filterwarnings("ignore")
    roads = [road for road in args.roads.split(",") if road]
    assert set(roads) <= set(ROADS), f"roads are {list(ROADS)}"
    print(
        f"torch {torch.__version__}, cpu, {torch.get_num_threads()} threads, {kernel_width()}; "
        f"{SEGMENTS} segments; medians of {args.rounds} interleaved rounds"
    )
    results = []
    for text in args.shapes.split(","):
        shape = tuple(int(n) for n in text.split("x"))
        batch = make_batch(shape, torch.float32, "cpu")
        counted = batch["response_mask"].float().mean().item()
        batches = {labels: labelled(batch, labels) for labels in LABELS}
        calls: dict[str, Callable[[], object]] = {
            f"{road}/{labels}": update_of(batches[labels], compile=ROADS[road])
            for road in (*roads, *(["default"] if "default" not in roads else []))
            for labels in LABELS
            if road in roads or labels == "none"
        }
        if not args.no_seed:
            calls["seed per segment"] = seed_per_segment(batches["turns"])
        ms = median_ms(calls, args.rounds)
        base = ms["default/none"]
        print(f"\n{text} ({counted:.0%} of the tokens counted); default without segments:")
        print(f"  {base:.3f} ms an update (the native kernel)")
        print(
            f"  {'road':9} {'none ms':>9} {'turns ms':>9} {'random ms':>9} "
            f"{'turns/none':>10} {'random/none':>11} {'turns/dflt':>10} {'random/dflt':>11}"
        )
        for road in roads:
            none, turns, scattered = (ms[f"{road}/{labels}"] for labels in LABELS)
            row = {
                "shape": list(shape),
                "road": road,
                "ms": {"none": none, "turns": turns, "random": scattered},
                "over_road": {"turns": turns / none, "random": scattered / none},
                "over_default": {
                    "none": none / base,
                    "turns": turns / base,
                    "random": scattered / base,
                },
            }
            results.append(row)
            print(
                f"  {road:9} {none:9.3f} {turns:9.3f} {scattered:9.3f} {turns / none:9.2f}x "
                f"{scattered / none:10.2f}x {turns / base:9.2f}x {scattered / base:10.2f}x"
            )
        if "seed per segment" in ms:
            seed = ms["seed per segment"]
            print(
                f"  the seed's five metrics once per segment (turns): {seed:.3f} ms, "
                f"{seed / base:.2f}x the default without segments"
            )
            results.append({"shape": list(shape), "road": "seed per segment", "ms": seed})
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
