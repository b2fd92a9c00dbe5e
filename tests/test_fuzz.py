"""Fuzzing: random batches, valid and invalid, through every path that takes a batch.

A Hypothesis strategy draws a valid batch (``conftest.batches``: every float dtype, mask
dtype and kind, special values, B and T down to 0), dresses it in valid but unusual
forms (sign-flipped log-probs, non-contiguous, expanded or requires-grad tensors, the
attention mask with prompt columns, no mask, a ``.batch`` wrapper) and then breaks it
0 to 2 times (missing keys, integer, boolean or complex dtypes, wrong ranks and shapes,
lists, NumPy arrays, the ``meta`` device, a batch that is a list, a tuple, a tensor...).

An independent oracle (:func:`oracle`), written from the documented rules rather than
imported, says which ``BatchError`` kind the batch must raise, or which tensors the
statistics must see. Every batch then goes through

- the statistics core, ``MismatchStats.update`` with the tensors as arguments;
- the extraction the callback uses, ``extract_inputs(tensor_sources(batch))`` and then
  ``MismatchStats.update``, and the callback's own update path (strict);
- a real ``Trainer`` run over 50 fuzzed batches in default mode.

Invariants: only ``BatchError`` (a ``ValueError``) and only of the predicted kind; a
rejected batch leaves the window exactly as it was; every accepted window agrees with
the float64 reference; no state keeps an autograd graph. About 4,500 batches in all;
``$ROLLOUT_DEBUG_EXAMPLES_SCALE`` multiplies the example counts for stress runs.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from conftest import Batch as RandomBatch
from conftest import batches as random_batches
from conftest import examples
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st
from lightning_helpers import FEATURES, TRAINER_DEFAULTS, MemoryLogger, RolloutModule
from reference import NAMES, Reference, assert_metrics_close, reference_metrics
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_rollout_debug import BatchError, RolloutDebugCallback, RolloutDebugWarning
from lightning_rollout_debug.metrics.batch import extract_inputs, tensor_sources
from lightning_rollout_debug.metrics.stats import MismatchStats

ROLLOUT, OLD, MASK = "rollout_log_probs", "old_log_probs", "response_mask"
ATTENTION, RESPONSES = "attention_mask", "responses"
ROLES = (ROLLOUT, OLD, MASK)
PREFIX = "training/"
DEFAULT_GROUPS = ("seed", "log_space", "kl", "importance_ratio", "sequence", "health", "quantiles")

# The documented dtypes, written out here rather than imported from the package.
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INTS = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
MASK_OK = (torch.bool, *INTS, *FLOATS)

pytestmark = [
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),  # NumPy's overflow notes (reference)
    pytest.mark.filterwarnings("ignore:The '.*dataloader' does not have many workers"),
    pytest.mark.filterwarnings("ignore:RolloutDebugCallback at step .* is outside"),
]


def fuzz_settings(count: int, *, shrink: bool = True) -> settings:
    """``count`` examples (scaled by ``$ROLLOUT_DEBUG_EXAMPLES_SCALE``), no deadline."""
    phases = [Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] * shrink)
    return settings(
        max_examples=examples(count),
        deadline=None,
        phases=phases,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


class Wrapped:
    """A verl ``DataProto``-like holder: the tensors live in ``.batch``."""

    def __init__(self, batch: Mapping[str, Any]) -> None:
        self.batch = batch

    def __repr__(self) -> str:
        return f"Wrapped({self.batch!r})"


# ---------------------------------------------------------------------- strategy
@dataclass
class FuzzBatch:
    """A drawn batch and the steps that made it (for Hypothesis' failure report)."""

    value: Any
    steps: list[str]

    def __repr__(self) -> str:
        return f"FuzzBatch(steps={self.steps}, value={self.value!r})"


def _positive(x: Tensor, rng: np.random.Generator) -> Tensor:
    # Flip the sign of some moderate entries: positive, finite log-probs (up to 30 nats).
    flip = torch.from_numpy(rng.random(tuple(x.shape)) < 0.3) & (x.abs() <= 30)
    return torch.where(flip, -x, x)


def _dress(draw: st.DrawFn, d: dict[str, Any], steps: list[str]) -> None:
    """Valid but unusual forms of a valid batch."""
    rows, cols = d[MASK].shape
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    for name in draw(
        st.lists(
            st.sampled_from(
                ["positive", "noncontiguous", "expanded", "grad", "attention", "nomask", "wrap"]
            ),
            max_size=3,
            unique=True,
        )
    ):
        role = draw(st.sampled_from(ROLES))
        if name == "positive":
            d[OLD] = _positive(d[OLD], rng)
        elif name == "noncontiguous" and role in d:
            d[role] = d[role].t().contiguous().t()
        elif name == "expanded" and rows and role in d:
            d[role] = d[role][:1].expand(rows, cols)
        elif name == "grad" and role in d and d[role].dtype.is_floating_point:
            d[role] = d[role].clone().requires_grad_() * 1.0  # a graph behind it
        elif name == "attention" and MASK in d:
            prompt = draw(st.integers(1, 4))
            d[ATTENTION] = torch.cat([torch.ones(rows, prompt, dtype=d[MASK].dtype), d[MASK]], 1)
            d[RESPONSES] = torch.zeros(rows, cols, dtype=torch.int64)
            del d[MASK]
        elif name == "nomask" and MASK in d:
            del d[MASK]
        elif name == "wrap":
            steps.append("wrap")
            continue
        else:
            continue
        steps.append(f"{name}:{role}")


def _break_tensor(draw: st.DrawFn, value: Tensor, how: str) -> Any:
    if how == "dtype":
        dtype = draw(st.sampled_from([torch.int64, torch.int8, torch.bool, torch.complex64]))
        return value.detach().to(dtype)
    if how == "rank":
        choice = draw(st.sampled_from(["flatten", "front", "back", "scalar"]))
        if choice == "flatten":
            return value.flatten()
        if choice == "scalar":
            return value.detach().float().sum().to(value.dtype)
        return value.unsqueeze(0 if choice == "front" else -1)
    if how == "shape":
        choice = draw(st.sampled_from(["narrow", "widen", "transpose", "rows"]))
        if choice == "narrow" and value.dim() == 2 and value.shape[1]:
            return value[:, :-1]
        if choice == "widen" and value.dim() == 2:
            return torch.cat([value, value[:, :1]], dim=1)
        if choice == "transpose" and value.dim() == 2:
            return value.t()
        return torch.cat([value, value[:1]], dim=0) if value.dim() else value
    if how == "list":
        choice = draw(st.sampled_from(["list", "numpy", "float", "none"]))
        if value.device.type == "meta":  # no data to convert
            return list(value.shape)
        plain = value.detach().float() if value.dtype == torch.bfloat16 else value.detach()
        if choice == "list":
            return plain.tolist()
        if choice == "numpy":
            return plain.numpy()
        return 0.5 if choice == "float" else None
    if how == "device":
        return value.to("meta")
    raise AssertionError(how)


def _break(draw: st.DrawFn, d: dict[str, Any], steps: list[str]) -> Any:
    """0 to 2 corruptions of the dict; returns what the batch finally is."""
    container = None
    moved = False
    for how in draw(
        st.lists(
            st.sampled_from(["drop", "dtype", "rank", "shape", "list", "device", "container"]),
            max_size=2,
        )
    ):
        keys = [key for key in (*ROLES, ATTENTION) if isinstance(d.get(key), Tensor)]
        if how == "container":
            container = draw(st.sampled_from(["list", "tuple", "tensor", "none", "str"]))
            steps.append(f"container:{container}")
            continue
        if not keys or (how == "device" and moved):
            continue
        key = draw(st.sampled_from(keys))
        if how == "drop":
            d.pop(key)
        else:
            d[key] = _break_tensor(draw, d[key], how)
            moved = moved or how == "device"
        steps.append(f"{how}:{key}")
    if container == "list":
        return list(d.values())
    if container == "tuple":
        return tuple(d.values())
    if container == "tensor":
        return next((v for v in d.values() if isinstance(v, Tensor)), torch.zeros(2, 2))
    if container == "str":
        return "rollout_log_probs"
    if container == "none":
        return None
    return d


@st.composite
def fuzz_batches(draw: st.DrawFn, *, broken: float = 0.5) -> FuzzBatch:
    """One batch: valid, dressed up, and (with probability about ``broken``) broken."""
    base: RandomBatch = draw(random_batches(with_ids=False, max_rows=5, max_width=24))
    d: dict[str, Any] = {ROLLOUT: base.rollout, OLD: base.old, MASK: base.mask}
    steps: list[str] = []
    _dress(draw, d, steps)
    value: Any = d
    if draw(st.floats(0, 1)) < broken:
        value = _break(draw, d, steps)
    if "wrap" in steps and isinstance(value, dict):
        value = Wrapped(value)
    return FuzzBatch(value, steps)


# ---------------------------------------------------------------------- oracle
@dataclass
class Verdict:
    """What must happen: a ``BatchError`` of ``kind``, or the tensors the statistics see."""

    kind: str | None = None
    tensors: tuple[Tensor, Tensor, Tensor] | None = None
    fallback: bool = False  # no mask: every position counts (the callback warns once)


def _type_problem(name: str, value: Any, dtypes: Sequence[torch.dtype]) -> str | None:
    if not isinstance(value, Tensor):
        return f"type:{name}"
    if value.dtype not in dtypes:
        return f"dtype:{name}"
    return None


def oracle(batch: Any, *, direct: bool = False) -> Verdict:
    """The documented rules, in the documented order (see ``batch.extract_inputs``).

    ``direct``: the three values are the arguments of ``MismatchStats.update`` (no lookup,
    no fallback: a missing mask is a type problem).
    """
    if isinstance(batch, Wrapped):
        batch = batch.batch
    if not isinstance(batch, Mapping):
        return Verdict("type:batch")
    rollout, old = batch.get(ROLLOUT), batch.get(OLD)
    mask, mask_name = batch.get(MASK), MASK
    if not direct:
        for name, value in ((ROLLOUT, rollout), (OLD, old)):
            if value is None:
                return Verdict(f"missing:{name}")
        if mask is None and batch.get(ATTENTION) is not None:
            mask, mask_name = batch[ATTENTION], ATTENTION
        responses = batch.get(RESPONSES)
        if (
            isinstance(mask, Tensor)
            and mask.dim() == 2
            and isinstance(responses, Tensor)
            and responses.dim() == 2
            and mask.shape[1] > responses.shape[1]
        ):
            mask = mask[:, mask.shape[1] - responses.shape[1] :]  # the last T: none for 0
    fallback = False
    if mask is None and not direct:
        fallback, mask_name = True, MASK
        if isinstance(rollout, Tensor):
            mask = torch.ones(rollout.shape, dtype=torch.bool, device=rollout.device)
    problem = (
        _type_problem(ROLLOUT, rollout, FLOATS)
        or _type_problem(OLD, old, FLOATS)
        or _type_problem(mask_name, mask, MASK_OK)
    )
    if problem:
        return Verdict(problem)
    if rollout.dim() != 2:
        return Verdict(f"rank:{ROLLOUT}")
    for name, value in ((OLD, old), (mask_name, mask)):
        if value.shape != rollout.shape:
            return Verdict(f"shape:{name}")
    if len({rollout.device, old.device, mask.device}) > 1:
        return Verdict("device")
    return Verdict(None, (rollout, old, mask), fallback)


# ---------------------------------------------------------------------- checks
def reference_over(accepted: Sequence[tuple[Tensor, Tensor, Tensor]]) -> Reference:
    if not accepted:
        empty = torch.zeros(0, 0)
        return reference_metrics(empty, empty, empty)
    rollouts, olds, masks = (list(column) for column in zip(*accepted, strict=True))
    return reference_metrics(rollouts, olds, masks)


# The period of stale weights reads the run's series, not a window (test_stale.py).
DEFAULT_NAMES = [
    name for group in DEFAULT_GROUPS for name in NAMES[group] if name != "rollout_stale_period"
]


def completed(metrics: Mapping[str, float]) -> dict[str, float]:
    """The default groups' metrics, NaN for those left out (undefined ones are not logged)."""
    return {name: metrics.get(name, math.nan) for name in DEFAULT_NAMES}


def assert_same_state(now: Tensor, before: Tensor) -> None:
    torch.testing.assert_close(now, before, rtol=0, atol=0, equal_nan=True)


def args_of(batch: Any) -> tuple[Any, Any, Any]:
    """The three values a caller of ``MismatchStats.update`` would pass from this batch."""
    if isinstance(batch, Wrapped):
        batch = batch.batch
    if isinstance(batch, Mapping):
        return batch.get(ROLLOUT), batch.get(OLD), batch.get(MASK)
    return batch, None, None


# ---------------------------------------------------------------------- the core
@fuzz_settings(1000)
@given(drawn=st.lists(fuzz_batches(), min_size=1, max_size=3))
def test_statistics_core_takes_any_arguments(drawn: list[FuzzBatch]) -> None:
    stats = MismatchStats()
    accepted = []
    for item in drawn:
        args = args_of(item.value)
        verdict = oracle({ROLLOUT: args[0], OLD: args[1], MASK: args[2]}, direct=True)
        event(verdict.kind or "valid")
        before = stats.state.clone()
        try:
            stats.update(*args)
        except BatchError as error:
            assert isinstance(error, ValueError)
            assert error.kind == verdict.kind, (error.kind, verdict.kind, str(error))
            assert_same_state(stats.state, before)
        else:
            assert verdict.kind is None, verdict.kind
            accepted.append(verdict.tensors)
    assert stats.state.grad_fn is None and not stats.state.requires_grad
    assert_metrics_close(stats.compute(), reference_over(accepted))


# ---------------------------------------------------------------------- the callback's path
@fuzz_settings(1000)
@given(drawn=st.lists(fuzz_batches(), min_size=1, max_size=3))
def test_extraction_and_callback_update_take_any_batch(drawn: list[FuzzBatch]) -> None:
    stats = MismatchStats()
    callback = RolloutDebugCallback(strict=True)
    loss = {"loss": torch.tensor(0.5)}  # what Lightning passes as `outputs`
    accepted = []
    for item in drawn:
        verdict = oracle(item.value)
        event(verdict.kind or ("valid, no mask" if verdict.fallback else "valid"))
        before = stats.state.clone()
        callback_before = callback.monitor._stats.state.clone()
        # 1. the extraction the callback uses, then the statistics
        try:
            inputs, fallback = extract_inputs(tensor_sources(item.value))
            stats.update(inputs.rollout_log_probs, inputs.old_log_probs, inputs.mask)
        except BatchError as error:
            assert error.kind == verdict.kind, (error.kind, verdict.kind, str(error))
            assert_same_state(stats.state, before)
        else:
            assert verdict.kind is None, verdict.kind
            assert (fallback is not None) == verdict.fallback
            accepted.append(verdict.tensors)
        # 2. the callback's own update path (strict: it raises what it would skip)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            try:
                callback._update(loss, item.value)
            except BatchError as error:
                assert error.kind == verdict.kind, (error.kind, verdict.kind, str(error))
                assert_same_state(callback.monitor._stats.state, callback_before)
            else:
                assert verdict.kind is None, verdict.kind
        skipped = [w for w in record if issubclass(w.category, RolloutDebugWarning)]
        assert len(skipped) <= int(verdict.fallback)  # only the no-mask notice, once
    want = reference_over(accepted)
    assert_metrics_close(stats.compute(), want)
    profile = callback.monitor._extras.summary(callback.monitor._extras.state).profile
    assert_metrics_close(
        completed(callback.monitor._stats.compute(profile)), want.select(DEFAULT_NAMES)
    )
    for state in (stats.state, callback.monitor._stats.state, callback.monitor._extras.state):
        assert state.grad_fn is None and not state.requires_grad


# ---------------------------------------------------------------------- a Trainer run
class FuzzModule(RolloutModule):
    """Trains on a constant input whatever the batch is; hands the batch over untouched."""

    def __init__(self, items: Sequence[Any]) -> None:
        super().__init__(log_loss=False)
        self.items = list(items)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.items, batch_size=None, collate_fn=lambda item: item)

    def transfer_batch_to_device(self, batch: Any, device: torch.device, idx: int) -> Any:
        return batch

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self.layer(torch.ones(1, FEATURES)).pow(2).mean()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        pass


def positive_kinds(verdicts: Sequence[Verdict]) -> set[str]:
    """The keys whose counting log-probs go above 1e-3 nats: the callback warns once each."""
    kinds = set()
    for verdict in verdicts:
        if verdict.kind is not None or verdict.tensors is None:
            continue
        rollout, old, mask = (torch.as_tensor(t).double() for t in verdict.tensors)
        rollout, old = rollout.clamp(min=-20.0), old.clamp(min=-20.0)
        counting = (mask != 0) & torch.isfinite(rollout) & torch.isfinite(old)
        for key, values in ((ROLLOUT, rollout), (OLD, old)):
            if bool((values[counting] > 1e-3).any()):
                kinds.add(f"positive:{key}")
    return kinds


RUN_LENGTH = 50
EVERY = 5


@fuzz_settings(6, shrink=False)  # shrinking 50-batch runs would take minutes
@given(drawn=st.lists(fuzz_batches(), min_size=RUN_LENGTH, max_size=RUN_LENGTH))
def test_trainer_run_over_fuzzed_batches(drawn: list[FuzzBatch]) -> None:
    # Lightning itself skips a batch that is None (no step): use another non-mapping.
    items = [[] if item.value is None else item.value for item in drawn]
    verdicts = [oracle(item) for item in items]
    logger = MemoryLogger()
    callback = RolloutDebugCallback(log_every_n_steps=EVERY)
    trainer = pl.Trainer(
        logger=logger,
        callbacks=[callback],
        max_epochs=1,
        log_every_n_steps=50,
        **TRAINER_DEFAULTS,
    )
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(FuzzModule(items))

    assert trainer.global_step == RUN_LENGTH  # default mode: the fit always completes
    kinds = {v.kind for v in verdicts if v.kind} | {"mask-fallback" for v in verdicts if v.fallback}
    kinds |= positive_kinds(verdicts)
    said = [str(w.message) for w in record if issubclass(w.category, RolloutDebugWarning)]
    empty = [message for message in said if "of the window logged at step" in message]
    skipped = [message for message in said if message not in empty]
    assert callback.monitor._warned == kinds and len(skipped) == len(kinds), (kinds, skipped)
    windows = range(0, RUN_LENGTH, EVERY)
    # A window of nothing but skipped batches says so, once in the run's 50 steps.
    wasted = [s for s in windows if all(v.kind for v in verdicts[s : s + EVERY])]
    assert len(empty) == min(1, len(wasted)), (wasted, empty)
    if wasted:
        assert f"logged at step {wasted[0] + EVERY - 1} was skipped" in empty[0]
    logged_steps = logger.catalog()
    assert sorted(logged_steps) == [start + EVERY - 1 for start in windows]
    for start in windows:
        accepted = [v.tensors for v in verdicts[start : start + EVERY] if v.kind is None]
        want = reference_over(accepted)
        try:
            logged = logged_steps[start + EVERY - 1]
            assert all(not math.isnan(value) for value in logged.values())
            assert_metrics_close(completed(logged), want.select(DEFAULT_NAMES))
        except AssertionError as error:
            where = f"window of batches {start}..{start + EVERY - 1}"
            raise AssertionError(f"{where}: {error}") from None
