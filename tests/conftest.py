"""Shared test data, and which tests are slow.

Slow tests carry the ``slow`` marker, set here from the tables below (a test may also
carry ``@pytest.mark.slow`` itself): ``pytest -m "not slow"`` is the quick subset, plain
``pytest`` runs everything.

Random ``[B, T]`` batches of log-probs, masks and token ids: Hypothesis draws the
structure (shape, dtypes, value regime, mask kind, how many special values); a NumPy
generator seeded by Hypothesis fills in the values, which keeps each example cheap. The
log-probs are built in their target dtype first, so the reference sees exactly the
(upcast) values the package sees.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch
from hypothesis import strategies as st
from reference import Reference, reference_metrics
from torch import Tensor


# ----------------------------------------------------------------------------- the kernel
def kernel_skip_reason() -> str | None:
    """Why the native kernel's own tests cannot run here; ``None``: they must run.

    Only the kernel turned off on purpose, or a source install where no C++ compiler was
    there to build it, skips them: an installation that has a compiler but lacks the
    kernel, or whose kernel fails to load, fails the tests.
    """
    from lightning_rollout_debug.metrics.native import SWITCH_ENV, builds

    switch = os.environ.get(SWITCH_ENV, "").strip().lower()
    if switch in ("0", "false", "off", "no"):
        return f"the native kernel is turned off ({SWITCH_ENV}={os.environ[SWITCH_ENV]})"
    if not builds() and cxx() is None:
        return "installed without the native kernel: no C++ compiler was there to build it"
    return None


def cxx() -> str | None:
    """The C++ compiler on ``PATH`` (``$CXX``, else ``c++``, ``g++`` or ``clang++``)."""
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["c++", "g++", "clang++"]
    return next(filter(None, map(shutil.which, names)), None)


NEEDS_CXX = pytest.mark.skipif(
    cxx() is None, reason="torch.compile on the CPU (inductor's C++ code) needs a C++ compiler"
)
"""For a test that compiles on the CPU with inductor and checks that it did."""

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "lightning_rollout_debug" / "metrics" / "native" / "row_sums.cpp"
"""The kernel's source, in the checkout."""


def changed_kernel(folder: Path, name: str, old: str, new: str) -> Path:
    """The kernel built from its source with ``old`` (found once) replaced by ``new``.

    Skips the test without a C++ compiler.
    """
    compiler = cxx()
    if compiler is None:
        pytest.skip("builds a changed kernel: needs a C++ compiler")
    source = SOURCE.read_text()
    assert source.count(old) == 1, old
    code, library = folder / f"{name}.cpp", folder / f"{name}.so"
    code.write_text(source.replace(old, new))
    subprocess.run(
        [compiler, "-O1", "-std=c++17", "-shared", "-fPIC", "-o", str(library), str(code)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    return library


def load_setup() -> ModuleType:
    """The checkout's ``setup.py`` as a module (its build flags), without building."""
    spec = importlib.util.spec_from_file_location("package_build", ROOT / "setup.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------- slow tests
SLOW_MODULES: dict[str, str] = {
    "test_distributed.py": "spawns process groups of several ranks",
    "test_fuzz.py": "fuzzes thousands of batches, through Trainer runs too",
    "test_memory.py": "thousands of updates and Trainer steps",
    "test_scale_out.py": "FSDP2 and two simulated nodes, in processes of their own",
}
"""Modules whose every test is slow, and why."""

SLOW_TESTS: dict[str, str] = {
    "test_native_widths.py::test_no_step_of_a_build_runs_lane_by_lane": (
        "compiles the kernel at every vector width"
    ),
    "test_native.py::test_a_kernel_that_forgets_a_slot_is_not_loaded": "compiles a kernel",
    "test_stats.py::test_sixteen_ranks_merge_to_the_statistics_of_all_tokens": "16 ranks",
    "test_segments.py::test_two_ranks_merge_segments_that_one_rank_holds": "two ranks",
    "test_tensorboard.py::test_two_ranks_histograms_and_worst_tokens_cover_both": "two ranks",
    "test_torch_path.py::test_triton_plans_a_handful_of_kernels_for_the_default_update": (
        "plans inductor's Triton code at four shapes"
    ),
}
"""Single tests (all their parametrisations) that are slow, and why."""

SLOW_FIXTURES: dict[str, str] = {
    "example": "trains examples/grpo_mismatch.py",
    "multiturn_example": "trains examples/multiturn_mismatch.py",
    "inductor_only": "compiles with torch.compile",
    "torch_path": "traces or compiles with torch.compile",
}
"""Fixtures that make any test using them slow, and why."""

SLOW_PARAMETERS: dict[str, str] = {"torch.compile": "compiles with torch.compile"}
"""Parameter values that make a parametrisation slow, and why."""


def is_slow(item: pytest.Item) -> bool:
    """Whether a collected test is slow by the tables above."""
    module = item.path.name
    function = getattr(item, "originalname", item.name)
    callspec = getattr(item, "callspec", None)
    parameters = callspec.params.values() if callspec is not None else ()
    return (
        module in SLOW_MODULES
        or f"{module}::{function}" in SLOW_TESTS
        or any(name in SLOW_FIXTURES for name in getattr(item, "fixturenames", ()))
        or any(isinstance(value, str) and value in SLOW_PARAMETERS for value in parameters)
    )


def pytest_collection_modifyitems(config: pytest.Config, items: Sequence[pytest.Item]) -> None:
    for item in items:
        if is_slow(item):
            item.add_marker(pytest.mark.slow)


# ----------------------------------------------------------------------------- test data
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
MASK_DTYPES = (
    torch.bool,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.float32,
    torch.float64,
)
ID_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)
REGIMES = ("near_zero", "near_floor", "unrelated", "matched", "mixed")
MASK_KINDS = ("bool", "binary", "counts", "zeros", "ones", "single", "prefix")
SPECIALS = np.array([np.nan, np.inf, -np.inf, 0.0, -20.0, -1e4, -1e30])


EXAMPLES_SCALE = float(os.environ.get("ROLLOUT_DEBUG_EXAMPLES_SCALE", "1"))


def examples(count: int) -> int:
    """``count`` Hypothesis examples, times ``$ROLLOUT_DEBUG_EXAMPLES_SCALE`` for stress runs."""
    return max(1, round(count * EXAMPLES_SCALE))


@dataclass
class Batch:
    """One batch as the statistics take it."""

    rollout: Tensor
    old: Tensor
    mask: Tensor
    rollout_ids: Tensor | None = None
    trainer_ids: Tensor | None = None

    def args(self) -> tuple[Tensor | None, ...]:
        return (self.rollout, self.old, self.mask, self.rollout_ids, self.trainer_ids)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.mask.shape)  # type: ignore[return-value]


def reference_for(window: Sequence[Batch], **kwargs: object) -> Reference:
    """The reference over every token of ``window`` (token ids only where a batch has them)."""
    return reference_metrics(
        [b.rollout for b in window],
        [b.old for b in window],
        [b.mask for b in window],
        rollout_ids=[b.rollout_ids for b in window],
        trainer_ids=[b.trainer_ids for b in window],
        **kwargs,
    )


def _near_floor(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    below = -20.0 - rng.exponential(3.0, shape)
    above = -20.0 + rng.uniform(0.0, 0.5, shape)
    return np.where(rng.random(shape) < 0.5, below, above)


def _pair(rng: np.random.Generator, shape: tuple[int, int], regime: str) -> tuple[np.ndarray, ...]:
    if regime == "near_zero":
        return -rng.uniform(0.0, 1e-6, shape), -rng.uniform(0.0, 1e-6, shape)
    if regime == "near_floor":
        return _near_floor(rng, shape), _near_floor(rng, shape)
    if regime == "unrelated":
        scale = rng.choice([0.1, 1.0, 5.0])
        return -rng.exponential(scale, shape), -rng.exponential(scale, shape)
    if regime == "matched":
        x = -rng.exponential(rng.choice([0.01, 1.0, 4.0]), shape)
        noise = rng.normal(0.0, rng.choice([1e-7, 1e-5, 1e-3, 1e-1]), shape)
        return x, x + noise
    # mixed: every element from a regime of its own
    pairs = [_pair(rng, shape, name) for name in REGIMES[:-1]]
    pick = rng.integers(0, len(pairs), shape)
    first = np.choose(pick, [p[0] for p in pairs])
    second = np.choose(pick, [p[1] for p in pairs])
    return first, second


def _specials(rng: np.random.Generator, x: np.ndarray, rate: float) -> np.ndarray:
    hit = rng.random(x.shape) < rate
    return np.where(hit, rng.choice(SPECIALS, x.shape), x)


def _mask(
    rng: np.random.Generator, shape: tuple[int, int], kind: str, dtype: torch.dtype
) -> Tensor:
    p = rng.uniform(0.0, 1.0)
    if kind == "bool":
        values = rng.random(shape) < p
        dtype = torch.bool
    elif kind == "binary":
        values = (rng.random(shape) < p).astype(np.float64)
    elif kind == "counts":  # any non-zero value counts
        choices = [0.0, 1.0, 2.0, 3.0] if dtype in (torch.bool, torch.uint8) else [0, 1, 2, -1]
        if dtype.is_floating_point:
            choices = [0.0, 0.5, 1.0, 2.0, -1.0]
        values = rng.choice(choices, shape)
    elif kind == "zeros":
        values = np.zeros(shape)
    elif kind == "ones":
        values = np.ones(shape)
    elif kind == "single":
        values = np.zeros(shape)
        if values.size:
            values[tuple(int(rng.integers(0, n)) for n in shape)] = 1.0
    else:  # prefix: a right-padded response mask
        lengths = rng.integers(0, shape[1] + 1, shape[0])
        values = (np.arange(shape[1])[None, :] < lengths[:, None]).astype(np.float64)
    if dtype == torch.bool:
        return torch.from_numpy(np.asarray(values) != 0)
    return torch.from_numpy(np.asarray(values, dtype=np.float64)).to(dtype)


def make_batch(
    rng: np.random.Generator,
    shape: tuple[int, int],
    *,
    dtype: torch.dtype = torch.float32,
    old_dtype: torch.dtype | None = None,
    regime: str = "mixed",
    mask_kind: str = "bool",
    mask_dtype: torch.dtype = torch.bool,
    special_rate: float = 0.0,
    with_ids: bool = False,
    id_dtype: torch.dtype = torch.int64,
) -> Batch:
    """A random batch; the log-probs are rounded to their dtype before anyone sees them."""
    first, second = _pair(rng, shape, regime)
    if rng.random() < 0.5:
        first, second = second, first
    first, second = _specials(rng, first, special_rate), _specials(rng, second, special_rate)
    rollout = torch.from_numpy(first).to(dtype)
    old = torch.from_numpy(second).to(old_dtype or dtype)
    mask = _mask(rng, shape, mask_kind, mask_dtype)
    if not with_ids:
        return Batch(rollout, old, mask)
    high = 100 if id_dtype == torch.uint8 else 50_000
    rollout_ids = rng.integers(0, high, shape)
    changed = rng.random(shape) < rng.choice([0.0, 0.05, 0.5])
    trainer_ids = np.where(changed, rng.integers(0, high, shape), rollout_ids)
    return Batch(
        rollout,
        old,
        mask,
        torch.from_numpy(rollout_ids).to(id_dtype),
        torch.from_numpy(trainer_ids).to(id_dtype),
    )


@st.composite
def batches(
    draw: st.DrawFn,
    *,
    width: int | None = None,
    with_ids: bool | None = None,
    max_rows: int = 6,
    max_width: int = 40,
) -> Batch:
    """A Hypothesis strategy of :class:`Batch`: B in 0..6, T in 0..40, every dtype and kind."""
    rows = draw(st.integers(0, max_rows))
    cols = draw(st.integers(0, max_width)) if width is None else width
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    old_dtype = draw(st.one_of(st.just(dtype), st.sampled_from(FLOAT_DTYPES)))
    return make_batch(
        np.random.default_rng(draw(st.integers(0, 2**32 - 1))),
        (rows, cols),
        dtype=dtype,
        old_dtype=old_dtype,
        regime=draw(st.sampled_from(REGIMES)),
        mask_kind=draw(st.sampled_from(MASK_KINDS)),
        mask_dtype=draw(st.sampled_from(MASK_DTYPES)),
        special_rate=draw(st.sampled_from([0.0, 0.0, 0.03, 0.3])),
        with_ids=draw(st.booleans()) if with_ids is None else with_ids,
        id_dtype=draw(st.sampled_from(ID_DTYPES)),
    )


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20240601)
