"""What each extra adds to the callback's update, as a ratio to the update with scalars only.

One training batch goes through the callback's update (no logging) with scalars only,
with each extra alone (worst tokens, histograms, the profile of the quantiles and
pictures), without the profile (histograms and worst tokens: the defaults before the
profile) and with the defaults; configurations interleave in one process, and the
medians over rounds are printed with their ratio to scalars only. On CPUs each is one
pass of the native kernel, so the ratios are what each extra costs that pass; on the
steps that do not log, the update is the whole of the callback's cost. The profile's
share is also printed per counted token: what the defaults add to the update without the
profile, a figure that does not move with the rest of the update.

The batch is that of the other benchmarks (right-padded rows of random lengths, about 62%
of the tokens counted), or with ``--mask random`` that of ``bench_trainer.py`` (a random
80% of the tokens counted, scattered): the extras cost per counted token, and a vector
of padding costs them nothing.

    python benchmarks/bench_update_parts.py [--shapes 64x2048,256x4096] [--rounds 200]
                                            [--mask padded|random] [--lanes 8]
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

from bench_launches import update_of
from bench_metrics import kernel_width, make_batch, use_lanes
from bench_trainer import RolloutBatches
from configurations import NO_PROFILE, SCALARS_ONLY, WITH_PROFILE

CONFIGURATIONS: dict[str, dict[str, object]] = {
    "scalars only": SCALARS_ONLY,
    "+ worst tokens": {**SCALARS_ONLY, "worst_tokens_k": 10},
    "+ histograms": {**SCALARS_ONLY, "histograms": True},
    "+ profile": {**SCALARS_ONLY, "groups": WITH_PROFILE, "profile_images": True},
    "no profile": NO_PROFILE,
    "defaults": {},
}


def main() -> None:
    """Print the medians and ratios per shape."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="64x2048,256x4096")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--mask", default="padded", choices=("padded", "random"))
    parser.add_argument(
        "--lanes",
        type=int,
        choices=(4, 8),
        help="run the native kernel's build of this many lanes",
    )
    args = parser.parse_args()
    use_lanes(args.lanes)
    warnings.filterwarnings("ignore")
    print(
        f"torch {torch.__version__}, {args.device}, {torch.get_num_threads()} threads, "
        f"{kernel_width()}; {args.mask} mask; medians of {args.rounds} interleaved rounds"
    )
    for text in args.shapes.split(","):
        shape = tuple(int(n) for n in text.split("x"))
        if args.mask == "random":
            rows, width = shape
            batch = {k: t.to(args.device) for k, t in RolloutBatches(rows, width, 1).batch.items()}
        else:
            batch = make_batch(shape, torch.float32, args.device)
        counted = batch["response_mask"].float().mean().item()
        updates = {name: update_of(batch, **options) for name, options in CONFIGURATIONS.items()}
        times: dict[str, list[float]] = {name: [] for name in updates}
        for update in updates.values():  # warm-up: the kernel's build, the caches
            for _ in range(5):
                update()
        for _ in range(args.rounds):
            for name, update in updates.items():
                if args.device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                update()
                if args.device == "cuda":
                    torch.cuda.synchronize()
                times[name].append(time.perf_counter() - start)
        base = statistics.median(times["scalars only"])
        print(f"{text} ({counted:.0%} of the tokens counted):")
        for name, values in times.items():
            ms = statistics.median(values) * 1e3
            print(f"  {name:15} {ms:8.3f} ms   {ms / (base * 1e3):5.2f}x scalars only")
        no_profile = statistics.median(times["no profile"])
        defaults = statistics.median(times["defaults"])
        print(f"  defaults / no profile: {defaults / no_profile:.2f}x")
        tokens = counted * shape[0] * shape[1]
        print(
            f"  the profile: {(defaults - no_profile) * 1e6:+.1f} µs an update, "
            f"{(defaults - no_profile) * 1e9 / tokens:.2f} ns per counted token"
        )


if __name__ == "__main__":
    main()
