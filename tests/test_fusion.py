"""The compiled (fused) update gives the same statistics as the eager one."""

from __future__ import annotations

import math
import operator
import warnings
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from lightning_helpers import TRAINER_DEFAULTS, RolloutModule, at_step, make_batches, read_scalars
from pytorch_lightning.loggers import TensorBoardLogger
from reference import assert_metrics_close, reference_metrics
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_rollout_debug import (
    GROUPS,
    METRIC_NAMES,
    MismatchStats,
    RolloutDebugCallback,
    RolloutDebugWarning,
)
from lightning_rollout_debug.metrics import backends, native
from lightning_rollout_debug.metrics.extras import TokenExtras
from lightning_rollout_debug.metrics.torch_pass.planes import PassPlan

LOG_RATIO_TAG = "training/rollout_log_ratio_hist"
COMPILE_FAILED = "torch.compile of the rollout metrics failed"
NAMES = [n for g in GROUPS if g != "token_ids" for n in METRIC_NAMES[g]]


@pytest.fixture(params=["native", "torch.compile"])
def fused_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each fused CPU update once through the native kernel and once through inductor."""
    if request.param == "torch.compile":
        monkeypatch.setattr(native.passes, "_pass", lambda *args, **kwargs: None)
    return request.param


@pytest.fixture
def inductor_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native.passes, "_pass", lambda *args, **kwargs: None)


def _batch(dtype: torch.dtype, rows: int = 96, width: int = 1024) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(7)
    rollout = torch.log(torch.rand(rows, width, generator=generator).clamp(min=1e-9))
    old = (rollout + 0.05 * torch.randn(rows, width, generator=generator)).clamp(max=0.0)
    old[3, :7] = -math.inf
    rollout[5, 2] = math.nan
    mask = torch.rand(rows, width, generator=generator) > 0.3
    mask[9] = False
    ids = torch.randint(0, 5, (2, rows, width), generator=generator)
    return rollout.to(dtype), old.to(dtype), mask, ids[0], ids[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_update_matches_eager_and_reference(dtype: torch.dtype, fused_path: str) -> None:
    tensors = _batch(dtype)
    fused, eager = MismatchStats(compile=True), MismatchStats(compile=False, chunk_tokens=4096)
    for stats in (fused, eager):
        stats.update(*tensors)
        stats.update(*(t[:40, :300] for t in tensors))
    want = reference_metrics(
        [tensors[0], tensors[0][:40, :300]],
        [tensors[1], tensors[1][:40, :300]],
        [tensors[2], tensors[2][:40, :300]],
        rollout_ids=[tensors[3], tensors[3][:40, :300]],
        trainer_ids=[tensors[4], tensors[4][:40, :300]],
    )
    # Every metric but the quantiles, which come from a profile (test_profile.py), and the
    # period of stale weights, from a run's series (test_stale.py).
    assert set(fused.compute()) == {
        name
        for group in GROUPS
        if group != "quantiles"
        for name in METRIC_NAMES[group]
        if name != "rollout_stale_period"
    }
    assert_metrics_close(fused.compute(), want)
    assert_metrics_close(eager.compute(), want)


@pytest.mark.parametrize("spread", ["independent", "near-floor"])
def test_compiled_update_is_exact_far_from_agreement(spread: str, fused_path: str) -> None:
    """Log-ratios up to the clamp and probabilities down to the floor, where rounding
    of the exponent's argument matters most."""
    generator = torch.Generator().manual_seed(11)
    shape = (64, 2048)
    if spread == "independent":
        rollout = torch.empty(shape).uniform_(-21.0, 0.0, generator=generator)
        old = torch.empty(shape).uniform_(-21.0, 0.0, generator=generator)
    else:
        rollout = torch.empty(shape).uniform_(-20.0, -17.0, generator=generator)
        old = rollout + torch.empty(shape).uniform_(-2.0, 2.0, generator=generator)
    mask = torch.rand(shape, generator=generator) > 0.1
    stats = MismatchStats(compile=True)
    stats.update(rollout, old, mask)
    assert_metrics_close(stats.compute(), reference_metrics([rollout], [old], [mask]))


def test_a_window_finishes_a_compiled_and_an_eager_pass_together(
    inductor_only: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch read by the compiled pass and one read eagerly (its compilation failed) in
    one window: each pass's largest values and lag products are read in their own layout,
    and every metric matches the float64 reference of both batches."""
    monkeypatch.setattr(backends, "_compiling", {"functions": {}, "failed": {}})
    rollout, old, mask, _, _ = _batch(torch.float32)
    second = (old.flip(1)[:40], rollout.flip(1)[:40], mask.flip(1)[:40])  # -inf in rollout
    stats = MismatchStats(compile=True)
    stats.update(rollout, old, mask)
    (plan,) = backends._compiling["functions"]
    backends._compiling["failed"][plan] = "eagerly from now on"
    stats.update(*second)
    want = reference_metrics([rollout, second[0]], [old, second[1]], [mask, second[2]])
    assert_metrics_close(stats.compute(), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_extras_match_eager_ones(inductor_only: None, dtype: torch.dtype) -> None:
    rollout, old, mask, ids, _ = _batch(dtype)
    summaries = []
    for compile in (True, False):
        extras = TokenExtras(worst_tokens_k=8, profile=True, compile=compile)
        extras.update(rollout, old, mask, ids, batch_index=2)
        summaries.append(extras.summary(extras.state))
    fused, eager = summaries
    assert fused.profile is not None and eager.profile is not None
    assert fused.profile.quantiles == pytest.approx(eager.profile.quantiles, rel=0.04)
    assert fused.profile.joint_histogram == eager.profile.joint_histogram
    for mine, theirs in zip(fused.profile.by_position, eager.profile.by_position, strict=True):
        assert (mine.start, mine.stop, mine.tokens) == (theirs.start, theirs.stop, theirs.tokens)
        assert mine.kl_k3 == pytest.approx(theirs.kl_k3, rel=1e-5, abs=1e-12, nan_ok=True)
    for tag, histogram in eager.histograms.items():
        other = fused.histograms[tag]
        counted = (mask != 0) & (rollout.float() < math.inf) & (old.float() < math.inf)
        assert other.num == histogram.num == int(counted.sum())  # -inf counts, NaN does not
        # A value within an ulp of a bin edge may land on either side of it.
        assert sum(abs(x - y) for x, y in zip(other.counts, histogram.counts, strict=True)) <= 4
        assert other.min == pytest.approx(histogram.min, rel=1e-6, abs=1e-12)
        assert other.max == pytest.approx(histogram.max, rel=1e-6)
        assert other.sum == pytest.approx(histogram.sum, rel=1e-6, abs=1e-6)
        assert other.sum_squares == pytest.approx(histogram.sum_squares, rel=1e-6)
    assert [(t.batch, t.row, t.position, t.token_id) for t in fused.worst_tokens] == [
        (t.batch, t.row, t.position, t.token_id) for t in eager.worst_tokens
    ]


def test_traced_updates_shift_tensors_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """No shift of two ints in the graphs torch.compile traces (statistics and extras).

    Traced with dynamic shapes, the extras' settings become symbolic ints, and some
    torch.compile releases (2.11) fail on a shift between two of them: the update then
    runs eagerly, hundreds of kernel launches on a GPU instead of a few dozen.
    """
    graphs: list[torch.fx.GraphModule] = []

    def capture(graph: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(graph)
        return graph.forward

    compile = torch.compile
    monkeypatch.setattr(
        torch, "compile", lambda function, **_: compile(function, dynamic=True, backend=capture)
    )
    monkeypatch.setattr(backends, "_compiling", {"functions": {}, "failed": {}})
    monkeypatch.setattr(native.passes, "_pass", lambda *args, **kwargs: None)
    torch._dynamo.reset()
    rollout, old, mask, ids, _ = _batch(torch.float32)
    try:
        MismatchStats(compile=True).update(rollout, old, mask)
        extras = TokenExtras(worst_tokens_k=8, profile=True, compile=True)
        extras.update(rollout, old, mask, ids, batch_index=2)
    finally:
        torch._dynamo.reset()
    assert len(graphs) >= 2 and not backends._compiling["failed"]
    shifts = [
        node.format_node()
        for graph in graphs
        for node in graph.graph.nodes
        if node.op == "call_function"
        and node.target in (operator.lshift, operator.rshift)
        and not isinstance(node.meta.get("example_value"), torch.Tensor)
    ]
    assert shifts == []


def test_a_pass_that_fails_to_compile_leaves_the_others_compiled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The extras' pass failing to compile (one warning, naming the torch release and what
    to pass) stays eager alone: the statistics' pass stays compiled."""
    compiled_calls: list[PassPlan] = []

    def compile_failing_for_the_extras(function: Any, **_: Any) -> Any:
        plan = function.args[0]

        def run(*args: Any, **kwargs: Any) -> Any:
            if plan.worst_tokens_k:
                raise RuntimeError("cannot trace this")
            compiled_calls.append(plan)
            return function(*args, **kwargs)

        return run

    monkeypatch.setattr(torch, "compile", compile_failing_for_the_extras)
    monkeypatch.setattr(backends, "_compiling", {"functions": {}, "failed": {}})
    monkeypatch.setattr(native.passes, "_pass", lambda *args, **kwargs: None)
    rollout, old, mask, ids, _ = _batch(torch.float32)
    stats, extras = MismatchStats(compile=True), TokenExtras(worst_tokens_k=4, compile=True)
    eager = TokenExtras(worst_tokens_k=4, compile=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for index in range(2):
            stats.update(rollout, old, mask)
            extras.update(rollout, old, mask, ids, batch_index=index)
            eager.update(rollout, old, mask, ids, batch_index=index)
    assert [plan.groups for plan in compiled_calls] == [stats.groups, stats.groups]
    assert [plan.worst_tokens_k for plan in backends._compiling["failed"]] == [4]
    (warning,) = [w for w in caught if COMPILE_FAILED in str(w.message)]
    assert f"torch {torch.__version__}" in str(warning.message)
    assert "compile=False" in str(warning.message)
    assert torch.equal(extras.state, eager.state)
    assert_metrics_close(
        stats.compute(), reference_metrics([rollout, rollout], [old, old], [mask, mask])
    )


def test_compiled_updates_do_not_recompile_for_new_batches(inductor_only: None) -> None:
    """New shapes, batch indices and ranks reuse the compiled code: a recompilation is a
    stall of seconds (and a synchronisation on GPUs) in the middle of training."""
    generator = torch.Generator().manual_seed(3)

    def batch(rows: int, width: int) -> tuple[torch.Tensor, ...]:
        rollout = torch.rand(rows, width, generator=generator).clamp(min=1e-6).log()
        old = (rollout + 0.01 * torch.randn(rows, width, generator=generator)).clamp(max=0.0)
        return rollout, old, torch.ones(rows, width, dtype=torch.bool)

    stats, extras = MismatchStats(compile=True), TokenExtras(compile=True, profile=True)
    for index, shape in enumerate([(8, 64), (9, 70)]):  # warm-up: compile, then go dynamic
        stats.update(*batch(*shape))
        extras.update(*batch(*shape), batch_index=index)
    with warnings.catch_warnings(), torch._dynamo.config.patch(error_on_recompile=True):
        warnings.simplefilter("error")  # a recompilation would fall back to eager, warning
        for index in range(2, 6):
            stats.update(*batch(5 + index, 60 + index))
            extras.update(*batch(5 + index, 60 + index), batch_index=index, rank=index % 2)
    assert stats.compute()["rollout_tokens"] == sum(r * w for r, w in [(8, 64), (9, 70)]) + sum(
        (5 + i) * (60 + i) for i in range(2, 6)
    )


def test_the_callback_passes_compile_through_and_validates_it() -> None:
    from lightning_rollout_debug import RolloutDebugCallback

    assert RolloutDebugCallback(compile=False).monitor._stats.compile is False
    assert RolloutDebugCallback(compile=False).monitor._extras.compile is False
    assert RolloutDebugCallback().monitor._stats.compile is None
    for build in (RolloutDebugCallback, MismatchStats, TokenExtras):
        with pytest.raises(ValueError, match=r"`compile` must be None \(auto\), True or False"):
            build(compile="yes")  # type: ignore[arg-type]


def _compile_raising_at(when: str) -> Any:
    """A stand-in for ``torch.compile`` that fails as a broken install does."""

    def compile(function: Any, **kwargs: Any) -> Any:
        if when == "construction":
            raise RuntimeError("Python 3.13+ is not supported by torch.compile here")

        def first_call(*args: Any, **kw: Any) -> Any:
            raise RuntimeError("inductor: no working C++ compiler")

        return first_call

    return compile


@pytest.mark.parametrize("when", ["construction", "first call"])
def test_a_failing_torch_compile_counts_every_batch_eagerly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, inductor_only: None, when: str
) -> None:
    """``torch.compile`` raising when called or when its result first runs: one warning,
    then eager arithmetic for the statistics and the extras; no batch is skipped."""
    monkeypatch.setattr(backends, "_compiling", {"functions": {}, "failed": {}})
    monkeypatch.setattr(torch, "compile", _compile_raising_at(when))
    batches = make_batches(4, batch_size=[3, 4, 2, 5], width=[7, 5, 9, 6], seed=21)
    callback = RolloutDebugCallback(compile=True, worst_tokens_k=3)
    logger = TensorBoardLogger(str(tmp_path), name="tb", version=0)
    trainer = pl.Trainer(
        **{**TRAINER_DEFAULTS, "max_steps": 4, "log_every_n_steps": 2},
        logger=logger,
        callbacks=[callback],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(RolloutModule(batches))
    compile_warnings = [w for w in caught if COMPILE_FAILED in str(w.message)]
    assert len(compile_warnings) == 1, [str(w.message) for w in caught]
    assert not [w for w in caught if issubclass(w.category, RolloutDebugWarning)]
    scalars = read_scalars(tmp_path / "tb" / "version_0")
    events = EventAccumulator(str(tmp_path / "tb" / "version_0"), size_guidance={"histograms": 0})
    events.Reload()
    histograms = {e.step: e.histogram_value.num for e in events.Histograms(LOG_RATIO_TAG)}
    for step, window in ((1, batches[:2]), (3, batches[2:])):
        want = reference_metrics(
            [b["rollout_log_probs"] for b in window],
            [b["old_log_probs"] for b in window],
            [b["response_mask"] for b in window],
        )
        assert_metrics_close(at_step(scalars, step, "training/"), want.select(list(NAMES)))
        assert histograms[step] == want["rollout_tokens"]
