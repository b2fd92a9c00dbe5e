"""Naming the usual pipeline mistakes from a merged window.

Most of the mismatch a new pipeline shows comes from how its log-probs were sliced,
masked or sampled, not from numerics. Each rule here reads a merged window (its
:class:`~lightning_rollout_debug.metrics.formulas.Window` and metrics) and returns a
:class:`Diagnosis` whose message names the mistake and its fix; none of them holds on a
correct run. The callback warns once per kind and run (raises under ``strict=True``).

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
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch.nn.modules.dropout import _DropoutNd

from lightning_rollout_debug.metrics.formulas import Window, lag_correlations

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
TRUNCATION_K1 = 0.01
"""k1 above this, and above :data:`TRUNCATION_FACTOR` times k3 by three standard errors
of k1, looks like engine-side truncation (top-k / top-p) with renormalised log-probs."""
TRUNCATION_FACTOR = 8.0
TRUNCATION_SHARE = 0.2
"""Strong truncation: the ratios' deficit ``1 - mean(rho) = k1 - k3`` at least this share
of k1 and :data:`TRUNCATION_ERRORS` standard errors of ``mean(rho)`` above 0. An engine
that keeps the mass ``Z`` of each step gives a share of ``(1 - Z) / -log(Z)``: 0.87 at
``Z = 0.75``, 0.39 at ``Z = 0.1``, where :data:`TRUNCATION_FACTOR` asks for 0.875."""
TRUNCATION_ERRORS = 4.0
TRUNCATION_STRONG_K1 = 0.1
"""k1 above this for the strong-truncation form: the mass an engine cuts away then
dwarfs what tokens it did not sample (padding scored by both sides) do to ``mean(rho)``."""
MIN_TOKENS = 256
"""Tokens a window needs before its k1 and k3 are compared."""
TRUNCATION_SLOPE = 1.1
"""Where :func:`_truncated` holds and the window has rollout log-probs of exactly 0 with a
trainer's below -1: the least-squares slope ``sum(a b) / sum(b^2)`` of the trainer's
log-probs on the rollout's at least this means the zeros are steps where the engine kept
one token, not padding (see :func:`kept_one_token`)."""
ONE_TOKEN_NATS = 8.0
"""The most ``b - a`` (``-log`` of the trainer's mass in what the engine kept) a truncating
engine's zeros are read with: it keeps at least its most likely token, and a top token
below ``e^-8`` needs thousands of near-equal candidates; padding's trainer log-probs sit
far lower (-7 to -28 in ``benchmarks/mistakes.py``, at the -20 floor mostly)."""

PADDING_RUN_SHARE = 0.25
"""The share of the zeros (rollout log-probs of 0 beside a trainer's below -1) that must sit
where padding puts them, right after another zero or last in their row, for the padding
rule to read them as padding; and at least :data:`PADDING_RUN_TOKENS` of them. Padding puts
all but the first of each run there; a confident token the trainer doubts (a zero alone
inside a row, at a rate ``q``) about ``q + 1 / T`` of them in rows of ``T`` tokens."""
PADDING_RUN_TOKENS = 2

ONE_SIDED_K1 = -0.01
"""k1 below this, and below 0 by :data:`ONE_SIDED_ERRORS` standard errors, means the
rollout log-probs are not those of the distribution that sampled the tokens."""
ONE_SIDED_ERRORS = 4.0

KINDS = ("misaligned", "padding", "truncated", "one_sided", "masked_logits", "prompt", "dropout")
"""The kinds of diagnosis, each warned about once per run."""


class RolloutDiagnosisWarning(UserWarning):
    """A pipeline mistake the window shows (its message names the fix)."""


class RolloutDiagnosisError(RuntimeError):
    """A pipeline mistake, raised instead of warned about with ``strict=True``."""


@dataclass(frozen=True)
class Diagnosis:
    """One named mistake: its kind (one of :data:`KINDS`) and a message with the fix."""

    kind: str
    message: str


def diagnose(window: Window, metrics: Mapping[str, float]) -> list[Diagnosis]:
    """The mistakes a merged window shows (``metrics``: its un-prefixed metrics)."""
    misaligned = _misaligned(window)
    # Log-probs of other tokens (misaligned): their KL estimates mean nothing.
    truncated = _truncated(window, metrics) if misaligned is None else None
    # A greedy or strongly truncated engine records 0.0 (probability 1) for the steps where
    # it kept one token, which the padding rule would count: those zeros are not padding.
    one_token = truncated is not None and kept_one_token(window)
    # Misaligned, the trainer's log-prob beside a rollout 0.0 is another token's: no sign
    # of padding. Pad ids inside the mask still are.
    zeros_say_padding = misaligned is None and not one_token
    found = [misaligned, _padding(window, count_zeros=zeros_say_padding), truncated]
    if misaligned is None:
        found.append(_one_sided(window, metrics))
    found.append(_masked_logits(window))
    return [diagnosis for diagnosis in found if diagnosis is not None]


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


def _k1_error(window: Window, k3: float) -> float:
    """The standard error of k1, ``sqrt(mean(r^2) / n)``.

    ``sum(r^2)`` comes from the health group's sums of ``a^2``, ``b^2`` and ``a b``; without
    them ``mean(r^2)`` is taken as ``2 k3``, its value for small ``r``.
    """
    n = window.n
    squares = window["sum_actor_log_prob_sq"] + window["sum_rollout_log_prob_sq"]
    mean_square = (squares - 2.0 * window["sum_actor_x_rollout"]) / n if squares > 0 else 2 * k3
    return math.sqrt(max(mean_square, 0.0) / n)


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
    if window["neighbour_pairs"] < MIN_PAIRS:
        return None
    correlations = lag_correlations(window)
    unshifted = correlations[0]
    lag, best = max(((lag, c) for lag, c in correlations.items() if lag), key=lambda x: x[1])
    if math.isnan(best) or best < ALIGNED_CORRELATION:
        return None
    spreads = lag_spreads(window)
    closer = spreads[lag] <= ALIGNED_SPREAD * spreads[0]
    if not math.isnan(unshifted) and best - unshifted < ALIGNMENT_MARGIN and not closer:
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


def _ratio_error(window: Window, k3: float) -> float:
    """The standard error of ``mean(rho)``, ``sqrt(var(rho) / n)``.

    From the importance-ratio group's sums; without them as that of k1 (the same for
    small ``r``).
    """
    n = window.n
    squares = window["ratio_sq_m1"] - 2.0 * window["ratio_m1"]  # sum (rho - 1)^2
    if squares <= 0:
        return _k1_error(window, k3)
    variance = squares / n - (window["ratio_m1"] / n) ** 2
    return math.sqrt(max(variance, 0.0) / n)


def rollout_all_zero(window: Window) -> bool:
    """Every counting rollout log-prob is exactly 0 while the trainer's are not all 0.

    From the health group's sums of squares (float64 sums of float32 squares: any
    ``b != 0`` leaves ``sum(b^2) > 0``); without that group both sums are 0 and this is
    false.
    """
    return window["sum_actor_log_prob_sq"] > 0 and window["sum_rollout_log_prob_sq"] == 0


def kept_one_token(window: Window) -> bool:
    """Whether the window's zeros are steps where a truncating engine kept one token.

    The rollout log-probs of exactly 0 where the trainer's is below -1 (greedy, top-k 1,
    a small top-p), rather than padding.

    Read only where :func:`_truncated` holds. Padding and the steps an engine keeps one
    token alone both put ``b = 0`` on a token whose trainer's log-prob ``a`` is below -1,
    and the window does not hold those tokens' ``a`` apart. The other tokens tell them
    apart, and the sums over them are in the window: a token with ``b = 0`` adds nothing to
    ``sum(b^2)`` or ``sum(a b)``. Where the zeros are padding, the other tokens were
    sampled and scored alike (``a ~ b``): the slope ``sum(a b) / sum(b^2)`` is about 1
    (0.99-1.07 in ``benchmarks/mistakes.py``, with a top-k 5 engine too). Where the engine
    truncates hard enough to keep one token at many steps, it renormalises at the others
    too, ``a = b + log Z`` with a small kept mass ``Z`` where ``b`` is low: the slope is
    1.3 to 2.3 (top-k 2, top-k 1 with tied bf16 logits, top-p 0.3 to 0.5). An engine that
    records 0.0 everywhere (greedy) leaves no other token: :func:`rollout_all_zero`.

    And no token's ``b - a`` may exceed :data:`ONE_TOKEN_NATS` (``min_log_ratio``, kept by
    the ``log_space`` and ``importance_ratio`` groups): a truncating engine keeps at least
    its top token, while a pad scored by the trainer sits far lower. Zero-filled padding
    whose trainer's log-probs lie between -8 and -1, behind an engine that keeps one token
    often enough for the slope to pass, reads as truncation; the pad ids
    (``pad_token_id``) still name that padding.
    """
    if window["zero_rollout_log_prob"] <= 0 or -window["min_log_ratio"] > ONE_TOKEN_NATS:
        return False
    if rollout_all_zero(window):
        return True
    squares = window["sum_rollout_log_prob_sq"]
    return squares > 0 and window["sum_actor_x_rollout"] >= TRUNCATION_SLOPE * squares


def _truncated(window: Window, metrics: Mapping[str, float]) -> Diagnosis | None:
    k1 = metrics.get("rollout_actor_kl_k1", math.nan)
    k3 = metrics.get("rollout_actor_kl_k3", math.nan)
    if rollout_all_zero(window) and (window["zero_rollout_log_prob"] > 0 or k1 > TRUNCATION_K1):
        return _greedy(window, k1)
    if window.n < MIN_TOKENS or not k1 > TRUNCATION_K1:
        return None
    deficit = k1 - k3  # 1 - mean(rho), in every window
    light = k1 > TRUNCATION_FACTOR * k3 + 3.0 * _k1_error(window, k3)
    error = _ratio_error(window, k3)
    strong = k1 > TRUNCATION_STRONG_K1 and deficit > max(
        TRUNCATION_SHARE * k1, TRUNCATION_ERRORS * error
    )
    if not (light or strong):
        return None
    zeros = window["zero_rollout_log_prob"]
    single = (
        f" The {zeros:.0f} masked-in tokens whose rollout log-prob is exactly 0.0 while the "
        "trainer's is below -1 are steps where the engine kept one token (the trainer's "
        f"log-probs are {window['sum_actor_x_rollout'] / window['sum_rollout_log_prob_sq']:.3g} "
        "times the rollout's elsewhere, where padding leaves them equal), not padding."
        if kept_one_token(window)
        else ""
    )
    return Diagnosis(
        "truncated",
        f"The importance ratios average {1.0 - deficit:.4g}, clearly below 1 (KL k1 = "
        f"{k1:.4g}, k3 = {k3:.4g}): the rollout log-probs look renormalised after top-k / "
        "top-p truncated sampling in the engine (greedy decoding is top-k 1), which keeps "
        f"about that share of the trainer's probability mass and biases k3 low.{single} Trust "
        "k1 here, or have the engine return log-probs of the full distribution.",
    )


def _greedy(window: Window, k1: float) -> Diagnosis:
    """Every rollout log-prob 0.0: the renormalised distribution of a greedy engine."""
    zeros = window["zero_rollout_log_prob"]
    if zeros <= 0:
        padding = ""
    elif kept_one_token(window):
        padding = (
            f"; {zeros:.0f} of them where the trainer's is below -1: the greedy tokens of "
            "uncertain steps, not padding"
        )
    else:
        padding = (
            "; the trainer scores some of them below -8 nats, which no greedy step gives: "
            "padding too, named apart"
        )
    return Diagnosis(
        "truncated",
        f"Every rollout log-prob is exactly 0.0 (probability 1) while the trainer's are not "
        f"(KL k1 = {k1:.4g}, the trainer's mean negative log-prob{padding}): truncated "
        "sampling to one token. The engine decodes greedily (top-k 1, or temperature 0) and "
        "records the log-prob of the renormalised one-token distribution, or it returns no "
        "log-probs and zeros stand in for them. The importance ratios are then the trainer's "
        "probabilities of the greedy tokens. Have the engine return log-probs of the full "
        "distribution (and sample from it for on-policy RL).",
    )


def _one_sided(window: Window, metrics: Mapping[str, float]) -> Diagnosis | None:
    """k1 clearly below 0, which no mismatch gives.

    ``E_rollout[-r]`` is a KL, never negative, when the rollout log-probs are those of the
    distribution the tokens were sampled from.
    """
    k1 = metrics.get("rollout_actor_kl_k1", math.nan)
    k3 = metrics.get("rollout_actor_kl_k3", math.nan)
    if window.n < MIN_TOKENS or not k1 < ONE_SIDED_K1:
        return None
    if not k1 < -ONE_SIDED_ERRORS * _k1_error(window, k3):
        return None
    return Diagnosis(
        "one_sided",
        f"KL k1 = {k1:.4g} is clearly below 0 (k3 = {k3:.4g}): the rollout log-probs are not "
        "those of the distribution that sampled the tokens. The engine samples with a "
        "temperature or top-p/top-k but records its log-probs before them (raw log-probs), "
        "or the trainer applies a temperature the engine's log-probs lack, or the top-p/top-k "
        "the engine sampled with but did not record. Record the processed log-probs in the "
        "engine, or apply the same temperature (and no truncation) to the trainer's logits.",
    )
