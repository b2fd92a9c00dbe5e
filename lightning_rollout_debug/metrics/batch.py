"""Find the mismatch tensors in whatever a batch is, and read an update's batch once.

A batch may be a mapping of tensors, a ``TensorDict``, or any object whose ``.batch``
attribute is one (verl's ``DataProto``). Lookups go through several *sources* in order,
so the callback can prefer what ``training_step`` returned over the batch itself. The
tensors found are checked by :mod:`.inputs`; a shape error gets a hint where the
batch shows its cause (a mask cut to the responses' width, the prompt's columns kept).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_rollout_debug.metrics.inputs import (
    BatchError,
    MismatchInputs,
    check_inputs,
    check_segment_ids,
    token_ids_mismatch,
)

RESPONSE_MASK_FALLBACK = "attention_mask"
RESPONSES_KEY = "responses"


@dataclass(frozen=True)
class BatchRead:
    """What an update takes from one batch, found and checked in one place (:func:`read_batch`)."""

    inputs: MismatchInputs
    token_ids: Tensor | None
    """Ids of the sampled tokens: the rollout's, else ``responses`` where they fit the mask."""
    ids_problem: str | None
    """Why there are no ``token_ids`` (``None`` when there are)."""
    mask_fallback: str | None
    """Why every position counts, when neither mask key is present (``None`` otherwise)."""
    segment_ids: Tensor | None = None
    """The segment labels, ``[B]`` or ``[B, T]`` (``None``: the batch has none)."""


def read_batch(objects: Sequence[Any], segment_key: str | None = None, **keys: Any) -> BatchRead:
    """Find and check an update's tensors in ``objects`` (the batch last), once.

    ``keys``: the batch keys :func:`extract_inputs` takes (``rollout_log_probs_key``,
    ``old_log_probs_key``, ``response_mask_key``, ``token_ids_keys``); ``segment_key``:
    that of the segment labels, if any (checked where the batch has them).

    Raises:
        BatchError: as :func:`extract_inputs`.

    Example:
        >>> rollout = torch.log(torch.tensor([[0.5, 0.25]]))
        >>> read = read_batch([{"old_log_probs": rollout}, {"rollout_log_probs": rollout,
        ...                    "responses": torch.tensor([[7, 9]])}])
        >>> read.token_ids.tolist(), read.mask_fallback is not None
        ([[7, 9]], True)
    """
    sources = tensor_sources(*objects)
    inputs, fallback = extract_inputs(sources, **keys)
    segments = None if segment_key is None else lookup(sources, segment_key)
    if segments is not None:
        check_segment_ids(segments, inputs.mask, segment_key)  # type: ignore[arg-type]
    if inputs.rollout_token_ids is not None:
        return BatchRead(inputs, inputs.rollout_token_ids, None, fallback, segments)
    responses = lookup(sources, RESPONSES_KEY)
    if responses is None:
        problem = f" holds no token ids (`{RESPONSES_KEY}` or `token_ids_keys[0]`)"
        return BatchRead(inputs, None, problem, fallback, segments)
    mismatch = token_ids_mismatch(responses, inputs.mask)
    if mismatch is not None:
        return BatchRead(inputs, None, f"'s `{RESPONSES_KEY}` {mismatch}", fallback, segments)
    return BatchRead(inputs, responses, None, fallback, segments)


def tensor_sources(*objects: Any) -> list[Any]:
    """Return the lookup sources among ``objects``: mappings, ``TensorDict``s or ``.batch`` holders.

    Objects that are none of these (``None``, a bare loss tensor, a list) are left out.
    """
    sources = []
    for obj in objects:
        if _is_lookup(obj):
            sources.append(obj)
        elif not isinstance(obj, Tensor) and _is_lookup(getattr(obj, "batch", None)):
            sources.append(obj.batch)
    return sources


def batch_type_error(
    batch: Any, error: BatchError, searched: str = "the output of `training_step`"
) -> BatchError:
    """``error``, or a ``type:batch`` error when a key is missing because ``batch`` is unsearchable.

    A batch that is a list, a tuple or a bare tensor is not searched for keys, only what
    came before it (``searched``: the output of ``training_step``) is; a missing key then
    blames the batch's type instead of listing the keys of the other sources alone.
    """
    if not error.kind.startswith("missing:") or tensor_sources(batch):
        return error
    converted = BatchError(
        "type:batch",
        f"The batch is a {type(batch).__name__}, not a mapping of tensors, a TensorDict or an "
        f"object whose `.batch` is one, so only {searched} was searched. {error}",
    )
    converted.__cause__ = error
    return converted


def _found(batch_type: type | None) -> str:
    return "is " if batch_type is None else f"is a {batch_type.__name__}, "


def _is_lookup(obj: Any) -> bool:
    if isinstance(obj, Mapping):
        return True
    # TensorDict and similar containers: keyed access without being a Mapping.
    return (
        obj is not None
        and not isinstance(obj, Tensor)
        and all(hasattr(obj, name) for name in ("keys", "__getitem__", "__contains__"))
    )


def lookup(sources: Sequence[Any], key: str) -> Any | None:
    """Return the value of ``key`` in the first source that holds one, else ``None``.

    A source whose ``key`` is ``None`` (a ``training_step`` output that leaves it unset,
    say) does not hold one: the next source is searched.
    """
    for source in sources:
        if key in source and (value := source[key]) is not None:
            return value
    return None


def require(sources: Sequence[Any], key: str) -> Any:
    """Return the value of ``key`` from the sources, or raise a :class:`BatchError`."""
    value = lookup(sources, key)
    if value is None:
        # `.keys()`: iterating a TensorDict yields its rows, not its keys.
        held: dict[str, bool] = {}
        for source in sources:
            for name in source.keys():  # noqa: SIM118
                held[str(name)] = held.get(str(name), False) or source[name] is not None
        found = sorted(name for name, value in held.items() if value)
        empty = sorted(name for name, value in held.items() if not value)
        said = f"Keys present: {found or 'none'}."
        if empty:
            said += f" Keys holding None: {empty}."
        raise BatchError(
            f"missing:{key}",
            f"The batch has no `{key}`; expected a [batch, response_length] tensor under that "
            f"key. {said}",
        )
    return value


def select_mask(
    sources: Sequence[Any], response_mask_key: str, width: int
) -> tuple[Tensor | None, str]:
    """Pick the response mask the way the original debug metrics do.

    ``response_mask_key`` if present, else ``attention_mask``; the chosen mask is cut to
    the last ``responses.shape[1]`` columns when the sources hold ``responses``. Returns
    ``(None, reason)`` when neither mask is present, so the caller decides how to fall
    back to all ones (``width`` is only used in that message).
    """
    for key in (response_mask_key, RESPONSE_MASK_FALLBACK):
        mask = lookup(sources, key)
        if mask is None:
            continue
        responses = lookup(sources, RESPONSES_KEY)
        if _is_matrix(mask) and _is_matrix(responses) and mask.shape[1] > responses.shape[1]:
            mask = mask[:, mask.shape[1] - responses.shape[1] :]  # zero columns for T = 0
        return mask, key
    return None, (
        f"The batch has neither `{response_mask_key}` nor `{RESPONSE_MASK_FALLBACK}`; every one "
        f"of the {width} response positions counts, padding included."
    )


def extract_inputs(
    sources: Sequence[Any],
    *,
    rollout_log_probs_key: str = "rollout_log_probs",
    old_log_probs_key: str = "old_log_probs",
    response_mask_key: str = "response_mask",
    token_ids_keys: tuple[str, str] | None = None,
    batch_type: type | None = None,
) -> tuple[MismatchInputs, str | None]:
    """Look the tensors up in ``sources`` (first source wins), pick the mask, validate.

    Returns the inputs and, when neither mask key is present and every position
    counts, the reason to warn about; ``None`` otherwise. ``batch_type``, the type of the
    batch ``sources`` came from, is named when none of it could be searched.

    Raises:
        BatchError: a key is missing, or a tensor has the wrong type, shape or dtype.
    """
    if not sources:
        raise BatchError(
            "type:batch",
            f"The batch {_found(batch_type)}not a mapping of tensors, a TensorDict, or an object "
            f"whose `.batch` is one; expected `{rollout_log_probs_key}` and "
            f"`{old_log_probs_key}` under those keys.",
        )
    rollout = require(sources, rollout_log_probs_key)
    old = require(sources, old_log_probs_key)
    mask, mask_name = select_mask(sources, response_mask_key, _width(rollout))
    fallback = None
    if mask is None:
        fallback, mask_name = mask_name, response_mask_key
        if isinstance(rollout, Tensor):
            mask = torch.ones(rollout.shape, dtype=torch.bool, device=rollout.device)
    ids: tuple[Any, Any] = (None, None)
    if token_ids_keys is not None:
        ids = (require(sources, token_ids_keys[0]), require(sources, token_ids_keys[1]))
    names = (rollout_log_probs_key, old_log_probs_key, mask_name)
    try:
        inputs = check_inputs(
            rollout,
            old,
            mask,
            *ids,
            names=names,
            id_names=token_ids_keys or ("rollout_token_ids", "trainer_token_ids"),
        )
    except BatchError as error:
        hints = []
        if error.kind.startswith("shape:"):
            hints = [cut_hint(sources, mask_name, mask), prompt_hint(sources, rollout, old, names)]
        told = [hint for hint in hints if hint is not None]
        if not told:
            raise
        raise BatchError(error.kind, " ".join([str(error), *told])) from None
    return inputs, fallback


def cut_hint(sources: Sequence[Any], mask_name: str, mask: Any) -> str | None:
    """Where the mask a shape error names is the last columns of a wider one.

    ``None`` where the mask is the batch's own, uncut.
    """
    original, responses = lookup(sources, mask_name), lookup(sources, RESPONSES_KEY)
    if not (_is_matrix(original) and _is_matrix(mask) and _is_matrix(responses)):
        return None
    if original.shape == mask.shape:
        return None
    return (
        f"(The batch's `{mask_name}` has shape {tuple(original.shape)}: its last "
        f"{mask.shape[1]} columns were taken, the width of `{RESPONSES_KEY}` "
        f"{tuple(responses.shape)}.)"
    )


def prompt_hint(sources: Sequence[Any], rollout: Any, old: Any, names: Sequence[str]) -> str | None:
    """Why the two log-prob tensors differ in width: the wider likely holds the prompt's columns.

    The log-probs of a whole sequence (prompt and response) are wider than the response's
    by the prompt's width, or by one less: the log-probs of every token but the first,
    from a forward pass over both (logits ``[:, :-1]`` against tokens ``[:, 1:]``). The
    prompt's width, where the batch shows it, confirms it: that of ``prompts``, of an
    ``attention_mask`` of the prompt alone, or what an ``attention_mask`` of prompt and
    response holds beyond the narrower log-probs. ``None`` when the widths do not differ.
    """
    if not (_is_matrix(rollout) and _is_matrix(old)) or rollout.shape[1] == old.shape[1]:
        return None
    response, whole = sorted((rollout.shape[1], old.shape[1]))
    wider, narrower = (names[0], names[1]) if rollout.shape[1] == whole else (names[1], names[0])
    extra = whole - response
    prompt_widths = set()
    if _is_matrix(prompts := lookup(sources, "prompts")):
        prompt_widths.add(prompts.shape[1])
    if _is_matrix(attention := lookup(sources, "attention_mask")):
        prompt_widths |= {attention.shape[1], attention.shape[1] - response}
    keep = (
        f"Keep the response's columns: `{wider}[:, -{response}:]` (for log-probs from causal-LM "
        "logits, see lightning_rollout_debug.response_log_probs)."
    )
    if response == 0 or not {extra, extra + 1} & prompt_widths:
        return (
            f"`{wider}` has {extra} more columns than `{narrower}`: it likely includes the "
            f"prompt's (log-probs of the whole sequence, prompt and response). {keep}"
        )
    width = (
        "the prompt's width"
        if extra in prompt_widths
        else "the prompt's width less one: the log-probs of every token after the first"
    )
    return f"`{wider}` looks like it includes the prompt: {extra} columns wider, {width}. {keep}"


def _width(value: Any) -> int | str:
    return value.shape[-1] if isinstance(value, Tensor) and value.dim() > 0 else "unknown"


def _is_matrix(value: Any) -> bool:
    return isinstance(value, Tensor) and value.dim() == 2
