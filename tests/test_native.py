"""The native CPU kernel (``row_sums.cpp``) against the reference and the torch arithmetic."""

from __future__ import annotations

import ast
import ctypes
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from conftest import (
    REGIMES,
    Batch,
    changed_kernel,
    kernel_skip_reason,
    make_batch,
    reference_for,
)
from lightning_helpers import TRAINER_DEFAULTS, MemoryLogger, RolloutModule, make_batches
from reference import assert_metrics_close, reference_metrics, tokens_of

from lightning_rollout_debug import GROUPS, METRIC_NAMES, MismatchStats, RolloutDebugCallback
from lightning_rollout_debug.metrics import backends, native
from lightning_rollout_debug.metrics.bins import LOG_RATIO_BINS, PROBS_DIFF_BINS
from lightning_rollout_debug.metrics.extras import TokenExtras
from lightning_rollout_debug.metrics.inputs import check_inputs
from lightning_rollout_debug.metrics.layout import Block
from lightning_rollout_debug.metrics.profile import (
    POSITION_BUCKETS,
    PROBABILITY_BUCKETS,
    PROFILE_SIZE,
    QUANTILE_BINS,
    profile_blocks,
)
from lightning_rollout_debug.metrics.rows import ROW_FIELDS, row_sums, rows_for
from lightning_rollout_debug.metrics.worst_tokens import WorstToken

KERNEL_SKIP = kernel_skip_reason()
pytestmark = pytest.mark.skipif(KERNEL_SKIP is not None, reason=str(KERNEL_SKIP))


def test_the_kernel_is_installed_and_loads() -> None:
    # Only a kernel turned off, or an install without a compiler, skips this module: a
    # kernel missing or refused here fails, with why.
    assert native.available(), native.kernel._kernel["problem"]


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
    "zero_rollout_log_prob",
    "zero_rollout_log_prob_run",
    "masked_actor_log_prob",
    "neighbour_pairs",
)


@pytest.fixture
def native_calls(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Records, per fused update, whether the native kernel's pass took it."""
    calls: list[bool] = []
    original = native.passes._pass

    def spy(*args: object, **kwargs: object) -> object:
        rows = original(*args, **kwargs)  # type: ignore[arg-type]
        calls.append(rows is not None)
        return rows

    monkeypatch.setattr(native.passes, "_pass", spy)
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
    assert_metrics_close(stats.compute(), reference_for(batches))


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
    assert native_calls == [True]  # the other dtypes are not handed to the kernel


NO_KERNEL_RUN = """
import warnings
import torch
from lightning_rollout_debug import MismatchStats
from lightning_rollout_debug.metrics import native
rollout = torch.linspace(-3.0, -0.01, 300 * 260).reshape(300, 260)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    stats = MismatchStats()
    stats.update(rollout, rollout - 0.01, torch.ones(300, 260, dtype=torch.bool))
    stats.update(rollout, rollout - 0.01, torch.ones(300, 260, dtype=torch.bool))
print([str(w.message) for w in caught if "native CPU kernel" in str(w.message)])
print(native.builds(), stats.compute()["rollout_log_probs_diff_mean"])
"""


def test_an_install_without_the_kernel_warns_once_and_computes_on_torch(tmp_path: Path) -> None:
    """The package as a source install without a compiler leaves it: no kernel beside the
    loader. The first CPU batch warns once, saying how to get it; the results hold."""
    package = Path(native.__file__).parents[2]
    copy = tmp_path / package.name
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    done = subprocess.run(
        [sys.executable, "-c", NO_KERNEL_RUN],
        capture_output=True, text=True, check=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(tmp_path)}, cwd=tmp_path,
    )  # fmt: skip
    messages, outcome = done.stdout.strip().splitlines()[-2:]
    assert outcome.startswith("{} ")  # the copy, without its builds
    assert float(outcome.split()[1]) == pytest.approx(0.01, rel=1e-4)
    warned = ast.literal_eval(messages)
    assert len(warned) == 1, warned
    assert "has no CPU kernel: it was built from source where no C++ compiler" in warned[0]
    assert "Install g++ or clang++ and reinstall it" in warned[0]


TRAINING_RUN = """
import json, sys
import pytorch_lightning as pl
from pytorch_lightning.loggers import TensorBoardLogger
sys.path.insert(0, sys.argv[1])
from lightning_helpers import TRAINER_DEFAULTS, RolloutModule, make_batches
from lightning_rollout_debug import RolloutDebugCallback
from lightning_rollout_debug.metrics import native
trainer = pl.Trainer(
    **{**TRAINER_DEFAULTS, "max_steps": 3}, logger=TensorBoardLogger("logs"),
    callbacks=[RolloutDebugCallback(log_every_n_steps=1)],
)
trainer.fit(RolloutModule(make_batches(3, batch_size=64, width=1100, seed=9)))
with open("/proc/self/maps") as maps:
    mapped = sorted({line.split()[-1] for line in maps if "_row_sums_" in line})
print(json.dumps({"lanes": native.vector_lanes(), "mapped": mapped}))
"""

SLEEPING_COMPILER = '#!/bin/sh\necho "$0 $*" >> {marker}\nsleep 600\n'


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads Linux's /proc/self/maps")
def test_a_training_run_loads_the_installed_kernel_and_compiles_nothing(tmp_path: Path) -> None:
    """With compilers on ``PATH`` that only sleep, and a new ``HOME`` and cache folder, a CPU
    training run uses the kernel at once, from the installed package, calls no compiler
    and writes nothing to either folder."""
    fakes, home, cache, run = (tmp_path / name for name in ("bin", "home", "cache", "run"))
    for folder in (fakes, home, cache, run):
        folder.mkdir()
    marker = tmp_path / "compiler-called"
    for name in ("c++", "g++", "cc", "gcc", "clang", "clang++"):
        (fakes / name).write_text(SLEEPING_COMPILER.format(marker=marker))
        (fakes / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{fakes}:{os.environ['PATH']}", "HOME": str(home)}
    env["XDG_CACHE_HOME"] = str(cache)
    env.pop("CXX", None)
    tests = Path(__file__).parent
    done = subprocess.run(
        [sys.executable, "-c", TRAINING_RUN, str(tests)],
        capture_output=True, text=True, timeout=300, env=env, cwd=run,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["lanes"] == native.loader.cpu_lanes()
    package = Path(native.__file__).resolve().parent
    assert found["mapped"] and all(Path(path).parent == package for path in found["mapped"])
    assert not marker.exists()
    assert list(home.iterdir()) == [] and list(cache.iterdir()) == []


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
def _assert_same_extras(
    native_extras: Any, eager: TokenExtras, rel: float = 1e-9, batches: Sequence[Any] = ()
) -> None:
    """The same bins and worst tokens; the histograms' float64 sums within ``rel``.

    The bins of the same float32 values are the same; those of ``|pa - pb|`` but for the
    tokens of ``batches`` within rounding of an edge (:func:`_assert_moved_at_edges`). The
    sums within 1e-6: the torch arithmetic sums each row in float32 (its squares about the
    row's mean), the kernel in float64.
    """
    got, want = (extras.summary(extras.state) for extras in (native_extras, eager))
    assert got.histograms.keys() == want.histograms.keys()
    for tag, histogram in want.histograms.items():
        other = got.histograms[tag]
        if tag == "rollout_probs_diff_hist":
            counts = (torch.tensor(h.counts, dtype=torch.float64) for h in (other, histogram))
            _assert_moved_at_edges(*counts, PROBS_DIFF_BINS.edges, *batches)
        else:
            assert other.counts == histogram.counts, tag  # the same bits, the same bins
        assert other.num == histogram.num
        # |pa - pb| near r = 0: the kernel's series and torch's expm1 may differ in the last bit.
        assert (other.min, other.max) == pytest.approx((histogram.min, histogram.max), rel=2.5e-7)
        assert other.sum == pytest.approx(histogram.sum, rel=max(rel, 1e-6), abs=1e-9)
        assert other.sum_squares == pytest.approx(histogram.sum_squares, rel=max(rel, 1e-6))
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
        assert native_token.context == eager_token.context
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
    _assert_same_extras(*extras, batches=batches)
    for each in extras:  # no segment labels: the kernel's -1, as the torch pass's
        assert all(t.segment is None for t in each.summary(each.state).worst_tokens)


def _largest_first(batch: Batch, k: int) -> list[tuple[int, int]]:
    """(row, position) of the k counting tokens with the largest float32 |r|, in float64
    NumPy: |r| descending, then the earlier row, then the earlier position."""
    a = np.maximum(batch.old.float().numpy(), np.float32(-20.0))
    b = np.maximum(batch.rollout.float().numpy(), np.float32(-20.0))
    counting = (batch.mask.numpy() != 0) & (a < np.inf) & (b < np.inf)
    key = np.abs(np.where(counting, a, 0.0) - np.where(counting, b, 0.0)).astype(np.float64)
    rows, positions = np.nonzero(counting)
    order = np.lexsort((positions, rows, -key[rows, positions]))[:k]
    return [(int(rows[i]), int(positions[i])) for i in order]


def _few_log_ratios(rng: np.random.Generator, shape: tuple[int, int]) -> Batch:
    """Log-ratios of a few values, the larger the rarer: ties at every rank of the k."""
    rollout = -rng.integers(8, 160, shape) / 8.0
    steps = rng.choice(6, shape, p=[0.4, 0.3, 0.2, 0.09, 0.0098, 0.0002])
    old = rollout + rng.choice([-1.0, 1.0], shape) * np.where(steps > 0, 2.0 ** (steps - 6), 0.0)
    mask = torch.from_numpy(rng.random(shape) < 0.9)
    return Batch(torch.from_numpy(rollout).float(), torch.from_numpy(old).float(), mask)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("k", [1, 3, 10, 64])
def test_native_worst_tokens_are_the_largest_and_the_earlier_of_equal_ones(
    threads: int, k: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel's k tokens are those with the largest |r|, and of equal |r| (bfloat16
    log-probs take few values, so ties are common) the earlier ones in the batch, for any
    number of threads: each thread's rows only keep tokens above the k-th |r| of its rows
    so far, which never drops one of the k."""
    monkeypatch.setattr(native.passes, "_TOKENS_PER_THREAD", 1 << 12)
    rng = np.random.default_rng(17)
    count = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for batch in (
            make_batch(rng, (45, 700), dtype=torch.bfloat16, regime="mixed", mask_kind="counts"),
            make_batch(rng, (30, 333), regime="mixed", mask_kind="counts", special_rate=0.01),
            _few_log_ratios(rng, (40, 900)),
            *(_few_log_ratios(rng, (8, 300)) for _ in range(100)),
        ):
            extras = TokenExtras(histograms=False, worst_tokens_k=k)
            extras.update(batch.rollout, batch.old, batch.mask)
            worst = extras.summary(extras.state).worst_tokens
            assert [(t.row, t.position) for t in worst] == _largest_first(batch, k)
    finally:
        torch.set_num_threads(count)


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
    names = [name for group in callback.config.groups for name in METRIC_NAMES[group]]
    assert_metrics_close(logger.catalog()[2], want.select(names))


# ---------------------------------------------------------------------- the profile
def _profile_parts(block: torch.Tensor) -> dict[str, torch.Tensor]:
    """A profile block cut into its parts, by the stem of their slots' names."""
    stems = [name.split("[", 1)[0] for part in profile_blocks() for name in part.names]
    assert len(stems) == len(block) == PROFILE_SIZE
    parts: dict[str, list[float]] = {}
    for stem, value in zip(stems, block.tolist(), strict=True):
        parts.setdefault(stem, []).append(value)
    return {stem: torch.tensor(values, dtype=torch.float64) for stem, values in parts.items()}


def _profile_of(extras: TokenExtras) -> dict[str, torch.Tensor]:
    return _profile_parts(extras.state[extras.size - PROFILE_SIZE :])


def _assert_same_profile(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], *batches: Any
) -> None:
    """The kernel's profile against the torch arithmetic's, of ``batches``.

    Counts of the same float32 values are equal; the fine bins of ``|pa - pb|`` may differ
    where the kernel's e^x and series and torch's exp and expm1 round a token's d
    differently in its last bits (:func:`_assert_moved_at_edges`); float64 sums agree to
    their rounding.
    """
    assert got.keys() == want.keys()
    for stem in ("log_diff_bins", "position_tokens", "probability_tokens", "joint", "width"):
        assert torch.equal(got[stem], want[stem]), stem
    fine, edges = got["probs_diff_bins"], QUANTILE_BINS[0][2].edges
    _assert_moved_at_edges(fine, want["probs_diff_bins"], edges, *batches)
    for stem in (
        "position_probs_diff",
        "position_kl_k3",
        "probability_probs_diff",
        "probability_log_diff",
    ):
        torch.testing.assert_close(got[stem], want[stem], rtol=1e-6, atol=1e-12, msg=stem)
    for stem in ("probs_diff_max", "log_diff_max"):
        assert got[stem].item() == pytest.approx(want[stem].item(), rel=1e-6, abs=0), stem


def _assert_moved_at_edges(
    got: torch.Tensor, want: torch.Tensor, edges: Sequence[float], *batches: Any
) -> None:
    """Counts of ``|pa - pb|`` in the bins of ``edges``, equal but for tokens on an edge.

    Two implementations may round a token's d differently in its last bits, which moves it
    to the neighbouring bin where its d lies within that rounding of their edge. So the net
    number of tokens that crossed each edge (the running sum of the counts' differences)
    is at most the number of ``batches``' counting tokens whose float64 d lies within 2^-20
    of it (float32 rounds to 2^-24).
    """
    assert got.sum() == want.sum()
    flow = torch.cumsum(got - want, 0)[:-1].abs()
    if not flow.any():
        return
    assert batches, "the counts differ and no batch tells which tokens lie on an edge"
    keys = ("rollout_log_probs", "old_log_probs", "response_mask")
    t = tokens_of([dict(zip(keys, (b.rollout, b.old, b.mask), strict=True)) for b in batches])
    d = np.sort(np.abs(np.exp(t["a"]) - np.exp(t["b"])))
    at = np.asarray(edges)
    near = np.searchsorted(d, at * (1 + 2**-20), "right")
    near -= np.searchsorted(d, at * (1 - 2**-20), "left")
    crossed = flow.nonzero().flatten().tolist()
    assert all(flow[j] <= near[j] for j in crossed), [(j, flow[j].item(), near[j]) for j in crossed]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.float32])
@pytest.mark.parametrize(("histograms", "k"), [(True, 10), (False, 0)])
def test_native_profile_matches_the_torch_profile(
    dtype: torch.dtype,
    mask_dtype: torch.dtype,
    histograms: bool,
    k: int,
    native_calls: list[bool],
) -> None:
    """Every part of the profile block from the kernel's one pass, against eager torch, over
    odd widths, a width across several powers of two, empty rows and non-finite values."""
    rng = np.random.default_rng(41)
    shapes_and_masks = [
        ((70, 1000), "prefix"),
        ((9, 5000), "counts"),
        ((5, 33), "zeros"),
        ((6, 17), "binary"),
        ((11, 1), "ones"),
        ((3, 16), "single"),
    ]
    batches = [
        make_batch(
            rng,
            shape,
            dtype=dtype,
            regime=regime,
            mask_kind=mask_kind,
            mask_dtype=mask_dtype,
            special_rate=0.02,
        )
        for (shape, mask_kind), regime in zip(shapes_and_masks, (*REGIMES, "mixed"), strict=True)
    ]
    for batch in batches:
        extras = [
            TokenExtras(histograms=histograms, worst_tokens_k=k, profile=True, compile=compile)
            for compile in (None, False)
        ]
        without = TokenExtras(histograms=histograms, worst_tokens_k=k)
        for each in (*extras, without):
            each.update(batch.rollout, batch.old, batch.mask)
        _assert_same_profile(*(_profile_of(each) for each in extras), batch)
        # The rest of the state is the kernel's without the profile (to the rounding of the
        # sums: the compiler may fuse a multiply-add in one variant and not in the other).
        torch.testing.assert_close(
            extras[0].state[: without.size], without.state, rtol=1e-7, atol=0
        )
    assert native_calls == [True, True] * len(batches)


@pytest.mark.parametrize("regime", REGIMES)
def test_native_profile_of_a_window_matches_the_torch_profile(regime: str) -> None:
    """Several batches of different widths merged into one window: the widest counts."""
    rng = np.random.default_rng(43)
    batches = [
        make_batch(rng, shape, regime=regime, mask_kind="prefix", special_rate=0.01)
        for shape in ((4, 256), (2, 2049), (7, 100))
    ]
    extras = [TokenExtras(profile=True, compile=compile) for compile in (None, False)]
    for index, batch in enumerate(batches):
        for each in extras:
            each.update(batch.rollout, batch.old, batch.mask, batch_index=index)
    got, want = (_profile_of(each) for each in extras)
    _assert_same_profile(got, want, *batches)
    assert got["width"].item() == 2049.0
    summaries = [each.summary(each.state).profile for each in extras]
    assert summaries[0] is not None and summaries[1] is not None
    assert summaries[0].tokens == summaries[1].tokens
    assert [b.tokens for b in summaries[0].by_position] == [
        b.tokens for b in summaries[1].by_position
    ]


def test_native_profile_counts_every_column_in_its_bucket() -> None:
    """Position buckets 0, 1, [2, 4), ... and the last one open, across vectors and blocks."""
    for width in (1, 15, 16, 17, 31, 33, 5000):
        ones = torch.ones(3, width)
        extras = TokenExtras(histograms=False, worst_tokens_k=0, profile=True)
        extras.update(torch.full((3, width), -0.5), torch.full((3, width), -0.25), ones)
        got = _profile_of(extras)
        columns = torch.arange(width, dtype=torch.float64)
        buckets = torch.where(columns >= 1, torch.floor(torch.log2(columns.clamp(min=1))) + 1, 0)
        want = torch.zeros(POSITION_BUCKETS, dtype=torch.float64)
        want.scatter_add_(0, buckets.long(), torch.full_like(columns, 3.0))
        assert torch.equal(got["position_tokens"], want), width
        assert got["width"].item() == width
        assert got["probability_tokens"][PROBABILITY_BUCKETS - 1] == 3 * width  # pa = e^-0.25


@pytest.mark.parametrize("shape", [(37, 5000), (100, 3000)])
def test_native_profile_does_not_depend_on_the_thread_count(
    shape: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Threads take blocks of rows and keep their own tables; the float64 sums are added
    in the order of the blocks, so any number of threads gives the same bits (of the
    histograms added up from the fine bins too). 100x3000: more blocks of 4096 tokens
    than the kernel keeps, so its blocks take more."""
    monkeypatch.setattr(native.passes, "_TOKENS_PER_THREAD", 1 << 10)
    rng = np.random.default_rng(44)
    batch = make_batch(rng, shape, regime="mixed", mask_kind="counts", special_rate=0.01)
    request = TokenExtras(profile=True).kernel_request()
    threads = torch.get_num_threads()
    blocks = []
    try:
        for count in (1, 2, 3, 5):
            torch.set_num_threads(count)
            found = native.states(
                batch.rollout,
                batch.old,
                batch.mask,
                frozenset(),
                2.0,
                ROW_FIELDS,
                extras=request,
            )
            assert found is not None and found[1] is not None
            blocks.append(found[1])  # the histograms from the fine bins, then the profile
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(blocks[0], block) for block in blocks[1:])


@pytest.mark.parametrize("groups", [frozenset({"seed"}), ALL])
def test_native_profile_with_the_statistics_in_one_pass(
    groups: frozenset[str], native_calls: list[bool]
) -> None:
    """k3 comes from the catalog's arithmetic, or from the same expressions without it."""
    rng = np.random.default_rng(45)
    batch = make_batch(rng, (20, 700), regime="unrelated", mask_kind="prefix", special_rate=0.01)
    inputs = check_inputs(batch.rollout, batch.old, batch.mask)
    extras = TokenExtras(profile=True)
    stats = MismatchStats(groups=groups, compile=True)
    found = backends.kernel_states(inputs, stats=stats, extras=extras)
    alone = backends.kernel_states(inputs, extras=extras)
    assert found is not None and alone is not None and native_calls == [True, True]
    assert torch.equal(found[1], alone[1])
    eager = TokenExtras(profile=True, compile=False)
    eager.update(batch.rollout, batch.old, batch.mask)
    _assert_same_profile(_profile_parts(found[1][-PROFILE_SIZE:]), _profile_of(eager), batch)


def test_a_pass_adds_its_profile_into_the_state_it_is_finished_into(
    native_calls: list[bool],
) -> None:
    """Finished ``into`` a window's packed extras, a batch's profile block is added to the
    window's (counts and sums add, the maxima and the width keep the larger), and the
    other slots are the batch's own."""
    rng = np.random.default_rng(47)
    first, second = (
        make_batch(rng, shape, regime="mixed", mask_kind="prefix", special_rate=0.01)
        for shape in ((6, 500), (9, 300))
    )
    extras = TokenExtras(worst_tokens_k=4, profile=True)
    found = [
        backends.kernel_states(check_inputs(batch.rollout, batch.old, batch.mask), extras=extras)
        for batch in (first, second)
    ]
    assert found[0] is not None and found[1] is not None
    window, batch_state = found[0][1], found[1][1]
    assert window is not None and batch_state is not None
    into = window.clone()
    inputs = check_inputs(second.rollout, second.old, second.mask)
    added = backends.kernel_states(inputs, extras=extras, into=into)
    assert added is not None and added[1] is into and native_calls == [True] * 3
    head = extras.size - PROFILE_SIZE
    assert torch.equal(into[:head], batch_state[:head])
    sums = PROFILE_SIZE - 3  # the profile block ends with its maxima and the width
    torch.testing.assert_close(
        into[head : head + sums], window[head : head + sums] + batch_state[head : head + sums]
    )
    assert torch.equal(into[-3:], torch.maximum(window[-3:], batch_state[-3:]))
    assert into[-1] == 500  # the wider batch's width

    request = extras.kernel_request(add_profile=True)
    with pytest.raises(ValueError, match=f"packed extras \\({extras.size} values\\)"):
        native.states(
            *(inputs.rollout_log_probs, inputs.old_log_probs, inputs.mask),
            frozenset(),
            2.0,
            ROW_FIELDS,
            extras=request,
            into=torch.zeros(3, dtype=torch.float64),
        )


@pytest.mark.parametrize("batches", [31, 32, 33])
def test_a_cpu_window_adds_up_its_batches_profiles_in_place(
    batches: int, native_calls: list[bool]
) -> None:
    """A window fed by the kernel holds one profile block however many batches wait (the
    rest of each batch's state waits), and gives the merge of every batch's own state:
    31 batches all wait, the 32nd merges the waiting rest into one, and a 33rd waits
    beside that merge."""
    rng = np.random.default_rng(48)
    window = TokenExtras(worst_tokens_k=4, profile=True)
    states = []
    for index in range(batches):
        batch = make_batch(rng, (3, 40 + index), regime="mixed", mask_kind="prefix")
        window.update(batch.rollout, batch.old, batch.mask, batch_index=index)
        inputs = check_inputs(batch.rollout, batch.old, batch.mask)
        own = backends.kernel_states(inputs, extras=window, batch=index)
        assert own is not None
        states.append(own[1])
    assert all(native_calls) and len(native_calls) == 2 * batches
    kept = [*vars(window).values(), *vars(window._in_place).values()]
    held = {  # the memory of every tensor the window holds, its in-place block's too, once
        tensor.untyped_storage().data_ptr(): tensor.untyped_storage().nbytes()
        for value in kept
        for tensor in (value if isinstance(value, list) else [value])
        if isinstance(tensor, torch.Tensor)
    }
    assert window._in_place.state is not None and window._in_place.heads  # measured above
    head = window.size - PROFILE_SIZE
    assert sum(held.values()) <= 8 * (window.size + 31 * head)
    got = window.state
    torch.testing.assert_close(got, window.merge_states(torch.stack(states)), rtol=1e-12, atol=0)
    assert window.state_problems(got) == []


@pytest.mark.parametrize("profile", [False, True])
def test_the_histograms_beside_the_catalog_match_the_torch_extras(
    profile: bool, native_calls: list[bool]
) -> None:
    """With the catalog in the same pass, the histograms' maxima and sums are taken from the
    row sums: the same histograms as torch's, as without the catalog."""
    rng = np.random.default_rng(46)
    batch = make_batch(rng, (30, 900), regime="mixed", mask_kind="prefix", special_rate=0.01)
    inputs = check_inputs(batch.rollout, batch.old, batch.mask)
    extras = TokenExtras(histograms=True, worst_tokens_k=5, profile=profile)
    stats = MismatchStats(groups=ALL, compile=True)
    found = backends.kernel_states(inputs, stats=stats, extras=extras)
    assert found is not None and native_calls == [True]
    eager = TokenExtras(histograms=True, worst_tokens_k=5, profile=profile, compile=False)
    eager.update(batch.rollout, batch.old, batch.mask)
    # Each |pa - pb| within a float32 rounding of torch's (the kernel's exponential).
    kernel = SimpleNamespace(summary=extras.summary, state=found[1])
    _assert_same_extras(kernel, eager, 6e-8, batches=[batch])


@pytest.mark.parametrize(("histograms", "k"), [(True, 10), (False, 0), (False, 3)])
def test_the_kernel_lays_out_the_profile_as_the_layout_does(histograms: bool, k: int) -> None:
    extras = TokenExtras(histograms=histograms, worst_tokens_k=k, profile=True)
    request = extras.kernel_request()
    assert request is not None and request.profile
    assert request.state_size() == extras.size


def test_a_kernel_built_for_another_profile_is_not_loaded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The loader compares the kernel's profile parts and constants with profile.py."""
    path = native.load()
    library = ctypes.CDLL(str(path))
    native.loader.bind(library, path, ROW_FIELDS)  # as built: accepted
    monkeypatch.setattr(native.loader, "PROBABILITY_BUCKETS", PROBABILITY_BUCKETS + 1)
    wrong = r"probability_buckets = 29 \(profile.py: 30\)"
    with pytest.raises(native.KernelUnavailable, match=wrong):
        native.loader.bind(library, path, ROW_FIELDS)
    monkeypatch.undo()
    blocks = profile_blocks()
    renamed = Block("max", ("probs_diff_max", "log_diff_max", "widest"))
    monkeypatch.setattr(native.loader, "profile_blocks", lambda: [*blocks[:-1], renamed])
    with pytest.raises(native.KernelUnavailable, match="names the parts of the profile block"):
        native.loader.bind(library, path, ROW_FIELDS)


def test_a_kernel_that_forgets_a_slot_is_not_loaded(tmp_path: Path) -> None:
    """The loader runs the finishing step once: a slot it leaves unwritten (here the sum of
    k3, dropped from ``StateOf::write``) would read as an empty window at every step."""
    library = changed_kernel(tmp_path, "forgetful", "{c_k3, s_k3},", "")
    forgetful = ctypes.CDLL(str(library))
    with pytest.raises(native.KernelUnavailable, match=r"leaves the slots \['kl_k3'\] unwritten"):
        native.loader.bind(forgetful, library, ROW_FIELDS)
    real = native.load()
    native.loader.bind(ctypes.CDLL(str(real)), real, ROW_FIELDS)  # the real one


def _edge_batch(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log ratios on and beside the edges of the fine and the coarse bins, of both signs.

    r = a - b with b = 0 (or a = 0) is exact: magnitudes 2^e (1 + j / 32) and their float32
    neighbours, +0 and -0 (a = -0.0), |r| = 32 (a = 12, b = -20), tokens masked out and
    non-finite ones.
    """
    magnitudes = []
    for e in (-29, -28, -27, -26, -21, -20, -19, -8, -1, 0, 1, 2, 3, 4):
        for j in (0, 1, 7, 8, 9, 15, 16, 24, 31):
            m = torch.tensor(2.0**e * (1 + j / 32), dtype=torch.float32)
            magnitudes += [m, torch.nextafter(m, m.new_tensor(0.0)), torch.nextafter(m, 2 * m)]
    m = torch.stack(magnitudes)
    m = m[m <= 20.0]
    zero = torch.zeros_like(m)
    old = torch.cat([-m, zero, torch.tensor([-0.0, 0.0, 12.0, -20.0, 12.5, -20.0, 0.0, -1.0])])
    rollout = torch.cat([zero, -m, torch.tensor([0.0, 0.0, -20.0, 12.0, -20.0, 12.5, 0.0, -1.0])])
    mask = torch.ones_like(old, dtype=torch.bool)
    mask[-1] = False  # masked out
    rollout[-2] = math.nan  # does not count
    width = 37  # two vectors and a tail of five tokens a row
    pad = -len(old) % width
    old, rollout = (torch.cat([t, torch.full((pad,), -0.5)]) for t in (old, rollout))
    mask = torch.cat([mask, torch.zeros(pad, dtype=torch.bool)])
    return rollout.to(dtype).view(-1, width), old.to(dtype).view(-1, width), mask.view(-1, width)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("compile", [None, False], ids=["kernel", "torch"])
@pytest.mark.parametrize("batch_kind", ["random", "edges"])
def test_histograms_added_up_from_the_profile_are_those_counted(
    dtype: torch.dtype, compile: bool | None, batch_kind: str, native_calls: list[bool]
) -> None:
    """With the profile, the histograms' bins are added up from its fine bins: each bin of
    |pa - pb| is 8 fine bins (the lowest one the fine bin below 2^-27, the highest all
    fine bins from 1 up), and the bins of both histograms are those counted without the
    profile, bit for bit, by the kernel and by the torch arithmetic."""
    if batch_kind == "edges":
        args = _edge_batch(dtype)
    else:
        rng = np.random.default_rng(47)
        batch = make_batch(
            rng, (23, 700), dtype=dtype, regime="mixed", mask_kind="prefix", special_rate=0.02
        )
        args = (batch.rollout, batch.old, batch.mask)
    extras = [TokenExtras(profile=profile, compile=compile) for profile in (True, False)]
    for each in extras:
        each.update(*args)
    assert native_calls == ([True, True] if compile is None else [])
    with_profile, without = (each.summary(each.state) for each in extras)
    # The kernel's sums to their rounding: the compiler may fuse a multiply-add in the pass
    # with the profile and not in the other, which moves pa and d by an ulp.
    rel = 1e-7 if compile is None else 0.0
    for tag, histogram in without.histograms.items():
        got = with_profile.histograms[tag]
        assert got.counts == histogram.counts, tag
        assert (got.num, got.min, got.max) == (histogram.num, histogram.min, histogram.max), tag
        assert got.sum == pytest.approx(histogram.sum, rel=rel, abs=0), tag
        assert got.sum_squares == pytest.approx(histogram.sum_squares, rel=rel, abs=0), tag
    # Every value of a fine bin lies in the coarse bin of the fine bin's lower edge.
    fine_bins = QUANTILE_BINS[0][2]
    fine = _profile_of(extras[0])["probs_diff_bins"]
    lower_edges = torch.tensor((0.0, *fine_bins.edges), dtype=torch.float64)
    coarse = torch.zeros(len(PROBS_DIFF_BINS.edges) + 1, dtype=torch.float64)
    coarse.index_add_(0, PROBS_DIFF_BINS.index(lower_edges), fine)
    assert with_profile.histograms["rollout_probs_diff_hist"].counts == tuple(coarse.tolist())
    if batch_kind == "edges":  # both signs of r, to |r| = 32 and beyond
        counts = with_profile.histograms["rollout_log_ratio_hist"].counts
        assert sum(counts[: len(counts) // 2]) > 100 and sum(counts[len(counts) // 2 + 1 :]) > 100
        extremes = LOG_RATIO_BINS.index(torch.tensor([-32.5, -32.0, 32.0, 32.5])).tolist()
        assert all(counts[bin] > 0 for bin in extremes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_fine_bins_of_edges_match_the_torch_profile(dtype: torch.dtype) -> None:
    """The kernel counts r by sign and adds the bins of |r| up from those: on and beside
    the edges of the bins, of both signs, they are those of the torch arithmetic (those of
    |pa - pb| but for a token within rounding of an edge)."""
    args = _edge_batch(dtype)
    extras = [
        TokenExtras(histograms=histograms, profile=True, compile=compile)
        for histograms in (True, False)
        for compile in (None, False)
    ]
    for each in extras:
        each.update(*args)
    profiles = [_profile_of(each) for each in extras]
    batch = SimpleNamespace(rollout=args[0], old=args[1], mask=args[2])
    for got in profiles[1:]:
        for stem in ("log_diff_bins", "joint", "probability_tokens"):
            assert torch.equal(got[stem], profiles[0][stem]), stem
        fine, edges = got["probs_diff_bins"], QUANTILE_BINS[0][2].edges
        _assert_moved_at_edges(fine, profiles[0]["probs_diff_bins"], edges, batch)


def test_histogram_bins_beyond_the_kernel_slots_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lane's two slots, its copy's offset included, are 16-bit fields: bins that do not
    fit are refused before anything is counted, and the torch path takes over."""
    kernel = native.kernel
    monkeypatch.setattr(kernel, "_kernel", dict(kernel._kernel))  # this test's give-up only
    rng = np.random.default_rng(46)
    batch = make_batch(rng, (4, 300), regime="mixed", mask_kind="prefix")
    fits = TokenExtras().kernel_request()
    assert fits is not None
    too_many = dataclasses.replace(fits, ratio_bins=(fits.ratio_bins[0], 2100), profile=False)
    arguments = (batch.rollout, batch.old, batch.mask, frozenset(), 2.0, ROW_FIELDS)
    assert native.states(*arguments, extras=dataclasses.replace(fits, profile=False)) is not None
    with pytest.warns(RuntimeWarning, match="rejected its arguments"):
        assert native.states(*arguments, extras=too_many) is None


def test_a_finishing_step_that_fails_falls_back_to_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An error in the kernel's finishing calls gives the kernel up with one warning: the
    batch and every later one go to the torch path, none is skipped."""
    assert native.available()
    kernel = native.kernel
    monkeypatch.setattr(kernel, "_kernel", dict(kernel._kernel))  # this test's give-up only

    def failing(*args: object) -> int:
        raise ctypes.ArgumentError("argument 3: wrong type")

    failing_steps = {"finish_state": failing, "finish_extras": failing}
    loaded = dataclasses.replace(native.kernel._kernel["kernel"], **failing_steps)
    monkeypatch.setitem(native.kernel._kernel, "kernel", loaded)
    rng = np.random.default_rng(49)
    batches = [make_batch(rng, (4, 90), regime="mixed", mask_kind="prefix") for _ in range(2)]
    stats = MismatchStats()
    with pytest.warns(RuntimeWarning, match="finishing step failed"):
        stats.update(batches[0].rollout, batches[0].old, batches[0].mask)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        stats.update(batches[1].rollout, batches[1].old, batches[1].mask)
    keys = ("rollout", "old", "mask")
    want = reference_metrics(*([getattr(batch, key) for batch in batches] for key in keys))
    assert_metrics_close(stats.compute(), want)


def test_probabilities_stay_finite_up_to_float32s_own_limit() -> None:
    # e^x overflows float32 above ln(FLT_MAX) = 88.7228; the kernel's exponential must
    # not overflow sooner (2^128 does not fit the exponent: 88.38 was its limit).
    old = torch.tensor([[88.0, 88.38, 88.5, 88.6, 88.72, -1.0, -0.3]])
    rollout = torch.full_like(old, -0.5)
    mask = torch.ones_like(old)
    want = np.abs(np.exp(old.double().numpy()) - np.exp(-0.5))
    assert np.isfinite(want).all()
    found = {}
    stats = MismatchStats()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # positive log-probs
        stats.update(rollout, old, mask)
        found[None] = stats.compute()
    assert math.isclose(found[None]["rollout_probs_diff_mean"], want.mean(), rel_tol=1e-5)
    assert math.isclose(found[None]["rollout_probs_diff_max"], want.max(), rel_tol=1e-5)
    # The torch arithmetic sums a row in float32, where two such values overflow: one token
    # a row, and rows add in float64.
    for compile in (None, False):
        stats = MismatchStats(compile=compile)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            stats.update(rollout.T, old.T, mask.T)
            found[compile] = stats.compute()
    for name, value in found[False].items():
        other = found[None][name]
        assert (math.isnan(value) and math.isnan(other)) or math.isclose(
            other, value, rel_tol=1e-5, abs_tol=1e-12
        ), (name, other, value)
