"""The kernel's segments: the float64 reference's metrics, and the torch road's state.

The kernel sums each row's runs of equal segment label apart in the pass that reads the
batch (``row_sums.cpp``), and finishes them into the packed segments of a
``SegmentWindow``; the torch road reduces the same tokens by segment row with scatters
(``torch_pass/segments.py``). Each segment's metrics from one pass are those of the float64
reference over the segment's tokens, whatever the labels (a label a sequence or a token,
out of range, in any integer dtype), the log-probs' dtype and regime, the mask's dtype and
the special log-probs. The packed state is the torch road's to float32 rounding wherever
the torch road keeps the digits (it centres a segment's tokens at their row's mean, in
float32: :func:`conditioned`), and a monitor logs the same values per segment on both roads.
"""

from __future__ import annotations

import ctypes
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REGIMES, changed_kernel, kernel_skip_reason, make_batch
from reference import assert_metrics_close, reference_metrics

from lightning_rollout_debug import GROUPS, MismatchStats, RolloutDebugMonitor
from lightning_rollout_debug.metrics import backends, native
from lightning_rollout_debug.metrics.extras import TokenExtras
from lightning_rollout_debug.metrics.inputs import check_inputs
from lightning_rollout_debug.metrics.layout import STATE
from lightning_rollout_debug.metrics.native import passes
from lightning_rollout_debug.metrics.rows import ROW_FIELDS
from lightning_rollout_debug.metrics.segments import (
    DEFAULT_SEGMENT_METRICS,
    SEGMENT_METRIC_CHOICES,
    SegmentWindow,
    segment_values,
)
from lightning_rollout_debug.metrics.worst_tokens import FIELDS

KERNEL_SKIP = kernel_skip_reason()
pytestmark = pytest.mark.skipif(KERNEL_SKIP is not None, reason=str(KERNEL_SKIP))

ALL = frozenset(GROUPS)
SEGMENTS = 5
# Slots that are counts or selections of float32 values both roads compute alike.
EXACT = (
    "count",
    "nonfinite",
    "ratio_high",
    "ratio_low",
    "max_actor_log_prob",
    "max_rollout_log_prob",
    "max_log_ratio",
    "min_log_ratio",
    "max_log_diff",
)
_NAMES = [name for block in STATE.blocks for name in block.names]


KINDS = ("rows", "turns", "runs", "tokens")
"""The kinds of labels of :func:`labels_of`."""
MASK_DTYPES = (torch.bool, torch.uint8, torch.int32, torch.int64, torch.float32, torch.float16)
"""The mask dtypes a batch may have (the kernel reads the first five as they are, the last
as a bool copy)."""


def labels_of(kind: str, rng: np.random.Generator, shape: tuple[int, int]) -> torch.Tensor:
    """Labels of ``kind`` for a ``shape`` batch, some outside ``[0, SEGMENTS)``.

    ``rows``: one a sequence; ``turns``: a row's tokens in 1 to 6 runs of increasing label,
    ending anywhere; ``runs``: runs of 1 to 40 tokens of any label; ``tokens``: a label a
    token, drawn at random (runs of about one token).
    """
    rows, width = shape
    if kind == "rows":
        return torch.from_numpy(rng.integers(-2, SEGMENTS + 2, rows))
    if kind == "tokens":
        return torch.from_numpy(rng.integers(-1, SEGMENTS + 1, shape))
    labels = np.empty(shape, dtype=np.int64)
    for row in range(rows):
        if kind == "turns":
            ends = np.sort(rng.integers(0, width + 1, int(rng.integers(0, 6))))
            turns = np.searchsorted(ends, np.arange(width), side="right")
            labels[row] = turns + rng.integers(-1, 2)
        else:
            lengths = rng.integers(1, 41, width)
            values = rng.integers(-1, SEGMENTS + 2, width)
            labels[row] = np.repeat(values, lengths)[:width]
    return torch.from_numpy(labels)


def torch_segments(batch, labels: torch.Tensor, segments: int = SEGMENTS) -> torch.Tensor:
    """The packed segments of the torch road (``compile=False``) for one batch."""
    window = SegmentWindow(segments, compile=False)
    window.update(batch.rollout, batch.old, batch.mask, labels)
    return window.state


def kernel_segments(
    batch,
    labels: torch.Tensor,
    segments: int = SEGMENTS,
    *,
    stats: MismatchStats | None = None,
    metrics: tuple[str, ...] | None = None,
) -> torch.Tensor | None:
    """The packed segments of one kernel pass (``None``: left to the torch road), read for
    ``metrics`` (``None``: every one)."""
    inputs = check_inputs(batch.rollout, batch.old, batch.mask)
    extras = TokenExtras(profile=True) if stats is not None else None
    window = SegmentWindow(segments, metrics=metrics)
    found = backends.kernel_states(inputs, stats=stats, extras=extras, segments=(window, labels))
    assert found is not None
    return found[2]


def assert_same_segments(got: torch.Tensor, want: torch.Tensor, segments: int = SEGMENTS) -> None:
    """Both packed segments hold the same slots: counts and extremes exactly, the rest to
    float32 rounding of the tokens' values, each slot a float64 sum of them added in
    another order: ``2e-6`` of the sum of their magnitudes. That is the slot itself for a
    sum of positive values; for a signed sum a bound from other slots (``sum |r| = n
    log_diff``, ``sum |rho - 1| <= mult_error_m1``, ``sum |rho^2 - 1| <= sum (rho - 1)^2 +
    2 sum |rho - 1|``); for a centred moment ``M_xy``, the raw sum it comes from, ``|M_xy| +
    n |mean_x mean_y|``, and the torch road's centring (for values of magnitude 1 or less:
    the batches of :func:`conditioned`)."""
    got, want = (state.view(segments + 1, STATE.size) for state in (got, want))
    assert torch.equal(got.isnan(), want.isnan())
    got, want = got.nan_to_num(), want.nan_to_num()

    def slot(name: str) -> torch.Tensor:
        return want[:, STATE.at[name]]

    count, mult = slot("count"), slot("mult_error_m1").abs()
    squares = (slot("ratio_sq") - 2 * slot("ratio") + count).clamp(min=0.0)
    bounds = {
        "log_ratio": count * slot("log_diff"),
        "ratio_m1": mult,
        "ratio_sq_m1": squares + 2 * mult,
    }
    failures = []
    for at, name in enumerate(_NAMES):
        mine, theirs = got[:, at], want[:, at]
        if name in EXACT:
            if not torch.equal(mine, theirs):
                failures.append(f"{name}: {mine.tolist()} != {theirs.tolist()}")
            continue
        scale, atol = bounds.get(name, theirs.abs()), 1e-12
        if "*" in name:
            x, y = (slot(side) for side in name.split("*"))
            scale = scale + count * (x * y).abs()
        if "*" in name or name in ("ratio_sq", "ratio_sq_m1"):
            # The torch road's second moments centre each token at its row's mean in
            # float32, not at its segment's: ``eps32`` of each value's distance from it,
            # squared (here at most 1).
            atol = 1.2e-7 * count
        if not bool(((mine - theirs).abs() <= 2e-6 * scale + atol).all()):
            failures.append(f"{name}: {mine.tolist()} != {theirs.tolist()}")
    assert not failures, "\n".join(failures)


def segment_masks(mask: torch.Tensor, labels: torch.Tensor, segments: int = SEGMENTS) -> list:
    """The mask of each segment's tokens: labels ``0`` to ``S - 1``, then every other."""
    labels = labels if labels.dim() == 2 else labels.unsqueeze(1).expand(mask.shape)
    other = (labels < 0) | (labels >= segments)
    kept = mask != 0
    return [kept & (labels == s) for s in range(segments)] + [kept & other]


def assert_segments_match_the_reference(
    state: torch.Tensor,
    batch,
    labels: torch.Tensor,
    segments: int = SEGMENTS,
    metrics: tuple[str, ...] = SEGMENT_METRIC_CHOICES,
) -> None:
    """Each segment's ``metrics`` are those of the float64 reference over its tokens alone."""
    values = segment_values(state, segments, metrics)
    for segment, mask in enumerate(segment_masks(batch.mask, labels, segments)):
        reference = reference_metrics(batch.rollout, batch.old, mask)
        want = reference.select(metrics)
        if reference["rollout_tokens"] == 0:
            assert segment not in values, segment
            continue
        assert_metrics_close(values[segment], want)


def conditioned(rng: np.random.Generator, shape: tuple[int, int], **kwargs: object):
    """A batch whose every value keeps its float32 digits on the torch road too.

    The torch road centres a segment's tokens at their row's mean in float32, which loses
    a segment's spread beside a row's extreme values (ratios of ``e^20``, say): log-probs
    of moderate regimes, and non-finite ones that never count (NaN, +inf; -inf is floored
    at -20) in place of a few.
    """
    regime = ("near_zero", "near_floor", "matched")[int(rng.integers(0, 3))]
    batch = make_batch(rng, shape, regime=regime, mask_kind="counts", **kwargs)
    for values in (batch.rollout, batch.old):
        hit = torch.from_numpy(rng.random(shape) < 0.03)
        special = torch.from_numpy(rng.choice([math.nan, math.inf], shape))
        values[hit] = special[hit].to(values.dtype)
    return batch


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask_dtype", MASK_DTYPES)
def test_kernel_segments_match_the_reference(
    kind: str, dtype: torch.dtype, mask_dtype: torch.dtype
) -> None:
    """[B] and [B, T] labels (some outside [0, S), some segments empty), float32 and
    bfloat16 log-probs of every regime, masks of every dtype the kernel takes, 3% of the
    log-probs special (NaN, infinities, 0, -20, far below it): each segment's metrics from
    one pass, with the statistics and the extras or alone, are those of the float64
    reference over the segment's tokens."""
    rng = np.random.default_rng(hash((kind, str(dtype), str(mask_dtype))) % 2**32)
    for regime in REGIMES:
        for shape in ((7, 100), (3, 37), (5, 16), (2, 1)):
            batch = make_batch(
                rng, shape, dtype=dtype, regime=regime, mask_kind="counts",
                mask_dtype=mask_dtype, special_rate=0.03,
            )  # fmt: skip
            labels = labels_of(kind, rng, shape)
            for stats in (None, MismatchStats(groups=ALL)):
                got = kernel_segments(batch, labels, stats=stats)
                assert got is not None
                assert_segments_match_the_reference(got, batch, labels)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask_dtype", MASK_DTYPES)
def test_kernel_segments_match_the_torch_road(
    kind: str, dtype: torch.dtype, mask_dtype: torch.dtype
) -> None:
    """The packed segments of one pass are the torch road's (``compile=False``) to float32
    rounding, slot by slot, for batches whose values keep their digits on both roads
    (:func:`conditioned`), non-finite log-probs among them."""
    rng = np.random.default_rng(hash(("torch", kind, str(dtype), str(mask_dtype))) % 2**32)
    for shape in ((7, 100), (3, 37), (5, 16), (2, 1), (4, 600)):
        for _ in range(3):
            batch = conditioned(rng, shape, dtype=dtype, mask_dtype=mask_dtype)
            labels = labels_of(kind, rng, shape)
            want = torch_segments(batch, labels)
            for stats in (None, MismatchStats(groups=ALL)):
                got = kernel_segments(batch, labels, stats=stats)
                assert got is not None
                assert_same_segments(got, want)


@pytest.mark.parametrize("lanes", native.VECTOR_LANES)
def test_every_width_sums_the_segments_as_the_reference(
    lanes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each build (16, 8 and 4 lanes) splits its vectors at the runs' ends alike: runs
    ending anywhere in a vector, runs shorter than one, rows shorter than one."""
    if lanes > native.loader.cpu_lanes():
        pytest.skip(f"this CPU runs the kernel at up to {native.loader.cpu_lanes()} lanes")
    monkeypatch.setattr(native.kernel, "_kernel", {"kernel": None, "problem": None})
    native.load(lanes)
    rng = np.random.default_rng(66 + lanes)
    for shape in ((7, 100), (3, 37), (5, 3), (2, 1), (3, 1100)):
        batch = make_batch(rng, shape, regime="mixed", mask_kind="counts", special_rate=0.03)
        for kind in KINDS:
            labels = labels_of(kind, rng, shape)
            for stats in (None, MismatchStats(groups=ALL)):
                got = kernel_segments(batch, labels, stats=stats)
                assert got is not None
                assert_segments_match_the_reference(got, batch, labels)


def test_labels_out_of_range_count_as_other_and_empty_segments_stay_empty() -> None:
    """Labels below 0 or from S on are ``other``'s; a segment without a token is the empty
    window, as the torch road leaves it."""
    rng = np.random.default_rng(60)
    batch = conditioned(rng, (4, 50))
    labels = torch.tensor([0, 2, -7, 100]).repeat_interleave(50).view(4, 50)
    labels[1, 25:] = 6  # S: other
    got, want = kernel_segments(batch, labels, 6), torch_segments(batch, labels, 6)
    assert got is not None
    assert_same_segments(got, want, 6)
    copies = got.view(7, STATE.size)
    empty = STATE.identity()
    for segment in (1, 3, 4, 5):
        assert torch.equal(copies[segment].nan_to_num(), empty.nan_to_num()), segment
    counting = (batch.mask != 0) & (batch.rollout < math.inf) & (batch.old < math.inf)
    other = counting[1, 25:].sum() + counting[2:].sum()
    assert copies[6, STATE.at["count"]] == float(other) > 0


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32])
def test_labels_of_any_integer_dtype_give_the_int64_labels_segments(dtype: torch.dtype) -> None:
    """int32 labels are read as they are, other dtypes as int64 copies; [B, T] labels need
    not be contiguous."""
    rng = np.random.default_rng(61)
    batch = conditioned(rng, (6, 90))
    labels = labels_of("runs", rng, (6, 90)).clamp(0, 100)
    want = kernel_segments(batch, labels)
    assert want is not None
    assert torch.equal(kernel_segments(batch, labels.to(dtype)), want)
    transposed = labels.to(dtype).T.contiguous().T
    assert not transposed.is_contiguous()
    assert torch.equal(kernel_segments(batch, transposed), want)


def test_kernel_segments_do_not_depend_on_the_thread_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """The segments' sums are kept per block of rows fixed by the shape and added up in the
    blocks' order: any number of threads gives the same bits, the statistics' and the
    extras' too."""
    monkeypatch.setattr(passes, "_TOKENS_PER_THREAD", 1 << 10)
    rng = np.random.default_rng(62)
    batch = make_batch(rng, (100, 700), regime="mixed", mask_kind="counts", special_rate=0.01)
    labels = labels_of("runs", rng, (100, 700))
    labels[::2] = labels_of("tokens", rng, (50, 700))  # rows sorted by segment
    inputs = check_inputs(batch.rollout, batch.old, batch.mask)
    stats, window = MismatchStats(groups=ALL), SegmentWindow(5)
    threads = torch.get_num_threads()
    for extras in (TokenExtras(profile=True), None):  # blocks of the profile, or their own
        found = []
        try:
            for count in (1, 2, 3):
                torch.set_num_threads(count)
                found.append(
                    backends.kernel_states(
                        inputs, stats=stats, extras=extras, segments=(window, labels)
                    )
                )
        finally:
            torch.set_num_threads(threads)
        for states in found[1:]:
            assert all(
                mine is theirs or torch.equal(mine, theirs)
                for mine, theirs in zip(states, found[0], strict=True)
            )


def test_segments_leave_the_statistics_and_the_extras_as_they_were() -> None:
    """A row's sums are its runs' added up: the statistics and the extras of a pass with
    segments are those without, to float64 rounding, but for the worst tokens' segments,
    each the label at the token's place."""
    rng = np.random.default_rng(63)
    batch = make_batch(rng, (9, 333), regime="mixed", mask_kind="counts", special_rate=0.01)
    inputs = check_inputs(batch.rollout, batch.old, batch.mask)
    stats = MismatchStats(groups=ALL)
    extras = TokenExtras(histograms=True, worst_tokens_k=5, profile=True)
    alone = backends.kernel_states(inputs, stats=stats, extras=extras)
    for kind in KINDS:
        labels = labels_of(kind, rng, (9, 333))
        found = backends.kernel_states(
            inputs, stats=stats, extras=extras, segments=(SegmentWindow(5), labels)
        )
        assert found is not None and alone is not None and found[2] is not None
        worst = extras.summary(found[1]).worst_tokens
        assert len(worst) == 5
        for token in worst:
            label = int(
                labels[token.row] if labels.dim() == 1 else labels[token.row, token.position]
            )
            assert token.segment == (label if 0 <= label < 5 else 5)
        segment = extras.layout.at["segment"]
        relabelled = found[1].clone()
        relabelled[segment : segment + 5 * FIELDS : FIELDS] = -1.0
        for mine, theirs in zip((found[0], relabelled), alone[:2], strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12, equal_nan=True)


def test_rows_of_short_runs_fill_buckets_on_either_side_of_the_threshold() -> None:
    """Rows whose runs average 1 to 96 tokens, on both sides of the 48 from which the pass
    follows the runs rather than putting the row's tokens in their segments' buckets, in
    one batch; a row of two labels in turns, whose buckets fill up within it, and one whose
    tokens do not count over a long stretch: each segment's metrics are the float64
    reference's, with and without the statistics and the extras, read for every metric and
    for the default ones (which the buckets are read for in fewer operations)."""
    rng = np.random.default_rng(64)
    rows, width = 98, 1200
    batch = make_batch(rng, (rows, width), regime="mixed", mask_kind="counts", special_rate=0.03)
    labels = np.empty((rows, width), dtype=np.int64)
    for row in range(rows - 2):
        run = 1 + row  # tokens a run
        values = rng.integers(-1, SEGMENTS + 1, width // run + 1)
        labels[row] = np.repeat(values, run)[:width]
    labels[-2] = np.arange(width) % 2  # 600 tokens of each: more than a bucket holds
    labels[-1] = rng.integers(0, SEGMENTS, width)
    batch.mask[-2:] = 1
    batch.mask[-1, 100:1100] = 0  # a thousand tokens that do not count, then some that do
    labels = torch.from_numpy(labels)
    for stats in (None, MismatchStats(groups=ALL)):
        for metrics in (SEGMENT_METRIC_CHOICES, DEFAULT_SEGMENT_METRICS):
            got = kernel_segments(batch, labels, stats=stats, metrics=metrics)
            assert got is not None
            assert_segments_match_the_reference(got, batch, labels, metrics=metrics)


@pytest.mark.parametrize("metric", SEGMENT_METRIC_CHOICES)
def test_each_metric_of_a_segment_needs_only_its_rows(metric: str) -> None:
    """A segment read for one metric alone (its rows of ``ROWS_OF_SEGMENT_METRIC``) has
    that metric's float64 reference value, over rows of runs and rows of buckets."""
    rng = np.random.default_rng(66)
    batch = make_batch(rng, (6, 400), regime="mixed", mask_kind="counts", special_rate=0.02)
    labels = labels_of("runs", rng, (6, 400))
    labels[::2] = labels_of("tokens", rng, (3, 400))
    got = kernel_segments(batch, labels, stats=MismatchStats(groups=ALL), metrics=(metric,))
    assert got is not None
    assert_segments_match_the_reference(got, batch, labels, metrics=(metric,))


@pytest.fixture
def native_calls(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Records, per kernel pass, whether it took the batch's segments."""
    calls: list[bool] = []
    original = passes._pass

    def spy(*args: object, **kwargs: object) -> object:
        done = original(*args, **kwargs)  # type: ignore[arg-type]
        calls.append(done is not None and done.labels.segment_rows is not None)
        return done

    monkeypatch.setattr(passes, "_pass", spy)
    return calls


def test_a_monitor_logs_the_torch_roads_segments_on_the_kernels(native_calls: list[bool]) -> None:
    """A default monitor on a CPU (the kernel's road) logs the values of each segment that
    a ``compile=False`` one logs: labels of turns, of sequences, of runs, a label a token,
    and a float64 batch, which takes the torch road whole; the window then folds passes of
    two plans. Past 32 batches, the window folds."""
    rng = np.random.default_rng(65)
    batches = []
    for index in range(36):
        batch = conditioned(rng, (5, 120))
        kind = ("turns", "rows", "runs", "tokens")[index % 4]
        item = {
            "rollout_log_probs": batch.rollout,
            "old_log_probs": batch.old,
            "response_mask": batch.mask,
            "segment_ids": labels_of(kind, rng, (5, 120)),
        }
        if index == 5:
            item = {key: v.double() if v.is_floating_point() else v for key, v in item.items()}
        batches.append(item)
    logged = []
    for compile in (None, False):
        monitor = RolloutDebugMonitor(alert_ranges={}, max_segments=SEGMENTS, compile=compile)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            for item in batches:
                monitor.update(item)
            logged.append(monitor.log(0))
    assert native_calls.count(True) == 35 and native_calls.count(False) == 0
    got, want = ({k: v for k, v in found.items() if "segments/" in k} for found in logged)
    assert sorted(got) == sorted(want) and "training/segments/other/rollout_tokens" in got
    for name, value in want.items():
        assert math.isclose(got[name], value, rel_tol=1e-5, abs_tol=1e-9), (name, got[name], value)


def test_a_kernel_that_finishes_other_slots_of_the_segments_is_not_loaded(tmp_path: Path) -> None:
    """The loader runs a pass with segments once: a segment's copy that held a slot of the
    sequence or the health group (here the health group among the segments') is refused."""
    groups = "(1 << g_kl) | (1 << g_ratio);"
    widened = "(1 << g_kl) | (1 << g_ratio) | (1 << g_health);"
    library = changed_kernel(tmp_path, "overreaching", groups, widened)
    with pytest.raises(native.KernelUnavailable, match="finishes the segments otherwise"):
        native.loader.bind(ctypes.CDLL(str(library)), library, ROW_FIELDS)
    real = native.load()
    native.loader.bind(ctypes.CDLL(str(real)), real, ROW_FIELDS)  # the real one
