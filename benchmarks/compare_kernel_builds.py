"""Two builds of the native kernel, taking turns in one process: build time, speed, results.

The kernel's source at a git revision (``--before``, by default ``HEAD``) and the source in
the working tree are each built with the flags ``setup.py`` builds the package's kernel
with (OpenMP included; the widest width this CPU runs, or ``--lanes``) and the C++
compiler on ``PATH`` (``$CXX``, else ``c++``) in a private temporary folder, timed,
loaded and checked as the package checks its kernel. Then both passes run on the
same batches, taking turns over ``--rounds`` rounds, for the seed group, every group and
the callback's defaults (histograms, 10 worst tokens, the profile), with float32 and
bfloat16 log-probs and a scattered bool mask (``random``) or right-padded int64 one
(``padded``). Printed per case: each build's median time, the medians and range of the
per-round ratios ``after / before``, and whether both wrote the same bits.

    python benchmarks/compare_kernel_builds.py [--before HEAD~1] [--shapes 64x2048,256x4096]
                                               [--rounds 15] [--lanes 8]

``--lanes 8`` (or 4) builds both at that vector width, as the package's build of that
width is made.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_metrics import make_batch
from bench_trainer import RolloutBatches

from lightning_rollout_debug import RolloutDebugCallback
from lightning_rollout_debug.metrics import native
from lightning_rollout_debug.metrics.native import loader, passes
from lightning_rollout_debug.metrics.rows import ROW_FIELDS

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "lightning_rollout_debug" / "metrics" / "native" / "row_sums.cpp"
LEVELS = {"seed": 0, "every group": 3, "defaults": 3}


def package_flags(lanes: int) -> list[str]:
    """The flags of the package's build of ``lanes`` lanes (``setup.py``)."""
    spec = importlib.util.spec_from_file_location("package_build", ROOT / "setup.py")
    assert spec is not None and spec.loader is not None
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)  # its flags; nothing is built
    widths = build.widths()
    return [*build.FLAGS, *widths[lanes], f"-DROLLOUT_LANES={lanes}", "-shared", "-fPIC"]


def build(source: bytes, folder: Path, name: str, lanes: int) -> tuple[Any, float]:
    """Build ``source`` into ``folder``; the bound row-sums entry and the build's seconds.

    A build from before the segments, whose row function takes none of their arguments, is
    bound alone and called without them (:func:`without_segments`).
    """
    output = folder / f"{name}.so"
    compiler = os.environ.get("CXX") or "c++"
    command = [compiler, *package_flags(lanes), "-x", "c++", "-", "-o", str(output)]
    start = time.perf_counter()
    done = subprocess.run(command, input=source, capture_output=True, check=False, cwd=folder)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"the {name} build failed:\n{done.stderr.decode()}")
    library = ctypes.CDLL(str(output))
    if not hasattr(library, "rollout_finish_segments"):
        return without_segments(library.rollout_row_sums), seconds
    function, _, _ = loader.bind(library, output, tuple(ROW_FIELDS))
    return function, seconds


def without_segments(function: Any) -> Callable[..., int]:
    """The row function of a build from before the segments, called as a later one is."""
    int64, pointer = ctypes.c_int64, ctypes.c_void_p
    function.restype = ctypes.c_int
    function.argtypes = [*(pointer,) * 3, *(ctypes.c_int,) * 2, int64, int64, ctypes.c_int,
                         ctypes.c_float, ctypes.c_float, ctypes.c_int, *(pointer,) * 4]  # fmt: skip

    def call(*arguments: Any) -> int:
        return function(*arguments[: len(function.argtypes)])

    return call


def case(
    functions: dict[str, Any], shape: tuple[int, int], dtype: torch.dtype, mask: str, what: str
) -> tuple[dict[str, Callable[[], int]], Callable[[], bool]]:
    """One call per build on the same batch, and a check that their outputs are the same."""
    rows, width = shape
    batch = (
        RolloutBatches(rows, width, 1, "random").batch
        if mask == "random"
        else make_batch(shape, torch.float32, "cpu")
    )
    rollout, old = (
        batch[key].to(dtype).contiguous() for key in ("rollout_log_probs", "old_log_probs")
    )
    flags = batch["response_mask"]
    flags = (flags if flags.dtype in passes._MASK_KINDS else flags != 0).contiguous()
    extras = RolloutDebugCallback().monitor._extras
    request = extras.kernel_request() if what == "defaults" and extras is not None else None
    kind = passes._LOG_PROB_KINDS[dtype]
    threads = passes._threads(rows * width, profile=request is not None)
    calls, outputs = {}, {}
    for name, function in functions.items():
        table = torch.empty(rows, len(ROW_FIELDS), dtype=torch.float64)
        kept = [table]
        pointers: list[int | None] = [None, None, None]
        if request is not None:
            settings = passes._settings(request)
            extras_rows = torch.empty(
                rows, native.EXTRAS_MOMENTS + 2 * request.k, dtype=torch.float64
            )
            bins = torch.zeros(request.summed_size(), dtype=torch.float64)
            kept += [extras_rows, bins]
            pointers = [settings.data_ptr(), extras_rows.data_ptr(), bins.data_ptr()]

        def call(
            function: Any = function, table: torch.Tensor = table, pointers: list = pointers
        ) -> int:
            return function(
                rollout.data_ptr(), old.data_ptr(), flags.data_ptr(), kind,
                passes._MASK_KINDS[flags.dtype], rows, width, LEVELS[what], 1.0, -0.5, threads,
                table.data_ptr(), *pointers, None, 0, 0, 0, 0, None,
            )  # fmt: skip

        calls[name], outputs[name] = call, kept

    def same() -> bool:
        for call in calls.values():
            assert call() == 0
        before, after = outputs.values()
        return all(torch.equal(x, y) for x, y in zip(before, after, strict=True))

    return calls, same


def main() -> None:
    """Build both, then print the cases' times and ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="HEAD", help="git revision of the first build")
    parser.add_argument("--shapes", default="64x2048,256x4096,512x8192")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--lanes", type=int, choices=(4, 8, 16), help="force this vector width")
    args = parser.parse_args()
    relative = SOURCE.relative_to(ROOT)
    lanes = args.lanes or loader.cpu_lanes()
    before = subprocess.run(
        ["git", "show", f"{args.before}:{relative}"], capture_output=True, check=True
    ).stdout
    sources = {"before": before, "after": SOURCE.read_bytes()}
    with tempfile.TemporaryDirectory(prefix="kernel-builds-") as folder:  # 0700
        functions = {}
        for name, source in sources.items():
            functions[name], seconds = build(source, Path(folder), name, lanes)
            origin = args.before if name == "before" else "the working tree"
            print(f"{name} ({origin}): built in {seconds:.1f} s")
        threads = torch.get_num_threads()
        print(f"torch {torch.__version__}, {threads} threads; medians of {args.rounds} rounds")
        for text in args.shapes.split(","):
            shape = tuple(int(n) for n in text.split("x"))
            repeats = max(1, 2_000_000 // (shape[0] * shape[1]))
            for dtype in (torch.float32, torch.bfloat16):
                for mask in ("random", "padded"):
                    for what in LEVELS:
                        calls, same = case(functions, shape, dtype, mask, what)
                        times: dict[str, list[float]] = {name: [] for name in calls}
                        for _ in range(args.rounds):
                            for name, call in calls.items():
                                start = time.perf_counter()
                                for _ in range(repeats):
                                    call()
                                times[name].append((time.perf_counter() - start) / repeats * 1e3)
                        ratios = [
                            a / b for a, b in zip(times["after"], times["before"], strict=True)
                        ]
                        print(
                            f"{text:>9} {str(dtype)[6:]:8} {mask:6} {what:11} "
                            f"before {statistics.median(times['before']):7.3f} ms  "
                            f"after {statistics.median(times['after']):7.3f} ms  "
                            f"after/before {statistics.median(ratios):.3f} "
                            f"({min(ratios):.2f} to {max(ratios):.2f})  same bits: {same()}"
                        )


if __name__ == "__main__":
    main()
