"""Bad or odd input, and checkpoints: every row of the table in ``docs/troubleshooting.md``.

Each row of the table "Bad or odd input" is one id of :data:`BAD_CASES` or
:data:`ODD_CASES` (the table names the test and the id). A row runs a real CPU Trainer
in default mode and with ``strict=True``:

- a *bad* batch is skipped in default mode with one ``RolloutDebugWarning`` per kind of
  problem (the row's bad batch comes twice), training goes on, and every logged window
  equals the float64 reference over its good batches only; ``strict=True`` raises a
  ``BatchError`` of that kind naming the same;
- an *odd but valid* batch counts like any other, in both modes: no warning (except the
  one documented for a batch without a mask), the windows equal the reference over
  every batch, and the batches are not modified.

Logged values are read from an in-memory logger, so they are compared in full
precision.
"""

from __future__ import annotations

import gc
import math
import re
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from lightning_helpers import (
    FEATURES,
    TRAINER_DEFAULTS,
    MemoryLogger,
    RolloutModule,
    make_batch,
    make_batches,
)
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from reference import NAMES, Reference, assert_metrics_close, reference_metrics

from lightning_rollout_debug import BatchError, RolloutDebugCallback, RolloutDebugWarning
from lightning_rollout_debug.functional import mismatch_metrics
from lightning_rollout_debug.metrics.stats import MismatchStats

pytestmark = [
    pytest.mark.filterwarnings("ignore:The '.*dataloader' does not have many workers"),
    pytest.mark.filterwarnings("ignore:The number of training batches .* is smaller than"),
    pytest.mark.filterwarnings("ignore:.*Checkpoint directory .* exists and is not empty"),
    pytest.mark.filterwarnings("ignore:`isinstance.treespec, LeafSpec.` is deprecated"),
    pytest.mark.filterwarnings("ignore:RolloutDebugCallback at step .* is outside"),
    pytest.mark.filterwarnings("ignore:Mean of empty slice"),
]

PREFIX = "training/"
DEFAULT_GROUPS = ("seed", "log_space", "kl", "importance_ratio", "sequence", "health", "quantiles")
ROLLOUT, OLD, MASK = "rollout_log_probs", "old_log_probs", "response_mask"
Batch = dict[str, Any]


# ---------------------------------------------------------------------- harness
class TolerantModule(RolloutModule):
    """:class:`RolloutModule` that trains on any batch, even one that is not a mapping.

    The batch is handed to the hooks exactly as the DataLoader yields it (no device
    transfer, so a ``meta`` tensor survives on a CPU-only machine). With
    ``graph_outputs``, ``training_step`` returns ``old_log_probs`` attached to the model's
    autograd graph (as a trainer that recomputes them does) and keeps a weak reference to
    each, so a test can check that nothing kept them alive.
    """

    def __init__(self, batches: Sequence[Any], *, graph_outputs: bool = False) -> None:
        super().__init__(batches, collate_fn=lambda item: item)
        self.graph_outputs = graph_outputs
        self.output_refs: list[weakref.ref[torch.Tensor]] = []

    def transfer_batch_to_device(self, batch: Any, device: torch.device, idx: int) -> Any:
        return batch

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x = torch.zeros(1, FEATURES)
        if isinstance(batch, Mapping) and "x" in batch:
            x, index = batch["x"], batch["index"].reshape(-1)
            self.seen.append(int(index[0]) if index.numel() else batch_idx)  # B = 0 too
        else:
            self.seen.append(-1)
        loss = self.layer(x.float()).pow(2).sum() / max(1, len(x))
        self.log("loss", loss)
        output = {"loss": loss}
        if self.graph_outputs and isinstance(batch, Mapping) and OLD in batch:
            old = batch[OLD] + 0.0 * self.layer.weight.sum()  # grad_fn reaches the weights
            assert old.grad_fn is not None
            self.output_refs.append(weakref.ref(old))
            output[OLD] = old
        return output

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        pass


class MetricsSpy(Callback):
    """Copies the rollout entries of ``trainer.callback_metrics`` after every batch."""

    def __init__(self) -> None:
        self.snapshots: list[set[str]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.snapshots.append({k for k in trainer.callback_metrics if k.startswith(PREFIX)})


@dataclass
class Run:
    trainer: pl.Trainer
    module: TolerantModule
    callback: RolloutDebugCallback
    logger: MemoryLogger
    warnings: list[str]
    spy: MetricsSpy


def fit(
    batches: Sequence[Any],
    *,
    strict: bool = False,
    graph_outputs: bool = False,
    every: int = 2,
    **callback_kwargs: Any,
) -> Run:
    module = TolerantModule(batches, graph_outputs=graph_outputs)
    callback = RolloutDebugCallback(strict=strict, log_every_n_steps=every, **callback_kwargs)
    logger, spy = MemoryLogger(), MetricsSpy()
    trainer = pl.Trainer(
        logger=logger, callbacks=[callback, spy], max_epochs=1, log_every_n_steps=50,
        **TRAINER_DEFAULTS,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(module)
    messages = [str(w.message) for w in record if issubclass(w.category, RolloutDebugWarning)]
    return Run(trainer, module, callback, logger, messages, spy)


def reference_inputs(batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the statistics should see of a valid dict batch: no mask means all ones."""
    rollout, old = batch[ROLLOUT], batch[OLD]
    mask = batch.get(MASK, torch.ones(rollout.shape, dtype=torch.bool))
    return rollout, old, mask


def expected(batches: Sequence[Batch]) -> Reference:
    """The reference over a window, restricted to what is logged: defined default metrics."""
    columns = list(zip(*(reference_inputs(batch) for batch in batches), strict=True))
    want = reference_metrics(*(list(column) for column in columns)) if batches else None
    if want is None:  # a window of skipped batches only: no token
        empty = torch.zeros(0, 0)
        want = reference_metrics(empty, empty, empty)
    names = [n for g in DEFAULT_GROUPS for n in NAMES[g] if not math.isnan(want[n])]
    return want.select(names)


def assert_windows(logger: MemoryLogger, windows: Mapping[int, Sequence[Batch]]) -> None:
    """Exactly these steps logged, each with the reference over exactly its batches."""
    logged = logger.catalog()
    assert sorted(logged) == sorted(windows), (sorted(logged), sorted(windows))
    for step, batches in windows.items():
        try:
            assert_metrics_close(logged[step], expected(batches))
        except AssertionError as error:
            raise AssertionError(f"window at step {step}: {error}") from None


def snapshot(batch: Any) -> Any:
    """A deep copy of a dict batch of real tensors (to check nothing modified it)."""
    return {key: value.detach().clone() for key, value in batch.items()}


def assert_unchanged(batch: Batch, before: Batch) -> None:
    assert sorted(batch) == sorted(before)
    for key, value in before.items():
        now = batch[key]
        assert now.dtype == value.dtype and now.shape == value.shape, key
        torch.testing.assert_close(now.detach(), value, rtol=0, atol=0, equal_nan=True)


def good(seed: int, index: int, **kwargs: Any) -> Batch:
    return make_batch(3, 5, seed=seed, index=index, **kwargs)


# ---------------------------------------------------------------------- the rows
def _without(batch: Batch, key: str) -> Batch:
    return {k: v for k, v in batch.items() if k != key}


def _with(batch: Batch, **changes: Any) -> Batch:
    return {**batch, **changes}


@dataclass
class BadCase:
    """A batch the callback must skip (default) or refuse (strict)."""

    id: str
    make: Callable[[Batch], Any]
    kind: str
    fragments: Sequence[str]


BAD_CASES = [
    BadCase(
        "missing-key",
        lambda b: _without(b, OLD),
        "missing:old_log_probs",
        ["`old_log_probs`", "[batch, response_length]", "Keys present", "'rollout_log_probs'"],
    ),
    BadCase(
        "shapes-differ",
        lambda b: _with(b, old_log_probs=b[OLD][:, :4]),
        "shape:old_log_probs",
        ["`old_log_probs` has shape (3, 4)", "`rollout_log_probs` has shape (3, 5)", "same"],
    ),
    BadCase(
        "mask-shape",
        lambda b: _with(b, response_mask=b[MASK].t()),
        "shape:response_mask",
        ["`response_mask` has shape (5, 3)", "(3, 5)", "[batch, response_length]"],
    ),
    BadCase(
        "int-log-probs",
        lambda b: _with(b, rollout_log_probs=(b[ROLLOUT] * 100).to(torch.int64)),
        "dtype:rollout_log_probs",
        ["`rollout_log_probs`", "int64", "(3, 5)", "floating-point", "float32"],
    ),
    BadCase(
        "bool-log-probs",
        lambda b: _with(b, old_log_probs=b[OLD] < -1.0),
        "dtype:old_log_probs",
        ["`old_log_probs`", "torch.bool", "(3, 5)", "floating-point"],
    ),
    BadCase(
        "complex-log-probs",
        lambda b: _with(b, rollout_log_probs=b[ROLLOUT].to(torch.complex64)),
        "dtype:rollout_log_probs",
        ["`rollout_log_probs`", "complex64", "(3, 5)", "floating-point"],
    ),
    BadCase(
        "1d-log-probs",
        lambda b: _with(b, **{k: b[k].flatten() for k in (ROLLOUT, OLD, MASK)}),
        "rank:rollout_log_probs",
        ["`rollout_log_probs` has shape (15,)", "2-D [batch, response_length]"],
    ),
    BadCase(
        "3d-log-probs",
        lambda b: _with(b, **{k: b[k].unsqueeze(-1) for k in (ROLLOUT, OLD, MASK)}),
        "rank:rollout_log_probs",
        ["`rollout_log_probs` has shape (3, 5, 1)", "2-D [batch, response_length]"],
    ),
    BadCase(
        "list-log-probs",
        lambda b: _with(b, rollout_log_probs=b[ROLLOUT].tolist()),
        "type:rollout_log_probs",
        ["`rollout_log_probs` is a list", "tensor", "[batch, response_length]"],
    ),
    BadCase(
        "list-mask",
        lambda b: _with(b, response_mask=b[MASK].tolist()),
        "type:response_mask",
        ["`response_mask` is a list", "mask", "[batch, response_length]"],
    ),
    BadCase(
        "other-device",
        lambda b: _with(b, old_log_probs=b[OLD].to("meta")),
        "device",
        ["`old_log_probs` on meta", "`rollout_log_probs` on cpu", "`response_mask` on cpu", "one"],
    ),
    BadCase(
        "meta-tensors",
        lambda b: _with(b, **{k: b[k].to("meta") for k in (ROLLOUT, OLD, MASK)}),
        "data:rollout_log_probs",
        ["`rollout_log_probs` is a meta tensor of shape (3, 5)", "cannot read", "dense"],
    ),
    BadCase(
        "list-batch",
        lambda b: [b[ROLLOUT], b[OLD], b[MASK]],
        "type:batch",
        ["The batch is a list", "mapping", "`rollout_log_probs`", "[batch, response_length]"],
    ),
    BadCase(
        "tuple-batch",
        lambda b: (b[ROLLOUT], b[OLD], b[MASK]),
        "type:batch",
        ["The batch is a tuple", "mapping", "`rollout_log_probs`", "[batch, response_length]"],
    ),
]


@dataclass
class OddCase:
    """A batch that is odd but valid: it counts, with no warning unless ``warning`` is set."""

    id: str
    make: Callable[[Batch], Batch]
    warning: Sequence[str] = ()
    graph_outputs: bool = False
    check: Callable[[dict[str, float]], None] | None = field(default=None, repr=False)


def _mask_values(batch: Batch) -> Batch:
    values = torch.tensor([0.0, 1.0, 2.0, -1.0, 0.5])
    return _with(batch, response_mask=values.roll(1).repeat(3, 1) * (batch[MASK] != 0))


def _nan_mask(batch: Batch) -> Batch:
    mask = batch[MASK].to(torch.float32)
    mask[1, 2] = math.nan  # NaN != 0: counts
    return _with(batch, response_mask=mask)


def _nan_rows(batch: Batch) -> Batch:
    rollout, old = batch[ROLLOUT].clone(), batch[OLD].clone()
    rollout[0] = math.nan
    old[2] = math.nan
    return _with(batch, rollout_log_probs=rollout, old_log_probs=old)


def _infinities(batch: Batch) -> Batch:
    rollout, old = batch[ROLLOUT].clone(), batch[OLD].clone()
    rollout[0, 0] = math.inf  # dropped, counted as non-finite
    rollout[1, 0] = old[1, 0] = -math.inf  # floored at -20 nats: counts
    rollout[2, 0] = -math.inf
    # The trainer's -inf alone on a sampled token is a mistake, named masked_logits
    # (test_diagnosis.py); here both sides agree, or the engine's is the odd one.
    return _with(batch, rollout_log_probs=rollout, old_log_probs=old, response_mask=batch[MASK] | 1)


def _positive(batch: Batch) -> Batch:
    # The classic sign slip: the trainer passes negative log-likelihoods (all > 0).
    return _with(batch, old_log_probs=-batch[OLD])


def _non_contiguous(batch: Batch) -> Batch:
    wide = torch.stack([batch[OLD], batch[OLD] - 1.0], dim=-1).flatten(1)  # [3, 10]
    out = _with(
        batch,
        rollout_log_probs=batch[ROLLOUT].t().contiguous().t(),  # column-major
        old_log_probs=wide[:, ::2],  # every other column
        response_mask=batch[MASK].t().contiguous().t(),
    )
    assert not any(out[k].is_contiguous() for k in (ROLLOUT, OLD, MASK))
    return out


def _expanded(batch: Batch) -> Batch:
    out = _with(
        batch,
        rollout_log_probs=batch[ROLLOUT][:1].expand(3, 5),  # stride 0: one row seen 3 times
        response_mask=torch.ones(1, 1, dtype=torch.bool).expand(3, 5),
    )
    assert out[ROLLOUT].stride(0) == 0 and out[MASK].stride() == (0, 0)
    return out


def _requires_grad(batch: Batch) -> Batch:
    leaf = batch[ROLLOUT].clone().requires_grad_()
    return _with(
        batch,
        rollout_log_probs=leaf,
        old_log_probs=batch[OLD].clone().requires_grad_() * 1.0,  # a graph behind it
    )


def _check_positive(metrics: dict[str, float]) -> None:
    # Positive log-probs read as probabilities above 1, and a perplexity below 1 for their
    # sequences: the sign slip shows as the actor's perplexity far below the rollout's.
    assert metrics["rollout_probs_diff_max"] > 1.0
    assert metrics["actor_ppl"] < metrics["rollout_ppl"]


ODD_CASES = [
    OddCase("bool-mask", lambda b: _with(b, response_mask=b[MASK] != 0)),
    OddCase("int-mask", lambda b: _with(b, response_mask=b[MASK].to(torch.uint8))),
    OddCase("float-mask", lambda b: _with(b, response_mask=b[MASK].to(torch.bfloat16))),
    OddCase("mask-values", _mask_values),
    OddCase("mask-nan", _nan_mask),
    OddCase("empty-batch", lambda b: make_batch(0, 5, seed=99, index=int(b["index"][0]))),
    OddCase("empty-width", lambda b: make_batch(3, 0, seed=99, index=int(b["index"][0]))),
    OddCase("all-nan-rows", _nan_rows),
    OddCase("inf-log-probs", _infinities),
    OddCase(
        "positive-log-probs",
        _positive,
        warning=["`old_log_probs` holds values up to", "log-probabilities are at most 0"],
        check=_check_positive,
    ),
    OddCase("non-contiguous", _non_contiguous),
    OddCase("expanded", _expanded),
    OddCase("requires-grad", _requires_grad),
    OddCase("graph-outputs", lambda b: b, graph_outputs=True),
    OddCase(
        "mixed-dtypes",
        lambda b: _with(
            b,
            rollout_log_probs=b[ROLLOUT].to(torch.bfloat16),
            old_log_probs=b[OLD].to(torch.float16),
            response_mask=b[MASK].to(torch.float64),
        ),
    ),
    OddCase(
        "no-mask",
        lambda b: _without(b, MASK),
        warning=["`response_mask`", "`attention_mask`", "every one of the 5 response positions"],
    ),
]


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize("case", BAD_CASES, ids=[case.id for case in BAD_CASES])
def test_bad_input_default_mode_skips_the_batch_with_one_warning(case: BadCase) -> None:
    batches: list[Any] = [good(10 + i, i) for i in range(6)]
    bad = {1, 3}  # the same problem twice: one warning
    for i in bad:
        batches[i] = case.make(batches[i])
    run = fit(batches)

    assert run.trainer.global_step == 6 and len(run.module.seen) == 6  # the fit completed
    assert len(run.warnings) == 1, run.warnings
    (message,) = run.warnings
    for fragment in case.fragments:
        assert fragment in message, (fragment, message)
    assert case.kind in run.callback.monitor._warned
    # the good batches of each window, and only those
    assert_windows(run.logger, {1: [batches[0]], 3: [batches[2]], 5: batches[4:]})


@pytest.mark.parametrize("case", BAD_CASES, ids=[case.id for case in BAD_CASES])
def test_bad_input_strict_mode_raises(case: BadCase) -> None:
    batches = [good(20, 0), case.make(good(21, 1)), good(22, 2)]
    with pytest.raises(BatchError) as info:
        fit(batches, strict=True)
    error = info.value
    assert isinstance(error, ValueError) and error.kind == case.kind, (error.kind, str(error))
    for fragment in case.fragments:
        assert fragment in str(error), (fragment, str(error))


# ---------------------------------------------------------------------- odd input
@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
@pytest.mark.parametrize("case", ODD_CASES, ids=[case.id for case in ODD_CASES])
def test_odd_but_valid_input_counts_without_warning(case: OddCase, strict: bool) -> None:
    batches = [good(30 + i, i) for i in range(4)]
    batches[1] = case.make(batches[1])
    before = [snapshot(batch) for batch in batches]
    run = fit(batches, strict=strict, graph_outputs=case.graph_outputs)

    assert run.trainer.global_step == 4 and run.module.seen == [0, 1, 2, 3]
    if case.warning:
        assert len(run.warnings) == 1, run.warnings
        assert all(fragment in run.warnings[0] for fragment in case.warning), run.warnings
    else:
        assert run.warnings == []
    assert_windows(run.logger, {1: batches[:2], 3: batches[2:]})
    for batch, then in zip(batches, before, strict=True):
        assert_unchanged(batch, then)
    if case.check is not None:
        case.check(run.logger.catalog()[1])
    state = run.callback.monitor._stats.state
    assert state.grad_fn is None and not state.requires_grad
    if case.graph_outputs:  # no graph outlives the step that made it
        refs = run.module.output_refs
        assert len(refs) == 4
        del run
        gc.collect()
        assert [ref() for ref in refs] == [None] * 4


def test_the_documented_table_has_one_row_per_case() -> None:
    page = (Path(__file__).resolve().parents[1] / "docs" / "troubleshooting.md").read_text()
    section = page.split("## Bad or odd input", 1)[1]
    rows = re.findall(r"^\| `([\w-]+)` \|", section, flags=re.MULTILINE)
    assert rows == [case.id for case in (*BAD_CASES, *ODD_CASES)]


# ---------------------------------------------------------------------- autograd
def test_requires_grad_inputs_keep_no_graph_alive() -> None:
    callback = RolloutDebugCallback()
    leaf = torch.randn(3, 5, requires_grad=True)
    old = torch.log_softmax(leaf * 2.0, dim=-1)  # non-leaf: its graph holds `leaf`
    rollout = old.detach() - 0.01
    batch = {ROLLOUT: rollout.requires_grad_(), OLD: old, MASK: torch.ones(3, 5)}
    refs = [weakref.ref(leaf), weakref.ref(old), weakref.ref(rollout)]
    callback._update({"loss": old.sum()}, batch)  # the work of on_train_batch_end
    want = expected([batch])
    assert callback.monitor._warned == set()

    # Control: holding any tensor of the graph keeps `leaf` alive, so the check can fail.
    kept = old.sum()
    del leaf, old, rollout, batch
    gc.collect()
    assert refs[0]() is not None
    del kept
    gc.collect()
    assert [ref() for ref in refs] == [None, None, None]  # the callback kept none of them
    state = callback.monitor._stats.state
    assert state.grad_fn is None and not state.requires_grad
    extras = callback.monitor._extras.state
    assert extras.grad_fn is None and not extras.requires_grad
    assert_metrics_close(
        {k: v for k, v in callback.monitor._stats.compute().items() if not math.isnan(v)}, want
    )


@pytest.mark.parametrize("shape", ["mask-shape", "list-batch"])
def test_a_skipped_batch_is_released_at_once(shape: str) -> None:
    # Rejecting a batch must not tie it into a reference cycle (a traceback holding the
    # frame that holds the error): reference counting alone frees it and its graph.
    callback = RolloutDebugCallback()
    leaf = torch.randn(3, 5, requires_grad=True)
    old = torch.log_softmax(leaf * 2.0, dim=-1)
    batch: Any = {ROLLOUT: old.detach(), OLD: old, MASK: torch.ones(3, 4)}
    if shape == "list-batch":
        batch = list(batch.values())
    refs = [weakref.ref(leaf), weakref.ref(old)]
    gc.collect()
    gc.disable()
    try:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            callback._update({"loss": old.sum()}, batch)
        del leaf, old, batch
        assert [ref() for ref in refs] == [None, None]
    finally:
        gc.enable()
    assert len(record) == 1 and issubclass(record[0].category, RolloutDebugWarning)


def test_graph_outputs_of_training_step_are_released() -> None:
    batches = [good(40 + i, i) for i in range(6)]
    run = fit(batches, graph_outputs=True)
    refs = run.module.output_refs
    assert len(refs) == 6 and run.warnings == []
    assert_windows(run.logger, {1: batches[:2], 3: batches[2:4], 5: batches[4:]})
    del run
    gc.collect()
    assert [ref() for ref in refs] == [None] * 6


# ---------------------------------------------------------------------- positive log-probs
def test_positive_log_probs_are_counted_like_any_other() -> None:
    rollout = torch.tensor([[-0.5, -1.0, -2.0], [-0.1, -0.2, -3.0]])
    old = torch.tensor([[0.5, 1.0, 2.0], [-0.1, 3.0, 20.0]])  # 20 nats: p = 4.9e8
    mask = torch.ones(2, 3)
    stats = MismatchStats()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning of any kind
        stats.update(rollout, old, mask)
        got = stats.compute()
    assert_metrics_close(got, reference_metrics(rollout, old, mask))
    # MismatchStats keeps no profile: no quantiles.
    groups = [group for group in DEFAULT_GROUPS if group != "quantiles"]
    assert all(
        math.isfinite(got[name])
        for group in groups
        for name in NAMES[group]
        if name != "rollout_stale_period"  # a run's series: not a window's
    )
    assert got["rollout_tokens"] == 6 and got["rollout_nonfinite_tokens"] == 0
    assert got["actor_ppl"] < 1.0 and got["rollout_probs_diff_max"] > 1.0


@pytest.mark.parametrize("strict", [False, True])
def test_huge_positive_log_probs_never_stop_the_fit(strict: bool) -> None:
    # Thousands of nats above 0 overflow every exp: the fit goes on, with one warning.
    batches = [good(40 + i, i) for i in range(4)]
    batches[1] = _with(batches[1], old_log_probs=torch.full_like(batches[1][OLD], 1e4))
    run = fit(batches, strict=strict)
    assert run.trainer.global_step == 4
    assert len(run.warnings) == 1 and "holds values up to 10000" in run.warnings[0]
    assert run.logger.catalog()[1]["rollout_seq_geo_ratio_max"] == math.inf


def test_positive_log_probs_beyond_the_float32_exp_range() -> None:
    # Above ~88.7 nats exp() overflows float32 (the element-wise precision of float32,
    # bfloat16 and float16 inputs; ~354 for float64 squares): the probability-space metrics turn
    # inf or NaN, every other metric stays right. Further up see `huge-positive-log-probs`.
    rollout = torch.full((2, 3), -0.5)
    old = torch.tensor([[100.0, -1.0, 95.0], [90.0, -0.5, -2.0]])
    mask = torch.ones(2, 3)
    stats = MismatchStats()
    stats.update(rollout, old, mask)
    got = stats.compute()
    want = reference_metrics(rollout, old, mask)
    overflowing = {
        *NAMES["seed"][1:],
        "rollout_actor_mult_prob_error",
        "rollout_actor_mult_prob_error_minus_one",
    }
    for name in overflowing:
        assert not math.isfinite(got[name]) or name == NAMES["seed"][4], (name, got[name])
    assert_metrics_close(
        {k: v for k, v in got.items() if k not in overflowing},
        want.select([k for k in got if k not in overflowing]),
    )


@pytest.mark.parametrize("shift", [200.0, 340.0])
def test_float64_positive_log_probs_keep_their_correlation(shift: float) -> None:
    # Adding a constant to both sides scales pa and pb alike: the correlation is that of
    # the unshifted batch. The product of the two co-moments overflows float64 above
    # about 177 nats, each co-moment only above about 354.
    generator = torch.Generator().manual_seed(3)
    rollout = torch.log(torch.rand(4, 50, generator=generator, dtype=torch.float64) * 0.9 + 0.05)
    old = rollout + 0.01 * torch.randn(4, 50, generator=generator, dtype=torch.float64)
    mask = torch.ones(4, 50)
    got = mismatch_metrics(rollout + shift, old + shift, mask, prefix="")
    want = reference_metrics(rollout + shift, old + shift, mask)
    assert_metrics_close(got, want.select(list(got)))
    unshifted = mismatch_metrics(rollout, old, mask, prefix="")
    name, one_minus = (
        "rollout_actor_probs_pearson_corr",
        "rollout_actor_probs_one_minus_pearson_corr",
    )
    assert got[name] == pytest.approx(unshifted[name], rel=1e-9)
    assert got[one_minus] == pytest.approx(unshifted[one_minus], rel=1e-6)


def test_overflowing_co_moments_leave_the_correlation_undefined() -> None:
    # Above about 354 nats the float64 squares of the probabilities overflow: the
    # correlation and its distance from 1 are undefined (NaN), never clamped to a bound.
    rollout = torch.log(torch.rand(4, 50, dtype=torch.float64) * 0.9 + 0.05) + 400.0
    got = mismatch_metrics(rollout, rollout + 0.01, torch.ones(4, 50), prefix="")
    assert math.isnan(got["rollout_actor_probs_pearson_corr"])
    assert math.isnan(got["rollout_actor_probs_one_minus_pearson_corr"])


# ---------------------------------------------------------------------- checkpoints
class ResumableLoader:
    """Yields the batches in order and resumes where it stopped (Lightning's ``_Stateful``)."""

    def __init__(self, batches: Sequence[Batch]) -> None:
        self.batches = list(batches)
        self.start = 0
        self.served = 0

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Batch]:
        start, self.start = self.start, 0
        for i in range(start, len(self.batches)):
            self.served = i + 1
            yield self.batches[i]

    def state_dict(self) -> dict[str, int]:
        return {"served": self.served}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start = state["served"]


class ResumableModule(RolloutModule):
    def train_dataloader(self) -> ResumableLoader:
        return ResumableLoader(self.batches)


def _resume_fit(
    tmp_path: Path, name: str, callback: RolloutDebugCallback, ckpt_path: str | None = None
) -> tuple[ResumableModule, MemoryLogger, list[str]]:
    module = ResumableModule(make_batches(8, seed=50, width=[4, 6] * 4))
    logger = MemoryLogger()
    checkpoint = ModelCheckpoint(dirpath=tmp_path / name, every_n_train_steps=1, save_top_k=-1)
    options = {**TRAINER_DEFAULTS, "enable_checkpointing": True}
    trainer = pl.Trainer(
        logger=logger, callbacks=[callback, checkpoint], max_epochs=1, log_every_n_steps=3,
        **options,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(module, ckpt_path=ckpt_path)
    messages = [str(w.message) for w in record if issubclass(w.category, RolloutDebugWarning)]
    return module, logger, messages


@pytest.mark.parametrize("ckpt_step", [1, 2, 3, 4, 7])
def test_resume_mid_window_continues_exactly(tmp_path: Path, ckpt_step: int) -> None:
    # A resumable loader: the resumed run must log what the uninterrupted one logged, at
    # the same steps, each window's batches counted once.
    whole, uninterrupted, _ = _resume_fit(tmp_path, "a", RolloutDebugCallback())
    batches = whole.batches
    # Every 3 steps; the open window is logged when training ends (step 7 or later).
    steps = sorted(uninterrupted.catalog())
    assert steps[:2] == [2, 5] and len(steps) == 3 and steps[2] >= 7
    assert_windows(uninterrupted, {2: batches[:3], 5: batches[3:6], steps[2]: batches[6:]})

    ckpt = tmp_path / "a" / f"epoch=0-step={ckpt_step}.ckpt"
    resumed, logger, messages = _resume_fit(tmp_path, "b", RolloutDebugCallback(), str(ckpt))
    assert resumed.seen == list(range(ckpt_step, 8)) and messages == []
    logged = logger.catalog()
    assert sorted(logged) == [step for step in steps if step >= ckpt_step]
    for step, metrics in logged.items():
        assert metrics == uninterrupted.catalog()[step], step
    tokens = sum(metrics["rollout_tokens"] for metrics in logged.values())
    wanted = sum(m["rollout_tokens"] for s, m in uninterrupted.catalog().items() if s >= ckpt_step)
    assert tokens == wanted  # nothing counted twice, nothing lost


def test_checkpoint_holds_the_configuration_and_a_mismatch_warns(tmp_path: Path) -> None:
    config = {
        "is_threshold": 1.5,
        "seq_ratio_bounds": (0.9, 1.1),
        "log_every_n_steps": 3,
        "response_mask_key": MASK,
    }
    original = RolloutDebugCallback(**config)
    _resume_fit(tmp_path, "a", original)
    ckpt = tmp_path / "a" / "epoch=0-step=4.ckpt"
    saved = torch.load(ckpt, weights_only=False)["callbacks"][original.state_key]
    own = {"log_every_n_steps": original.log_every_n_steps}
    assert saved["config"] == {**original.config.checkpoint_identity(), **own}
    assert saved["config"]["is_threshold"] == 1.5
    assert saved["config"]["seq_ratio_bounds"] == (0.9, 1.1)
    assert saved["batches_in_window"] == 1  # step 4: batch 4 only since step 2 logged

    # The same constructor: silent, and it logs what the original logged.
    _, same, messages = _resume_fit(tmp_path, "b", RolloutDebugCallback(**config), str(ckpt))
    assert messages == []
    # Another threshold: one warning naming the setting that changed; the constructor wins.
    # The window's importance ratios were counted against 1.5: it starts empty rather than
    # mixing them with those counted against 4.0.
    other = RolloutDebugCallback(**{**config, "is_threshold": 4.0})
    _, changed, messages = _resume_fit(tmp_path, "c", other, str(ckpt))
    assert len(messages) == 1, messages
    assert "checkpoint was written with another configuration" in messages[0]
    assert "(`is_threshold` 1.5, now 4.0)" in messages[0], messages[0]
    assert "sums of groups ['importance_ratio']" in messages[0], messages[0]
    assert "starts empty" in messages[0], messages[0]
    steps = sorted(same.catalog())
    assert steps == sorted(changed.catalog()) and steps[0] == 5 and len(steps) == 2
    restored_tokens = float(saved["window"][0])
    assert restored_tokens > 0
    for step, left_out in zip(steps, (restored_tokens, 0.0), strict=True):
        before, after = same.catalog()[step], changed.catalog()[step]
        assert after["rollout_tokens"] == before["rollout_tokens"] - left_out
        assert after["rollout_is_ratio_frac_high"] <= before["rollout_is_ratio_frac_high"]


def test_a_resume_under_another_key_says_that_nothing_carries_on(tmp_path: Path) -> None:
    """The checkpoint entry is keyed by `prefix` and `groups`: another one restores nothing,
    the drift baselines included, and the callback says so (a new callback beside the one
    that wrote the checkpoint has nothing to restore and says nothing)."""
    original = RolloutDebugCallback(log_every_n_steps=3)
    _resume_fit(tmp_path, "a", original)
    ckpt = str(tmp_path / "a" / "epoch=0-step=4.ckpt")
    groups = ["seed", "kl", "health"]
    _, logger, messages = _resume_fit(
        tmp_path, "b", RolloutDebugCallback(log_every_n_steps=3, groups=groups), ckpt
    )
    (message,) = messages
    assert "the checkpoint holds no state under this callback's key" in message
    assert f"only under {original.state_key}: its window" in message
    assert "drift baselines start empty" in message
    _, carried_on, _ = _resume_fit(tmp_path, "c", RolloutDebugCallback(log_every_n_steps=3), ckpt)
    assert logger.catalog()[5]["rollout_tokens"] < carried_on.catalog()[5]["rollout_tokens"]
    callbacks = [RolloutDebugCallback(log_every_n_steps=3, prefix=p) for p in (PREFIX, "new/")]
    module = ResumableModule(make_batches(8, seed=50, width=[4, 6] * 4))
    trainer = pl.Trainer(
        logger=MemoryLogger(), callbacks=callbacks, max_epochs=1, **TRAINER_DEFAULTS
    )
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(module, ckpt_path=ckpt)
    assert not [w for w in record if issubclass(w.category, RolloutDebugWarning)]


# Damaged callback states in a checkpoint: (how, what the warning names, what survives).
# "window": nothing of the checkpoint's window; "extras": its statistics, not its extras.
Damage = Callable[[dict[str, Any]], Any]
DAMAGED_STATES: dict[str, tuple[Damage, str, str]] = {
    "no-window": (lambda s: _without(s, "window"), "no `window`", "window"),
    "list-window": (lambda s: _with(s, window=s["window"].tolist()), "is a list", "window"),
    "int64-window": (
        lambda s: _with(s, window=s["window"].to(torch.int64)),
        "dtype torch.int64; expected float64",
        "window",
    ),
    "nan-window": (
        lambda s: _with(s, window=torch.full_like(s["window"], math.nan)),
        "the token count of the window is nan",
        "window",
    ),
    "short-window": (lambda s: _with(s, window=s["window"][:-1]), "has shape", "window"),
    "negative-count": (
        lambda s: _with(s, window=s["window"].index_fill(0, torch.tensor([0]), -3.0)),
        "-3.0; expected a whole number >= 0",
        "window",
    ),
    "bad-batch-count": (
        lambda s: _with(s, batches_in_window="one"),
        "`batches_in_window` is 'one'",
        "window",
    ),
    "not-a-dict": (lambda s: list(s.values()), "not a dict", "window"),
    "zero-batch-count": (
        lambda s: _with(s, batches_in_window=0),
        "tokens, but `batches_in_window` is 0; expected at least 1",
        "window",
    ),
    "short-extras": (
        lambda s: _with(s, extras_window=s["extras_window"][:-1]),
        "the extras window has shape",
        "extras",
    ),
    "nan-extras": (
        lambda s: _with(s, extras_window=torch.full_like(s["extras_window"], math.nan)),
        "the count `rollout_log_ratio_hist[0]` of the extras window is nan",
        "extras",
    ),
}


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Batch]]:
    """A checkpoint at step 4 whose callback window holds batch 3 (step 2 logged 0-2)."""
    tmp_path = tmp_path_factory.mktemp("saved")
    module, _, _ = _resume_fit(tmp_path, "a", RolloutDebugCallback())
    ckpt = tmp_path / "a" / "epoch=0-step=4.ckpt"
    key = RolloutDebugCallback().state_key
    assert torch.load(ckpt, weights_only=False)["callbacks"][key]["batches_in_window"] == 1
    return ckpt, module.batches


@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
@pytest.mark.parametrize("damage", list(DAMAGED_STATES))
def test_a_damaged_checkpoint_state_starts_an_empty_window(
    tmp_path: Path, saved_checkpoint: tuple[Path, list[Batch]], damage: str, strict: bool
) -> None:
    original, batches = saved_checkpoint
    corrupt, fragment, lost = DAMAGED_STATES[damage]
    checkpoint = torch.load(original, weights_only=False)
    key = RolloutDebugCallback().state_key
    checkpoint["callbacks"][key] = corrupt(checkpoint["callbacks"][key])
    damaged = tmp_path / "damaged.ckpt"
    torch.save(checkpoint, damaged)
    callback = RolloutDebugCallback(strict=strict)
    if strict:
        with pytest.raises(ValueError, match="checkpoint's state cannot be restored") as info:
            _resume_fit(tmp_path, "b", callback, str(damaged))
        assert fragment in str(info.value)
        return
    resumed, logger, messages = _resume_fit(tmp_path, "b", callback, str(damaged))
    assert resumed.seen == [4, 5, 6, 7]
    assert len(messages) == 1, messages
    assert messages[0].startswith("RolloutDebugCallback(prefix='training/'): the checkpoint")
    assert fragment in messages[0] and "Training goes on" in messages[0]
    # The window after the resume: batch 3 (saved) is lost with the damaged window only.
    first = batches[4:6] if lost == "window" else batches[3:6]
    assert_windows(logger, {5: first, 7: batches[6:]})
