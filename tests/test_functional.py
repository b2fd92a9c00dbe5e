"""The seed-compatible functions and ``mismatch_metrics`` against the NumPy reference."""

from __future__ import annotations

import math
import re
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from conftest import FLOAT_DTYPES, ID_DTYPES, MASK_DTYPES, Batch, batches, examples, make_batch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import (
    NAMES,
    SEED_FUNCTION_NAMES,
    assert_metrics_close,
    assert_pearson_close,
    pearson,
    pearson_sides,
    reference_metrics,
    to_numpy,
)
from tensordict import TensorDict

from lightning_rollout_debug.functional import (
    calculate_debug_metrics,
    calculate_log_prob_diff,
    calculate_token_list_diff,
    mismatch_metrics,
    pearson_correlation_coefficient,
)

PREFIX = "training/"
SEED_KEYS = [PREFIX + name for name in SEED_FUNCTION_NAMES]
# One batch has no run's series: no period of stale weights.
NO_ID_NAMES = [
    name
    for group, names in NAMES.items()
    if group != "token_ids"
    for name in names
    if name != "rollout_stale_period"
]
ALL = [name for names in NAMES.values() for name in names if name != "rollout_stale_period"]


class FakeDataProto:
    """The shape of verl's DataProto that matters here: tensors under ``.batch``."""

    def __init__(self, batch: Any) -> None:
        self.batch = batch
        self.non_tensor_batch: dict[str, Any] = {}
        self.meta_info: dict[str, Any] = {}


def wrap(tensors: dict[str, torch.Tensor], container: str) -> Any:
    if container == "dict":
        return tensors
    if container == "dataproto_dict":
        return FakeDataProto(tensors)
    rows = next(iter(tensors.values())).shape[0]
    if container == "tensordict":
        return TensorDict(tensors, batch_size=[rows])
    assert container == "dataproto"
    return FakeDataProto(TensorDict(tensors, batch_size=[rows]))


CONTAINERS = ["dict", "tensordict", "dataproto", "dataproto_dict"]


def seed_reference(rollout: Any, old: Any, mask: Any) -> Any:
    return reference_metrics(rollout, old, mask).select(SEED_FUNCTION_NAMES)


# ------------------------------------------------------------- calculate_debug_metrics
@settings(max_examples=examples(150), deadline=None)
@given(batch=batches(with_ids=False), container=st.sampled_from(CONTAINERS))
def test_debug_metrics_match_reference(batch: Batch, container: str) -> None:
    data = wrap(
        {
            "rollout_log_probs": batch.rollout,
            "old_log_probs": batch.old,
            "response_mask": batch.mask,
        },
        container,
    )
    got = calculate_debug_metrics(data)
    assert list(got) == SEED_KEYS
    assert_metrics_close(got, seed_reference(batch.rollout, batch.old, batch.mask), prefix=PREFIX)


@pytest.mark.parametrize("container", CONTAINERS)
def test_debug_metrics_prefix(container: str, rng: np.random.Generator) -> None:
    batch = make_batch(rng, (3, 5))
    data = wrap(
        {
            "rollout_log_probs": batch.rollout,
            "old_log_probs": batch.old,
            "response_mask": batch.mask,
        },
        container,
    )
    got = calculate_debug_metrics(data, prefix="debug/")
    assert list(got) == ["debug/" + name for name in SEED_FUNCTION_NAMES]
    assert list(calculate_debug_metrics(data, prefix="")) == list(SEED_FUNCTION_NAMES)


@pytest.mark.parametrize("prefix", [None, 1, b"training/"])
def test_a_prefix_that_is_not_a_string_is_refused(prefix: object) -> None:
    batch = {"rollout_log_probs": torch.zeros(1, 2), "old_log_probs": torch.zeros(1, 2)}
    message = f"`prefix` must be a string such as 'training/', got {prefix!r}."
    with pytest.raises(ValueError, match=re.escape(message)):
        calculate_debug_metrics({**batch, "response_mask": torch.ones(1, 2)}, prefix=prefix)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=re.escape(message)):
        mismatch_metrics(*batch.values(), torch.ones(1, 2), prefix=prefix)  # type: ignore[arg-type]


@pytest.mark.parametrize("container", CONTAINERS)
def test_response_mask_is_preferred_over_attention_mask(
    container: str, rng: np.random.Generator
) -> None:
    batch = make_batch(rng, (4, 6), mask_kind="prefix", mask_dtype=torch.int64)
    data = wrap(
        {
            "rollout_log_probs": batch.rollout,
            "old_log_probs": batch.old,
            "response_mask": batch.mask,
            "attention_mask": torch.ones(4, 6, dtype=torch.int64),
        },
        container,
    )
    got = calculate_debug_metrics(data)
    assert_metrics_close(got, seed_reference(batch.rollout, batch.old, batch.mask), prefix=PREFIX)


@pytest.mark.parametrize("container", CONTAINERS)
@pytest.mark.parametrize("key", ["attention_mask", "response_mask"])
def test_mask_is_cut_to_the_response_columns(
    container: str, key: str, rng: np.random.Generator
) -> None:
    """The chosen mask covers prompt + response; only its last responses.shape[1] columns count."""
    batch = make_batch(rng, (3, 5), mask_kind="prefix", mask_dtype=torch.int64)
    prompt = torch.from_numpy(rng.integers(0, 2, (3, 4)))
    data = wrap(
        {
            "rollout_log_probs": batch.rollout,
            "old_log_probs": batch.old,
            key: torch.cat([prompt, batch.mask], dim=1),
            "responses": torch.zeros(3, 5, dtype=torch.int64),
        },
        container,
    )
    got = calculate_debug_metrics(data)
    assert_metrics_close(got, seed_reference(batch.rollout, batch.old, batch.mask), prefix=PREFIX)


def test_attention_mask_of_response_width_is_used_as_is(rng: np.random.Generator) -> None:
    batch = make_batch(rng, (3, 5), mask_kind="binary", mask_dtype=torch.float32)
    data = {
        "rollout_log_probs": batch.rollout,
        "old_log_probs": batch.old,
        "attention_mask": batch.mask,
    }
    assert_metrics_close(
        calculate_debug_metrics(data),
        seed_reference(batch.rollout, batch.old, batch.mask),
        prefix=PREFIX,
    )


@pytest.mark.parametrize("container", CONTAINERS)
def test_no_mask_counts_every_position_and_warns(container: str, rng: np.random.Generator) -> None:
    batch = make_batch(rng, (3, 7), special_rate=0.1)
    data = wrap({"rollout_log_probs": batch.rollout, "old_log_probs": batch.old}, container)
    with pytest.warns(UserWarning, match=r"neither `response_mask` nor `attention_mask`.*7"):
        got = calculate_debug_metrics(data)
    want = seed_reference(batch.rollout, batch.old, np.ones((3, 7)))
    assert_metrics_close(got, want, prefix=PREFIX)


@pytest.mark.parametrize("container", CONTAINERS)
@pytest.mark.parametrize("shape", [(3, 5), (0, 5), (3, 0), (0, 0)])
def test_empty_mask_gives_valid_zero_and_nan(
    container: str, shape: tuple[int, int], rng: np.random.Generator
) -> None:
    batch = make_batch(rng, shape, mask_kind="zeros", mask_dtype=torch.bool)
    data = wrap(
        {
            "rollout_log_probs": batch.rollout,
            "old_log_probs": batch.old,
            "response_mask": batch.mask,
        },
        container,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = calculate_debug_metrics(data)
    assert list(got) == SEED_KEYS
    assert got[PREFIX + "rollout_probs_diff_valid"] == 0.0
    assert all(math.isnan(got[key]) for key in SEED_KEYS[1:])


def test_only_nonfinite_tokens_is_an_empty_window() -> None:
    nan, inf = math.nan, math.inf
    data = {
        "rollout_log_probs": torch.tensor([[nan, -1.0, 0.0]]),
        "old_log_probs": torch.tensor([[-1.0, inf, -0.5]]),
        "response_mask": torch.tensor([[1, 1, 0]]),
    }
    got = calculate_debug_metrics(data)
    assert got[PREFIX + "rollout_probs_diff_valid"] == 0.0
    assert all(math.isnan(got[key]) for key in SEED_KEYS[1:])


def test_seed_metrics_by_hand() -> None:
    """The seed's own computation: exp both, diff, max/mean/std(unbiased), corrcoef."""
    rollout = torch.log(torch.tensor([[0.5, 0.3, 0.2, 0.9]], dtype=torch.float64))
    old = torch.log(torch.tensor([[0.6, 0.3, 0.1, 0.1]], dtype=torch.float64))
    mask = torch.tensor([[1, 1, 1, 0]])
    got = calculate_debug_metrics(
        {"rollout_log_probs": rollout, "old_log_probs": old, "response_mask": mask}
    )
    diffs = np.array([0.1, 0.0, 0.1])
    assert got[PREFIX + "rollout_probs_diff_valid"] == 1.0
    assert got[PREFIX + "rollout_probs_diff_max"] == pytest.approx(0.1, rel=1e-12)
    assert got[PREFIX + "rollout_probs_diff_mean"] == pytest.approx(diffs.mean(), rel=1e-12)
    assert got[PREFIX + "rollout_probs_diff_std"] == pytest.approx(diffs.std(ddof=1), rel=1e-12)
    corr = np.corrcoef([0.6, 0.3, 0.1], [0.5, 0.3, 0.2])[0, 1]
    assert got[PREFIX + "rollout_actor_probs_pearson_corr"] == pytest.approx(corr, rel=1e-12)


# ---------------------------------------------------------------- errors of a batch
def _good(rows: int = 2, cols: int = 3) -> dict[str, Any]:
    return {
        "rollout_log_probs": torch.zeros(rows, cols),
        "old_log_probs": torch.zeros(rows, cols),
        "response_mask": torch.ones(rows, cols),
    }


@pytest.mark.parametrize(
    ("change", "fragments"),
    [
        ({"rollout_log_probs": None}, ["rollout_log_probs", "old_log_probs", "response_mask"]),
        ({"old_log_probs": None}, ["old_log_probs", "Keys present"]),
        (
            {"old_log_probs": torch.zeros(2, 4)},
            ["old_log_probs", "(2, 4)", "rollout_log_probs", "(2, 3)"],
        ),
        ({"old_log_probs": torch.zeros(3, 3)}, ["old_log_probs", "(3, 3)", "(2, 3)"]),
        ({"response_mask": torch.ones(2, 5)}, ["response_mask", "(2, 5)", "(2, 3)"]),
        (
            {
                "rollout_log_probs": torch.zeros(6),
                "old_log_probs": torch.zeros(6),
                "response_mask": torch.ones(6),
            },
            ["rollout_log_probs", "(6,)", "2-D"],
        ),
        (
            {
                "rollout_log_probs": torch.zeros(2, 3, 4),
                "old_log_probs": torch.zeros(2, 3, 4),
                "response_mask": torch.ones(2, 3, 4),
            },
            ["rollout_log_probs", "(2, 3, 4)", "2-D"],
        ),
        (
            {"old_log_probs": torch.zeros(2, 3, dtype=torch.int64)},
            ["old_log_probs", "int64", "(2, 3)"],
        ),
        ({"rollout_log_probs": torch.zeros(2, 3, dtype=torch.bool)}, ["rollout_log_probs", "bool"]),
        (
            {"rollout_log_probs": torch.zeros(2, 3, dtype=torch.complex64)},
            ["rollout_log_probs", "complex64"],
        ),
        ({"rollout_log_probs": [[0.0, 0.0, 0.0]] * 2}, ["rollout_log_probs", "list"]),
        (
            {"response_mask": torch.ones(2, 3, dtype=torch.complex64)},
            ["response_mask", "complex64"],
        ),
    ],
)
@pytest.mark.parametrize("container", ["dict", "dataproto_dict"])
def test_bad_batches_raise_value_errors_naming_keys_and_shapes(
    change: dict[str, Any], fragments: list[str], container: str
) -> None:
    tensors = {k: v for k, v in (_good() | change).items() if v is not None}
    with pytest.raises(ValueError) as info:
        calculate_debug_metrics(wrap(tensors, container))
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_attention_mask_of_the_wrong_width_is_named() -> None:
    data = _good() | {"attention_mask": torch.ones(2, 7)}
    del data["response_mask"]
    with pytest.raises(ValueError, match=r"`attention_mask` has shape \(2, 7\).*\(2, 3\)"):
        calculate_debug_metrics(data)


@pytest.mark.parametrize("data", [None, [1, 2], torch.zeros(2, 3), "batch", 3.0])
def test_data_that_is_not_a_batch(data: Any) -> None:
    with pytest.raises(ValueError, match="mapping of tensors"):
        calculate_debug_metrics(data)


# ---------------------------------------------------------------- mismatch_metrics
@settings(max_examples=examples(150), deadline=None)
@given(
    batch=batches(),
    c=st.sampled_from([2.0, 1.2, 4.0]),
    bounds=st.sampled_from([(0.99, 1.01), (0.8, 1.25), (1.0, 1.0)]),
    prefix=st.sampled_from([PREFIX, "", "rollout/"]),
)
def test_mismatch_metrics_match_reference(
    batch: Batch, c: float, bounds: tuple[float, float], prefix: str
) -> None:
    got = mismatch_metrics(
        batch.rollout,
        batch.old,
        batch.mask,
        prefix=prefix,
        is_threshold=c,
        seq_ratio_bounds=bounds,
        rollout_token_ids=batch.rollout_ids,
        trainer_token_ids=batch.trainer_ids,
    )
    want = reference_metrics(
        batch.rollout,
        batch.old,
        batch.mask,
        is_threshold=c,
        seq_ratio_bounds=bounds,
        rollout_ids=batch.rollout_ids,
        trainer_ids=batch.trainer_ids,
    )
    names = ALL if batch.rollout_ids is not None else NO_ID_NAMES
    assert list(got) == [prefix + name for name in names]
    assert_metrics_close(got, want.select(names), prefix=prefix)


def test_mismatch_metrics_default_prefix_and_empty_mask() -> None:
    got = mismatch_metrics(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3))
    assert list(got) == [PREFIX + name for name in NO_ID_NAMES]
    defined = {
        "rollout_probs_diff_valid": 0.0,
        "rollout_tokens": 0.0,
        "rollout_sequences": 0.0,
        "rollout_nonfinite_tokens": 0.0,
        "rollout_zero_log_prob_tokens": 0.0,
    }
    for name in NO_ID_NAMES:
        value = got[PREFIX + name]
        assert value == defined[name] if name in defined else math.isnan(value), name


def test_mismatch_metrics_threshold_and_bounds_are_used() -> None:
    rollout = torch.log(torch.tensor([[0.5, 0.5, 0.5]], dtype=torch.float64))
    old = torch.log(torch.tensor([[0.9, 0.6, 0.2]], dtype=torch.float64))  # rho 1.8, 1.2, 0.4
    mask = torch.ones(1, 3)
    low = mismatch_metrics(rollout, old, mask, is_threshold=1.5, prefix="")
    high = mismatch_metrics(rollout, old, mask, is_threshold=3.0, prefix="")
    assert low["rollout_is_ratio_frac_high"] == pytest.approx(1 / 3)
    assert low["rollout_is_ratio_frac_low"] == pytest.approx(1 / 3)
    assert high["rollout_is_ratio_frac_high"] == 0.0
    assert high["rollout_is_ratio_frac_low"] == 0.0
    geo = (1.8 * 1.2 * 0.4) ** (1 / 3)  # 0.952...
    inside = mismatch_metrics(rollout, old, mask, seq_ratio_bounds=(0.9, 1.0), prefix="")
    outside = mismatch_metrics(rollout, old, mask, seq_ratio_bounds=(0.99, 1.01), prefix="")
    assert inside["rollout_seq_geo_ratio_min"] == pytest.approx(geo)
    assert inside["rollout_seq_frac_outside"] == 0.0
    assert outside["rollout_seq_frac_outside"] == 1.0


def test_mismatch_metrics_token_ids() -> None:
    ids = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    other = torch.tensor([[1, 0, 3], [4, 5, 6], [0, 8, 9]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [0, 1, 1]])  # row 2's difference is masked out
    got = mismatch_metrics(
        torch.zeros(3, 3),
        torch.zeros(3, 3),
        mask,
        rollout_token_ids=ids,
        trainer_token_ids=other,
        prefix="",
    )
    assert got["rollout_token_diff_count"] == 1.0
    assert got["rollout_token_diff_seq_frac"] == pytest.approx(1 / 3)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"is_threshold": 1.0}, "is_threshold"),
        ({"seq_ratio_bounds": (1.1, 1.2)}, "seq_ratio_bounds"),
        ({"rollout_token_ids": torch.zeros(2, 3, dtype=torch.int64)}, "trainer_token_ids"),
        ({"trainer_token_ids": torch.zeros(2, 3, dtype=torch.int64)}, "rollout_token_ids"),
        (
            {"rollout_token_ids": torch.zeros(2, 3), "trainer_token_ids": torch.zeros(2, 3)},
            "rollout_token_ids.*float32",
        ),
        (
            {
                "rollout_token_ids": torch.zeros(2, 4, dtype=torch.int64),
                "trainer_token_ids": torch.zeros(2, 4, dtype=torch.int64),
            },
            r"\(2, 4\)",
        ),
    ],
)
def test_mismatch_metrics_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        mismatch_metrics(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), **kwargs)


# ---------------------------------------------------------- calculate_token_list_diff
@settings(max_examples=examples(100), deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    rows=st.integers(0, 6),
    cols=st.integers(0, 20),
    id_dtype=st.sampled_from(ID_DTYPES),
    mask_dtype=st.sampled_from(MASK_DTYPES),
    mask_kind=st.sampled_from(["bool", "counts", "zeros", "prefix", "single"]),
)
def test_token_list_diff_counts_masked_differences_per_row(
    seed: int,
    rows: int,
    cols: int,
    id_dtype: torch.dtype,
    mask_dtype: torch.dtype,
    mask_kind: str,
) -> None:
    batch = make_batch(
        np.random.default_rng(seed),
        (rows, cols),
        with_ids=True,
        id_dtype=id_dtype,
        mask_kind=mask_kind,
        mask_dtype=mask_dtype,
    )
    got = calculate_token_list_diff(batch.rollout_ids, batch.trainer_ids, batch.mask)
    masked = to_numpy(batch.mask) != 0
    want = ((batch.rollout_ids.numpy() != batch.trainer_ids.numpy()) & masked).sum(axis=1)
    assert isinstance(got, torch.Tensor) and got.shape == (rows,)
    np.testing.assert_array_equal(got.numpy(), want)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (
            (torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3)),
            "tensor1.*float32",
        ),
        (
            (
                torch.zeros(2, 3, dtype=torch.long),
                torch.zeros(2, 4, dtype=torch.long),
                torch.ones(2, 3),
            ),
            r"tensor2.*\(2, 4\).*\(2, 3\)",
        ),
        (
            (
                torch.zeros(2, 3, dtype=torch.long),
                torch.zeros(2, 3, dtype=torch.long),
                torch.ones(3, 3),
            ),
            r"mask.*\(3, 3\)",
        ),
        (
            (torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long), torch.ones(3)),
            r"tensor1.*\(3,\)",
        ),
        (([[1, 2]], torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2)), "tensor1.*list"),
    ],
)
def test_token_list_diff_errors(args: tuple[Any, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        calculate_token_list_diff(*args)


# ----------------------------------------------------- pearson_correlation_coefficient
@st.composite
def pearson_inputs(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    shape = (draw(st.integers(0, 5)), draw(st.integers(0, 30)))
    offset = draw(st.sampled_from([0.0, 1.0, -50.0, 1e4]))
    scale = draw(st.sampled_from([1.0, 1e-3, 1e-6, 0.0]))
    x = offset + scale * rng.normal(size=shape)
    kind = draw(st.sampled_from(["linear", "noisy", "unrelated", "constant"]))
    if kind == "linear":
        y = -2.0 * x + 3.0
    elif kind == "noisy":
        y = x + rng.normal(0.0, draw(st.sampled_from([1e-4, 1e-1, 10.0])), shape)
    elif kind == "unrelated":
        y = rng.normal(size=shape)
    else:
        y = np.full(shape, 0.25)
    special = rng.random(shape) < draw(st.sampled_from([0.0, 0.1]))
    x = np.where(special, rng.choice([np.nan, np.inf, -np.inf], shape), x)
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    mask = rng.random(shape) < draw(st.sampled_from([0.0, 0.5, 1.0]))
    return (
        torch.from_numpy(x).to(dtype),
        torch.from_numpy(y).to(draw(st.sampled_from([dtype, torch.float64]))),
        torch.from_numpy(mask).to(draw(st.sampled_from(MASK_DTYPES))),
    )


@settings(max_examples=examples(200), deadline=None)
@given(inputs=pearson_inputs())
def test_pearson_matches_reference(inputs: tuple[torch.Tensor, ...]) -> None:
    x, y, mask = inputs
    keep = (to_numpy(mask) != 0) & np.isfinite(to_numpy(x)) & np.isfinite(to_numpy(y))
    xs, ys = to_numpy(x)[keep], to_numpy(y)[keep]
    got = pearson_correlation_coefficient(x, y, mask)
    assert_pearson_close(got, pearson(xs, ys), pearson_sides(xs, ys), "pearson")


def test_pearson_special_cases() -> None:
    x = torch.tensor([[0.1, 0.5, 0.9, 0.3]])
    ones = torch.ones(1, 4)
    assert pearson_correlation_coefficient(x, 2 * x + 1, ones) == pytest.approx(1.0)
    assert pearson_correlation_coefficient(x, -x, ones) == pytest.approx(-1.0)
    assert math.isnan(pearson_correlation_coefficient(x, torch.full((1, 4), 0.3), ones))
    assert math.isnan(pearson_correlation_coefficient(x, x, torch.tensor([[0, 1, 0, 0]])))
    assert math.isnan(pearson_correlation_coefficient(x, x, torch.zeros(1, 4)))
    assert isinstance(pearson_correlation_coefficient(x, x, ones), float)
    with pytest.raises(ValueError, match=r"tensor2.*\(1, 3\)"):
        pearson_correlation_coefficient(x, torch.zeros(1, 3), ones)


@pytest.mark.parametrize(
    ("offset", "scale"), [(1e3, 1e-3), (1e6, 1.0), (1e8, 1.0), (1.0, 1e-7), (-5e7, 0.5)]
)
def test_pearson_of_float64_values_far_from_zero_keeps_its_digits(
    offset: float, scale: float
) -> None:
    """A mean many spreads away from zero: float64 holds the values, and the correlation
    keeps the digits float64 gives it (one-pass power sums lost 4 to all of them)."""
    rng = np.random.default_rng(48)
    z = rng.normal(size=(4, 500))
    xs, ys = offset + scale * z, z + 0.1 * rng.normal(size=z.shape)
    got = pearson_correlation_coefficient(torch.from_numpy(xs), torch.from_numpy(ys),
                                          torch.ones(4, 500))  # fmt: skip
    assert got == pytest.approx(pearson(xs.ravel(), ys.ravel()), abs=1e-12)


# ------------------------------------------------------------ calculate_log_prob_diff
@settings(max_examples=examples(100), deadline=None)
@given(batch=batches(with_ids=False))
def test_log_prob_diff_is_abs_diff_at_masked_positions_in_row_major_order(batch: Batch) -> None:
    first, second = batch.rollout, batch.old.to(batch.rollout.dtype)
    got = calculate_log_prob_diff(first, second, batch.mask)
    masked = to_numpy(batch.mask) != 0
    with np.errstate(invalid="ignore"):  # inf - inf
        want = np.abs(to_numpy(first) - to_numpy(second))[masked]  # NumPy indexes row-major
    assert got.dim() == 1 and got.dtype == first.dtype and got.shape[0] == masked.sum()
    # subtraction in the input dtype: at most half an ulp of the result off
    rtol = torch.finfo(first.dtype).eps
    np.testing.assert_allclose(to_numpy(got), want, rtol=rtol, atol=0, equal_nan=True)


def test_log_prob_diff_order_by_hand() -> None:
    a = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    b = torch.zeros(2, 3)
    mask = torch.tensor([[0, 1, 1], [1, 0, 1]])
    assert calculate_log_prob_diff(a, b, mask).tolist() == [2.0, 3.0, 4.0, 6.0]
    with pytest.raises(ValueError, match=r"log_probs2.*\(2, 2\)"):
        calculate_log_prob_diff(a, torch.zeros(2, 2), mask)
