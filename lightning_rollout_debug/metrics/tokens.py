"""Per-token arithmetic: the catalog's rules for which tokens count, and each token's values.

Every backend reads a token the same way: log-probs floored at :data:`LOG_PROB_FLOOR`,
a token counting where the mask is non-zero and neither log-prob is NaN or +inf
(:func:`counting_tokens`), ``|pa - pb|`` and ``k3`` without cancellation near ``r = 0``
(:func:`prob_diff`, :func:`kl_k3_tokens`), and the padding rules of the health group
(:func:`zero_run`, :func:`masked_actor`). :mod:`.rows` reduces these along the rows, and
the native CPU kernel does the same arithmetic by hand.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

LOG_PROB_FLOOR = -20.0
"""Log-probabilities are floored here first, so ``-inf`` counts as -20 nats."""

LOG_RATIO_CLAMP = 20.0
"""The log importance ratio is clamped to ``[-20, 20]`` before exponentiation."""

RATIO_MIN, RATIO_MAX = math.exp(-LOG_RATIO_CLAMP), math.exp(LOG_RATIO_CLAMP)
"""The importance ratio's range, ``e^-20`` to ``e^20``: that of the clamped log-ratio."""

PADDING_ACTOR_LOG_PROB = -1.0
"""A rollout log-prob of exactly 0 counts as padding where the trainer's is below this:
no rounding turns a probability under ``e^-1`` into 1."""


def counting_tokens(
    rollout_log_probs: Tensor, old_log_probs: Tensor, mask: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The handling rules of the catalog, element-wise: ``(a, b, r, masked, finite)``.

    Log-probs are floored at :data:`LOG_PROB_FLOOR` in float32 (float64 for float64
    inputs); a token counts where ``masked & finite`` (mask non-zero, neither log-prob
    NaN or +inf). ``a`` (old), ``b`` (rollout) and ``r = a - b`` are zero where a token
    does not count, so plain sums skip those tokens.
    """
    f64 = torch.float64
    dtype = f64 if f64 in (old_log_probs.dtype, rollout_log_probs.dtype) else torch.float32
    a = old_log_probs.to(dtype).clamp(min=LOG_PROB_FLOOR)
    b = rollout_log_probs.to(dtype).clamp(min=LOG_PROB_FLOOR)
    masked = mask != 0
    finite = (a < math.inf) & (b < math.inf)  # floored: neither NaN nor +inf
    counting = masked & finite
    a = torch.where(counting, a, 0.0)
    b = torch.where(counting, b, 0.0)
    return a, b, a - b, masked, finite


def prob_diff(prob_actor: Tensor, prob_rollout: Tensor, r: Tensor) -> Tensor:
    """``abs(pa - pb)`` without losing digits, from ``pa = exp(a)``, ``pb = exp(b)``, ``r``.

    ``pa - pb = pb * expm1(r)``, with the series of ``expm1``, for ``|r| < 1/2``: no
    cancellation when the two are close. Farther apart the subtraction loses at most a
    factor 5 of rounding, whereas the rounding of ``r`` (up to 1e-6 at ``|r| = 20``) would
    cost digits.
    """
    close = r.abs() < 0.5
    return torch.where(close, prob_rollout * _expm1_near_zero(r), prob_actor - prob_rollout).abs()


def kl_k3_tokens(prob_actor: Tensor, prob_rollout: Tensor, r: Tensor) -> Tensor:
    """Each token's ``k3 = rho - 1 - r``, from ``pa``, ``pb`` and ``r`` as in :func:`row_sums`.

    Near ``r = 0`` the series of ``e^r - 1 - r``; farther out ``rho = pa / pb`` clamped
    like ``r``. No cancellation either way.
    """
    near_zero = r.abs() < 0.5
    far = (prob_actor / prob_rollout).clamp(RATIO_MIN, RATIO_MAX)
    return torch.where(near_zero, r * r * exp_tail(r), (far - 1.0) - r)


def next_column(x: Tensor) -> Tensor:
    """Each column's right neighbour: ``x[:, t + 1]``, and zero (False) after the last."""
    return torch.nn.functional.pad(x[:, 1:], (0, 1)) if x.shape[1] else x


def previous_column(x: Tensor) -> Tensor:
    """Each column's left neighbour: ``x[:, t - 1]``, and zero (False) before the first."""
    return torch.nn.functional.pad(x[:, :-1], (1, 0)) if x.shape[1] else x


def masked_actor(rollout_log_probs: Tensor, old_log_probs: Tensor, counting: Tensor) -> Tensor:
    """Each row's counting tokens whose trainer's log-prob is ``-inf`` and rollout's not.

    No model gives a sampled token probability 0 unless its logits are masked; a rollout
    log-prob of 0 (a dummy, as for padding) does not count.

    Example:
        >>> inf = float("inf")
        >>> old = torch.tensor([[-inf, -inf, -inf, -1.0]])
        >>> rollout = torch.tensor([[-2.0, 0.0, -inf, -1.0]])
        >>> masked_actor(rollout, old, torch.ones(1, 4, dtype=torch.bool)).tolist()
        [1]
    """
    b = rollout_log_probs
    flags = counting & (old_log_probs == -math.inf) & (b > -math.inf) & (b != 0.0)
    return flags.sum(1, dtype=torch.int32)


def zero_run(zero: Tensor, counting: Tensor) -> Tensor:
    """Each row's zeros where padding puts them: right after another, or last in the row.

    ``zero`` flags the rollout log-probs of 0 that :data:`PADDING_ACTOR_LOG_PROB` admits.
    Padding fills a row from its end: each of its zeros but the first follows another,
    and the run ends the row, where even a single pad token (a mask one token too long)
    sits. A confident token the trainer disagrees with is a zero alone inside a row.

    Example:
        >>> zero = torch.tensor([[0, 1, 0, 1, 1], [0, 0, 0, 0, 1]], dtype=torch.bool)
        >>> zero_run(zero, torch.ones(2, 5, dtype=torch.bool)).tolist()
        [1, 1]
    """
    if zero.shape[1] == 0:
        return zero.sum(1, dtype=torch.int32)
    previous = previous_column(zero)
    count = (zero & previous).sum(1, dtype=torch.int32)
    # The last counting column t and whether a run of zeros starts there, as the largest
    # 2 t + lone(t): a reduction in the same loop as the count, no second pass.
    lone = zero & ~previous
    position = torch.arange(zero.shape[1], device=zero.device)
    last = torch.where(counting, 2 * position + lone.long(), -1).amax(1)
    return count + ((last >= 0) & (last % 2 == 1)).to(torch.int32)


def exp(x: Tensor) -> Tensor:
    """``e^x`` as ``2^(x log2 e)``, element-wise.

    The same function, but a compiler that stores every reused ``exp`` result in memory
    (inductor on CPUs) keeps this one in registers. Rounding ``x log2 e`` costs at most
    ``|x| * 6e-8`` relative in float32: 1.2e-6 at the log-prob floor, 6e-8 at ``x = -1``.
    """
    return torch.exp2(x * 1.4426950408889634)  # a literal: dynamo lifts global floats


def exp_tail(x: Tensor) -> Tensor:
    """``(e^x - 1 - x) / x^2 = sum_{n >= 2} x^(n-2) / n!`` for ``|x| < 1/2`` (Horner).

    Summed up to ``x^8 / 8!`` in float32 and ``x^14 / 14!`` in float64: for ``|x| < 1/2``
    the truncation is below the dtype's resolution (relative to ``e^x - 1``: 1.1e-8 and
    5e-17; to ``e^x - 1 - x``: 4.3e-8 and 1.9e-16). Compilers may lower ``expm1`` to
    ``exp(x) - 1``, which loses every digit for tiny ``x``; the series keeps them, and
    one evaluation serves ``expm1`` and ``e^x - 1 - x`` alike.
    """
    highest = 14 if x.dtype == torch.float64 else 8
    tail = torch.full_like(x, 1.0 / math.factorial(highest))
    for order in range(highest - 1, 1, -1):
        tail = tail * x + 1.0 / math.factorial(order)
    return tail


def _expm1_near_zero(x: Tensor) -> Tensor:
    """``e^x - 1`` for ``|x| < 1/2``, to a few ulp."""
    return x + x * x * exp_tail(x)
