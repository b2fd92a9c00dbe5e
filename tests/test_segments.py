"""Segments (issue #55): the mismatch of each turn, data source or task, by the reference.

A batch's ``segment_ids`` label its tokens (``[B, T]``: the turn) or its rows (``[B]``:
the data source, the task). A segment's values are the catalog's formulas over its
counting tokens, so its float64 reference is the window's reference with the mask cut to
the segment (:func:`reference.reference_segments`). ``segment_metrics`` is compared with
it directly; real CPU Trainer runs with gradient accumulation, on each road of an update
(eager torch arithmetic, ``torch.compile``, the default), write TensorBoard event files
that are read back tag by tag; two ``ddp_spawn`` processes merge segments that one rank
holds alone; and a window with segments keeps a state of a fixed size, which a checkpoint
carries over.
"""

from __future__ import annotations

import io
import math
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import Batch, batches, cxx, examples
from conftest import make_batch as random_batch
from hypothesis import given, settings
from hypothesis import strategies as st
from lightning_helpers import (
    MemoryLogger,
    RolloutModule,
    at_step,
    make_batch,
    read_scalars,
    split_windows,
    step_of_batches,
)
from reference import (
    OTHER,
    SEGMENT_NAMES,
    Reference,
    assert_metrics_close,
    assert_profile,
    reference_profile,
    reference_segments,
    token_labels,
)
from test_callback import assert_windows, fit, tb_logger
from test_distributed import RankModule, interleave, with_nonfinite
from test_distributed import fit as fit_two_ranks
from torch._dynamo.utils import counters

from lightning_rollout_debug import RolloutDebugCallback, RolloutDebugMonitor, RolloutDebugWarning
from lightning_rollout_debug.functional import mismatch_profile, segment_metrics
from lightning_rollout_debug.metrics import segments
from lightning_rollout_debug.metrics.native import passes as native_passes
from lightning_rollout_debug.metrics.segments import DEFAULT_SEGMENT_METRICS, SEGMENT_METRIC_CHOICES

pytestmark = [
    pytest.mark.filterwarnings("ignore:The '.*dataloader' does not have many workers"),
    pytest.mark.filterwarnings("ignore:The number of training batches .* is smaller than"),
    pytest.mark.filterwarnings("ignore:`isinstance.treespec, LeafSpec.` is deprecated"),
    # Threshold alerts on the (deliberately noisy) test data: not what these tests check.
    pytest.mark.filterwarnings("ignore:RolloutDebugCallback at step .* is outside"),
    pytest.mark.filterwarnings("ignore:RolloutDebugMonitor at step .* is outside"),
]

PREFIX = "training/"
SEGMENTS = f"{PREFIX}segments/"
NAMES = ("math", "code", "chat", "tool")
"""The names of the segments of the Trainer runs (``max_segments=4``)."""
ROADS: dict[str, bool | None] = {"eager": False, "torch.compile": True, "default": None}
"""The CPU roads of an update with segments, by the ``compile`` that takes it."""
LABELS = ("tokens", "sequences")
"""``[B, T]`` labels (a turn per run of tokens) and ``[B]`` labels (one per row)."""
CONTRACT_DEFAULTS = (
    "rollout_tokens",
    "rollout_probs_diff_mean",
    "rollout_probs_diff_max",
    "rollout_log_probs_diff_mean",
    "rollout_actor_kl_k1",
    "rollout_actor_kl_k3",
    "rollout_is_ratio_frac_high",
    "rollout_is_ratio_frac_low",
)
CHOSEN = (
    "rollout_log_probs_diff_std",
    "rollout_actor_probs_pearson_corr",
    "rollout_is_ess",
    "rollout_nonfinite_tokens",
)
"""Segment metrics other than the defaults."""
COMPILE_FAILED = "torch.compile of the rollout metrics failed"


# ---------------------------------------------------------------------- data
def turns(rng: np.random.Generator, rows: int, width: int, count: int) -> np.ndarray:
    """``[rows, width]`` labels: each row cut into ``count`` contiguous runs labelled
    ``0 .. count - 1`` in order (a run may be empty), as the turns of a conversation."""
    cuts = np.sort(rng.integers(0, width + 1, (rows, count - 1)), axis=1)
    columns = np.arange(width)
    return (columns[None, :, None] >= cuts[:, None, :]).sum(axis=2)


def labelled(batch: dict[str, torch.Tensor], ids: np.ndarray, key: str = "segment_ids") -> dict:
    """``batch`` with the labels ``ids`` under ``key`` (int64)."""
    return {**batch, key: torch.from_numpy(np.asarray(ids, dtype=np.int64))}


def labels_of(kind: str, rng: np.random.Generator, rows: int, width: int, count: int) -> np.ndarray:
    """Labels of a batch in ``0 .. count - 1``: turns, or one per row (each label in turn)."""
    if kind == "tokens":
        return turns(rng, rows, width, count)
    return (np.arange(rows) + int(rng.integers(0, count))) % count


def cut(ids: np.ndarray, mask: torch.Tensor, row: int, stop: int, label: int) -> None:
    """Give ``label`` to the first ``stop`` tokens of ``row`` (or the row, for ``[B]`` labels)
    and mask them out: a segment whose every token is masked."""
    if ids.ndim == 1:
        ids[row] = label
        mask[row] = 0
    else:
        ids[row, :stop] = label
        mask[row, :stop] = 0


def outside(ids: np.ndarray, high: int) -> None:
    """Labels out of range in the first and the last row: ``high`` and ``-3``."""
    if ids.ndim == 1:
        ids[0], ids[-1] = high, -3
    else:
        ids[0, :] = high
        ids[-1, : max(1, ids.shape[1] // 2)] = -3


def road_batches(kind: str) -> list[dict[str, torch.Tensor]]:
    """Eight batches of ``kind`` labels: two windows of four (two per optimizer step).

    The first window holds all four segments and ``other`` (labels 7 and -3 in batch 2),
    non-finite tokens (batch 1), a floored rollout log-prob (batch 0; batch 5 too) and
    labels in int32 (batch 3). The second has no counted
    token of ``tool`` (3): batch 5 gives it only masked tokens; batch 6 is bfloat16.
    """
    out = []
    for i in range(8):
        rows, width = 3 + i % 3, 12 + 4 * (i % 4)
        dtype = torch.bfloat16 if i == 6 else torch.float32
        batch = make_batch(rows, width, seed=300 + i, index=i, dtype=dtype)
        if i in (1, 4):
            batch = with_nonfinite(batch, 3, seed=i)
        if i in (0, 5):  # a rollout log-prob below the floor: r near 20, rho near e^20
            batch["rollout_log_probs"][0, 1] = -30.0
            batch["response_mask"][0, 1] = 1
        rng = np.random.default_rng(i)
        ids = labels_of(kind, rng, rows, width, 4 if i < 4 else 3)
        if i == 2:
            outside(ids, 7)
        if i == 5:
            cut(ids, batch["response_mask"], 1, 4, 3)
        batch = labelled(batch, ids)
        if i == 3:
            batch["segment_ids"] = batch["segment_ids"].to(torch.int32)
        out.append(batch)
    return out


# ---------------------------------------------------------------------- expectations
def window_segments(
    window: Sequence[Mapping[str, torch.Tensor]],
    num_segments: int,
    key: str = "segment_ids",
) -> dict[int | str, Reference]:
    """The reference of each segment of a window of dict batches (``None``: no labels)."""
    return reference_segments(
        [b["rollout_log_probs"] for b in window],
        [b["old_log_probs"] for b in window],
        [b["response_mask"] for b in window],
        [b.get(key) for b in window],
        num_segments,
    )


def segment_name(key: int | str, names: Sequence[str] = ()) -> str:
    """A segment's name in the tags: its given name, else its number; ``other``."""
    if key == OTHER:
        return OTHER
    assert isinstance(key, int)
    return names[key] if key < len(names) else str(key)


def expected_segments(
    want: Mapping[int | str, Reference],
    metrics: Sequence[str] = DEFAULT_SEGMENT_METRICS,
    names: Sequence[str] = (),
) -> dict[str, Reference]:
    """What a logger receives: each segment's defined values of ``metrics``, by name."""
    return {
        segment_name(key, names): ref.select([m for m in metrics if not math.isnan(ref[m])])
        for key, ref in want.items()
    }


def segments_of(logged: Mapping[str, float]) -> dict[str, dict[str, float]]:
    """The segment scalars of one step, ``{name: {metric: value}}``; every tag is
    ``training/segments/<name>/<metric>``, a name without ``/``."""
    out: dict[str, dict[str, float]] = {}
    for tag, value in logged.items():
        if tag.startswith(SEGMENTS):
            name, metric = tag[len(SEGMENTS) :].split("/")
            out.setdefault(name, {})[metric] = float(value)
    return out


def assert_segments(
    got: Mapping[str, Mapping[str, float]], want: Mapping[str, Reference], where: str
) -> None:
    """The same segments, each with exactly the reference's names and values."""
    assert sorted(got) == sorted(want), f"{where}: segments {sorted(got)}, want {sorted(want)}"
    for name, reference in want.items():
        try:
            assert_metrics_close(got[name], reference)
        except AssertionError as error:
            raise AssertionError(f"{where}, segment {name!r}: {error}") from None


def segment_warnings(messages: Sequence[str]) -> list[str]:
    return [message for message in messages if "segment" in message.lower()]


# ---------------------------------------------------------------------- the catalog
def test_the_segment_metrics_are_those_of_the_contract() -> None:
    assert tuple(DEFAULT_SEGMENT_METRICS) == CONTRACT_DEFAULTS
    assert sorted(SEGMENT_METRIC_CHOICES) == sorted(SEGMENT_NAMES)
    assert len(set(SEGMENT_METRIC_CHOICES)) == len(SEGMENT_METRIC_CHOICES)
    assert set(DEFAULT_SEGMENT_METRICS) <= set(SEGMENT_METRIC_CHOICES)
    assert segments.OTHER == OTHER


# ---------------------------------------------------------------------- functional
def functional_case(
    kind: str, dtype: torch.dtype, seed: int = 0
) -> tuple[Batch, np.ndarray, torch.Tensor]:
    """A batch of 8 rows of 48 tokens with masked and non-finite tokens, and its labels.

    Labels 0 to 3 (turns or rows), 6 and -1 (out of range of 5 segments), and 4, whose
    every token is masked: the segments 0 to 3 and ``other`` count tokens, 4 none.
    """
    rng = np.random.default_rng(seed)
    batch = random_batch(rng, (8, 48), dtype=dtype, special_rate=0.04)
    mask = torch.from_numpy(rng.random((8, 48)) < 0.8)
    ids = labels_of(kind, rng, 8, 48, 4)
    if kind == "tokens":
        ids[1, 40:] = 6
        ids[2, :6] = -1
    else:
        ids[1], ids[2] = 6, -1
    cut(ids, mask, 3, 5, 4)
    return batch, ids, mask


@pytest.mark.parametrize("kind", LABELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_segment_metrics_match_the_reference(kind: str, dtype: torch.dtype) -> None:
    batch, ids, mask = functional_case(kind, dtype)
    assert ((token_labels(ids, mask.shape) == 4) & mask.numpy()).sum() == 0  # 4 is empty
    for num_segments in (5, None):
        got = segment_metrics(
            batch.rollout,
            batch.old,
            mask,
            torch.from_numpy(ids),
            num_segments=num_segments,
            metrics=SEGMENT_METRIC_CHOICES,
        )
        want = reference_segments(batch.rollout, batch.old, mask, ids, num_segments)
        # 5 segments: 6 and -1 are `other`; by the labels (7 segments): -1 alone.
        assert sorted(map(str, want)) == sorted(
            ["0", "1", "2", "3", OTHER] if num_segments else ["0", "1", "2", "3", "6", OTHER]
        )
        assert sorted(map(str, got)) == sorted(map(str, want))
        for key, reference in want.items():
            try:
                assert_metrics_close(got[key], reference.select(SEGMENT_METRIC_CHOICES))
            except AssertionError as error:
                raise AssertionError(f"{num_segments} segments, {key!r}: {error}") from None
    # Non-finite log-probs among the counted segments' masked tokens: dropped, counted.
    assert sum(want[key]["rollout_nonfinite_tokens"] for key in want) > 0


@pytest.mark.parametrize("kind", LABELS)
def test_segment_metrics_by_default_and_by_their_dtype_of_labels(kind: str) -> None:
    batch, ids, mask = functional_case(kind, torch.float32, seed=1)
    want = reference_segments(batch.rollout, batch.old, mask, ids, 5)
    for label_dtype in (torch.int64, torch.int32, torch.int16):
        got = segment_metrics(
            batch.rollout, batch.old, mask, torch.from_numpy(ids).to(label_dtype), num_segments=5
        )
        assert sorted(map(str, got)) == sorted(map(str, want))
        for key, reference in want.items():
            assert list(got[key]) == list(DEFAULT_SEGMENT_METRICS)
            assert_metrics_close(got[key], reference.select(DEFAULT_SEGMENT_METRICS))


@settings(max_examples=examples(60), deadline=None)
@given(
    batch=batches(with_ids=False),
    kind=st.sampled_from(LABELS),
    num_segments=st.sampled_from([None, 1, 3, 8]),
    seed=st.integers(0, 2**32 - 1),
)
def test_segment_metrics_of_any_batch_match_the_reference(
    batch: Batch, kind: str, num_segments: int | None, seed: int
) -> None:
    rows, width = batch.shape
    rng = np.random.default_rng(seed)
    ids = rng.integers(-2, 7, rows if kind == "sequences" else (rows, width))
    got = segment_metrics(
        batch.rollout,
        batch.old,
        batch.mask,
        torch.from_numpy(ids),
        num_segments=num_segments,
        metrics=SEGMENT_METRIC_CHOICES,
    )
    want = reference_segments(batch.rollout, batch.old, batch.mask, ids, num_segments)
    assert sorted(map(str, got)) == sorted(map(str, want))
    for key, reference in want.items():
        assert_metrics_close(got[key], reference.select(SEGMENT_METRIC_CHOICES))


@pytest.mark.parametrize("kind", LABELS)
@pytest.mark.parametrize("segment", [0, 2])
def test_the_profile_of_a_segment_is_that_of_its_tokens(kind: str, segment: int) -> None:
    batch, ids, mask = functional_case(kind, torch.float32, seed=2)
    got = mismatch_profile(
        batch.rollout, batch.old, mask, segment_ids=torch.from_numpy(ids), segment=segment
    )
    here = mask & torch.from_numpy(token_labels(ids, mask.shape) == segment)
    data = {"rollout_log_probs": batch.rollout, "old_log_probs": batch.old, "response_mask": here}
    assert_profile(got, reference_profile([data]))


# ---------------------------------------------------------------------- Trainer runs
@pytest.fixture(scope="module", params=list(ROADS))
def road(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module", params=LABELS)
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def road_run(road: str, kind: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Eight batches, two per optimizer step, logged every two steps: two windows of four.

    The ``torch.compile`` road runs with the native kernel off, as an accelerator's does
    (on a CPU, ``compile=True`` leaves the batches the kernel takes to it)."""
    batches = road_batches(kind)
    tmp_path = tmp_path_factory.mktemp("segments")
    callback = RolloutDebugCallback(compile=ROADS[road], max_segments=4, segment_names=NAMES)
    torch._dynamo.reset()  # what this run compiles, it compiles anew
    counters.clear()
    with warnings.catch_warnings(record=True) as caught, pytest.MonkeyPatch.context() as patch:
        if road == "torch.compile":
            patch.setattr(native_passes, "_pass", lambda *args, **kwargs: None)
        warnings.simplefilter("always")
        fit(
            RolloutModule(batches),
            [callback],
            logger=tb_logger(tmp_path),
            log_every_n_steps=2,
            accumulate_grad_batches=2,
        )
    return {
        "batches": batches,
        "windows": split_windows(batches, step_of_batches(8, 2), [1, 3]),
        "scalars": read_scalars(tmp_path / "tb" / "version_0"),
        "warnings": [str(w.message) for w in caught],
        "graphs": counters["stats"]["unique_graphs"],
    }


def test_each_segment_logs_the_reference_of_its_tokens(road_run: dict[str, Any]) -> None:
    scalars = road_run["scalars"]
    windows = road_run["windows"]
    assert [len(window) for window in windows.values()] == [4, 4]
    for step, window in windows.items():
        want = window_segments(window, 4)
        got = segments_of(at_step(scalars, step))
        assert_segments(got, expected_segments(want, names=NAMES), f"step {step}")
    # The data hold what the windows promise: every segment and `other`, then no `tool`.
    first, second = (sorted(segments_of(at_step(scalars, step))) for step in windows)
    assert first == sorted([*NAMES, OTHER]) and second == ["chat", "code", "math"]
    # Segments are logged at the logged steps only.
    steps = {step for tag, series in scalars.items() if tag.startswith(SEGMENTS) for step in series}
    assert steps == {1, 3}


def test_the_window_wide_metrics_are_those_of_every_token(road_run: dict[str, Any]) -> None:
    assert_windows(road_run["scalars"], road_run["windows"])


def test_out_of_range_labels_warn_once_in_a_run(road_run: dict[str, Any]) -> None:
    found = segment_warnings(road_run["warnings"])
    assert len(found) == 1, found


def test_only_the_compiled_road_compiles(road: str, road_run: dict[str, Any]) -> None:
    """``compile=True`` without the kernel takes the batches with segments through
    ``torch.compile`` (with a C++ compiler, without a failed compilation falling back to
    eager); the other roads compile nothing."""
    failed = [m for m in road_run["warnings"] if COMPILE_FAILED in m]
    if road != "torch.compile":
        assert road_run["graphs"] == 0
    elif cxx() is not None:
        assert not failed, failed
        assert road_run["graphs"] >= 1


def test_a_key_of_its_own_names_and_numbers(tmp_path: Path) -> None:
    """``segment_key`` chooses the labels; given names first, then numbers, then ``other``."""
    batches = []
    for i in range(4):
        batch = make_batch(4, 16, seed=400 + i, index=i)
        ids = turns(np.random.default_rng(40 + i), 4, 16, 3)
        if i == 1:
            ids[2, 8:] = 5
        batch = labelled(batch, ids, key="turn")
        batch["segment_ids"] = torch.zeros(4, 16, dtype=torch.int64)  # not the key: unread
        batches.append(batch)
    callback = RolloutDebugCallback(
        segment_key="turn", max_segments=3, segment_names=("system", "user")
    )
    fit(RolloutModule(batches), [callback], logger=tb_logger(tmp_path), log_every_n_steps=2)
    scalars = read_scalars(tmp_path / "tb" / "version_0")
    windows = split_windows(batches, step_of_batches(4), [1, 3])
    for step, window in windows.items():
        want = window_segments(window, 3, key="turn")
        expected = expected_segments(want, names=("system", "user"))
        assert_segments(segments_of(at_step(scalars, step)), expected, f"step {step}")
    assert sorted(segments_of(at_step(scalars, 1))) == ["2", OTHER, "system", "user"]


def test_without_the_key_no_segment_is_logged(tmp_path: Path) -> None:
    batches = [make_batch(3, 9, seed=500 + i, index=i) for i in range(4)]
    callback = RolloutDebugCallback(max_segments=8, segment_names=("a", "b"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(RolloutModule(batches), [callback], logger=tb_logger(tmp_path), log_every_n_steps=2)
    scalars = read_scalars(tmp_path / "tb" / "version_0")
    assert not [tag for tag in scalars if "segments/" in tag]
    assert not segment_warnings([str(w.message) for w in caught])
    assert_windows(scalars, split_windows(batches, step_of_batches(4), [1, 3]))


def test_segment_metrics_choose_what_each_segment_logs(tmp_path: Path) -> None:
    batches = []
    for i in range(4):
        batch = make_batch(5, 20, seed=600 + i, index=i)
        if i == 2:
            batch = with_nonfinite(batch, 4, seed=i)
        if i == 1:  # a floored rollout log-prob: rho near e^20 beside the other turns' tokens
            batch["rollout_log_probs"][0, 10] = -30.0
            batch["response_mask"][0, 10] = 1
        batches.append(labelled(batch, turns(np.random.default_rng(60 + i), 5, 20, 3)))
    callback = RolloutDebugCallback(max_segments=3, segment_metrics=list(CHOSEN))
    fit(RolloutModule(batches), [callback], logger=tb_logger(tmp_path), log_every_n_steps=2)
    scalars = read_scalars(tmp_path / "tb" / "version_0")
    windows = split_windows(batches, step_of_batches(4), [1, 3])
    for step, window in windows.items():
        want = window_segments(window, 3)
        got = segments_of(at_step(scalars, step))
        assert_segments(got, expected_segments(want, CHOSEN), f"step {step}")
        assert all(sorted(values) == sorted(CHOSEN) for values in got.values()), got


# ---------------------------------------------------------------------- settings
INVALID: list[tuple[dict[str, Any], tuple[str, ...]]] = [
    ({"max_segments": 0}, ("max_segments", "256", "got 0")),
    ({"max_segments": 257}, ("max_segments", "256", "257")),
    ({"max_segments": 2.5}, ("max_segments", "256", "2.5")),
    ({"segment_names": ["math", "a/b"]}, ("segment_names", "'a/b'", "/")),
    ({"segment_names": ["math", "math"]}, ("segment_names", "'math'")),
    ({"segment_names": ["math", ""]}, ("segment_names",)),
    ({"segment_names": ["other"]}, ("segment_names", "other")),
    ({"max_segments": 2, "segment_names": ["a", "b", "c"]}, ("segment_names", "max_segments")),
    ({"segment_metrics": ["rollout_tokens", "nope"]}, ("segment_metrics", "'nope'")),
    ({"segment_metrics": ["actor_ppl"]}, ("segment_metrics", "'actor_ppl'")),
    (
        {"groups": ["seed", "health"], "segment_metrics": ["rollout_actor_kl_k3"]},
        ("segment_metrics", "rollout_actor_kl_k3"),
    ),
    ({"segment_key": ""}, ("segment_key",)),
]


@pytest.mark.parametrize("door", [RolloutDebugCallback, RolloutDebugMonitor])
@pytest.mark.parametrize(("kwargs", "fragments"), INVALID)
def test_invalid_segment_settings_are_explained(
    door: type, kwargs: dict[str, Any], fragments: tuple[str, ...]
) -> None:
    with pytest.raises(ValueError, match=f"Invalid {door.__name__} arguments") as info:
        door(**kwargs)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    if "segment_metrics" in kwargs and "groups" not in kwargs:  # the valid values are listed
        missing = [name for name in SEGMENT_METRIC_CHOICES if name not in message]
        assert not missing, (missing, message)


def test_a_segment_window_names_metrics_it_cannot_be_read_for() -> None:
    """A window read for metrics a segment does not have is refused at once, naming them
    and the valid ones; a valid choice sets the row quantities it is read for."""
    with pytest.raises(ValueError, match=r"'rollout_ppl'.*valid: rollout_tokens"):
        segments.SegmentWindow(3, metrics=["rollout_ppl"])
    window = segments.SegmentWindow(3, metrics=("rollout_actor_kl_k3",))
    assert "kl_k3" in window.rows and "prob_diff" not in window.rows


# ---------------------------------------------------------------------- the monitor
def monitor_of(**kwargs: Any) -> RolloutDebugMonitor:
    return RolloutDebugMonitor(alert_ranges={}, drift_factors={}, **kwargs)


def log_segments(monitor: RolloutDebugMonitor, step: int) -> dict[str, dict[str, float]]:
    """What a logger receives of the segments at ``step``, in full precision."""
    logger = MemoryLogger()
    monitor.log(step, loggers=[logger])
    return segments_of(logger.steps.get(step, {}))


def test_an_out_of_range_label_is_other_with_one_warning() -> None:
    monitor = monitor_of(max_segments=2)
    window = []
    with pytest.warns(RolloutDebugWarning) as record:
        for i in range(5):
            batch = make_batch(3, 10, seed=700 + i, index=i)
            ids = turns(np.random.default_rng(70 + i), 3, 10, 2)
            ids[i % 3, 5:] = (5, -1, 2)[i % 3]
            batch = labelled(batch, ids)
            monitor.update(batch)
            window.append(batch)
            if i == 2:
                got = log_segments(monitor, 0)
                want = expected_segments(window_segments(window, 2))
                assert_segments(got, want, "step 0")
                assert OTHER in got
                window = []
        got = log_segments(monitor, 1)
    assert_segments(got, expected_segments(window_segments(window, 2)), "step 1")
    found = segment_warnings([str(w.message) for w in record])
    assert len(found) == 1, found
    assert issubclass(
        next(w for w in record if "segment" in str(w.message).lower()).category, RolloutDebugWarning
    )


def test_batches_without_labels_belong_to_no_segment() -> None:
    """A window of batches with and without the key: the segments hold the labelled
    batches' tokens; the window-wide metrics every token."""
    monitor = monitor_of(max_segments=4)
    window = []
    for i in range(4):
        batch = make_batch(4, 12, seed=800 + i, index=i)
        if i % 2:
            rng = np.random.default_rng(80 + i)
            batch = labelled(batch, labels_of(LABELS[i // 2], rng, 4, 12, 4))
        monitor.update(batch)
        window.append(batch)
    logger = MemoryLogger()
    monitor.log(0, loggers=[logger])
    got = segments_of(logger.steps[0])
    assert_segments(got, expected_segments(window_segments(window, 4)), "step 0")
    tokens = sum(values["rollout_tokens"] for values in got.values())
    labelled_tokens = sum(int(b["response_mask"].sum()) for b in window[1::2])
    assert tokens == labelled_tokens < logger.steps[0][f"{PREFIX}rollout_tokens"]


# ---------------------------------------------------------------------- state
def state_bytes(state: Any) -> int:
    """The bytes of every tensor of a (nested) state."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, Mapping):
        return sum(state_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(value) for value in state)
    return 0


def state_batch(i: int) -> dict[str, torch.Tensor]:
    """Batches of every size; the first labels its tokens 0 only, the others every label
    up to 80 and beyond."""
    rows, width = 2 + i % 5, 8 + 3 * (i % 7)
    batch = make_batch(rows, width, seed=900 + i, index=i)
    if i == 0:
        return labelled(batch, np.zeros((rows, width), dtype=np.int64))
    rng = np.random.default_rng(i)
    return labelled(batch, rng.integers(-1, 80, (rows, width) if i % 2 else rows))


@pytest.mark.parametrize("compile", [None, False], ids=["default", "eager"])
def test_the_state_size_follows_max_segments_not_the_steps(compile: bool | None) -> None:
    sizes = {}
    for max_segments in (4, 64):
        monitor = monitor_of(max_segments=max_segments, compile=compile)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RolloutDebugWarning)  # the labels beyond
            for i in range(50):
                monitor.update(state_batch(i))
                if i in (0, 49):
                    sizes[max_segments, i + 1] = state_bytes(monitor.state_dict())
    assert sizes[4, 1] == sizes[4, 50], sizes
    assert sizes[64, 1] == sizes[64, 50], sizes
    assert sizes[64, 1] > sizes[4, 1], sizes


def test_the_sums_waiting_by_segment_do_not_grow_with_the_batch() -> None:
    """An eager pass keeps its sums by segment row in ``G L (S + 1)`` rows (8 lanes, groups
    of rows), at most 4,096 whatever the batch: a batch of 4 rows and one of 600 leave as
    many waiting in the window, and the window logs each segment as the reference has it."""
    rng = np.random.default_rng(7)
    counts = []
    for rows in (4, 600):
        batch = labelled(make_batch(rows, 64, seed=rows), turns(rng, rows, 64, 16))
        monitor = monitor_of(max_segments=16, compile=False)
        monitor.update(batch)
        [sums] = monitor._segments._pending
        first = sums.segments[0]
        counts.append(first.shape[-1])
        assert first.shape[-1] % 17 == 0 and first.shape[-1] <= 4096
        want = expected_segments(window_segments([batch], 16))
        assert_segments(log_segments(monitor, 1), want, f"{rows} rows")
    assert counts[0] == counts[1], counts


@pytest.mark.parametrize("kind", LABELS)
def test_a_checkpoint_mid_window_logs_what_an_uninterrupted_window_logs(kind: str) -> None:
    batches = road_batches(kind)[:4]
    settings = {"max_segments": 4, "segment_names": NAMES}
    uninterrupted, first = monitor_of(**settings), monitor_of(**settings)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RolloutDebugWarning)  # batch 2's labels beyond
        for batch in batches:
            uninterrupted.update(batch)
        for batch in batches[:2]:
            first.update(batch)
        buffer = io.BytesIO()
        torch.save(first.state_dict(), buffer)
        buffer.seek(0)
        resumed = monitor_of(**settings)
        resumed.load_state_dict(torch.load(buffer, weights_only=False))
        for monitor in (resumed, first):  # the state is read, the window left as it was
            for batch in batches[2:]:
                monitor.update(batch)
        logged = [log_segments(m, 1) for m in (uninterrupted, resumed, first)]
    want = expected_segments(window_segments(batches, 4), names=NAMES)
    assert_segments(logged[0], want, "uninterrupted")
    for got in logged[1:]:
        assert sorted(got) == sorted(logged[0])
        for name, values in logged[0].items():
            assert got[name] == pytest.approx(values, rel=1e-12, abs=1e-15), name


# ---------------------------------------------------------------------- two ranks
def rank_batches() -> list[list[dict[str, torch.Tensor]]]:
    """``[rank][batch]``, two windows of two batches per rank.

    Rank 0 has no labels in the first window (no key at all) and segments 0 and 1 in the
    second; rank 1 has segments 1 and 2 in both, ``other`` (label 9) in the first, and
    ``[B]`` labels in its third batch. So in the first window 1, 2 and ``other`` are rank
    1's alone, and in the second 0 is rank 0's and 2 rank 1's.
    """
    per_rank: list[list[dict[str, torch.Tensor]]] = [[], []]
    for i in range(4):
        rows, width = 3 + i % 2, 10 + 2 * i
        batch = make_batch(rows, width, seed=1000 + i, index=1000 + i)
        if i >= 2:
            batch = labelled(batch, turns(np.random.default_rng(i), rows, width, 2))
        per_rank[0].append(batch)
    for i in range(4):
        rows, width = 4 - i % 2, 7 + 3 * i
        batch = make_batch(rows, width, seed=1100 + i, index=1100 + i)
        rng = np.random.default_rng(10 + i)
        ids = 1 + (np.arange(rows) % 2 if i == 2 else turns(rng, rows, width, 2))
        if i == 1:
            ids[0, width // 2 :] = 9
        per_rank[1].append(labelled(batch, ids))
    return per_rank


def test_two_ranks_merge_segments_that_one_rank_holds(tmp_path: Path) -> None:
    per_rank = rank_batches()
    scalars, _ = fit_two_ranks(
        tmp_path,
        RankModule(interleave(per_rank)),
        [RolloutDebugCallback(log_every_n_steps=2, max_segments=4)],
        max_epochs=1,
    )
    expected_names = {1: ["1", "2", OTHER], 3: ["0", "1", "2"]}
    for step, start in ((1, 0), (3, 2)):
        window = [batch for batches in per_rank for batch in batches[start : start + 2]]
        got = segments_of(at_step(scalars, step))
        assert_segments(got, expected_segments(window_segments(window, 4)), f"step {step}")
        assert sorted(got) == expected_names[step]


def test_the_ranks_hold_the_segments_the_two_rank_test_says() -> None:
    """The premise of the two-rank test, by the reference: each segment's ranks."""
    per_rank = rank_batches()
    holders: dict[tuple[int, str], set[int]] = {}
    for rank, own in enumerate(per_rank):
        for window, start in ((1, 0), (3, 2)):
            for key in window_segments(own[start : start + 2], 4):
                holders.setdefault((window, str(key)), set()).add(rank)
    assert holders == {
        (1, "1"): {1},
        (1, "2"): {1},
        (1, OTHER): {1},
        (3, "0"): {0},
        (3, "1"): {0, 1},
        (3, "2"): {1},
    }
    assert all("segment_ids" not in batch for batch in per_rank[0][:2])
