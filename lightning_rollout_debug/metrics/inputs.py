"""The checked tensors of one batch, and the checks that make them.

:func:`check_inputs` takes the log-probs, the mask and optionally the token ids of one
batch and returns them as :class:`MismatchInputs`, or raises a :class:`BatchError` (a
``ValueError`` whose ``kind`` names the problem) naming the key, the shape, dtype or
device found and what was expected. Only tensor metadata is read: nothing waits for the
device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

LOG_PROB_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


MASK_DTYPES = (
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    *LOG_PROB_DTYPES,
)


TOKEN_ID_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


class BatchError(ValueError):
    """A batch the statistics cannot use.

    ``kind`` names the kind of problem (for example ``"missing:old_log_probs"``) so a
    caller can report each kind once.
    """

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class MismatchInputs:
    """The validated tensors of one batch, all ``[batch, response_length]`` on one device."""

    rollout_log_probs: Tensor
    old_log_probs: Tensor
    mask: Tensor
    rollout_token_ids: Tensor | None = None
    trainer_token_ids: Tensor | None = None


def check_inputs(
    rollout_log_probs: Any,
    old_log_probs: Any,
    mask: Any,
    rollout_token_ids: Any = None,
    trainer_token_ids: Any = None,
    *,
    names: Sequence[str] = ("rollout_log_probs", "old_log_probs", "response_mask"),
    id_names: Sequence[str] = ("rollout_token_ids", "trainer_token_ids"),
) -> MismatchInputs:
    """Validate the tensors of one batch and return them bundled.

    Raises :class:`BatchError` (a ``ValueError``) naming the key, the shape or dtype found
    and what was expected. Only tensor metadata is read: nothing waits for the device.

    Example:
        >>> import torch
        >>> inputs = check_inputs(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3))
        >>> tuple(inputs.mask.shape)
        (2, 3)
        >>> check_inputs(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
        Traceback (most recent call last):
        ...
        lightning_rollout_debug.metrics.inputs.BatchError: `old_log_probs` has shape (2, 4) but `rollout_log_probs` has shape (2, 3); expected the same [batch, response_length] shape for both.
    """  # noqa: E501
    rollout_name, old_name, mask_name = names
    for name, value in ((rollout_name, rollout_log_probs), (old_name, old_log_probs)):
        _check_tensor(name, value, LOG_PROB_DTYPES, "a floating-point log-probability tensor")
    _check_tensor(mask_name, mask, MASK_DTYPES, "a bool, integer or floating-point mask")
    shape = _same_shapes(
        (rollout_name, rollout_log_probs), (old_name, old_log_probs), (mask_name, mask)
    )
    tensors = {rollout_name: rollout_log_probs, old_name: old_log_probs, mask_name: mask}
    ids = (rollout_token_ids, trainer_token_ids)
    if any(value is not None for value in ids):
        for name, value in zip(id_names, ids, strict=True):
            if isinstance(value, Tensor) and value.dim() == 2 and tuple(value.shape) != shape:
                raise BatchError(
                    f"shape:{name}",
                    f"`{name}` has shape {tuple(value.shape)} but `{rollout_name}` has shape "
                    f"{shape}; expected the token ids of the same [batch, response_length].",
                )
        check_token_ids(*ids, mask, names=(*id_names, mask_name))
        tensors.update(zip(id_names, ids, strict=True))
    _check_one_device(tensors)
    _check_readable(tensors)
    return MismatchInputs(rollout_log_probs, old_log_probs, mask, *ids)


def _same_shapes(first: tuple[str, Tensor], *others: tuple[str, Tensor]) -> tuple[int, ...]:
    """The 2-D ``[batch, response_length]`` shape of ``first``, which ``others`` share."""
    first_name, value = first
    shape = tuple(value.shape)
    if len(shape) != 2:
        raise BatchError(
            f"rank:{first_name}",
            f"`{first_name}` has shape {shape}; expected a 2-D [batch, response_length] tensor.",
        )
    for name, other in others:
        if tuple(other.shape) != shape:
            raise BatchError(
                f"shape:{name}",
                f"`{name}` has shape {tuple(other.shape)} but `{first_name}` has shape {shape}; "
                f"expected the same [batch, response_length] shape for both.",
            )
    return shape


def check_token_ids(
    rollout_token_ids: Any,
    trainer_token_ids: Any,
    mask: Any,
    *,
    names: Sequence[str] = ("rollout_token_ids", "trainer_token_ids", "response_mask"),
) -> None:
    """Validate two ``[batch, response_length]`` integer token-id tensors and their mask.

    Raises:
        BatchError: naming the key, the shape or dtype found and what was expected.
    """
    first, second, mask_name = names
    _check_tensor(first, rollout_token_ids, TOKEN_ID_DTYPES, "an integer token-id tensor")
    _check_tensor(second, trainer_token_ids, TOKEN_ID_DTYPES, "an integer token-id tensor")
    _check_tensor(mask_name, mask, MASK_DTYPES, "a bool, integer or floating-point mask")
    _same_shapes((first, rollout_token_ids), (second, trainer_token_ids), (mask_name, mask))
    tensors = {first: rollout_token_ids, second: trainer_token_ids, mask_name: mask}
    _check_one_device(tensors)
    _check_readable(tensors)


def check_segment_ids(segment_ids: Any, mask: Tensor, name: str = "segment_ids") -> None:
    """Validate segment labels: an integer ``[batch]`` or ``[batch, response_length]`` tensor.

    Raises:
        BatchError: naming the key, the type, dtype, shape or device found and what was
            expected.

    Example:
        >>> check_segment_ids(torch.zeros(2, 4), torch.ones(2, 3))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lightning_rollout_debug.metrics.inputs.BatchError: `segment_ids` has dtype torch.float32;...
    """
    rows, width = mask.shape
    expected = (
        f"an integer tensor of shape [{rows}] (a label per sequence) or [{rows}, {width}] "
        "(a label per token)"
    )
    if not isinstance(segment_ids, Tensor):
        found = f"is a {type(segment_ids).__name__}"
    elif segment_ids.dtype not in TOKEN_ID_DTYPES:
        found = f"has dtype {segment_ids.dtype}"
    elif tuple(segment_ids.shape) not in ((rows,), (rows, width)):
        found = f"has shape {list(segment_ids.shape)}"
    else:
        _check_one_device({"response_mask": mask, name: segment_ids})
        _check_readable({name: segment_ids})
        return
    raise BatchError(f"segments:{name}", f"`{name}` {found}; expected {expected}.")


def token_ids_for(ids: Any, mask: Tensor) -> Tensor | None:
    """``ids`` if it is an integer ``[B, T]`` tensor matching ``mask``, else ``None``."""
    return ids if token_ids_mismatch(ids, mask) is None else None


def token_ids_mismatch(ids: Any, mask: Tensor) -> str | None:
    """Why ``ids`` are not the token ids of ``mask``'s tokens (``None``: they are).

    Example:
        >>> token_ids_mismatch(torch.zeros(2, 3), torch.ones(2, 3))
        'has dtype torch.float32, not an integer dtype'
        >>> token_ids_mismatch(torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 3))
        "has shape (2, 4), not the mask's (2, 3)"
    """
    if not isinstance(ids, Tensor):
        return f"is a {type(ids).__name__}, not a tensor"
    if ids.dtype not in TOKEN_ID_DTYPES:
        return f"has dtype {ids.dtype}, not an integer dtype"
    if ids.shape != mask.shape:
        return f"has shape {tuple(ids.shape)}, not the mask's {tuple(mask.shape)}"
    if ids.device != mask.device:
        return f"is on {ids.device}, not on the log-probs' {mask.device}"
    return None


def _check_one_device(tensors: dict[str, Tensor]) -> None:
    devices = {name: value.device for name, value in tensors.items()}
    if len(set(devices.values())) > 1:
        found = ", ".join(f"`{name}` on {device}" for name, device in devices.items())
        raise BatchError("device", f"The tensors are on different devices ({found}); expected one.")


def _check_readable(tensors: dict[str, Tensor]) -> None:
    """Refuse tensors whose values cannot be read: meta, sparse or nested ones."""
    for name, value in tensors.items():
        if value.is_meta or value.layout != torch.strided or value.is_nested:
            kind = "meta" if value.is_meta else "nested" if value.is_nested else str(value.layout)
            raise BatchError(
                f"data:{name}",
                f"`{name}` is a {kind.removeprefix('torch.')} tensor of shape "
                f"{tuple(value.shape)}, which the statistics cannot read; expected a dense, "
                "strided tensor with its data on a CPU or an accelerator (a meta tensor has "
                "none).",
            )


def _check_tensor(name: str, value: Any, dtypes: tuple[torch.dtype, ...], what: str) -> None:
    if not isinstance(value, Tensor):
        raise BatchError(
            f"type:{name}",
            f"`{name}` is a {type(value).__name__}; expected {what} of shape "
            f"[batch, response_length].",
        )
    if value.dtype not in dtypes:
        valid = ", ".join(str(dtype).removeprefix("torch.") for dtype in dtypes)
        raise BatchError(
            f"dtype:{name}",
            f"`{name}` has dtype {value.dtype} and shape {tuple(value.shape)}; expected {what} "
            f"with one of the dtypes {valid}.",
        )
