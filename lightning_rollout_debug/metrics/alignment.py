"""Response log-probs and mask from causal-LM logits, with no off-by-one.

A causal language model's logits at position ``t`` score the token at ``t + 1``. Slicing
them with the prompt width instead of one less, keeping the prompt columns, or leaving
the padding after EOS in the mask are the usual ways a pipeline's log-probs stop lining
up with the rollout engine's. :func:`response_log_probs` does the slicing once.

Example:
    >>> import torch
    >>> logits = torch.zeros(1, 4, 3)  # a forward pass over [prompt 2 | response 2]
    >>> logits[0, 1, 2] = 5.0  # position 1 scores token 2 at position 2
    >>> sequences = torch.tensor([[0, 1, 2, 0]])
    >>> log_probs, mask = response_log_probs(logits, sequences, prompt_width=2)
    >>> log_probs.shape, mask.tolist()
    (torch.Size([1, 2]), [[True, True]])
    >>> round(log_probs[0, 0].exp().item(), 4)  # e^5 / (e^5 + 2)
    0.9867
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

from lightning_rollout_debug.metrics.settings import is_token_id


@torch.no_grad()
def response_log_probs(
    logits: Tensor,
    sequences: Tensor,
    prompt_width: int,
    *,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    temperature: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """``[B, T]`` log-probs of the response tokens and the response mask.

    Args:
        logits: ``[B, P + T, V]`` logits of a forward pass over ``sequences`` (position
            ``t`` scores token ``t + 1``), or ``[B, T, V]`` per-step logits of generation
            (``torch.stack(generate(...).logits, 1)``: step ``t`` scores response token ``t``).
        sequences: ``[B, P + T]`` token ids: the prompt (left-padded to width ``P``), then
            the response.
        prompt_width: ``P``, the width of the prompt part of ``sequences``.
        eos_token_id: the response ends at its first EOS, which counts; what follows is
            masked out.
        pad_token_id: pad tokens in the response are masked out.
        temperature: the sampling temperature the engine divided the logits by.

    Returns:
        ``(log_probs, mask)``: float32 ``[B, T]`` log-probs of the sampled response tokens
        and a bool ``[B, T]`` mask, ready as ``old_log_probs`` (or ``rollout_log_probs``)
        and ``response_mask``. A token id outside the vocabulary (such as -100, the
        labels' ignore index) has a NaN log-prob; where the mask counts it, the callback
        reports it among the non-finite tokens.

    Raises:
        ValueError: arguments that are not tensors of the kind (floating-point logits,
            integer token ids), shapes that do not fit together, a prompt width that is
            not an int inside ``sequences``, a token id that is not an int, or a
            temperature that is not a finite positive number.
    """
    for name, value in (("logits", logits), ("sequences", sequences)):
        if not isinstance(value, Tensor):
            raise ValueError(f"`{name}` must be a torch.Tensor, got a {type(value).__name__}.")
    if not logits.is_floating_point():
        raise ValueError(f"`logits` must be a floating-point tensor, got {logits.dtype}.")
    if sequences.is_floating_point() or sequences.is_complex() or sequences.dtype == torch.bool:
        raise ValueError(
            f"`sequences` must be an integer tensor of token ids, got {sequences.dtype}."
        )
    for name, value in (("eos_token_id", eos_token_id), ("pad_token_id", pad_token_id)):
        if value is not None and not is_token_id(value):
            raise ValueError(f"`{name}` must be None or an int token id, got {value!r}.")
    if logits.ndim != 3 or sequences.ndim != 2 or logits.shape[0] != sequences.shape[0]:
        raise ValueError(
            f"`logits` must be [B, L, V] and `sequences` [B, P + T] with the same B; got "
            f"{tuple(logits.shape)} and {tuple(sequences.shape)}."
        )
    total = sequences.shape[1]
    if (
        isinstance(prompt_width, bool)
        or not isinstance(prompt_width, numbers.Integral)
        or not 0 < prompt_width < total
    ):
        raise ValueError(
            f"`prompt_width` must be an int between 1 and the width of `sequences` minus 1 "
            f"({total - 1}); got {prompt_width!r}."
        )
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, numbers.Real)
        or not 0 < temperature < math.inf
    ):
        raise ValueError(f"`temperature` must be a finite positive number, got {temperature!r}.")
    width = total - prompt_width
    if logits.shape[1] == total:
        scores = logits[:, prompt_width - 1 : -1]  # position t scores token t + 1
    elif logits.shape[1] == width:
        scores = logits
    else:
        raise ValueError(
            f"`logits` has {logits.shape[1]} positions; expected {total} (a forward pass over "
            f"`sequences`) or {width} (one per generated token)."
        )
    tokens = sequences[:, prompt_width:].long()  # gather takes int64 indices
    scores = scores.float() / temperature
    vocabulary = scores.shape[-1]
    known = (tokens >= 0) & (tokens < vocabulary)
    chosen = scores.gather(-1, tokens.clamp(0, vocabulary - 1).unsqueeze(-1)).squeeze(-1)
    log_probs = (chosen - torch.logsumexp(scores, dim=-1)).masked_fill(~known, math.nan)
    mask = torch.ones_like(tokens, dtype=torch.bool)
    first_eos = torch.zeros_like(mask)
    if eos_token_id is not None:
        is_eos = (tokens == eos_token_id).int()
        mask = (is_eos.cumsum(1) - is_eos) == 0  # up to and including the first EOS
        first_eos = mask & (is_eos == 1)
    if pad_token_id is not None:  # the first EOS counts even where pad and EOS are one id
        mask &= (tokens != pad_token_id) | first_eos
    return log_probs, mask
