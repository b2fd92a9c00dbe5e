"""MismatchStats against the independent NumPy reference, plus its contracts."""

from __future__ import annotations

import contextlib
import io
import math
import random
from collections.abc import Callable

import numpy as np
import pytest
import torch
from conftest import Batch, batches, examples, make_batch, reference_for
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import ALL_NAMES, NAMES, assert_metrics_close, reference_metrics
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_rollout_debug.metrics.catalog import GROUPS, METRIC_NAMES
from lightning_rollout_debug.metrics.extras import TokenExtras
from lightning_rollout_debug.metrics.layout import (
    STATE_SIZE,
    identity_state,
    merge_states,
    state_problems,
)
from lightning_rollout_debug.metrics.stats import MismatchStats

# The metrics of MismatchStats' own state: the quantiles come from a profile (test_profile.py).
STATS_NAMES = tuple(
    name for name in ALL_NAMES if name not in (*NAMES["quantiles"], "rollout_stale_period")
)
"""What ``MismatchStats.compute`` gives: no quantiles without a profile, no period of stale
weights without the run's series."""
C_VALUES = st.sampled_from([2.0, 1.5, 1.01, 5.0, 3])
BOUNDS = st.sampled_from([(0.99, 1.01), (0.5, 2.0), (1.0, 1.0), (0.9, 1.0), (0.999999, 1.5)])


def fed(window: list[Batch], **kwargs: object) -> MismatchStats:
    stats = MismatchStats(**kwargs)
    for batch in window:
        stats.update(*batch.args())
    return stats


# ------------------------------------------------------------------ vs the reference
def test_catalog_names_match_the_design() -> None:
    assert tuple(GROUPS) == tuple(NAMES)
    assert {group: tuple(names) for group, names in METRIC_NAMES.items()} == NAMES


ROADS = st.sampled_from(
    [
        {},  # the kernel for float32 and bfloat16 log-probs, the torch pass for the others
        {"compile": False},  # the eager torch pass at every dtype
        {"compile": False, "groups": ["seed"]},  # its lean pass
        {"compile": False, "groups": ["seed", "log_space", "sequence"]},
    ]
)


@settings(max_examples=examples(800), deadline=None)
@given(batch=batches(), c=C_VALUES, bounds=BOUNDS, road=ROADS)
def test_one_batch_matches_reference(
    batch: Batch, c: float, bounds: tuple[float, float], road: dict[str, object]
) -> None:
    stats = MismatchStats(is_threshold=c, seq_ratio_bounds=bounds, **road)
    stats.update(*batch.args())
    want = reference_for([batch], is_threshold=c, seq_ratio_bounds=bounds)
    if "groups" in road:
        want = want.select([name for group in road["groups"] for name in METRIC_NAMES[group]])
    assert_metrics_close(stats.compute(), want)


@settings(max_examples=examples(200), deadline=None)
@given(window=st.lists(batches(), max_size=4))
def test_window_of_batches_of_different_shapes(window: list[Batch]) -> None:
    assert_metrics_close(fed(window).compute(), reference_for(window))


@pytest.mark.parametrize("compile", [None, False])
def test_a_long_window_merges_every_batch(rng: np.random.Generator, compile: bool | None) -> None:
    """More batches than a window holds unmerged: every one counts, read at any time."""
    window = [
        make_batch(rng, (int(rng.integers(1, 5)), int(rng.integers(1, 40))), special_rate=0.05)
        for _ in range(75)
    ]
    stats = MismatchStats(compile=compile)
    for seen, batch in enumerate(window, start=1):
        stats.update(*batch.args())
        if seen in (1, 31, 32, 33, 64):
            assert_metrics_close(stats.compute(), reference_for(window[:seen]))
    assert_metrics_close(stats.compute(), reference_for(window))


def test_empty_window() -> None:
    got = MismatchStats().compute()
    want = reference_metrics(torch.zeros(0, 0), torch.zeros(0, 0), torch.zeros(0, 0))
    assert_metrics_close(got, want)
    assert got["rollout_probs_diff_valid"] == 0.0
    assert got["rollout_tokens"] == got["rollout_sequences"] == 0.0
    assert got["rollout_nonfinite_tokens"] == 0.0
    assert set(got) == set(STATS_NAMES)
    undefined = set(STATS_NAMES) - {
        "rollout_probs_diff_valid",
        "rollout_tokens",
        "rollout_sequences",
        "rollout_nonfinite_tokens",
        "rollout_zero_log_prob_tokens",
    }
    assert all(math.isnan(got[name]) for name in undefined)


def test_hand_computed_values() -> None:
    """A tiny example worked out by hand, independent of both implementations."""
    rollout = torch.log(torch.tensor([[0.5, 0.25, 0.9], [0.2, 0.1, 0.3]], dtype=torch.float64))
    old = torch.log(torch.tensor([[0.5, 0.5, 0.9], [0.1, 0.1, 0.3]], dtype=torch.float64))
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    stats = MismatchStats(is_threshold=1.5)
    stats.update(rollout, old, mask)
    got = stats.compute()
    # counting pairs (pa, pb): (0.5, 0.5), (0.5, 0.25), (0.1, 0.2); rho = 1, 2, 0.5
    log2 = math.log(2.0)
    want = {
        "rollout_tokens": 3.0,
        "rollout_sequences": 2.0,
        "rollout_nonfinite_tokens": 0.0,
        "rollout_zero_log_prob_tokens": 0.0,
        "rollout_probs_diff_valid": 1.0,
        "rollout_probs_diff_max": 0.25,
        "rollout_probs_diff_mean": 0.35 / 3,
        "rollout_probs_diff_std": math.sqrt(
            ((0 - 0.35 / 3) ** 2 + (0.25 - 0.35 / 3) ** 2 + (0.1 - 0.35 / 3) ** 2) / 2
        ),
        "rollout_actor_probs_pearson_corr": (0.14 / 3) / math.sqrt((0.32 / 3) * (0.155 / 3)),
        "rollout_log_probs_diff_max": log2,
        "rollout_log_probs_diff_mean": 2 * log2 / 3,
        "rollout_log_probs_diff_std": log2 / math.sqrt(3.0),
        "rollout_actor_kl_k1": 0.0,
        "rollout_actor_kl_k3": (0.0 + (1.0 - log2) + (-0.5 + log2)) / 3,
        "rollout_actor_mult_prob_error": 5 / 3,
        "rollout_is_ratio_mean": 3.5 / 3,
        "rollout_is_ratio_min": 0.5,
        "rollout_is_ratio_max": 2.0,
        "rollout_is_ratio_frac_high": 1 / 3,
        "rollout_is_ratio_frac_low": 1 / 3,
        "rollout_is_chi2": 5.25 / 3 - 1.0,
        "rollout_is_ess": 3.5**2 / (3 * 5.25),
        "actor_ppl": (2.0 + 10.0) / 2,
        "rollout_ppl": (math.sqrt(8.0) + 5.0) / 2,
        "rollout_actor_log_ppl_diff": (-log2 / 2 + log2) / 2,
        "rollout_actor_log_ppl_abs_diff_max": log2,
        "rollout_seq_geo_ratio_min": 0.5,
        "rollout_seq_geo_ratio_max": math.sqrt(2.0),
        "rollout_seq_frac_outside": 1.0,
    }
    for name, value in want.items():
        assert got[name] == pytest.approx(value, rel=1e-12, abs=1e-15), name
    assert math.isnan(got["rollout_token_diff_count"])


# ------------------------------------------------------------------------ merging
@settings(max_examples=examples(150), deadline=None)
@given(
    width=st.integers(0, 12),
    with_ids=st.booleans(),
    data=st.data(),
    order_seed=st.integers(0, 2**32 - 1),
)
def test_merge_is_associative(
    width: int, with_ids: bool, data: st.DataObject, order_seed: int
) -> None:
    window = data.draw(st.lists(batches(width=width, with_ids=with_ids), max_size=4))
    want = reference_for(window)
    order = random.Random(order_seed)

    # (a) one instance, updated batch after batch
    assert_metrics_close(fed(window).compute(), want)

    # (b) one update on the concatenation (same width)
    if window:
        whole = MismatchStats()
        cat = [
            torch.cat(parts) if parts[0] is not None else None
            for parts in zip(*(b.args() for b in window), strict=True)
        ]
        whole.update(*cat)
        assert_metrics_close(whole.compute(), want)

    # (c) separate instances, plus empty ones, merged pairwise in a random order/grouping
    parts = [fed([b]) for b in window] + [MismatchStats() for _ in range(order.randint(0, 2))]
    order.shuffle(parts)
    while len(parts) > 1:
        i = order.randrange(len(parts) - 1)
        left, right = parts[i], parts.pop(i + 1)
        parts[i] = left.merge(right if order.random() < 0.5 else right.state)
    merged = parts[0] if parts else MismatchStats()
    assert_metrics_close(merged.compute(), want)

    # (d) merge_states of the stacked states, in any order, with identity states mixed in
    states = [fed([b]).state for b in window] + [identity_state()] * order.randint(0, 2)
    order.shuffle(states)
    if states:
        stacked = MismatchStats.from_state(merge_states(torch.stack(states)))
        assert_metrics_close(stacked.compute(), want)


@settings(max_examples=examples(60), deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_sixteen_ranks_merge_to_the_statistics_of_all_tokens(seed: int) -> None:
    rng = np.random.default_rng(seed)
    ranks = []
    for _ in range(16):
        ranks.append(
            make_batch(
                rng,
                (int(rng.integers(0, 5)), int(rng.integers(0, 30))),
                dtype=torch.float32,
                regime=str(rng.choice(["matched", "mixed", "near_zero", "unrelated"])),
                mask_kind=str(rng.choice(["bool", "prefix", "zeros"])),
                special_rate=float(rng.choice([0.0, 0.05])),
                with_ids=True,
            )
        )
    states = torch.stack([fed([batch]).state for batch in ranks])
    want = reference_for(ranks)
    assert_metrics_close(MismatchStats.from_state(merge_states(states)).compute(), want)

    # the same through `synced`, with a fake all_gather handing back every rank's state
    local = fed([ranks[0]])
    before = local.state.clone()
    merged = local.synced(lambda state: torch.cat([state.unsqueeze(0), states[1:]]))
    assert_metrics_close(merged.compute(), want)
    assert torch.equal(local.state, before)


def test_merge_of_two_empty_windows_is_empty() -> None:
    merged = MismatchStats().merge(MismatchStats())
    assert torch.equal(merged.state, identity_state())
    assert merge_states(torch.stack([identity_state()] * 3)).equal(identity_state())


# ---------------------------------------------------------------------- chunking
@settings(max_examples=examples(100), deadline=None)
@given(batch=batches(), chunk=st.integers(1, 9))
def test_small_chunks_give_the_same_result(batch: Batch, chunk: int) -> None:
    small = MismatchStats(chunk_tokens=chunk)
    small.update(*batch.args())
    large = MismatchStats()
    large.update(*batch.args())
    want = reference_for([batch])
    assert_metrics_close(small.compute(), want)
    assert_metrics_close(large.compute(), want)


# ------------------------------------------------------- reset, persistence, groups
def test_reset_starts_an_empty_window(rng: np.random.Generator) -> None:
    first, second = (make_batch(rng, (3, 7), special_rate=0.1) for _ in range(2))
    stats = fed([first])
    stats.reset()
    assert stats.device is None
    assert torch.equal(stats.state, identity_state())
    assert_metrics_close(stats.compute(), reference_for([]))
    stats.update(*second.args())
    assert_metrics_close(stats.compute(), reference_for([second]))


def test_state_dict_round_trip(rng: np.random.Generator) -> None:
    window = [make_batch(rng, (4, 9), special_rate=0.05, with_ids=True) for _ in range(3)]
    stats = fed(window[:2], is_threshold=3.0)
    saved = stats.state_dict()
    assert saved["state"].device.type == "cpu" and saved["state"].dtype == torch.float64
    assert saved["is_threshold"] == 3.0 and saved["seq_ratio_bounds"] == (0.99, 1.01)
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    restored = MismatchStats(is_threshold=3.0)
    restored.load_state_dict(torch.load(buffer))
    assert torch.equal(restored.state, stats.state)
    assert_metrics_close(restored.compute(), reference_for(window[:2], is_threshold=3.0))
    # the restored window keeps growing like the original
    restored.update(*window[2].args())
    assert_metrics_close(restored.compute(), reference_for(window, is_threshold=3.0))
    with pytest.raises(ValueError, match=str(STATE_SIZE)):
        restored.load_state(torch.zeros(STATE_SIZE + 1, dtype=torch.float64))


# Settings whose window lacks sums that the default statistics count: (settings, groups).
COUNTED_OTHERWISE = {
    "fewer-groups": ({"groups": ["seed", "kl", "token_ids"]}, "log_space"),
    "another-threshold": ({"is_threshold": 1.5}, "importance_ratio: `is_threshold` 1.5"),
    "other-bounds": ({"seq_ratio_bounds": (0.9, 1.1)}, "sequence: `seq_ratio_bounds`"),
}


@pytest.mark.parametrize("other", COUNTED_OTHERWISE.values(), ids=COUNTED_OTHERWISE.keys())
def test_a_window_counted_otherwise_is_refused(
    rng: np.random.Generator, other: tuple[dict[str, object], str]
) -> None:
    """Its tokens would count in every mean but not, or otherwise, in some groups' sums."""
    settings, named = other
    first, second = (make_batch(rng, (4, 9), special_rate=0.05) for _ in range(2))
    stats = fed([first])
    before = stats.state.clone()
    counted_otherwise = fed([second], **settings)
    with pytest.raises(ValueError, match="Cannot merge these statistics") as merging:
        stats.merge(counted_otherwise)
    with pytest.raises(ValueError, match="Cannot load this state") as loading:
        MismatchStats().load_state_dict(counted_otherwise.state_dict())
    for raised in (merging, loading):
        assert named in str(raised.value) and "`seq_ratio_bounds`." in str(raised.value)
    assert torch.equal(stats.state, before)


def test_a_window_of_more_groups_merges_and_loads(rng: np.random.Generator) -> None:
    window = [make_batch(rng, (4, 9), special_rate=0.05) for _ in range(2)]
    groups = ["seed", "kl", "sequence"]
    every_group = fed(window[1:], is_threshold=1.5)  # a threshold these groups do not use
    merged = fed(window[:1], groups=groups).merge(every_group)
    want = reference_for(window).select([n for g in groups for n in NAMES[g]])
    assert_metrics_close(merged.compute(), want)
    loaded = MismatchStats(groups=groups)
    loaded.load_state_dict(every_group.state_dict())
    assert torch.equal(loaded.state, every_group.state)
    with pytest.raises(ValueError, match=r"groups \['seed', 'kl', 'sequence'\]"):
        loaded.load_state_dict({**every_group.state_dict(), "groups": None})
    # A packed state carries no settings: it is taken as it is.
    packed = fed(window[:1]).merge(fed(window[1:], groups=["seed"]).state)
    assert packed.compute()["rollout_tokens"] == reference_for(window)["rollout_tokens"]


def test_state_dict_is_a_copy(rng: np.random.Generator) -> None:
    batch = make_batch(rng, (2, 5))
    stats = fed([batch])
    saved = stats.state_dict()["state"].clone()
    snapshot = stats.state_dict()["state"]
    stats.update(*batch.args())
    assert torch.equal(snapshot, saved)


@settings(max_examples=examples(100), deadline=None)
@given(
    groups=st.lists(st.sampled_from(GROUPS), unique=True, min_size=1),
    batch=batches(),
)
def test_groups_selection(groups: list[str], batch: Batch) -> None:
    stats = MismatchStats(groups=groups)
    stats.update(*batch.args())
    got = stats.compute()
    # Without a profile the quantiles are left out, without a series the stale period.
    names = [name for group in GROUPS if group in groups for name in NAMES[group]]
    names = [name for name in names if name in STATS_NAMES]
    assert list(got) == names
    assert_metrics_close(got, reference_for([batch]).select(names))


def test_groups_accepts_one_name_as_a_string() -> None:
    assert list(MismatchStats(groups="health").compute()) == list(NAMES["health"])


@pytest.mark.parametrize("value", [1.0, 1, 0.5, 0.0, -2.0, math.inf, math.nan, True, "2", None])
def test_is_threshold_is_validated(value: object) -> None:
    message = r"`is_threshold` must be a finite number greater than 1"
    with pytest.raises(ValueError, match=message) as info:
        MismatchStats(is_threshold=value)  # type: ignore[arg-type]
    assert repr(value) in str(info.value)


@pytest.mark.parametrize(
    "value",
    [
        (1.01, 0.99),
        (0.0, 1.01),
        (0.9, 0.95),
        (1.05, 1.1),
        (0.99, math.inf),
        (0.99,),
        (0.9, 1, 2),
        "ab",
        None,
        (math.nan, 1.0),
    ],
)
def test_seq_ratio_bounds_are_validated(value: object) -> None:
    with pytest.raises(ValueError, match=r"`seq_ratio_bounds` must be \(lo, hi\) with 0 < lo <= 1"):
        MismatchStats(seq_ratio_bounds=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("groups", [["nope"], ["seed", "bogus"], "sed", []])
def test_groups_are_validated(groups: object) -> None:
    if groups == []:  # an empty selection is allowed: only counts are kept, nothing reported
        assert MismatchStats(groups=groups).compute() == {}  # type: ignore[arg-type]
        return
    with pytest.raises(ValueError, match="valid groups are") as info:
        MismatchStats(groups=groups)  # type: ignore[arg-type]
    for group in GROUPS:
        assert repr(group) in str(info.value)


@pytest.mark.parametrize("chunk", [0, -1, 1.5, "8"])
def test_chunk_tokens_is_validated(chunk: object) -> None:
    with pytest.raises(ValueError, match="chunk_tokens"):
        MismatchStats(chunk_tokens=chunk)  # type: ignore[arg-type]


def test_valid_arguments_are_kept() -> None:
    stats = MismatchStats(is_threshold=3, seq_ratio_bounds=np.array([0.9, 1.1]), groups=("kl",))
    assert stats.is_threshold == 3.0 and isinstance(stats.is_threshold, float)
    assert stats.seq_ratio_bounds == (0.9, 1.1)
    assert stats.groups == frozenset({"kl"})


# --------------------------------------------------------- inputs and autograd
@settings(max_examples=examples(60), deadline=None)
@given(batch=batches(with_ids=True))
def test_inputs_are_not_modified(batch: Batch) -> None:
    before = [t.clone() for t in batch.args()]
    stats = MismatchStats(chunk_tokens=5)
    stats.update(*batch.args())
    stats.compute()
    for now, then in zip(batch.args(), before, strict=True):
        torch.testing.assert_close(now, then, rtol=0, atol=0, equal_nan=True)


def test_no_autograd_graph_is_kept(rng: np.random.Generator) -> None:
    batch = make_batch(rng, (3, 6), dtype=torch.float32)
    rollout = batch.rollout.clone().requires_grad_()
    old = batch.old.clone().requires_grad_() * 1.0  # a non-leaf with a graph behind it
    stats = MismatchStats()
    stats.update(rollout, old, batch.mask)
    assert stats.state.grad_fn is None and not stats.state.requires_grad
    other = MismatchStats()
    other.update(rollout, old, batch.mask)
    stats.merge(other)
    assert stats.state.grad_fn is None and not stats.state.requires_grad
    with_graph = torch.zeros(STATE_SIZE, dtype=torch.float64, requires_grad=True) * 1.0
    assert MismatchStats.from_state(with_graph).state.grad_fn is None
    assert_metrics_close(
        stats.compute(),
        reference_for([Batch(rollout.detach(), old.detach(), batch.mask)] * 2),
    )


# --------------------------------------------------------------- host synchronisation
class OpRecorder(TorchDispatchMode):
    """Records every aten op that reaches the dispatcher, with its arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple, dict]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.calls.append((func._schema.name, args, kwargs))
        return func(*args, **kwargs)

    @property
    def names(self) -> list[str]:
        return [name for name, _, _ in self.calls]


SYNCING_OPS = {
    "aten::_local_scalar_dense",
    "aten::item",
    "aten::nonzero",
    "aten::nonzero_static",
    "aten::masked_select",
    "aten::equal",
    "aten::is_nonzero",
    "aten::unique",
    "aten::_unique2",
}


def host_syncs(calls: list[tuple[str, tuple, dict]]) -> list[str]:
    """The recorded calls that wait for the device or move data between devices."""
    found = []
    for name, args, kwargs in calls:
        if name in SYNCING_OPS:
            found.append(name)
        elif name == "aten::index" and any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1]
        ):
            found.append(f"{name} with a boolean mask")
        elif name == "aten::index" and any(isinstance(i, torch.Tensor) for i in args[1]):
            # Integer indices made from a Python list are copied from the host to the device.
            found.append(f"{name} with an integer index tensor")
        elif name == "aten::_to_copy" and kwargs.get("device") not in (None, args[0].device):
            found.append(f"{name} {args[0].device} -> {kwargs['device']}")
        elif name == "aten::copy_" and args[0].device != args[1].device:
            found.append(f"{name} {args[1].device} -> {args[0].device}")
        elif name in ("aten::_copy_from", "aten::_copy_from_and_resize"):
            found.append(name)
    return found


def test_the_recorder_sees_host_syncs() -> None:
    x = torch.randn(3, 4)
    with OpRecorder() as recorder:
        x[0, 0].item()
        _ = x[x > 0]
        bool(x.sum() > 0)
        x.to("meta")
        _ = x[:, [0, 2]]
    found = host_syncs(recorder.calls)
    assert "aten::_local_scalar_dense" in found
    assert "aten::index with a boolean mask" in found
    assert "aten::_to_copy cpu -> meta" in found
    assert "aten::index with an integer index tensor" in found


@pytest.mark.parametrize("data", ["real", "fake"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_update_never_waits_for_the_device(
    data: str, dtype: torch.dtype, rng: np.random.Generator
) -> None:
    """No op of an update reads data back to the host or moves it between devices.

    On fake tensors (shapes only, no data) any data-dependent step raises, so an update
    that completes there cannot depend on tensor values on the host.
    """
    fake = FakeTensorMode() if data == "fake" else None
    stats = MismatchStats(chunk_tokens=8)
    if fake is None:  # the native kernel's checks when a process first loads it, not an update's
        MismatchStats().update(*make_batch(rng, (4, 6), dtype=dtype, with_ids=True).args())
    with fake or contextlib.nullcontext():
        for _ in range(2):
            batch = make_batch(rng, (4, 6), dtype=dtype, special_rate=0.1, with_ids=True)
            args = [fake.from_tensor(t) if fake else t for t in batch.args()]
            with OpRecorder() as recorder:
                stats.update(*args)
            assert recorder.calls, "the recorder saw nothing"
            assert host_syncs(recorder.calls) == []
            assert isinstance(stats.state, FakeTensor) == (fake is not None)
        with OpRecorder() as recorder:
            stats.merge(MismatchStats.from_state(stats.state))
        assert host_syncs(recorder.calls) == []


def test_compute_copies_the_state_to_the_host_once(
    monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator
) -> None:
    """One device-to-host transfer per compute.

    On a GPU the transfer would show up as a dispatcher op; on the CPU ``tolist`` reads
    memory directly and dispatches nothing, so we count ``Tensor.tolist`` calls and check
    that no per-value ``.item()`` (``_local_scalar_dense``) or other sync happens besides.
    """
    stats = fed([make_batch(rng, (3, 5), with_ids=True)])
    calls: list[torch.Tensor] = []
    original: Callable[[torch.Tensor], list] = torch.Tensor.tolist

    def counting_tolist(self: torch.Tensor) -> list:
        calls.append(self)
        return original(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    with OpRecorder() as recorder:
        metrics = stats.compute()
    assert len(calls) == 1 and calls[0].shape == (STATE_SIZE,)
    assert host_syncs(recorder.calls) == []
    assert len(metrics) == len(STATS_NAMES)


# ------------------------------------------------------------ regressions found here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_ess_when_every_ratio_is_tiny(dtype: torch.dtype) -> None:
    """rho << 1 everywhere: n + sum(rho - 1) in float32 was 0 (ZeroDivisionError in compute)."""
    rollout = torch.tensor([[0.0, -0.5, -1e-3]], dtype=dtype)
    old = torch.tensor([[-19.0, -12.0, -30.0]], dtype=dtype)
    stats = MismatchStats()
    stats.update(rollout, old, torch.ones(1, 3))
    got = stats.compute()
    assert_metrics_close(got, reference_metrics(rollout, old, torch.ones(1, 3)))
    assert 0.0 < got["rollout_is_ess"] <= 1.0


@pytest.mark.parametrize("compile", [None, False], ids=["kernel", "eager"])
def test_alignment_lag_of_tiny_log_probs_beside_floored_ones(compile: bool | None) -> None:
    """Log-probs near 1e-7 between floored ones: a lag side that is the window's totals
    less the run edges (the kernel's) must not look spread where cancellation left noise."""
    inf, nan = math.inf, math.nan
    rollout = torch.tensor(
        [[-5.4181e-08, 0.0, inf, -8.2145e-08, -4.6546e-07, -4.5521e-07, -1.0e04, -5.9774e-07,
          0.0, inf, -3.2365e-07, -20.0, -1.8862e-07, -2.1512e-07, -1.4573e-07, -8.2083e-07,
          -1.9171e-07, -2.6489e-07, -2.0260e-07, -8.0286e-07, -inf, -2.0834e-07, inf,
          -8.1521e-07]]
    )  # fmt: skip
    old = torch.tensor(
        [[-inf, -inf, -5.7474e-07, -5.0640e-07, -5.6421e-07, -inf, -20.0, -8.6430e-08,
          -7.4248e-07, -8.2037e-07, -7.1216e-07, -4.0993e-07, -9.4295e-07, inf, -8.0294e-07,
          -6.0205e-07, nan, -3.3240e-07, -3.7827e-07, -1.7605e-07, -6.4260e-07, -4.3924e-07,
          -7.1580e-07, -inf]]
    )  # fmt: skip
    mask = torch.zeros(1, 24, dtype=torch.bool)
    mask[0, [0, 1, 9, 11, 12, 13, 17, 18, 20, 22]] = True
    stats = MismatchStats(compile=compile)
    stats.update(rollout, old, mask)
    assert_metrics_close(stats.compute(), reference_metrics(rollout, old, mask))


def test_ess_of_one_token_is_one() -> None:
    stats = MismatchStats()
    stats.update(torch.tensor([[-0.099]]), torch.tensor([[-5.098]]), torch.ones(1, 1))
    assert stats.compute()["rollout_is_ess"] == pytest.approx(1.0, rel=1e-6)


def test_probs_diff_of_far_apart_pairs_keeps_float32_accuracy() -> None:
    """pa ~ 1 against pb ~ 2e-9: r ~ 20 rounds by up to 1e-6 in float32; subtract instead."""
    old = torch.tensor([[-7.376e-7, -9.909e-7, -3.1e-7]])
    rollout = torch.tensor([[-20.0, -math.inf, -9984.0]])
    stats = MismatchStats(groups=["seed"])
    stats.update(rollout, old, torch.ones(1, 3))
    assert_metrics_close(
        stats.compute(), reference_metrics(rollout, old, torch.ones(1, 3)).select(NAMES["seed"])
    )


@pytest.mark.parametrize("shape", [(0, 4), (3, 0), (0, 0)])
def test_empty_batch_with_token_ids_counts_zero_differences(shape: tuple[int, int]) -> None:
    stats = MismatchStats()
    empty_ids = torch.zeros(shape, dtype=torch.int64)
    stats.update(torch.zeros(shape), torch.zeros(shape), torch.ones(shape), empty_ids, empty_ids)
    got = stats.compute()
    assert got["rollout_token_diff_count"] == 0.0
    assert math.isnan(got["rollout_token_diff_seq_frac"])
    assert math.isnan(MismatchStats().compute()["rollout_token_diff_count"])


def test_sequence_ratio_on_a_tight_bound_is_not_moved_by_float32_rounding() -> None:
    """g_i = exp(-3.4e-7) lies outside [1, 1]; a float32 r of about +-20 rounds that away."""
    rollout = torch.tensor([[-2.5621e-07, -20.0]])
    old = torch.tensor([[-math.inf, -9.4024e-07]])
    stats = MismatchStats(seq_ratio_bounds=(1.0, 1.0), groups=["sequence"])
    stats.update(rollout, old, torch.ones(1, 2))
    want = reference_metrics(rollout, old, torch.ones(1, 2), seq_ratio_bounds=(1.0, 1.0))
    assert want["rollout_seq_frac_outside"] == 1.0
    assert_metrics_close(stats.compute(), want.select(NAMES["sequence"]))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("compile", [None, False], ids=["default", "eager"])
def test_the_mean_log_ratio_keeps_its_digits_whatever_the_groups(
    dtype: torch.dtype, compile: bool | None
) -> None:
    """k1 and the sequences' mean log-ratio are the exact sums of ``a - b``, in every group.

    The log-probs are far larger than their differences (1e-9 nats in float64, one unit in
    the last place in float32): a difference of the two sides' sums keeps none of it.
    """
    generator = torch.Generator().manual_seed(3)
    # From 1e-12 to 12 nats: float32 values whose float64 sums round too.
    span = torch.empty(6, 64, dtype=torch.float64)
    span.uniform_(math.log(1e-12), math.log(12.0), generator=generator)
    rollout = -span.exp().to(dtype)
    if dtype == torch.float64:
        shift = torch.randn(6, 64, dtype=dtype, generator=generator) * 1e-9
        old = rollout + shift
    else:
        up = torch.rand(6, 64, generator=generator) < 0.7
        old = torch.where(up, torch.nextafter(rollout, torch.zeros(())), rollout)
    mask = torch.ones(6, 64)
    mask[:, 50:] = 0
    r = [
        [float(x) - float(y) for x, y in zip(a_row, b_row, strict=True)]
        for a_row, b_row in zip(old, rollout, strict=True)
    ]
    kept = [row[:50] for row in r]
    k1 = -math.fsum(x for row in kept for x in row) / (6 * 50)
    log_ppl = -math.fsum(math.fsum(row) / 50 for row in kept) / 6
    for groups in (None, ["kl"], ["kl", "sequence"], ["sequence"], ["importance_ratio", "health"]):
        stats = MismatchStats(groups=groups, compile=compile)
        stats.update(rollout, old, mask)
        got = stats.compute()
        if "rollout_actor_kl_k1" in got:
            assert got["rollout_actor_kl_k1"] == pytest.approx(k1, rel=1e-12, abs=0)
        if "rollout_actor_log_ppl_diff" in got:
            assert got["rollout_actor_log_ppl_diff"] == pytest.approx(log_ppl, rel=1e-12, abs=0)


@settings(max_examples=examples(150), deadline=None)
@given(st.lists(batches(), min_size=0, max_size=3), st.booleans())
def test_every_real_window_passes_the_state_checks(items: list[Batch], fused: bool) -> None:
    """No false alarm: a window built from any input, odd values included, is valid."""
    stats = MismatchStats(compile=None if fused else False)
    extras = TokenExtras(worst_tokens_k=3, compile=False)
    for batch in items:
        stats.update(*batch.args())
        extras.update(batch.rollout, batch.old, batch.mask, batch_index=2)
    assert state_problems(stats.state) == []
    assert extras.state_problems(extras.state) == []
    merged = MismatchStats().merge(stats).merge(stats)
    assert state_problems(merged.state) == []


def test_the_state_checks_name_what_no_window_holds(rng: np.random.Generator) -> None:
    stats = fed([make_batch(rng, (3, 5))])
    state = stats.state
    assert state_problems(state) == [] and state_problems(identity_state()) == []

    def changed(at: int, value: float) -> torch.Tensor:
        return state.index_fill(0, torch.tensor([at]), value)

    count_at, max_at = 0, STATE_SIZE - 3  # a maximum slot
    assert state_problems(changed(count_at, 2.5)) == [
        "the token count of the window is 2.5; expected a whole number >= 0"
    ]
    assert "is NaN" in state_problems(changed(max_at, math.nan))[0]
    empty = identity_state().index_fill(0, torch.tensor([1]), 0.3)  # a mean, no tokens
    assert state_problems(empty) == [
        "the window holds no tokens but its other statistics are not empty"
    ]
    assert state_problems(state.float()) == ["the window has dtype torch.float32; expected float64"]
    assert state_problems(state[:-1]) == [
        f"the window has shape ({STATE_SIZE - 1},); expected ({STATE_SIZE},)"
    ]
    assert state_problems([0.0] * STATE_SIZE) == ["the window is a list; expected a float64 tensor"]
