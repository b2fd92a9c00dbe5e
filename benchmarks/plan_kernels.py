"""The GPU kernels inductor plans for one compiled update, counted on a machine without one.

On an accelerator every update runs through ``torch.compile`` (see
``lightning_rollout_debug/backends.py``), and each Triton kernel of the compiled graph is
one launch. This script asks inductor for the Triton code of the same functions on CPU
tensors (inductor's Triton backend for CPUs, told to plan for an sm_90 GPU, adding
atomically as a GPU does) and counts the kernels the generated wrapper calls, without
compiling or running any of them. It needs the ``triton`` package, not a GPU:

    pip install triton
    python benchmarks/plan_kernels.py [--shape 8x512] [--names]

Each Triton kernel is one launch; an operation inductor leaves to ATen (``aten.topk``,
listed by name) launches one or more. It counts the compiled graphs only: the few
operations around them (two fills for the extras' labels, the window's fold every 32
updates) are not in it, and the extras run once per 2**18 tokens (their chunks);
``bench_launches.py --device cuda`` counts everything where a GPU is lent. Written
against torch 2.13's inductor, whose internals it patches: other versions may need other
patches.
"""

from __future__ import annotations

import argparse
import re
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_metrics import make_batch
from configurations import SCALARS_ONLY

from lightning_rollout_debug import RolloutDebugCallback
from lightning_rollout_debug.backends import _compiled
from lightning_rollout_debug.extras import TokenExtras
from lightning_rollout_debug.rows import batch_state

_WRAPPERS: list[str] = []


class _NotRun:
    """A kernel inductor planned and did not compile: calling it stops the graph."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def run(self, *args: Any, **kwargs: Any) -> None:
        raise _Planned

    __call__ = run


class _Planned(Exception):
    """The graph's code is written; nothing of it runs."""


def plan_for_a_gpu() -> None:
    """Make inductor write Triton code for CPU tensors as for an sm_90 GPU, and keep it."""
    import torch._inductor.config as config
    import torch.utils._triton as triton_utils
    from torch._inductor import async_compile
    from torch._inductor.graph import GraphLowering
    from triton.backends.compiler import GPUTarget

    class Backend:
        target = GPUTarget("cuda", 90, 32)

        def hash(self) -> str:
            return "planned"

    triton_utils.triton_backend = Backend  # type: ignore[assignment]
    triton_utils.triton_hash_with_backend = lambda: "planned"  # type: ignore[assignment]
    config.cpu_backend = "triton"
    config.compile_threads = 1
    config.fx_graph_cache = False  # a cached graph writes no code
    config.cpp.fallback_scatter_reduce_sum = False  # a GPU adds atomically in Triton
    config.autotune_local_cache = False
    async_compile.AsyncCompile.triton = lambda self, *args, **kwargs: _NotRun()  # type: ignore[method-assign]
    codegen = GraphLowering.codegen

    def keep(self: GraphLowering, *args: Any, **kwargs: Any) -> Any:
        result = codegen(self, *args, **kwargs)
        code = result[0]
        _WRAPPERS.append(getattr(code, "value", str(code)))
        return result

    GraphLowering.codegen = keep  # type: ignore[method-assign]


def kernels(function: Callable[..., torch.Tensor], *args: Any) -> list[str]:
    """The Triton kernels, in launch order, of ``function`` compiled as the update compiles it."""
    _WRAPPERS.clear()
    try:
        _compiled(function)(*args)
    except Exception as error:  # the first kernel call stops the graph
        if not isinstance(error, _Planned) and "_Planned" not in repr(error):
            raise
    names = []
    for code in _WRAPPERS:
        calls = code[code.find("def call(") : code.find("def benchmark_compiled_module")]
        names += re.findall(r"(\w+\.run|extern_kernels\.\w+|aten\.\w+(?:\.\w+)?)\(", calls)
    return [name.removesuffix(".run") for name in names]


def planned(callback: RolloutDebugCallback, batch: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """The kernels of the statistics' and the extras' compiled functions for ``callback``."""
    stats, extras = callback.monitor._stats, callback.monitor._extras
    tensors = (batch["rollout_log_probs"], batch["old_log_probs"], batch["response_mask"])
    found = {
        "statistics": kernels(
            lambda *t: batch_state(
                *t,
                None,
                None,
                groups=stats.groups,
                is_threshold=stats.is_threshold,
                seq_ratio_bounds=stats.seq_ratio_bounds,
            ),
            *tensors,
        )
    }
    if extras is not None:
        labels = [torch.zeros((), dtype=torch.float64) for _ in range(2)]
        found["extras"] = kernels(
            lambda *t: TokenExtras._chunk_state(extras, *t, None, 0, *labels), *tensors
        )
    return found


def main() -> None:
    """Print the planned kernels of scalars only and of the defaults."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="8x512")
    parser.add_argument("--names", action="store_true", help="list the kernels by name")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    plan_for_a_gpu()
    shape = tuple(int(n) for n in args.shape.split("x"))
    batch = make_batch(shape, torch.float32, "cpu")
    print(f"torch {torch.__version__}: Triton kernels planned per update, {args.shape}")
    for label, options in (("scalars only", SCALARS_ONLY), ("defaults", {})):
        found = planned(RolloutDebugCallback(alert_ranges={}, **options), batch)  # type: ignore[arg-type]
        parts = ", ".join(f"{part} {len(names)}" for part, names in found.items())
        print(f"{label:>13}: {sum(map(len, found.values()))} ({parts})")
        if args.names:
            for part, names in found.items():
                for name in names:
                    print(f"{'':>15}{part}: {name[:110]}")


if __name__ == "__main__":
    main()
