"""The native kernel's builds of every vector width (16, 8 and 4 float32 lanes).

The package is installed with one build per width (``setup.py``), and an update loads
the widest the CPU runs; the rest of the suite runs that one. Here each build this CPU
runs is loaded in turn and checked against the torch arithmetic and the float64
reference, column by column: the shuffles that move lanes, the first vector's position
buckets, the tails of rows and the per-lane copies of the counts all depend on the width.
"""

from __future__ import annotations

import platform
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REGIMES, SOURCE, cxx, kernel_skip_reason, load_setup, make_batch, reference_for
from reference import assert_metrics_close
from test_native import EXACT, _assert_same_extras, _assert_same_profile, _profile_of
from torch import Tensor

from lightning_rollout_debug import GROUPS, MismatchStats
from lightning_rollout_debug.metrics import native
from lightning_rollout_debug.metrics.extras import TokenExtras
from lightning_rollout_debug.metrics.profile import POSITION_BUCKETS
from lightning_rollout_debug.metrics.rows import ROW_FIELDS, row_sums, rows_for

KERNEL_SKIP = kernel_skip_reason()
pytestmark = pytest.mark.skipif(KERNEL_SKIP is not None, reason=str(KERNEL_SKIP))

# Widths below, at and above every lane count, rows of one token, and rows that span
# several position buckets and several of the kernel's 512-token blocks.
SHAPES = ((9, 333), (4, 16), (3, 7), (2, 1), (5, 33), (3, 1100))


@pytest.fixture(params=native.VECTOR_LANES, ids=lambda lanes: f"{lanes}-lanes")
def lanes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """The build of ``request.param`` lanes, in use for the test."""
    wanted, widest = request.param, native.loader.cpu_lanes()
    if wanted > widest:
        pytest.skip(f"this CPU runs the kernel at up to {widest} lanes")
    fresh = {"kernel": None, "problem": None}
    monkeypatch.setattr(native.kernel, "_kernel", fresh)
    native.load(wanted)
    assert native.vector_lanes() == wanted
    return wanted


def test_every_width_is_installed_and_this_cpu_runs_the_widest_it_can() -> None:
    """On x86-64 the package holds the builds of 16, 8 and 4 lanes (elsewhere of 4), and an
    update loads the widest the CPU runs."""
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    assert sorted(native.builds()) == ([4, 8, 16] if x86 else [4])
    assert native.vector_lanes() == native.loader.cpu_lanes()


@pytest.mark.parametrize("groups", [frozenset({"seed"}), frozenset(GROUPS)])
def test_row_sums_match_the_torch_arithmetic(lanes: int, groups: frozenset[str]) -> None:
    rng = np.random.default_rng(lanes)
    for shape, regime in zip(SHAPES, (*REGIMES, "mixed"), strict=True):
        batch = make_batch(
            rng, shape, regime=regime, mask_kind="counts", mask_dtype=torch.int64, special_rate=0.02
        )
        got = native.row_sums(
            batch.rollout, batch.old, batch.mask, rows_for(groups), 2.0, ROW_FIELDS
        )
        want = row_sums(batch.rollout, batch.old, batch.mask, groups, 2.0)
        assert got is not None
        for name, value in want.items():
            expected = value.to(torch.float64)
            if name in EXACT:
                assert torch.equal(got[name], expected), (shape, name)
            else:
                torch.testing.assert_close(
                    got[name], expected, rtol=3e-6, atol=1e-9, msg=f"{shape} {name}"
                )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_updates_match_the_reference(lanes: int, dtype: torch.dtype) -> None:
    rng = np.random.default_rng(100 + lanes)
    stats = MismatchStats(compile=True)
    batches = [
        make_batch(
            rng,
            shape,
            dtype=dtype,
            regime="mixed",
            mask_kind="prefix",
            mask_dtype=torch.bool,
            special_rate=0.03,
            with_ids=True,
        )
        for shape in SHAPES
    ]
    for batch in batches:
        stats.update(*batch.args())
    assert_metrics_close(stats.compute(), reference_for(batches))


def zeros_where_padding_puts_them(rollout: Tensor, old: Tensor, mask: Tensor) -> np.ndarray:
    """Each row's rollout log-probs of 0 (beside a trainer's below -1) that follow another
    such token or are the row's last counting token: straight from the definition."""
    a = np.maximum(old.double().numpy(), -20.0)  # NaN stays NaN
    b = np.maximum(rollout.double().numpy(), -20.0)
    counting = (mask.numpy() != 0) & (a < np.inf) & (b < np.inf)
    zero = counting & (b == 0.0) & (a < -1.0)
    out = np.zeros(zero.shape[0], dtype=np.int64)
    for row, flags in enumerate(zero):
        after = [t for t in range(1, len(flags)) if flags[t] and flags[t - 1]]
        last = np.flatnonzero(counting[row])
        end = last.size > 0 and flags[last[-1]] and not (last[-1] > 0 and flags[last[-1] - 1])
        out[row] = len(after) + int(end)
    return out


def padding_like_batch(rng: np.random.Generator, shape: tuple[int, int]) -> tuple[Tensor, ...]:
    """Zeros alone, in runs, at rows' ends and beside masked-out or non-finite tokens."""
    rows, width = shape
    rollout = np.where(rng.random(shape) < 0.4, 0.0, -3.0 * rng.random(shape))
    old = np.where(rng.random(shape) < 0.8, -1.5 - 10.0 * rng.random(shape), -rng.random(shape))
    special = rng.choice([np.nan, np.inf, -np.inf, -np.inf], shape)
    old = np.where(rng.random(shape) < 0.1, special, old)
    rollout = np.where(rng.random(shape) < 0.05, rng.choice([np.nan, -np.inf], shape), rollout)
    lengths = rng.integers(0, width + 1, (rows, 1))
    mask = (np.arange(width)[None, :] < lengths) & (rng.random(shape) < 0.9)
    return tuple(
        torch.from_numpy(x) for x in (rollout.astype(np.float32), old.astype(np.float32), mask)
    )


def masked_trainer_tokens(rollout: Tensor, old: Tensor, mask: Tensor) -> np.ndarray:
    """Each row's counting tokens with a trainer's -inf and a rollout's finite, non-zero."""
    a, b = old.double().numpy(), rollout.double().numpy()
    counting = (mask.numpy() != 0) & ~np.isnan(a) & ~np.isnan(b) & (a < np.inf) & (b < np.inf)
    return np.sum(counting & (a == -np.inf) & np.isfinite(b) & (b != 0.0), axis=1)


def test_zeros_where_padding_puts_them_match_numpy(lanes: int) -> None:
    """The kernel's counts and the torch ones (eager and compiled share their code) against
    NumPy: the zeros where padding puts them, and the trainer's -inf beside finite ones."""
    rng = np.random.default_rng(300 + lanes)
    counted = counted_masked = 0
    for shape in (*SHAPES, (6, 2 * lanes), (6, 2 * lanes + 1), (40, 3)):
        rollout, old, mask = padding_like_batch(rng, shape)
        want = zeros_where_padding_puts_them(rollout, old, mask)
        counted += int(want.sum())
        name = "zero_rollout_log_prob_run"
        eager = row_sums(rollout, old, mask, frozenset({"health"}), 2.0)
        kernel = native.row_sums(
            rollout, old, mask, rows_for(frozenset({"health"})), 2.0, ROW_FIELDS
        )
        assert kernel is not None
        assert eager[name].tolist() == want.tolist(), shape
        assert kernel[name].tolist() == want.astype(np.float64).tolist(), shape
        masked = masked_trainer_tokens(rollout, old, mask)
        name = "masked_actor_log_prob"
        assert eager[name].tolist() == masked.tolist(), shape
        assert kernel[name].tolist() == masked.astype(np.float64).tolist(), shape
        counted_masked += int(masked.sum())
    assert counted > 100 and counted_masked > 20


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
def test_extras_and_profile_match_the_torch_ones(lanes: int, mask_dtype: torch.dtype) -> None:
    """Histograms, worst tokens and the profile, from the kernel and from eager torch.

    The sums of a few hundred tokens hold the kernel's e^x and torch's, which differ by up
    to 1.2e-6 relative near the log-prob floor.
    """
    rng = np.random.default_rng(200 + lanes)
    for shape in SHAPES:
        batch = make_batch(
            rng, shape, regime="mixed", mask_kind="prefix", mask_dtype=mask_dtype, special_rate=0.02
        )
        ids = torch.from_numpy(rng.integers(0, 1000, shape))
        kernel, eager = (
            TokenExtras(worst_tokens_k=10, profile=True, compile=compile)
            for compile in (None, False)
        )
        for each in (kernel, eager):
            each.update(batch.rollout, batch.old, batch.mask, ids)
        _assert_same_extras(kernel, eager, 1e-6, batches=[batch])
        _assert_same_profile(_profile_of(kernel), _profile_of(eager), batch)


def test_the_profile_counts_every_column_in_its_bucket(lanes: int) -> None:
    """The first vector's lanes fall in buckets 0, 1, [2, 4), ...; later vectors in one."""
    for width in (1, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 33, 600):
        extras = TokenExtras(histograms=False, worst_tokens_k=0, profile=True)
        extras.update(
            torch.full((3, width), -0.5), torch.full((3, width), -0.25), torch.ones(3, width)
        )
        columns = torch.arange(width, dtype=torch.float64)
        buckets = torch.where(columns >= 1, torch.floor(torch.log2(columns.clamp(min=1))) + 1, 0)
        want = torch.zeros(POSITION_BUCKETS, dtype=torch.float64)
        want.scatter_add_(0, buckets.long(), torch.full_like(columns, 3.0))
        assert torch.equal(_profile_of(extras)["position_tokens"], want), width


def _is_gcc(compiler: str) -> bool:
    found = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False)
    return found.returncode == 0 and "Free Software Foundation" in found.stdout


@pytest.mark.parametrize("lanes", [16, 8, 4])
def test_no_step_of_a_build_runs_lane_by_lane(lanes: int, tmp_path: Path) -> None:
    """GCC names every vector step it does one lane at a time; no build of x86 has one.

    Compiled (not run) with the flags ``setup.py`` builds that width with.
    """
    compiler = cxx()
    if platform.machine() not in ("x86_64", "AMD64") or compiler is None or not _is_gcc(compiler):
        pytest.skip("GCC's -Wvector-operation-performance, for x86 targets")
    build = load_setup()
    flags = [*build.FLAGS, *build.X86_64_WIDTHS[lanes], f"-DROLLOUT_LANES={lanes}"]
    found = subprocess.run(
        [compiler, *flags, "-Wvector-operation-performance",
         "-S", str(SOURCE), "-o", str(tmp_path / "row_sums.s")],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert found.returncode == 0, found.stderr
    assert "expanded" not in found.stderr, found.stderr[:2000]
    assembly = (tmp_path / "row_sums.s").read_text()
    width = re.search(
        r"^rollout_vector_lanes:\n(?:\S.*\n|\s+\..*\n)*\s+movl\s+\$(\d+),", assembly, re.M
    )
    assert width is not None and int(width.group(1)) == lanes
