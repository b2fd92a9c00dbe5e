"""The GPU kernels inductor plans for one compiled update, counted on a machine without one.

On an accelerator every update runs through ``torch.compile`` (see
``lightning_rollout_debug/metrics/backends.py``), and each Triton kernel of the compiled
graph is one launch. This script asks inductor for the Triton code of the same functions
on CPU tensors (inductor's Triton backend for CPUs, told to plan for an sm_90 GPU, adding
atomically and storing values as it does for a GPU) and counts the kernels the generated
wrapper calls, without compiling or running any of them. It needs the ``triton`` package,
not a GPU:

    pip install triton
    python benchmarks/plan_kernels.py [--shapes 8x512,64x2048,256x4096,1x65536] [--names]
        [--defaults-only] [--segments]

Each Triton kernel is one launch; an operation inductor leaves to ATen (``aten.topk``,
listed by name) launches one or more. With ``--segments`` the batches carry ``segment_ids``,
16 turns a row, and a column counts the defaults with them. It counts the compiled graph
each shape runs, in one process, as a run meets the shapes in turn: a shape the graph
already compiled serves (``dynamic=True``) runs that graph, and a new one is planned only
where dynamo compiles one (a batch of one row, say); the ``graphs`` column counts the
graphs compiled so far. The update is that one graph (statistics and extras together),
and the window's fold, every 32 updates, is outside it; ``bench_launches.py --device
cuda`` counts everything where a GPU is lent. It patches inductor's internals, as torch
2.6, 2.13 and 2.15 have them: other versions may need other patches.
"""

from __future__ import annotations

import argparse
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_metrics import make_batch
from configurations import SCALARS_ONLY

from lightning_rollout_debug import RolloutDebugCallback
from lightning_rollout_debug.metrics import backends
from lightning_rollout_debug.metrics.torch_pass.constants import constants
from lightning_rollout_debug.metrics.torch_pass.planes import PassPlan

_WRAPPERS: list[str] = []
"""The code of every graph compiled so far, in order."""

_RAN: list[int] = []
"""The graph (its index in :data:`_WRAPPERS`) whose first kernel stopped each call."""


class _NotRun:
    """A kernel inductor planned and did not compile: calling it stops the graph."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.graph = len(_WRAPPERS) - 1  # made as its graph's code is loaded

    def run(self, *args: Any, **kwargs: Any) -> None:
        _RAN.append(self.graph)
        raise _Planned

    __call__ = run


class _Planned(Exception):
    """The graph's code is written; nothing of it runs."""


def plan_for_a_gpu() -> None:
    """Make inductor write Triton code for CPU tensors as for an sm_90 GPU, and keep it."""
    import torch._inductor.config as config
    import torch.utils._triton as triton_utils
    from torch._inductor import async_compile, ir
    from torch._inductor.graph import GraphLowering
    from triton.backends.compiler import GPUTarget

    class Backend:
        target = GPUTarget("cuda", 90, 32)

        def hash(self) -> str:
            return "planned"

    triton_utils.triton_backend = Backend  # type: ignore[assignment]
    triton_utils.triton_hash_with_backend = lambda: "planned"  # type: ignore[assignment]
    config.cpu_backend = "triton"
    # Which values are stored rather than recomputed, decided as on a GPU: ir.py asks
    # is_cpu only for its CPU heuristics (store a reused exp, inline larger bodies).
    ir.is_cpu = lambda node: False
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


def kernels(plan: PassPlan, *tensors: torch.Tensor) -> list[str]:
    """The kernels, in launch order, of the graph an update of ``plan`` runs for ``tensors``.

    The graphs compiled for the call, or (where the pass already compiled one that serves
    these shapes) the graph that ran.
    """
    written, ran = len(_WRAPPERS), len(_RAN)
    try:
        backends._compiled(plan)(*tensors)
    except Exception as error:  # the first kernel call stops the graph
        if not isinstance(error, _Planned) and "_Planned" not in repr(error):
            raise
    if len(_WRAPPERS) > written:
        codes = _WRAPPERS[written:]
    else:
        assert len(_RAN) > ran, "no graph ran"
        codes = [_WRAPPERS[_RAN[-1]]]
    names = []
    for code in codes:
        calls = code[code.find("def call(") : code.find("def benchmark_compiled_module")]
        names += re.findall(r"(\w+\.run|extern_kernels\.\w+|aten\.\w+(?:\.\w+)?)\(", calls)
    return [name.removesuffix(".run") for name in names]


def planned(options: dict[str, Any], batch: dict[str, torch.Tensor]) -> list[str]:
    """The kernels of one compiled update of a callback built with ``options`` (with the
    batch's ``segment_ids``, if any, as its segments)."""
    monitor = RolloutDebugCallback(alert_ranges={}, **options).monitor
    labels = batch.get("segment_ids")
    segments = None if labels is None else monitor._segments
    plan = backends.pass_plan(monitor._stats, monitor._extras, segments)
    tensors = (batch["rollout_log_probs"], batch["old_log_probs"], batch["response_mask"])
    if labels is not None:
        tensors += (None, labels)
    constants(torch.float32, batch["response_mask"])  # made before the trace, as an update does
    return kernels(plan, *tensors)


def main() -> None:
    """Print the planned kernels of scalars only and of the defaults at each shape."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="8x512,64x2048,256x4096,1x65536")
    parser.add_argument("--names", action="store_true", help="list the defaults' kernels")
    parser.add_argument("--defaults-only", action="store_true", help="skip scalars only")
    parser.add_argument("--segments", action="store_true", help="the defaults with segments too")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    plan_for_a_gpu()
    print(f"torch {torch.__version__}: Triton kernels planned per compiled update")
    header = f"{'shape':>11} {'graphs':>6} {'scalars only':>13} {'defaults':>9}"
    print(header + " segments" * args.segments)
    for text in args.shapes.split(","):
        shape = tuple(int(n) for n in text.split("x"))
        batch = make_batch(shape, torch.float32, "cpu")
        scalars = [] if args.defaults_only else planned(SCALARS_ONLY, batch)
        defaults = planned({}, batch)
        line = f" {len(scalars):>13} {len(defaults):>9}"
        if args.segments:
            turns = torch.arange(shape[1]).mul(16).div(shape[1], rounding_mode="floor")
            labelled = {**batch, "segment_ids": turns.expand(shape).contiguous()}
            line += f" {len(planned({}, labelled)):>8}"
        print(f"{text:>11} {len(_WRAPPERS):>6}{line}", flush=True)
        if args.names:
            for name in defaults:
                print(f"{'':>13}{name}")


if __name__ == "__main__":
    main()
