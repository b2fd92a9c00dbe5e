"""What a logged step does on the host, part by part, with the defaults.

One merged window of the defaults (statistics, histograms, worst tokens, profile) over a
``[rows, width]`` batch, copied to the host once, then each part of a logged step that
the callback runs on the host, timed in interleaved rounds (medians):

* **metrics**: every metric of the window (``MismatchStats.compute``, the quantiles too);
* **summary**: the extras' host summary (histograms, worst tokens, the profile's
  token count and quantiles);
* **profile views**: the profile's buckets by position and by probability and its joint
  counts, read when the pictures are drawn;
* **draw**: drawing the three pictures;
* **pictures to TensorBoard**: the pictures through ``SummaryWriter.add_image``, as the
  callback writes them (the RGB arrays, encoded as PNGs by Pillow, queued as events);
* **palette PNG**: the pictures as palette PNGs (``profile_pngs``), for comparison;
* **checksum in Python**: TensorBoard's CRC-32C of PNGs of the pictures' size, which its
  writer thread computes in Python for every byte of every event;
* **scalars**: the window's scalars through Lightning's ``TensorBoardLogger.log_metrics``,
  as the callback logs them (an event per scalar through the writer's queue).

The batch is that of ``bench_trainer.py`` (``--mask random``: a scattered 80% of the
tokens counted, the default; ``--mask padded``: right-padded responses).

    python benchmarks/bench_logged_step.py [--rows 64 --width 2048 --rounds 100]
                                           [--mask random|padded]
"""

from __future__ import annotations

import argparse
import atexit
import io
import itertools
import math
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from PIL import Image
from pytorch_lightning.loggers import TensorBoardLogger
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_metrics import kernel_width
from bench_trainer import QUIET, RolloutBatches

from lightning_rollout_debug import RolloutDebugCallback
from lightning_rollout_debug.metrics.profile import PROFILE_SIZE, read_profile
from lightning_rollout_debug.views.canvas import encode_png
from lightning_rollout_debug.views.pictures import profile_images
from lightning_rollout_debug.views.tensorboard import log_scalars, write_profile


def rgb_png(image: Image.Image) -> bytes:
    """The picture as an RGB PNG, as a ``SummaryWriter`` encodes an ``add_image`` array."""
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="PNG")
    return buffer.getvalue()


def parts(rows: int, width: int, mask: str) -> tuple[dict[str, Callable[[], object]], int, int]:
    """The host parts of a logged step, each a closure over one window; the bytes of the
    pictures' PNGs as the writer stores them; the number of scalars."""
    callback = RolloutDebugCallback(**QUIET)  # type: ignore[arg-type]
    callback.monitor.batches_in_window = 1
    callback._update({}, RolloutBatches(rows, width, 1, mask).batch)
    stats, extras = callback.monitor._stats, callback.monitor._extras
    assert extras is not None
    host = extras.state.to("cpu", torch.float64).numpy().copy()
    block = host[-PROFILE_SIZE:]
    profile = extras.summary(host).profile
    images = profile_images(profile)
    pngs = [rgb_png(image) for image in images.values()]

    def views() -> object:
        fresh = read_profile(block)
        return fresh.by_position, fresh.by_probability, fresh.joint_counts

    metrics = stats.compute(profile)
    scalars = {f"training/{name}": v for name, v in metrics.items() if not math.isnan(v)}
    folder = tempfile.mkdtemp(prefix="bench-logged-step-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)  # removed when the process ends
    logger = TensorBoardLogger(folder, name="bench", version=0)
    writer = logger.experiment
    steps = itertools.count()

    found = {
        "metrics": lambda: stats.compute(profile),
        "summary": lambda: extras.summary(host),
        "profile views": views,
        "draw": lambda: profile_images(profile),
        "pictures to TensorBoard": lambda: write_profile(writer, "", profile, next(steps)),
        "palette PNG": lambda: [encode_png(image) for image in images.values()],
        "checksum in Python": lambda: [masked_crc32c(png) for png in pngs],
        "scalars": lambda: log_scalars(logger, scalars, next(steps)),
    }
    return found, sum(map(len, pngs)), len(scalars)


def main() -> None:
    """Print the median of each part, in milliseconds."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--mask", default="random", choices=("random", "padded"))
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    found, png_bytes, scalar_count = parts(args.rows, args.width, args.mask)
    times: dict[str, list[float]] = {name: [] for name in found}
    for part in found.values():  # warm-up: caches, fonts, text stamps
        part()
    for _ in range(args.rounds):
        for name, part in found.items():
            start = time.perf_counter()
            part()
            times[name].append(time.perf_counter() - start)
    print(
        f"torch {torch.__version__}, {kernel_width()}; a window of {args.rows}x{args.width}, "
        f"{args.mask} mask; medians of {args.rounds} interleaved rounds"
    )
    for name, values in times.items():
        print(f"  {name:22} {statistics.median(values) * 1e3:7.3f} ms")
    checksum = statistics.median(times["checksum in Python"])
    per_byte = checksum / png_bytes * 1e9
    print(f"  the pictures' RGB PNGs: {png_bytes} bytes, their checksum {per_byte:.0f} ns a byte")
    print(f"  the window's scalars: {scalar_count}")


if __name__ == "__main__":
    main()
