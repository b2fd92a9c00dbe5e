"""Naming the usual pipeline mistakes from a merged window.

Most of the mismatch a new pipeline shows comes from how its log-probs were sliced,
masked or sampled, not from numerics. Each rule reads a merged window (its
:class:`~lightning_rollout_debug.metrics.formulas.Window` and metrics) and returns a
:class:`~.findings.Diagnosis` whose message names the mistake and its fix; none of them
holds on a correct run. :func:`diagnose` names the causes of a window before the symptoms
they explain (:mod:`.findings`); the rules of the sampling are in :mod:`.sampling`. The
callback warns once per kind and run (raises under ``strict=True``).

Example:
    >>> import torch
    >>> from lightning_rollout_debug import MismatchStats
    >>> from lightning_rollout_debug.metrics.formulas import Window
    >>> old = torch.log(0.9 * torch.rand(8, 64, generator=torch.Generator().manual_seed(0)))
    >>> stats = MismatchStats()  # the engine renormalised over 95% of the mass: + 0.05 nats
    >>> stats.update(old + 0.05, old, torch.ones(8, 64))
    >>> [found.kind for found in diagnose(Window(stats.state.tolist()), stats.compute())]
    ['truncated']
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping

import torch
from torch.nn.modules.dropout import _DropoutNd

from lightning_rollout_debug.checks.findings import (
    KINDS,
    Diagnosis,
    RolloutDiagnosisError,
    RolloutDiagnosisWarning,
    in_order,
)
from lightning_rollout_debug.checks.sampling import kept_one_token, one_sided, truncated
from lightning_rollout_debug.checks.shifts import shifted
from lightning_rollout_debug.checks.stale import stale
from lightning_rollout_debug.metrics.formulas import Window, lag_correlations

__all__ = [
    "KINDS",
    "Diagnosis",
    "RolloutDiagnosisError",
    "RolloutDiagnosisWarning",
    "active_dropout",
    "diagnose",
    "lag_spreads",
]

MIN_PAIRS = 64
"""Neighbouring token pairs a window needs before its alignment is judged."""
ALIGNMENT_MARGIN = 0.25
"""How much a shifted correlation must beat the unshifted one to call the log-probs
misaligned; it must also reach :data:`ALIGNED_CORRELATION`."""
ALIGNED_CORRELATION = 0.5
ALIGNED_SPREAD = 0.25
"""Or the shifted pairs' mean squared difference at most this share of the unshifted
one: a window mixing confident and uncertain responses correlates well at every lag
(its spread between sequences), but only the right lag pairs values that agree."""

PADDING_RUN_SHARE = 0.25
"""The share of the zeros (rollout log-probs of 0 beside a trainer's below -1) that must sit
where padding puts them, right after another zero or last in their row, for the padding
rule to read them as padding; and at least :data:`PADDING_RUN_TOKENS` of them. Padding puts
all but the first of each run there; a confident token the trainer doubts (a zero alone
inside a row, at a rate ``q``) about ``q + 1 / T`` of them in rows of ``T`` tokens."""
PADDING_RUN_TOKENS = 2


def diagnose(
    window: Window, metrics: Mapping[str, float], known: Collection[str] = ()
) -> list[Diagnosis]:
    """The mistakes a merged window shows, causes first (``metrics``: its un-prefixed metrics).

    ``known``: causes found outside the window (``"dropout"``, at the start of training).
    A cause, of the window or known, explains the window's symptoms (truncated or
    one-sided sampling), which are then not named as causes of their own
    (:func:`~.findings.in_order`). Dropout's noise is in every value the rules read: with
    dropout known, neither a shift nor rollout log-probs of 0 are read from them (pad ids
    and masked logits still are). A shift by one position comes from the window's exact
    sums, a longer one (the prompt's columns) from its sample (:func:`~.shifts.shifted`).
    """
    noisy = "dropout" in known
    misaligned = None if noisy else _misaligned(window) or shifted(window)
    # Log-probs of other tokens (misaligned): their KL estimates mean nothing.
    sampled = truncated(window, metrics) if misaligned is None else None
    # A greedy or strongly truncated engine records 0.0 (probability 1) for the steps where
    # it kept one token, which the padding rule would count: those zeros are not padding.
    one_token = sampled is not None and kept_one_token(window)
    # Misaligned, the trainer's log-prob beside a rollout 0.0 is another token's: no sign
    # of padding. Pad ids inside the mask still are.
    zeros_say_padding = misaligned is None and not one_token and not noisy
    found = [misaligned, _padding(window, count_zeros=zeros_say_padding), sampled]
    if misaligned is None:
        found.append(one_sided(window, metrics))
    found += [_masked_logits(window), stale(window)]
    return in_order([diagnosis for diagnosis in found if diagnosis is not None], known)


def _masked_logits(window: Window) -> Diagnosis | None:
    """Sampled tokens the trainer gives probability 0 (``-inf``) while the engine does not.

    No softmax of finite logits gives 0; only a mask does, and the engine sampled the
    token, so its own distribution held it. A rollout log-prob of 0 (a dummy, as padding
    has) does not count.
    """
    tokens = window["masked_actor_log_prob"]
    if tokens <= 0:
        return None
    return Diagnosis(
        "masked_logits",
        f"{tokens:.0f} sampled tokens have a trainer's log-prob of -inf while the engine's is "
        "finite, and count at the -20 floor: the trainer masks logits that the engine "
        "sampled from (top-k / top-p / min-p applied in the recompute, suppressed or "
        "bad-word ids, a vocabulary cut to the tokenizer's size). Compute old_log_probs from "
        "the same distribution the engine sampled from, without the mask (or apply the mask "
        "in the engine as well).",
    )


DROPOUT_ATTRIBUTES = ("dropout", "attention_dropout", "dropout_p", "hidden_dropout")
"""Attributes by which a module applies dropout itself (``nn.MultiheadAttention``'s
``dropout``, Hugging Face attention's ``attention_dropout``, the residual dropout of
Falcon's and BLOOM's layers, ``hidden_dropout``), as a probability."""


def active_dropout(model: torch.nn.Module) -> list[str]:
    """The names of ``model``'s modules in training mode that apply dropout with ``p > 0``.

    Dropout modules, and modules whose :data:`DROPOUT_ATTRIBUTES` hold a probability
    above 0 (attention that drops its weights inside the attention call).
    """
    return [
        name or type(module).__name__
        for name, module in model.named_modules()
        if module.training and _dropout_p(module) > 0
    ]


def _dropout_p(module: torch.nn.Module) -> float:
    if isinstance(module, _DropoutNd):
        return float(module.p)
    values = [getattr(module, name, None) for name in DROPOUT_ATTRIBUTES]
    return max(
        (float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)),
        default=0.0,
    )


def lag_spreads(window: Window) -> dict[int, float]:
    """Mean squared difference of ``a_t`` and ``b_(t+L)`` over the pairs of each lag.

    The pairs of :func:`~lightning_rollout_debug.metrics.formulas.lag_correlations`; NaN without
    pairs.
    """
    pairs = window["neighbour_pairs"]
    sums = {
        -1: (pairs, "minus_actor_sq", "minus_rollout_sq", "sum_next_actor_x_rollout"),
        0: (window.n, "sum_actor_log_prob_sq", "sum_rollout_log_prob_sq", "sum_actor_x_rollout"),
        1: (pairs, "plus_actor_sq", "plus_rollout_sq", "sum_actor_x_next_rollout"),
    }
    return {
        lag: (window[xx] + window[yy] - 2.0 * window[xy]) / n if n > 0 else math.nan
        for lag, (n, xx, yy, xy) in sums.items()
    }


def _misaligned(window: Window) -> Diagnosis | None:
    """A shift by one position: the lag -1 or +1 fits the log-probs better than lag 0.

    Its correlation reaches :data:`ALIGNED_CORRELATION` and its pairs agree: their mean
    squared difference is at most :data:`ALIGNED_SPREAD` of the unshifted one, or below it
    with a correlation :data:`ALIGNMENT_MARGIN` above the unshifted. Noise on the trainer's
    side (dropout) lowers the unshifted correlation, but leaves the shifted pairs no closer.
    """
    if window["neighbour_pairs"] < MIN_PAIRS:
        return None
    correlations = lag_correlations(window)
    unshifted = correlations[0]
    lag, best = max(((lag, c) for lag, c in correlations.items() if lag), key=lambda x: x[1])
    if math.isnan(best) or best < ALIGNED_CORRELATION:
        return None
    spreads = lag_spreads(window)
    closer = spreads[lag] <= ALIGNED_SPREAD * spreads[0]
    margin = math.isnan(unshifted) or best - unshifted >= ALIGNMENT_MARGIN
    if not (closer or (margin and spreads[lag] < spreads[0])):
        return None
    side = "early" if lag > 0 else "late"
    return Diagnosis(
        "misaligned",
        f"The log-probs look misaligned by one position: the trainer's old_log_probs "
        f"correlate {best:.3f} with the rollout's shifted by {lag:+d}, against "
        f"{unshifted:.3f} unshifted, and differ by {spreads[lag]:.3g} (mean square) from "
        f"them, against {spreads[0]:.3g} (the trainer's are one token {side}). Causal-LM logits at "
        "position t predict token t + 1: take the log-probs of the response from "
        "logits[:, P - 1 : -1] for a prompt of width P (see "
        "lightning_rollout_debug.response_log_probs).",
    )


def zeros_sit_like_padding(window: Window) -> bool:
    """Whether the window's rollout log-probs of 0 sit where padding puts them.

    Each of them counts where the trainer's log-prob is below -1. At least
    :data:`PADDING_RUN_TOKENS`, and :data:`PADDING_RUN_SHARE` of them, must follow another
    in their row or be their row's last counting token: a padded row's zeros run to its
    end, while confident tokens (which a bf16 engine records as 0.0) that the trainer
    doubts, after a routing flip or stale weights, sit alone inside the rows.
    """
    zeros, run = window["zero_rollout_log_prob"], window["zero_rollout_log_prob_run"]
    return run >= max(PADDING_RUN_TOKENS, PADDING_RUN_SHARE * zeros)


def _padding(window: Window, *, count_zeros: bool = True) -> Diagnosis | None:
    """Padding inside the mask: pad ids, and rollout log-probs of 0 (with ``count_zeros``).

    Pad ids in the run that ends a row's masked tokens, the first of it excepted (taken
    for an EOS; a pad id with masked tokens of other ids after it is no padding); rollout
    log-probs of exactly 0 where the trainer's is below -1, where they sit like padding
    (:func:`zeros_sit_like_padding`).
    """
    counted = count_zeros and zeros_sit_like_padding(window)
    zeros = window["zero_rollout_log_prob"] if counted else 0.0
    pads = window["pad_in_mask"]
    if zeros <= 0 and pads <= 0:
        return None
    seen = []
    if zeros > 0:
        seen.append(
            f"{zeros:.0f} masked-in tokens whose rollout log-prob is exactly 0.0 while the "
            "trainer's is not (what an engine writes for padding), "
            f"{window['zero_rollout_log_prob_run']:.0f} of them right after another or last "
            "in their row, where padding puts them"
        )
    if pads > 0:
        seen.append(
            f"{pads:.0f} pad tokens inside the response mask (the run of pad ids that ends "
            "their row's masked tokens, but for its first, taken for an EOS)"
        )
    return Diagnosis(
        "padding",
        f"The response mask looks like it includes padding: {' and '.join(seen)}. Mask out "
        "every position after the first EOS (and the pad tokens) in response_mask. If the "
        "tokens sit before the response instead, the mask (an attention_mask?) covers the "
        "prompt's columns: take the response's columns only.",
    )
