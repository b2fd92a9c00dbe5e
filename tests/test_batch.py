"""Pulling tensors out of batches and validating them: messages and error kinds."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tensordict import TensorDict

from lightning_rollout_debug.functional import calculate_debug_metrics
from lightning_rollout_debug.metrics.batch import (
    extract_inputs,
    lookup,
    require,
    select_mask,
    tensor_sources,
)
from lightning_rollout_debug.metrics.inputs import (
    BatchError,
    MismatchInputs,
    check_inputs,
    check_token_ids,
)


class FakeDataProto:
    def __init__(self, batch: Any) -> None:
        self.batch = batch


def t(*shape: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=device)


def ids(*shape: int, device: str = "cpu") -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.int64, device=device)


def raises(kind: str, *fragments: str) -> Any:
    """Context manager: a BatchError of ``kind`` whose message holds every fragment."""

    class _Check:
        def __enter__(self) -> None:
            self._ctx = pytest.raises(BatchError)
            self.info = self._ctx.__enter__()

        def __exit__(self, *exc: Any) -> bool:
            suppressed = self._ctx.__exit__(*exc)
            error = self.info.value
            assert isinstance(error, ValueError)
            assert error.kind == kind, (error.kind, str(error))
            for fragment in fragments:
                assert fragment in str(error), (fragment, str(error))
            return suppressed

    return _Check()


# ---------------------------------------------------------------------- sources
def test_tensor_sources_keeps_lookups_in_order() -> None:
    plain = {"a": t(1, 1)}
    td = TensorDict({"b": t(1, 1)}, batch_size=[1])
    holder = FakeDataProto({"c": t(1, 1)})
    td_holder = FakeDataProto(TensorDict({"d": t(1, 1)}, batch_size=[1]))
    sources = tensor_sources(
        None, plain, t(2), td, [1, 2], holder, 3.0, td_holder, FakeDataProto(None), "text"
    )
    assert sources == [plain, td, holder.batch, td_holder.batch]
    assert tensor_sources() == []
    assert tensor_sources(None, t(3), [t(1)], (1,)) == []


def test_lookup_prefers_the_first_source() -> None:
    first, second = {"x": t(1, 1), "y": t(2, 2)}, {"x": t(3, 3), "z": t(4, 4)}
    assert lookup([first, second], "x") is first["x"]
    assert lookup([first, second], "z") is second["z"]
    assert lookup([first, second], "w") is None
    assert lookup([], "x") is None


def test_require_names_the_key_and_the_keys_present() -> None:
    sources = [{"old_log_probs": t(1, 1)}, TensorDict({"responses": ids(1, 1)}, batch_size=[1])]
    with raises(
        "missing:rollout_log_probs", "`rollout_log_probs`", "['old_log_probs', 'responses']"
    ):
        require(sources, "rollout_log_probs")
    with raises("missing:old_log_probs", "Keys present: none"):
        require([], "old_log_probs")
    assert require(sources, "responses") is sources[1]["responses"]


def test_a_key_holding_none_is_not_listed_as_present() -> None:
    sources = [{"old_log_probs": None, "rollout_log_probs": t(1, 1)}]
    with pytest.raises(BatchError) as info:
        require(sources, "old_log_probs")
    message = str(info.value)
    assert "Keys present: ['rollout_log_probs']." in message
    assert "Keys holding None: ['old_log_probs']." in message


def test_a_key_left_none_in_the_outputs_is_taken_from_the_batch() -> None:
    """``training_step`` returning ``{"old_log_probs": None}`` leaves the batch's tensor in
    use; a key that is None everywhere is named as holding None, never as present."""
    outputs = {"loss": t(1, 1), "old_log_probs": None}
    batch = {"old_log_probs": t(2, 2), "rollout_log_probs": None}
    assert lookup([outputs, batch], "old_log_probs") is batch["old_log_probs"]
    assert require([outputs, batch], "old_log_probs") is batch["old_log_probs"]
    with pytest.raises(BatchError) as info:
        require([outputs, batch], "rollout_log_probs")
    message = str(info.value)
    assert "Keys present: ['loss', 'old_log_probs']." in message
    assert "Keys holding None: ['rollout_log_probs']." in message


# -------------------------------------------------------------------------- masks
def test_select_mask_prefers_the_response_mask() -> None:
    response, attention = t(2, 3), torch.ones(2, 3)
    mask, key = select_mask(
        [{"response_mask": response, "attention_mask": attention}], "response_mask", 3
    )
    assert mask is response and key == "response_mask"


def test_select_mask_custom_key_and_fallback() -> None:
    attention = torch.ones(2, 3)
    mask, key = select_mask([{"loss_mask": t(2, 3)}, {"attention_mask": attention}], "loss_mask", 3)
    assert key == "loss_mask"
    mask, key = select_mask([{"attention_mask": attention}], "loss_mask", 3)
    assert mask is attention and key == "attention_mask"


@pytest.mark.parametrize("key", ["response_mask", "attention_mask"])
def test_select_mask_cuts_to_the_response_columns(key: str) -> None:
    full = torch.arange(14).reshape(2, 7)
    mask, name = select_mask([{key: full, "responses": ids(2, 3)}], "response_mask", 3)
    assert name == key
    assert torch.equal(mask, full[:, -3:])


@pytest.mark.parametrize("key", ["response_mask", "attention_mask"])
def test_select_mask_cuts_to_no_columns_for_empty_responses(key: str) -> None:
    full = torch.ones(3, 4)
    mask, _ = select_mask([{key: full, "responses": ids(3, 0)}], "response_mask", 0)
    assert mask.shape == (3, 0)
    metrics = calculate_debug_metrics(
        {"rollout_log_probs": t(3, 0), "old_log_probs": t(3, 0), key: full, "responses": ids(3, 0)}
    )
    assert metrics["training/rollout_probs_diff_valid"] == 0.0  # no tokens, no error


def test_select_mask_leaves_masks_it_cannot_cut() -> None:
    narrow = torch.ones(2, 2)
    mask, _ = select_mask([{"attention_mask": narrow, "responses": ids(2, 3)}], "response_mask", 3)
    assert mask is narrow  # narrower than responses: the shape check reports it later
    flat = torch.ones(5)
    mask, _ = select_mask([{"attention_mask": flat, "responses": ids(2, 3)}], "response_mask", 3)
    assert mask is flat


def test_select_mask_without_either_mask_explains_why() -> None:
    mask, reason = select_mask([{"responses": ids(2, 9)}], "response_mask", 9)
    assert mask is None
    assert "`response_mask`" in reason and "`attention_mask`" in reason and "9" in reason


# ------------------------------------------------------------------- check_inputs
def test_check_inputs_returns_the_same_tensors() -> None:
    rollout, old, mask = t(2, 3), t(2, 3, dtype=torch.bfloat16), torch.ones(2, 3, dtype=torch.bool)
    inputs = check_inputs(rollout, old, mask, ids(2, 3), ids(2, 3))
    assert isinstance(inputs, MismatchInputs)
    assert inputs.rollout_log_probs is rollout and inputs.old_log_probs is old
    assert inputs.mask is mask
    assert inputs.rollout_token_ids is not None and inputs.trainer_token_ids is not None
    assert check_inputs(t(0, 0), t(0, 0), t(0, 0)).rollout_token_ids is None


@pytest.mark.parametrize(
    ("args", "kind", "fragments"),
    [
        (
            (t(2, 3), t(2, 4), t(2, 3)),
            "shape:old_log_probs",
            ["`old_log_probs` has shape (2, 4)", "`rollout_log_probs` has shape (2, 3)"],
        ),
        ((t(2, 3), t(3), t(2, 3)), "shape:old_log_probs", ["(3,)", "(2, 3)"]),
        (
            (t(2, 3), t(2, 3), t(3, 2)),
            "shape:response_mask",
            ["`response_mask` has shape (3, 2)", "(2, 3)"],
        ),
        ((t(2, 3), t(2, 3), t(2, 3, 1)), "shape:response_mask", ["(2, 3, 1)"]),
        ((t(5), t(5), t(5)), "rank:rollout_log_probs", ["`rollout_log_probs`", "(5,)", "2-D"]),
        ((t(2, 3, 4), t(2, 3, 4), t(2, 3, 4)), "rank:rollout_log_probs", ["(2, 3, 4)", "2-D"]),
        ((t(), t(), t()), "rank:rollout_log_probs", ["()"]),
        (
            (t(2, 3, dtype=torch.int64), t(2, 3), t(2, 3)),
            "dtype:rollout_log_probs",
            ["int64", "(2, 3)", "float32"],
        ),
        ((t(2, 3), t(2, 3, dtype=torch.int32), t(2, 3)), "dtype:old_log_probs", ["int32"]),
        ((t(2, 3), t(2, 3, dtype=torch.bool), t(2, 3)), "dtype:old_log_probs", ["bool"]),
        (
            (t(2, 3, dtype=torch.complex64), t(2, 3), t(2, 3)),
            "dtype:rollout_log_probs",
            ["complex64"],
        ),
        (
            (t(2, 3), t(2, 3), t(2, 3, dtype=torch.complex128)),
            "dtype:response_mask",
            ["complex128", "bool"],
        ),
        (
            ([[0.0] * 3] * 2, t(2, 3), t(2, 3)),
            "type:rollout_log_probs",
            ["`rollout_log_probs` is a list"],
        ),
        ((t(2, 3), [[0.0] * 3] * 2, t(2, 3)), "type:old_log_probs", ["list"]),
        ((t(2, 3), t(2, 3), [[1] * 3] * 2), "type:response_mask", ["`response_mask` is a list"]),
        ((t(2, 3), t(2, 3), None), "type:response_mask", ["NoneType"]),
        ((None, t(2, 3), t(2, 3)), "type:rollout_log_probs", ["NoneType"]),
    ],
)
def test_check_inputs_errors(args: tuple[Any, ...], kind: str, fragments: list[str]) -> None:
    with raises(kind, *fragments):
        check_inputs(*args)


def test_a_mask_cut_to_the_responses_width_names_its_own_shape() -> None:
    """The mask a shape error names is the last columns of the batch's wider one: the
    message gives the batch's shape and why those columns were taken."""
    batch = {
        "rollout_log_probs": t(2, 5),
        "old_log_probs": t(2, 5),
        "attention_mask": ids(2, 9),  # prompt and response
        "responses": ids(2, 6),  # one more than the log-probs
    }
    with raises(
        "shape:attention_mask",
        "`attention_mask` has shape (2, 6) but `rollout_log_probs` has shape (2, 5)",
        "The batch's `attention_mask` has shape (2, 9): its last 6 columns were taken, the "
        "width of `responses` (2, 6).",
    ):
        extract_inputs([batch])


def test_check_inputs_uses_the_given_names() -> None:
    with raises("shape:attention_mask", "`attention_mask` has shape (2, 7)", "`lp` has shape"):
        check_inputs(t(2, 3), t(2, 3), t(2, 7), names=("lp", "old", "attention_mask"))


@pytest.mark.parametrize(
    ("token_ids", "kind", "fragments"),
    [
        ((ids(2, 3), None), "type:trainer_token_ids", ["`trainer_token_ids` is a NoneType"]),
        ((None, ids(2, 3)), "type:rollout_token_ids", ["NoneType"]),
        ((t(2, 3), ids(2, 3)), "dtype:rollout_token_ids", ["float32", "int64"]),
        ((ids(2, 3), torch.zeros(2, 3, dtype=torch.bool)), "dtype:trainer_token_ids", ["bool"]),
        ((ids(2, 3), ids(2, 4)), "shape:trainer_token_ids", ["(2, 4)", "(2, 3)"]),
        (
            (ids(2, 4), ids(2, 4)),
            "shape:rollout_token_ids",
            ["`rollout_token_ids` has shape (2, 4)", "`rollout_log_probs` has shape (2, 3)"],
        ),
        ((ids(6), ids(6)), "rank:rollout_token_ids", ["(6,)"]),
    ],
)
def test_token_id_errors(token_ids: tuple[Any, Any], kind: str, fragments: list[str]) -> None:
    with raises(kind, *fragments):
        check_inputs(t(2, 3), t(2, 3), t(2, 3), *token_ids)


def test_check_token_ids_alone() -> None:
    check_token_ids(ids(2, 3), ids(2, 3), t(2, 3))
    with raises("shape:m", "`m` has shape (1, 3)"):
        check_token_ids(ids(2, 3), ids(2, 3), t(1, 3), names=("a", "b", "m"))


# ------------------------------------------------------------------------- devices
@pytest.mark.parametrize("which", [0, 1, 2])
def test_tensors_on_different_devices(which: int) -> None:
    args = [t(2, 3), t(2, 3), t(2, 3)]
    args[which] = args[which].to("meta")
    names = ("rollout_log_probs", "old_log_probs", "response_mask")
    with raises("device", "different devices", f"`{names[which]}` on meta", "on cpu"):
        check_inputs(*args)


def test_token_ids_on_another_device() -> None:
    with raises("device", "`trainer_token_ids` on meta"):
        check_inputs(t(2, 3), t(2, 3), t(2, 3), ids(2, 3), ids(2, 3, device="meta"))


@pytest.mark.parametrize("which", [0, 1, 2])
def test_tensors_without_readable_data_are_refused(which: int) -> None:
    """Meta tensors (no data at all), sparse and nested ones: refused from their metadata."""
    names = ("rollout_log_probs", "old_log_probs", "response_mask")
    on_meta = [t(2, 3, device="meta") for _ in names]
    with raises("data:rollout_log_probs", "`rollout_log_probs` is a meta tensor", "(2, 3)"):
        check_inputs(*on_meta)
    sparse = [t(2, 3), t(2, 3), t(2, 3)]
    sparse[which] = sparse[which].to_sparse()
    with raises(f"data:{names[which]}", "sparse_coo tensor", "dense, strided"):
        check_inputs(*sparse)
    with raises("data:rollout_token_ids", "`rollout_token_ids` is a meta tensor"):
        check_token_ids(ids(2, 3, device="meta"), ids(2, 3, device="meta"), on_meta[2])


# ------------------------------------------------------------------ extract_inputs
def test_extract_inputs_with_every_kind_of_source() -> None:
    batch = {
        "rollout_log_probs": t(2, 3),
        "old_log_probs": t(2, 3),
        "attention_mask": torch.ones(2, 5),
        "responses": ids(2, 3),
        "r_ids": ids(2, 3),
        "t_ids": ids(2, 3),
    }
    inputs, fallback = extract_inputs(
        tensor_sources({"old_log_probs": t(2, 3, dtype=torch.float64)}, FakeDataProto(batch)),
        token_ids_keys=("r_ids", "t_ids"),
    )
    assert fallback is None
    assert inputs.old_log_probs.dtype == torch.float64  # the first source wins
    assert inputs.mask.shape == (2, 3)
    assert inputs.rollout_token_ids is batch["r_ids"]


def test_extract_inputs_falls_back_to_all_ones() -> None:
    inputs, fallback = extract_inputs([{"rollout_log_probs": t(2, 4), "old_log_probs": t(2, 4)}])
    assert fallback is not None and "4" in fallback
    assert inputs.mask.dtype == torch.bool and bool(inputs.mask.all())


@pytest.mark.parametrize("batch", [[t(2, 3)], (t(2, 3),), None, t(2, 3)])
def test_calculate_debug_metrics_names_the_type_of_an_unsearchable_batch(batch: Any) -> None:
    with raises("type:batch", f"The batch is a {type(batch).__name__}, not a mapping"):
        calculate_debug_metrics(batch)


def test_extract_inputs_errors() -> None:
    with raises("type:batch", "rollout_log_probs", "old_log_probs"):
        extract_inputs([])
    with raises("missing:lp", "`lp`"):
        extract_inputs([{"old_log_probs": t(2, 3)}], rollout_log_probs_key="lp")
    with raises("missing:t_ids", "`t_ids`"):
        extract_inputs(
            [{"rollout_log_probs": t(2, 3), "old_log_probs": t(2, 3), "r_ids": ids(2, 3)}],
            token_ids_keys=("r_ids", "t_ids"),
        )
    with raises("shape:attention_mask", "`attention_mask` has shape (2, 2)"):
        extract_inputs(
            [
                {
                    "rollout_log_probs": t(2, 3),
                    "old_log_probs": t(2, 3),
                    "attention_mask": t(2, 2),
                    "responses": ids(2, 3),
                }
            ]
        )
    with raises("type:rollout_log_probs", "list"):
        extract_inputs([{"rollout_log_probs": [[0.0]], "old_log_probs": t(1, 1)}])
