"""The rules that read how the engine sampled: truncated sampling, and one-sided processing.

Both compare the window's KL estimates. When the rollout log-probs are those of the
distribution the tokens were sampled from, k1 (``mean(-r)``) estimates ``KL(rollout ||
actor)`` and is not negative in expectation, and ``mean(rho) = 1 - (k1 - k3)`` is 1 in
expectation where that distribution holds every token the trainer's does. An engine that
truncates (top-k / top-p) and records the renormalised log-probs keeps ``mean(rho)``
below 1 (:func:`truncated`); log-probs of another distribution than the sampled one drive
k1 below 0 (:func:`one_sided`). These are symptoms
(:data:`~lightning_rollout_debug.checks.findings.SYMPTOMS`): a cause of the same window
explains them.

Example:
    >>> import torch
    >>> from lightning_rollout_debug import MismatchStats
    >>> from lightning_rollout_debug.metrics.formulas import Window
    >>> old = torch.log(0.9 * torch.rand(8, 64, generator=torch.Generator().manual_seed(0)))
    >>> stats = MismatchStats()  # the engine renormalised over 95% of the mass: + 0.05 nats
    >>> stats.update(old + 0.05, old, torch.ones(8, 64))
    >>> truncated(Window(stats.state.tolist()), stats.compute()).kind
    'truncated'
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from lightning_rollout_debug.checks.findings import Diagnosis
from lightning_rollout_debug.metrics.formulas import Window

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
"""Where :func:`truncated` holds and the window has rollout log-probs of exactly 0 with a
trainer's below -1: the least-squares slope ``sum(a b) / sum(b^2)`` of the trainer's
log-probs on the rollout's at least this means the zeros are steps where the engine kept
one token, not padding (see :func:`kept_one_token`)."""
ONE_TOKEN_NATS = 8.0
"""The most ``b - a`` (``-log`` of the trainer's mass in what the engine kept) a truncating
engine's zeros are read with: it keeps at least its most likely token, and a top token
below ``e^-8`` needs thousands of near-equal candidates; padding's trainer log-probs sit
far lower (-7 to -28 in ``benchmarks/mistakes.py``, at the -20 floor mostly)."""

ONE_SIDED_K1 = -0.01
"""k1 below this, and below 0 by :data:`ONE_SIDED_ERRORS` standard errors, means the
rollout log-probs are not those of the distribution that sampled the tokens."""
ONE_SIDED_ERRORS = 4.0


def k1_error(window: Window, k3: float) -> float:
    """The standard error of k1, ``sqrt(mean(r^2) / n)``.

    ``sum(r^2)`` comes from the health group's sums of ``a^2``, ``b^2`` and ``a b``; without
    them ``mean(r^2)`` is taken as ``2 k3``, its value for small ``r``.
    """
    n = window.n
    squares = window["sum_actor_log_prob_sq"] + window["sum_rollout_log_prob_sq"]
    mean_square = (squares - 2.0 * window["sum_actor_x_rollout"]) / n if squares > 0 else 2 * k3
    return math.sqrt(max(mean_square, 0.0) / n)


def _ratio_error(window: Window, k3: float) -> float:
    """The standard error of ``mean(rho)``, ``sqrt(var(rho) / n)``.

    From the importance-ratio group's sums; without them as that of k1 (the same for
    small ``r``).
    """
    n = window.n
    squares = window["ratio_sq_m1"] - 2.0 * window["ratio_m1"]  # sum (rho - 1)^2
    if squares <= 0:
        return k1_error(window, k3)
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

    Read only where :func:`truncated` holds. Padding and the steps an engine keeps one
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


def truncated(window: Window, metrics: Mapping[str, float]) -> Diagnosis | None:
    """Truncated sampling: ``mean(rho) = 1 - (k1 - k3)`` clearly below 1, or a greedy engine.

    ``metrics``: the window's un-prefixed metrics (k1, k3).
    """
    k1 = metrics.get("rollout_actor_kl_k1", math.nan)
    k3 = metrics.get("rollout_actor_kl_k3", math.nan)
    if rollout_all_zero(window) and (window["zero_rollout_log_prob"] > 0 or k1 > TRUNCATION_K1):
        return _greedy(window, k1)
    if window.n < MIN_TOKENS or not k1 > TRUNCATION_K1:
        return None
    deficit = k1 - k3  # 1 - mean(rho), in every window
    light = k1 > TRUNCATION_FACTOR * k3 + 3.0 * k1_error(window, k3)
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
        f"about that share of the trainer's probability mass.{single} The tokens come from "
        "the truncated distribution, not the trainer's: k1 measures that gap, k3 misses the "
        "mass cut away. Sample without truncation (top_k=0, top_p=1.0, min_p=0 in the "
        "engine), or keep it and correct with the importance ratio exp(old_log_probs - "
        "rollout_log_probs) of these renormalised log-probs: it reweights only the tokens "
        "the engine kept, so what is estimated over them (the loss, a k1 KL penalty) stays "
        f"biased by the mass cut away ({deficit:.2g} of the trainer's here). Log-probs of "
        "the full distribution would hide the truncation (every metric looks healthy) "
        "while the sampling stays truncated and off-policy.",
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
        "probabilities of the greedy tokens, and no ratio makes them on-policy. Sample from "
        "the full distribution (top_k=0, top_p=1.0, temperature 1) and record the log-probs "
        "of the sampled tokens; log-probs of the full distribution recorded beside greedy "
        "decoding would hide it (every metric looks healthy) while training stays "
        "off-policy.",
    )


def one_sided(window: Window, metrics: Mapping[str, float]) -> Diagnosis | None:
    """One-sided sampling processing: k1 clearly below 0, which no mismatch gives.

    ``E_rollout[-r]`` is a KL, never negative, when the rollout log-probs are those of the
    distribution the tokens were sampled from.
    """
    k1 = metrics.get("rollout_actor_kl_k1", math.nan)
    k3 = metrics.get("rollout_actor_kl_k3", math.nan)
    if window.n < MIN_TOKENS or not k1 < ONE_SIDED_K1:
        return None
    if not k1 < -ONE_SIDED_ERRORS * k1_error(window, k3):
        return None
    return Diagnosis(
        "one_sided",
        f"KL k1 = {k1:.4g} is clearly below 0 (k3 = {k3:.4g}): the rollout log-probs are not "
        "those of the distribution that sampled the tokens. The engine samples with a "
        "temperature or top-p/top-k but records its log-probs before them (raw log-probs), "
        "or the trainer applies a temperature the engine's log-probs lack, or the top-p/top-k "
        "the engine sampled with but did not record; or the mask holds tokens the engine did "
        "not sample (padding after EOS, tool or observation tokens that both sides score: "
        "pass pad_token_id to have the pad ids counted). Record the processed log-probs in "
        "the engine, or apply the same temperature (and no truncation) to the trainer's "
        "logits.",
    )
