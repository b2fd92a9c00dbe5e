"""Screenshots of the TensorBoard dashboard of a real run, for ``docs/tensorboard.md``.

1. Trains ``examples/grpo_mismatch.py`` twice for ``--max-steps`` steps (the default
   bfloat16 rollout engine, and the same with stale weights, ``--weight-sync-every 4``),
   so every chart compares a small mismatch with a large one.
2. Starts ``tensorboard --logdir ... --host 127.0.0.1`` and waits until it serves the runs.
3. Takes PNG screenshots of the custom-scalars, histograms, text and images pages with
   headless Chromium (``apt-get install chromium``).
4. Stops TensorBoard.

    python scripts/screenshot_dashboard.py [--out docs/images] [--max-steps 30]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "grpo_mismatch.py"
RUNS = {
    "bf16": ["--rollout-dtype", "bfloat16", "--weight-sync-every", "1"],
    "bf16-stale": ["--rollout-dtype", "bfloat16", "--weight-sync-every", "4"],
}
PAGES = {
    "tensorboard_custom_scalars.png": "custom_scalars",
    "tensorboard_histograms.png": "histograms",
    "tensorboard_worst_tokens.png": "text",
    "tensorboard_profiles.png": "images",
}
TALL_PAGES = {"tensorboard_profiles.png": 1420}
"""Window heights of the pages whose cards do not fit the default window."""
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
    for name, flags in RUNS.items():
        command = [sys.executable, str(EXAMPLE), *flags, "--max-steps", str(max_steps)]
        command += ["--logdir", str(logdir / name)]
        print("+", " ".join(command), flush=True)
        subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)


def wait_for_tensorboard(url: str, runs: int, timeout: float = 120.0) -> None:
    """Poll TensorBoard until it lists ``runs`` runs with custom-scalar layouts."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/data/plugin/custom_scalars/layout") as reply:
                layout = json.load(reply)
            with urllib.request.urlopen(f"{url}/data/runs") as reply:
                found = json.load(reply)
            if layout.get("category") and len(found) >= runs:
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


def main(argv: list[str] | None = None) -> None:
    """Train, serve, screenshot, stop."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images")
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--logdir", type=Path, help="reuse (or keep) the logs here")
    parser.add_argument("--port", type=int, default=6006)
    parser.add_argument("--window-size", default="1400,1000")
    parser.add_argument("--wait-ms", type=int, default=15000, help="Chromium virtual time")
    args = parser.parse_args(argv)

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        parser.error("needs Chromium: apt-get install -y chromium")
    tensorboard = shutil.which("tensorboard") or str(Path(sys.executable).parent / "tensorboard")
    logdir = args.logdir or Path(tempfile.mkdtemp(prefix="rollout-debug-tb-"))
    if not any(logdir.rglob("events.out.tfevents.*")):
        train(logdir, args.max_steps)
    args.out.mkdir(parents=True, exist_ok=True)

    url = f"http://127.0.0.1:{args.port}"
    server = subprocess.Popen(
        [tensorboard, "--logdir", str(logdir), "--host", "127.0.0.1", "--port", str(args.port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    try:
        wait_for_tensorboard(url, runs=len(RUNS))
        for name, page in PAGES.items():
            size = args.window_size
            if name in TALL_PAGES:
                size = f"{size.split(',')[0]},{TALL_PAGES[name]}"
            screenshot(chromium, f"{url}/#{page}", args.out / name, size, args.wait_ms)
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    print(f"logs in {logdir}")


if __name__ == "__main__":
    main()
