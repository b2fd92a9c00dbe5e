"""The native CPU kernel (``row_sums.cpp``) against the reference and the torch arithmetic."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from conftest import REGIMES, make_batch
from lightning_helpers import TRAINER_DEFAULTS, MemoryLogger, RolloutModule, make_batches
from reference import assert_metrics_close, reference_metrics

from lightning_rollout_debug import (
    GROUPS,
    METRIC_NAMES,
    MismatchStats,
    RolloutDebugCallback,
    native,
)
from lightning_rollout_debug.extras import TokenExtras, WorstToken
from lightning_rollout_debug.rows import ROW_FIELDS, row_sums, rows_for

pytestmark = pytest.mark.skipif(not native.available(), reason="no C++ compiler here")

ALL = frozenset(GROUPS)
# Fields that are selections or counts of float32 values both sides compute alike.
EXACT = (
    "count",
    "nonfinite",
    "max_actor_log_prob",
    "max_rollout_log_prob",
    "max_log_ratio",
    "max_neg_log_ratio",
    "ratio_high",
    "ratio_low",
)


@pytest.fixture
def native_calls(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Records, per fused update, whether the native kernel's pass took it."""
    calls: list[bool] = []
    original = native._pass

    def spy(*args: object, **kwargs: object) -> object:
        rows = original(*args, **kwargs)  # type: ignore[arg-type]
        calls.append(rows is not None)
        return rows

    monkeypatch.setattr(native, "_pass", spy)
    return calls


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "mask_dtype", [torch.bool, torch.uint8, torch.int32, torch.int64, torch.float32, torch.float16]
)
def test_native_updates_match_the_reference(
    regime: str, dtype: torch.dtype, mask_dtype: torch.dtype, native_calls: list[bool]
) -> None:
    rng = np.random.default_rng(hash((regime, str(dtype), str(mask_dtype))) % 2**32)
    stats = MismatchStats(compile=True)
    batches = [
        make_batch(
            rng,
            shape,
            dtype=dtype,
            regime=regime,
            mask_kind=kind,
            mask_dtype=mask_dtype,
            special_rate=0.03,
            with_ids=True,
        )
        for shape, kind in (
            ((7, 100), "counts"),
            ((3, 17), "prefix"),
            ((5, 16), "binary"),
            ((2, 1), "ones"),
        )
    ]
    for batch in batches:
        stats.update(*batch.args())
    assert native_calls == [True] * len(batches)
    want = reference_metrics(
        [b.rollout for b in batches],
        [b.old for b in batches],
        [b.mask for b in batches],
        rollout_ids=[b.rollout_ids for b in batches],
        trainer_ids=[b.trainer_ids for b in batches],
    )
    assert_metrics_close(stats.compute(), want)


@pytest.mark.parametrize("groups", [frozenset({"seed"}), frozenset({"seed", "sequence"}), ALL])
@pytest.mark.parametrize("regime", ["matched", "near_floor", "unrelated"])
def test_native_row_sums_match_the_torch_arithmetic(groups: frozenset[str], regime: str) -> None:
    rng = np.random.default_rng(5)
    batch = make_batch(
        rng, (9, 333), regime=regime, mask_kind="counts", mask_dtype=torch.int64, special_rate=0.02
    )
    got = native.row_sums(batch.rollout, batch.old, batch.mask, rows_for(groups), 2.0, ROW_FIELDS)
    want = row_sums(batch.rollout, batch.old, batch.mask, groups, 2.0)
    assert got is not None
    for name, value in want.items():
        expected = value.to(torch.float64)
        if name in EXACT:
            assert torch.equal(got[name], expected), name
        else:  # e^a or pb e^r, each within a few float32 ulp (|a| * 6e-8 at most)
            torch.testing.assert_close(got[name], expected, rtol=3e-6, atol=1e-9, msg=name)


def test_native_results_do_not_depend_on_the_thread_count() -> None:
    rng = np.random.default_rng(8)
    batch = make_batch(rng, (13, 1000), regime="mixed", special_rate=0.01)
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 3):
            torch.set_num_threads(count)
            results.append(
                native.row_sums(
                    batch.rollout, batch.old, batch.mask, rows_for(ALL), 2.0, ROW_FIELDS
                )
            )
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(results[0][name], results[1][name]) for name in ROW_FIELDS)


def test_other_layouts_and_dtypes_go_the_torch_way(native_calls: list[bool]) -> None:
    rng = np.random.default_rng(9)
    batch = make_batch(rng, (300, 260), regime="matched", mask_kind="prefix")
    cases = {
        "transposed": (batch.rollout.T.contiguous().T, batch.old, batch.mask),  # native, copied
        "mixed dtypes": (batch.rollout, batch.old.to(torch.bfloat16), batch.mask),
        "float64": (batch.rollout.double(), batch.old.double(), batch.mask),
    }
    for args in cases.values():
        stats = MismatchStats(compile=True)
        stats.update(*args)
        assert_metrics_close(stats.compute(), reference_metrics(*args))
    assert native_calls == [True, False, False]


def test_a_failed_build_warns_once_and_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_compiler() -> list[str]:
        raise native.KernelUnavailable("no C++ compiler found; install one or set CXX")

    monkeypatch.setattr(native, "_kernel", {"function": None, "problem": None, "columns": ()})
    monkeypatch.setattr(native, "_compiler", no_compiler)
    rng = np.random.default_rng(10)
    batch = make_batch(rng, (300, 260), regime="matched", mask_kind="prefix")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stats = MismatchStats(compile=True)
        stats.update(*batch.args())
        stats.update(*batch.args())
    messages = [str(w.message) for w in caught if "native CPU kernel" in str(w.message)]
    assert len(messages) == 1 and "no C++ compiler found" in messages[0]
    want = reference_metrics([batch.rollout] * 2, [batch.old] * 2, [batch.mask] * 2)
    assert_metrics_close(stats.compute(), want)


def test_the_exponential_is_accurate_over_the_log_prob_range() -> None:
    """One token per row, so each row's sum is that token's pa; with b = 0, pa is e^a
    below -0.5 and pb e^r (the series) above."""
    old = torch.linspace(-20.0, 0.0, 20001).unsqueeze(1)
    rollout = torch.zeros_like(old)
    seed = rows_for(frozenset({"seed"}))
    mask = torch.ones_like(old, dtype=torch.bool)
    rows = native.row_sums(rollout, old, mask, seed, 2.0, ROW_FIELDS)
    assert rows is not None
    exact = torch.exp(old.squeeze(1).double())
    relative = ((rows["prob_actor"] - exact) / exact).abs()
    # Rounding of a * log2(e) in float32, plus a few ulp of the series and the scaling.
    assert torch.all(relative <= old.squeeze(1).double().abs() * 6e-8 + 3e-7)
    assert torch.all(rows["prob_rollout"] == 1.0)


# ---------------------------------------------------------------------- the extras
def _assert_same_extras(native_extras: TokenExtras, eager: TokenExtras) -> None:
    got, want = (extras.summary(extras.state) for extras in (native_extras, eager))
    assert got.histograms.keys() == want.histograms.keys()
    for tag, histogram in want.histograms.items():
        other = got.histograms[tag]
        assert other.counts == histogram.counts, tag  # the same bits, the same bins
        assert (other.num, other.min, other.max) == (histogram.num, histogram.min, histogram.max)
        assert other.sum == pytest.approx(histogram.sum, rel=1e-9, abs=1e-9)
        assert other.sum_squares == pytest.approx(histogram.sum_squares, rel=1e-9)
    # The same keys; among equal keys (bfloat16 has few values) either token may be kept.
    keys = [sorted(abs(t.log_ratio) for t in found.worst_tokens) for found in (got, want)]
    assert keys[0] == keys[1]
    last = keys[0][0] if keys[0] else 0.0
    above = [
        sorted((t for t in found.worst_tokens if abs(t.log_ratio) > last), key=_place)
        for found in (got, want)
    ]
    assert [_place(t) for t in above[0]] == [_place(t) for t in above[1]]
    for native_token, eager_token in zip(*above, strict=True):
        assert native_token.log_ratio == eager_token.log_ratio
        assert native_token.token_id == eager_token.token_id
        # e^a and e^b in float64 by two libraries: equal to the last bit or two.
        for field in ("actor_prob", "rollout_prob"):
            assert getattr(native_token, field) == pytest.approx(
                getattr(eager_token, field), rel=4e-16, abs=0
            )


def _place(token: WorstToken) -> tuple[int, int, int, int]:
    return token.rank, token.batch, token.row, token.position


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("histograms", "k"), [(True, 10), (True, 0), (False, 5), (True, 64), (True, 65)]
)
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.float32])
def test_native_extras_match_the_torch_extras(
    dtype: torch.dtype,
    histograms: bool,
    k: int,
    mask_dtype: torch.dtype,
    native_calls: list[bool],
) -> None:
    """Histograms bin for bin, worst tokens token for token, from the kernel's one pass
    (k above the kernel's 64 goes the torch way)."""
    rng = np.random.default_rng(31)
    batches = [
        make_batch(
            rng, shape, dtype=dtype, regime="mixed", mask_kind="prefix", mask_dtype=mask_dtype
        )
        for shape in ((70, 1000), (40, 1700))
    ]
    ids = [torch.from_numpy(rng.integers(0, 1000, b.mask.shape)) for b in batches]
    extras = [
        TokenExtras(histograms=histograms, worst_tokens_k=k, compile=compile)
        for compile in (None, False)
    ]
    for index, (batch, batch_ids) in enumerate(zip(batches, ids, strict=True)):
        for each in extras:
            each.update(batch.rollout, batch.old, batch.mask, batch_ids, batch_index=index, rank=1)
    assert native_calls == ([True, True] if k <= native.MAX_WORST_TOKENS else [])
    _assert_same_extras(*extras)


@pytest.mark.parametrize(("histograms", "k"), [(True, 10), (True, 0), (False, 5), (False, 0)])
def test_the_kernel_lays_out_the_extras_as_the_layout_does(histograms: bool, k: int) -> None:
    extras = TokenExtras(histograms=histograms, worst_tokens_k=k)
    request = extras.kernel_request()
    assert request is not None and request.state_size() == extras.size


def test_the_callback_reads_a_cpu_batch_once(
    native_calls: list[bool],
) -> None:
    """With the default histograms and worst tokens, one kernel pass per batch serves the
    statistics and the extras; the logged scalars are the reference's."""
    batches = make_batches(3, batch_size=64, width=1100, seed=9)
    logger = MemoryLogger()
    callback = RolloutDebugCallback(log_every_n_steps=3)
    trainer = pl.Trainer(
        **{**TRAINER_DEFAULTS, "max_steps": 3}, logger=logger, callbacks=[callback]
    )
    trainer.fit(RolloutModule(batches))
    assert native_calls == [True, True, True]
    want = reference_metrics(
        [b["rollout_log_probs"] for b in batches],
        [b["old_log_probs"] for b in batches],
        [b["response_mask"] for b in batches],
    )
    names = [name for group in callback.groups for name in METRIC_NAMES[group]]
    assert_metrics_close(logger.catalog()[2], want.select(names))
