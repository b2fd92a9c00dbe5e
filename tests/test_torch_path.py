"""The torch arithmetic, the path of accelerators: its operations, its graph and its plan.

An update that runs eagerly (``compile=False``, or a failed compilation) issues a fixed
number of top-level torch operations, each at least one kernel launch on a GPU, whatever
the batch's size; compiled, it is one graph, traced at most twice for any number of batch
shapes, whose Triton plan is a handful of kernels. Counts and plans are deterministic:
they are tested here (timings are benchmarks, in ``benchmarks/``).
"""

from __future__ import annotations

import functools
import math
import re
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import NEEDS_CXX, kernel_skip_reason
from reference import assert_metrics_close, reference_metrics
from torch.profiler import ProfilerActivity, profile

from lightning_rollout_debug import GROUPS, METRIC_NAMES, RolloutDebugMonitor
from lightning_rollout_debug.functional import calculate_debug_metrics
from lightning_rollout_debug.metrics import backends, native
from lightning_rollout_debug.metrics.torch_pass.bins import bin_indices
from lightning_rollout_debug.metrics.torch_pass.constants import constants
from lightning_rollout_debug.metrics.torch_pass.planes import PassPlan, Planes

ROOT = Path(__file__).resolve().parent.parent
SHAPES = [(4, 256), (64, 2048), (512, 8192)]
"""From a small batch to 4M tokens, the most one pass reads."""

SCALARS_ONLY: dict[str, Any] = {
    "groups": [group for group in GROUPS if group not in ("token_ids", "quantiles")],
    "histograms": False,
    "worst_tokens_k": 0,
    "profile_images": False,
}
"""The statistics alone, as scalars (``benchmarks/configurations.py``)."""

OPERATIONS = {
    "defaults": 75,
    "defaults, token ids": 78,
    "defaults, segments": 93,
    "defaults, segments by sequence": 94,
    "scalars only": 42,
    "seed only": 26,
}
"""Top-level torch operations of one eager update, by configuration (with token ids in the
batch, the worst tokens take their ids and the ids before them)."""


def _batch(
    rows: int, width: int, seed: int = 0, ids: bool = False, segments: str = ""
) -> dict[str, torch.Tensor]:
    """Log-probs of sampled tokens, a small mismatch, rows padded to random lengths (an int64
    mask, as the response columns of an attention mask); with ``ids``, the sampled tokens'
    ids (``responses``); with ``segments``, 16 turns a row (``"turns"``) or a data source a
    row (``"sequences"``) as ``segment_ids``."""
    generator = torch.Generator().manual_seed(seed)
    rollout = torch.empty(rows, width).uniform_(1e-6, 1.0, generator=generator).log_()
    old = (rollout + 0.01 * torch.randn(rows, width, generator=generator)).clamp_(max=0.0)
    lengths = torch.randint(max(1, width // 4), width + 1, (rows, 1), generator=generator)
    mask = (torch.arange(width) < lengths).long()
    batch = {"rollout_log_probs": rollout, "old_log_probs": old, "response_mask": mask}
    if ids:
        batch["responses"] = torch.randint(0, 50_000, (rows, width), generator=generator)
    if segments == "turns":
        batch["segment_ids"] = torch.arange(width).mul(16).div(width, rounding_mode="floor")
        batch["segment_ids"] = batch["segment_ids"].expand(rows, width).contiguous()
    elif segments == "sequences":
        batch["segment_ids"] = torch.randint(0, 16, (rows,), generator=generator)
    return batch


def _operations(update: Callable[[], None]) -> list[str]:
    """The top-level torch operations of one ``update``, after two to warm up."""
    update()
    update()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        update()
    return [e.name for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None]


CONFIGURATIONS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "defaults, token ids": {},
    "defaults, segments": {},
    "defaults, segments by sequence": {},
    "scalars only": SCALARS_ONLY,
    "seed only": {**SCALARS_ONLY, "groups": ["seed"]},
}


@pytest.mark.parametrize("configuration", list(CONFIGURATIONS))
def test_an_eager_update_issues_the_same_few_operations_at_every_size(
    configuration: str,
) -> None:
    """Defaults (statistics, histograms, worst tokens, profile) 75 operations, 78 with
    token ids, 93 with a segment label a token and 94 with one a sequence (at most 110:
    the bound of 100 and 10 for the segments), the statistics alone 42, the seed's group
    26 (the seed's own algorithm: 39), the same number from 1,024 tokens to 4M: nothing
    loops over chunks or values."""
    counts = []
    for shape in SHAPES:
        monitor = RolloutDebugMonitor(
            alert_ranges={}, compile=False, **CONFIGURATIONS[configuration]
        )
        segments = "" if "segments" not in configuration else "turns"
        segments = "sequences" if "by sequence" in configuration else segments
        batch = _batch(*shape, ids="token ids" in configuration, segments=segments)
        counts.append(len(_operations(functools.partial(monitor.update, batch))))
        del monitor, batch
    assert counts == [counts[0]] * len(SHAPES)
    assert counts[0] == OPERATIONS[configuration]


def test_a_bool_mask_adds_one_view() -> None:
    """A bool mask is compared as bytes (compared with 0, a bool is widened to int64 first:
    ten times the time on a CPU): one view more than an integer mask, no kernel."""
    batch = _batch(64, 512)
    monitor = RolloutDebugMonitor(alert_ranges={}, compile=False)
    integer = _operations(functools.partial(monitor.update, batch))
    batch["response_mask"] = batch["response_mask"].bool()
    boolean = _operations(functools.partial(monitor.update, batch))
    assert sorted(boolean) == sorted([*integer, "aten::view"])


def test_the_seed_function_issues_the_same_few_operations_at_every_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``calculate_debug_metrics`` on the torch path, eagerly (a CPU without the kernel):
    its pass and its finishing, 79 operations at every size, 54 of them kernels (the rest
    views); the seed's own algorithm issues 39."""
    monkeypatch.setattr(native.passes, "_pass", lambda *args, **kwargs: None)
    counts, kernels = [], []
    for shape in SHAPES:
        batch = _batch(*shape)
        names = _operations(functools.partial(calculate_debug_metrics, batch))
        counts.append(len(names))
        kernels.append(sum(name not in VIEWS for name in names))
        del batch
    assert (counts, kernels) == ([79] * len(SHAPES), [54] * len(SHAPES)), names


VIEWS = frozenset(
    f"aten::{name}"
    for name in (
        *("select", "slice", "unbind", "squeeze", "unsqueeze", "view"),
        *("flatten", "split", "split_with_sizes", "narrow"),
    )
) | {"aten::resolve_conj", "aten::resolve_neg"}
"""Operations that only make views (or no-op flags): no kernel on an accelerator."""


@pytest.fixture
def torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU batches through torch.compile, as an accelerator's: no native kernel, fresh
    compiled functions."""
    monkeypatch.setattr(native.passes, "_pass", lambda *args, **kwargs: None)
    monkeypatch.setattr(backends, "_compiling", {"functions": {}, "failed": {}})
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


SIX_SHAPES = [(8, 512), (64, 200), (3, 1000), (17, 64), (1, 4096), (1, 300)]


@pytest.mark.parametrize(
    ("ids", "segments"),
    [(False, ""), (True, ""), (True, "turns")],
    ids=["", "token ids", "segments"],
)
def test_a_compiled_update_is_one_graph_traced_at_most_twice(
    torch_path: None, monkeypatch: pytest.MonkeyPatch, ids: bool, segments: str
) -> None:
    """The whole default update is one graph without a break (``fullgraph=True`` raises at
    one), traced at most twice over six batch shapes (one row specialises); with token ids
    too (the worst tokens' ids and those before them), and with segment labels."""
    graphs: list[torch.fx.GraphModule] = []

    def capture(graph: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(graph)
        return graph.forward

    compile = torch.compile

    def whole(function: Any, **options: Any) -> Any:
        return compile(function, dynamic=True, fullgraph=True, backend=capture)

    monkeypatch.setattr(torch, "compile", whole)
    monitor = RolloutDebugMonitor(alert_ranges={}, compile=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a failed compilation warns
        for shape in SIX_SHAPES:
            monitor.update(_batch(*shape, ids=ids, segments=segments))
    assert not backends._compiling["failed"]
    assert len(backends._compiling["functions"]) == 1  # statistics and extras: one pass
    assert 1 <= len(graphs) <= 2


@NEEDS_CXX
def test_the_compiled_default_update_is_exact(torch_path: None) -> None:
    """Inductor's code for the whole default update, against the float64 reference and
    against the eager update (the same bins but for values within an ulp of an edge)."""
    batches = [_batch(37, 700, seed=1), _batch(5, 1500, seed=2)]
    batches[0]["old_log_probs"][3, :9] = -math.inf
    batches[1]["rollout_log_probs"][2, 4] = math.nan
    monitors = [RolloutDebugMonitor(alert_ranges={}, compile=c) for c in (True, False)]
    for monitor in monitors:
        for batch in batches:
            monitor.update(batch)
    assert not backends._compiling["failed"]
    want = reference_metrics(*([b[key] for b in batches] for key in _KEYS))
    want = want.select([n for g in GROUPS if g != "token_ids" for n in METRIC_NAMES[g]])
    summaries = [monitor._extras.summary(monitor._extras.state) for monitor in monitors]
    for monitor in monitors:
        assert_metrics_close(monitor._stats.compute(), want)
    compiled, eager = summaries
    for tag, histogram in eager.histograms.items():
        other = compiled.histograms[tag]
        assert other.num == histogram.num == want["rollout_tokens"]
        assert sum(abs(x - y) for x, y in zip(other.counts, histogram.counts, strict=True)) <= 4
    assert [(t.batch, t.row, t.position) for t in compiled.worst_tokens] == [
        (t.batch, t.row, t.position) for t in eager.worst_tokens
    ]


_KEYS = ("rollout_log_probs", "old_log_probs", "response_mask")


KERNEL_SKIP = kernel_skip_reason()


@pytest.mark.parametrize(
    "road",
    [
        pytest.param(
            "kernel", marks=pytest.mark.skipif(KERNEL_SKIP is not None, reason=str(KERNEL_SKIP))
        ),
        "eager",
        "compiled",
    ],
)
def test_the_ratio_metrics_are_finite_for_log_probs_beyond_the_float32_exponential(
    road: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Log-probs above 88 nats overflow ``e^a`` in float32: the KL and ratio metrics are
    taken in log space on every road, finite and exact against the float64 reference."""
    if road != "kernel":
        monkeypatch.setattr(native.passes, "_pass", lambda *args, **kwargs: None)
        monkeypatch.setattr(backends, "_compiling", {"functions": {}, "failed": {}})
        torch._dynamo.reset()
    generator = torch.Generator().manual_seed(3)
    rollout = torch.empty(4, 64).uniform_(80.0, 120.0, generator=generator)
    steps = torch.tensor([0.0, 0.01, -0.3, 0.5, -0.7, 2.0, -5.0, 30.0])
    old = rollout + steps.repeat(8)  # near and far log-ratios, clamped beyond 20
    batch = {"rollout_log_probs": rollout, "old_log_probs": old, "response_mask": torch.ones(4, 64)}
    compile = {"kernel": {}, "eager": {"compile": False}, "compiled": {"compile": True}}[road]
    monitor = RolloutDebugMonitor(alert_ranges={}, **compile)
    monitor.update(batch)
    got = monitor._stats.compute()
    torch._dynamo.reset()
    want = reference_metrics(rollout, old, batch["response_mask"])
    names = [*METRIC_NAMES["kl"], *METRIC_NAMES["importance_ratio"]]
    assert all(math.isfinite(want[name]) for name in names)
    assert_metrics_close({name: got[name] for name in names}, want.select(names))


LEAN = {**SCALARS_ONLY, "groups": ["seed", "log_space", "sequence"]}
"""A lean pass: the seed, log-space and sequence groups alone, no extras."""


@pytest.mark.parametrize(
    ("road", "options"),
    [
        ("eager", LEAN),
        ("eager", {**LEAN, "groups": ["seed"]}),
        ("eager", SCALARS_ONLY),
        ("eager", {}),
        ("compiled", LEAN),
    ],
    ids=["eager lean", "eager seed", "eager scalars only", "eager defaults", "compiled lean"],
)
def test_the_probability_difference_is_exact_up_to_the_float32_exponentials_limit(
    road: str, options: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``|pa - pb|`` is finite wherever both probabilities are: a log-prob up to
    ``ln(FLT_MAX)`` against one near 0 or floored at -20 (``|r|`` up to 108, whose
    ``e^|r|`` overflows), exact against the float64 reference on every torch pass, the lean
    one (:data:`LEAN`) included. One token a row: a float32 row sum of two such values
    would overflow, and rows add in float64. Compiled, the mean and the largest value: its
    squares are float32 (summed in float64), which overflow above 1.8e19."""
    monkeypatch.setattr(native.passes, "_pass", lambda *args, **kwargs: None)
    monkeypatch.setattr(backends, "_compiling", {"functions": {}, "failed": {}})
    torch._dynamo.reset()
    old = torch.tensor([88.0, 88.38, 88.5, 88.6, 88.72, 70.0, 75.0, 1e-3, -1.0, -0.3])
    rollout = torch.tensor([-0.5] * 5 + [-30.0, -20.0, 0.0, -0.5, -0.2])
    batch = {"rollout_log_probs": rollout[:, None], "old_log_probs": old[:, None]}
    batch["response_mask"] = torch.ones(len(old), 1)
    monitor = RolloutDebugMonitor(alert_ranges={}, compile=road == "compiled", **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # positive log-probs
        monitor.update(batch)
        got = monitor._stats.compute()
    torch._dynamo.reset()
    assert not backends._compiling["failed"]
    want = reference_metrics(*(batch[key] for key in _KEYS))
    names = METRIC_NAMES["seed"]
    assert all(math.isfinite(want[name]) for name in names if "pearson" not in name)
    if road == "compiled":
        names = ["rollout_probs_diff_mean", "rollout_probs_diff_max"]
    assert want["rollout_probs_diff_max"] > 3e38
    assert_metrics_close({name: got[name] for name in names}, want.select(names))
    if options.get("groups") == ["seed"]:  # the function's pass is this lean one
        seed = calculate_debug_metrics(batch)
        assert seed["training/rollout_probs_diff_max"] == got["rollout_probs_diff_max"]


TORCH_RELEASE = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])

PLANNED_WITH_SEGMENTS = {(2, 6): 14, (2, 13): 14, (2, 15): 15}
"""The kernels planned for a default update with segment labels, by release: besides the
defaults', the sums by segment row (a base filled, one scatter-add), their largest values
(a base, the values and the index laid out for an ATen ``scatter_reduce``) and the worst
tokens' segments."""


def _plans(*arguments: str) -> list[tuple[str, ...]]:
    """The rows ``benchmarks/plan_kernels.py`` prints: each shape and its counts."""
    command = [sys.executable, str(ROOT / "benchmarks" / "plan_kernels.py"), *arguments]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=True)
    return re.findall(r"^\s*(\d+x\d+)((?:\s+\d+)+)$", done.stdout, re.MULTILINE)


def test_the_eager_fine_bins_are_those_of_the_edges() -> None:
    """An eager pass reads the quantiles' fine bins of ``|a - b|`` and ``|pa - pb|`` off
    their float32 bits: for random bit patterns of every non-negative float, the edges,
    their neighbours, zero, subnormals and infinity, each value's bin is
    ``searchsorted(edges, x, side="right")`` of the edges of the formula
    ``2**e (1 + j / 32)``, from ``2**-27`` up to 2 and 32."""
    generator = torch.Generator().manual_seed(5)
    patterns = torch.randint(0, 0x7F800001, (100_000,), generator=generator, dtype=torch.int32)
    edges = {
        name: np.array([2.0 ** (-27 + j // 32) * (1 + (j % 32) / 32) for j in range(32 * k + 1)])
        for name, k in (("fine_d", 28), ("fine_l", 32))
    }
    known = torch.tensor(np.concatenate(list(edges.values())), dtype=torch.float32)
    near = [torch.nextafter(known, torch.tensor(side)) for side in (0.0, math.inf)]
    special = torch.tensor([0.0, -0.0, 1e-45, 1e-38, 3.0, 40.0, 1e30, math.inf])
    values = torch.cat([patterns.view(torch.float32), known, *near, special]).view(1, -1)
    plan = PassPlan(frozenset({"seed"}), profile=True)
    planes = Planes(plan.planes, values, torch.float32)
    planes["d"].copy_(values)
    planes["l"].copy_(values)
    index = bin_indices(plan, planes, constants(torch.float32, values))
    for name, bounds in edges.items():
        want = np.searchsorted(bounds, values[0].double().numpy(), side="right")
        np.testing.assert_array_equal(index[name][0].numpy(), want, err_msg=name)


def test_triton_plans_a_handful_of_kernels_for_the_default_update() -> None:
    """``benchmarks/plan_kernels.py``: the Triton kernels inductor plans for one compiled
    default update (planned for an sm_90 GPU, on the CPU: Triton, no GPU) at four shapes,
    at most 8 each (torch 2.6, 2.13 and 2.15 plan 7); with segment labels, 16 turns a row,
    those of :data:`PLANNED_WITH_SEGMENTS`. The shapes come in turn, as in a run: each plan
    compiles one graph for them all and one more for the batch of one row."""
    if TORCH_RELEASE < (2, 6):
        pytest.skip("inductor writes Triton code for CPU tensors from torch 2.6 on")
    pytest.importorskip("triton", reason="planning Triton kernels needs the triton package")
    shapes = "8x512,64x2048,256x4096,1x65536"
    rows = _plans("--shapes", shapes, "--defaults-only", "--segments")
    assert [shape for shape, _ in rows] == shapes.split(",")
    columns = [[int(count) for count in counts.split()] for _, counts in rows]
    graphs, _, planned, with_segments = (list(column) for column in zip(*columns, strict=True))
    assert graphs[:3] == [2, 2, 2] and graphs[3] <= 4  # the second graph: one row
    assert all(1 <= count <= 8 for count in planned), rows
    for defaults, segments in zip(planned, with_segments, strict=True):
        assert segments == PLANNED_WITH_SEGMENTS.get(TORCH_RELEASE, segments) > defaults
