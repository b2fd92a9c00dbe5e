"""Screenshots of the TensorBoard dashboard of a real run, for ``docs/tensorboard.md``.

1. Trains ``examples/grpo_mismatch.py`` twice for ``--max-steps`` steps (the default
   bfloat16 rollout engine, and the same with stale weights, ``--weight-sync-every 4``),
   so every chart compares a small mismatch with a large one; the example imports the
   package of this checkout.
2. Starts ``tensorboard --logdir ... --host 127.0.0.1 --port ...`` and waits until it
   serves both runs' custom-scalars layout and profile pictures.
3. Takes PNG screenshots of the custom-scalars, histograms, text and images pages, and of
   the profile pictures on the Time Series page (``?tagFilter=rollout_profile``), with
   headless Chromium (``apt-get install chromium``) at TensorBoard's default card sizes.
4. Stops TensorBoard.

With ``--segments``, the screenshot of ``docs/segments.md`` instead: trains
``examples/multiturn_mismatch.py`` (a label a turn), copies the run's per-segment
scalars to a run of their own beside the segments category of the layout the monitor
writes (four of its charts, the other categories left out, so that the page shows them
alone), and takes the custom-scalars page.

    python scripts/screenshot_dashboard.py [--out docs/images] [--max-steps 30] [--segments]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_rollout_debug.views.canvas import TEXT_COLOUR

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "grpo_mismatch.py"
RUNS = {
    "bf16": ["--rollout-dtype", "bfloat16", "--weight-sync-every", "1"],
    "bf16-stale": ["--rollout-dtype", "bfloat16", "--weight-sync-every", "4"],
}
PAGES = {
    "tensorboard_custom_scalars.png": "#custom_scalars",
    "tensorboard_histograms.png": "#histograms",
    "tensorboard_worst_tokens.png": "#text",
    "tensorboard_profiles.png": "#images",
    "tensorboard_profiles_time_series.png": "?tagFilter=rollout_profile#timeseries",
}
"""Each screenshot and the page of TensorBoard it shows (the part of the URL after the host)."""
TALL_PAGES = {"tensorboard_profiles.png": 1360, "tensorboard_profiles_time_series.png": 1200}
"""Window heights of the pages whose cards do not fit the default window."""
SLOW_PAGES = {"tensorboard_profiles_time_series.png": 3.0}
"""How many times ``--wait-ms`` the pages that load their cards one by one take."""
PICTURE_PAGES = {"tensorboard_profiles.png", "tensorboard_profiles_time_series.png"}
"""The pages of the profile pictures: taken until two takes show the same pictures."""
PROFILE_TAG = "training/rollout_profile/"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]


def train(logdir: Path, max_steps: int) -> None:
    """Run the example once per setting, each into its own run directory."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    for name, flags in RUNS.items():
        command = [sys.executable, str(EXAMPLE), *flags, "--max-steps", str(max_steps)]
        command += ["--logdir", str(logdir / name)]
        print("+", " ".join(command), flush=True)
        subprocess.run(
            command,
            check=True,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": path},
        )


def wait_for_tensorboard(url: str, runs: int, timeout: float = 120.0) -> None:
    """Poll TensorBoard until it lists ``runs`` runs with custom-scalar layouts and pictures."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/data/plugin/custom_scalars/layout") as reply:
                layout = json.load(reply)
            with urllib.request.urlopen(f"{url}/data/runs") as reply:
                found = json.load(reply)
            with urllib.request.urlopen(f"{url}/data/plugin/images/tags") as reply:
                images = json.load(reply)
            pictures = [run for run, tags in images.items() if any(PROFILE_TAG in t for t in tags)]
            if layout.get("category") and len(found) >= runs and len(pictures) >= runs:
                return
        except OSError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"TensorBoard at {url} did not serve {runs} runs within {timeout} s")


def screenshot(chromium: str, url: str, out: Path, size: str, wait_ms: int) -> None:
    """One PNG of ``url`` with a fresh, throw-away Chromium profile."""
    with tempfile.TemporaryDirectory() as profile:
        command = [
            chromium,
            *CHROMIUM_FLAGS,
            f"--user-data-dir={profile}",
            f"--screenshot={out}",
            f"--window-size={size}",
            f"--virtual-time-budget={wait_ms}",
            url,
        ]
        subprocess.run(command, check=True, timeout=180, capture_output=True)
    print(f"wrote {out} ({out.stat().st_size} bytes)", flush=True)


def picture_ink(path: Path) -> int:
    """The pixels of the pictures' text colour in a screenshot.

    TensorBoard scales the pictures pixel by pixel, so their colours show unmixed; its own
    text is another grey.
    """
    pixels = np.asarray(Image.open(path).convert("RGB"))
    return int(np.all(pixels == np.asarray(TEXT_COLOUR, dtype=np.uint8), axis=-1).sum())


def screenshot_pictures(
    chromium: str, url: str, out: Path, size: str, wait_ms: int, tries: int = 6
) -> None:
    """Screenshots of a page of pictures until two in a row show the same pictures.

    A Time Series card loads its picture when it comes into view, and a headless take
    sometimes ends before every card has: a take whose pictures' ink differs from the
    previous take's is taken again.
    """
    seen = -1
    for _ in range(tries):
        screenshot(chromium, url, out, size, wait_ms)
        ink = picture_ink(out)
        if ink > 0 and ink == seen:
            return
        seen = ink
    raise RuntimeError(f"{out.name}: no two takes in {tries} showed the same pictures")


MULTITURN = ROOT / "examples" / "multiturn_mismatch.py"
SEGMENTS_PNG = "segments.png"
SEGMENT_CHARTS = (
    "rollout_actor_kl_k3",
    "rollout_probs_diff_mean",
    "rollout_log_probs_diff_mean",
    "rollout_probs_diff_max",
)
"""The charts of the segments category the screenshot shows (four fit the window)."""


def segments_only(logdir: Path, view: Path) -> None:
    """The per-segment scalars of the run in ``logdir``, and the segments category alone.

    Written to ``view`` with TensorBoard's own writer: the same values at the same steps,
    and the category as :func:`~lightning_rollout_debug.views.tensorboard.dashboard_layout`
    lays it out for the run's metrics.
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    from lightning_rollout_debug.views.tensorboard import dashboard_layout

    events = EventAccumulator(str(next(logdir.rglob("events.out.tfevents.*")).parent))
    events.Reload()
    tags = [tag for tag in events.Tags()["scalars"] if "/segments/" in tag]
    prefix = tags[0].split("segments/")[0]
    found = {tag.rsplit("/", 1)[1] for tag in tags}
    metrics = [metric for metric in SEGMENT_CHARTS if metric in found]
    writer = SummaryWriter(str(view / "multiturn"))
    writer.add_custom_scalars(dashboard_layout(prefix, [], metrics))
    for tag in tags:
        for event in events.Scalars(tag):
            writer.add_scalar(tag, event.value, event.step)
    writer.close()


def wait_for_layout(url: str, timeout: float = 120.0) -> None:
    """Poll TensorBoard until it serves a custom-scalars layout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/data/plugin/custom_scalars/layout") as reply:
                if json.load(reply).get("category"):
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"TensorBoard at {url} served no layout within {timeout} s")


@contextlib.contextmanager
def serving(tensorboard: str, logdir: Path, port: int) -> Iterator[str]:
    """TensorBoard serving ``logdir`` on ``port`` for the block; its URL."""
    server = subprocess.Popen(
        [tensorboard, "--logdir", str(logdir), "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def segments_screenshot(chromium: str, tensorboard: str, args: argparse.Namespace) -> None:
    """``segments.png``: the segments category of the multi-turn example's run."""
    logdir = args.logdir or Path(tempfile.mkdtemp(prefix="rollout-debug-segments-"))
    if not any(logdir.rglob("events.out.tfevents.*")):
        command = [sys.executable, str(MULTITURN), "--max-steps", str(args.max_steps)]
        print("+", " ".join(command), flush=True)
        command += ["--logdir", str(logdir)]
        subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    view = Path(tempfile.mkdtemp(prefix="rollout-debug-segments-view-"))
    segments_only(logdir, view)
    with serving(tensorboard, view, args.port) as url:
        wait_for_layout(url)
        size = f"{args.window_size.split(',')[0]},860"
        screenshot(chromium, f"{url}/#custom_scalars", args.out / SEGMENTS_PNG, size, args.wait_ms)
    print(f"logs in {logdir}")


def main(argv: list[str] | None = None) -> None:
    """Train, serve, screenshot, stop."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images")
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--logdir", type=Path, help="reuse (or keep) the logs here")
    parser.add_argument("--port", type=int, default=6006)
    parser.add_argument("--window-size", default="1400,1000")
    parser.add_argument("--wait-ms", type=int, default=15000, help="Chromium virtual time")
    parser.add_argument("--segments", action="store_true", help="segments.png alone")
    args = parser.parse_args(argv)

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        parser.error("needs Chromium: apt-get install -y chromium")
    tensorboard = shutil.which("tensorboard") or str(Path(sys.executable).parent / "tensorboard")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.segments:
        segments_screenshot(chromium, tensorboard, args)
        return
    logdir = args.logdir or Path(tempfile.mkdtemp(prefix="rollout-debug-tb-"))
    if not any(logdir.rglob("events.out.tfevents.*")):
        train(logdir, args.max_steps)
    with serving(tensorboard, logdir, args.port) as url:
        wait_for_tensorboard(url, runs=len(RUNS))
        for name, page in PAGES.items():
            size = args.window_size
            if name in TALL_PAGES:
                size = f"{size.split(',')[0]},{TALL_PAGES[name]}"
            wait_ms = round(args.wait_ms * SLOW_PAGES.get(name, 1.0))
            take = screenshot_pictures if name in PICTURE_PAGES else screenshot
            take(chromium, f"{url}/{page}", args.out / name, size, wait_ms)
    print(f"logs in {logdir}")


if __name__ == "__main__":
    main()
