"""The native kernel's row quantities, and their torch reduction the kernel is tested with.

Every token-level quantity of the catalog (:mod:`.tokens`) is reduced along the rows
first: the native CPU kernel computes the ``[B]`` row sums of :data:`ROW_FIELDS` by hand
and finishes them into a packed state of :data:`~lightning_rollout_debug.metrics.layout.STATE`.
:func:`row_sums` is the same reduction in torch, which the kernel's tests compare with.
:data:`ROWS_OF_GROUP` says which row quantities each metric group needs, and the
kernel's columns are checked against :data:`ROW_FIELDS` by name.
"""

from __future__ import annotations

import math
from collections.abc import Collection

import torch
from torch import Tensor

from lightning_rollout_debug.metrics.layout import LAG_MOMENTS, STATE
from lightning_rollout_debug.metrics.tokens import (
    PADDING_ACTOR_LOG_PROB,
    RATIO_MAX,
    RATIO_MIN,
    counting_tokens,
    exp,
    exp_tail,
    kl_k3_tokens,
    masked_actor,
    next_column,
    prob_diff,
    zero_run,
)

_COMOMENTS = tuple(
    tuple(name.split("*"))
    for block in STATE.blocks
    if block.rule == "comoment"
    for name in block.names
)


HEALTH_SUMS = (
    "zero_rollout_log_prob",
    "zero_rollout_log_prob_run",
    "masked_actor_log_prob",
    "neighbour_pairs",
    "sum_actor_log_prob",
    "sum_rollout_log_prob",
    *LAG_MOMENTS,
)
"""The health group's row sums, summed into the state slots of the same names."""

ROW_FIELDS: tuple[str, ...] = (
    "count",
    "nonfinite",
    "max_actor_log_prob",
    "max_rollout_log_prob",
    "sum_actor_log_prob",
    "sum_rollout_log_prob",
    "prob_actor",
    "prob_rollout",
    "prob_diff",
    "prob_actor*prob_actor",
    "prob_rollout*prob_rollout",
    "prob_actor*prob_rollout",
    "prob_diff*prob_diff",
    "max_prob_diff",
    "max_log_ratio",
    "max_neg_log_ratio",
    "log_diff",
    "log_diff*log_diff",
    "log_ratio",
    "kl_k3",
    "mult_error_m1",
    "ratio_m1",
    "ratio_sq_m1",
    "ratio",
    "ratio_sq",
    "ratio_high",
    "ratio_low",
    "zero_rollout_log_prob",
    "zero_rollout_log_prob_run",
    "masked_actor_log_prob",
    "neighbour_pairs",
    *LAG_MOMENTS,
)
"""The per-row reductions of an update, in the column order of the native CPU kernel."""


TOKEN_ID_SLOTS = ("id_updates", "id_rows", "id_diff", "id_diff_rows")
"""The state slots of the token-id comparison (:func:`token_id_slots`)."""
PAD_SLOTS = ("pad_updates", "pad_in_mask")
"""The state slots of the padding check (:func:`pad_slots`)."""
CHECK_SLOTS = (*TOKEN_ID_SLOTS, *PAD_SLOTS)
"""The slots torch writes on every path, the kernel included: those of the two checks
of token ids, which read ids rather than log-probs."""

_ALWAYS = ("count", "nonfinite", "max_actor_log_prob", "max_rollout_log_prob")
_PROBS = ("prob_actor", "prob_rollout", "prob_diff")
_RATIO_EXTREMES = ("max_log_ratio", "max_neg_log_ratio")
ROWS_OF_GROUP: dict[str, tuple[str, ...]] = {
    "seed": (
        *_PROBS,
        "prob_actor*prob_actor",
        "prob_rollout*prob_rollout",
        "prob_actor*prob_rollout",
        "prob_diff*prob_diff",
        "max_prob_diff",
    ),
    "log_space": (*_RATIO_EXTREMES, "log_diff", "log_diff*log_diff"),
    "kl": ("log_ratio", "kl_k3", "mult_error_m1"),
    "importance_ratio": (
        "log_ratio",
        *_RATIO_EXTREMES,
        "ratio_m1",
        "ratio_sq_m1",
        "ratio",
        "ratio_sq",
        "ratio_high",
        "ratio_low",
    ),
    # The sums of the inputs (the perplexities) and of r (each sequence's mean log-ratio).
    "sequence": ("sum_actor_log_prob", "sum_rollout_log_prob", "log_ratio"),
    # Rollout log-probs of exactly 0, and the log-probs' moments at neighbouring positions.
    "health": HEALTH_SUMS,
    "token_ids": (),
    # From the profile of the extras (lightning_rollout_debug.metrics.profile), not from rows.
    "quantiles": (),
}
"""The row quantities (of :data:`ROW_FIELDS`) each metric group needs, besides the token
counts and the largest log-probs that every update keeps."""

SEGMENT_GROUPS = ("seed", "log_space", "kl", "importance_ratio")
"""The groups whose metrics are token-level: those a segment has (:mod:`.segments`), the
slots of which the kernel's segment states write."""

_LOG_RATIO_EXTREMES = ("log_diff", *_RATIO_EXTREMES)
_PROBS_PEARSON = (*_PROBS[:2], *ROWS_OF_GROUP["seed"][3:6])
ROWS_OF_SEGMENT_METRIC: dict[str, tuple[str, ...]] = {
    "rollout_tokens": (),
    "rollout_nonfinite_tokens": (),
    "rollout_probs_diff_valid": (),
    "rollout_probs_diff_max": ("max_prob_diff",),
    "rollout_probs_diff_mean": ("prob_diff",),
    "rollout_probs_diff_std": ("prob_diff", "prob_diff*prob_diff"),
    "rollout_actor_probs_pearson_corr": _PROBS_PEARSON,
    "rollout_actor_probs_one_minus_pearson_corr": _PROBS_PEARSON,
    "rollout_log_probs_diff_max": _LOG_RATIO_EXTREMES,
    "rollout_log_probs_diff_mean": ("log_diff",),
    "rollout_log_probs_diff_std": ("log_diff", "log_diff*log_diff"),
    "rollout_actor_kl_k1": ("log_ratio",),
    "rollout_actor_kl_k3": ("kl_k3",),
    "rollout_actor_mult_prob_error": ("mult_error_m1",),
    "rollout_actor_mult_prob_error_minus_one": ("mult_error_m1",),
    "rollout_is_ratio_mean": ("ratio_m1",),
    "rollout_is_ratio_mean_minus_one": ("ratio_m1",),
    "rollout_is_ratio_min": ("ratio_high", *_RATIO_EXTREMES),
    "rollout_is_ratio_max": ("ratio_high", *_RATIO_EXTREMES),
    "rollout_is_ratio_frac_high": ("ratio_high", "ratio_low"),
    "rollout_is_ratio_frac_low": ("ratio_high", "ratio_low"),
    "rollout_is_chi2": ("ratio_sq_m1",),
    "rollout_is_ess": ("ratio", "ratio_sq"),
    "rollout_is_one_minus_ess": ("ratio", "ratio_sq", "ratio_m1", "ratio_sq_m1"),
}
"""The row quantities each metric a segment can be logged with reads, besides the token
counts and the largest log-probs: a segment's rows are its metrics' alone, and a kernel
pass reads a row's tokens again for them only (``row_sums.cpp``: a row of short runs, its
tokens put in their segments' buckets)."""


def segment_rows_of(metrics: Collection[str]) -> frozenset[str]:
    """The row quantities of a segment logged with ``metrics``.

    Example:
        >>> sorted(segment_rows_of(["rollout_actor_kl_k3"]))  # doctest: +NORMALIZE_WHITESPACE
        ['count', 'kl_k3', 'max_actor_log_prob', 'max_rollout_log_prob', 'nonfinite']
    """
    return frozenset(set(_ALWAYS).union(*(ROWS_OF_SEGMENT_METRIC[name] for name in metrics)))


def rows_for(groups: frozenset[str]) -> frozenset[str]:
    """The row quantities an update of ``groups`` computes."""
    return frozenset(set(_ALWAYS).union(*(ROWS_OF_GROUP[group] for group in groups)))


_RATIO_ROWS = frozenset(
    {"kl_k3", "mult_error_m1", "ratio_m1", "ratio_sq_m1", "ratio", "ratio_sq", "ratio_high"}
)


def row_sums(
    rollout_log_probs: Tensor,
    old_log_probs: Tensor,
    mask: Tensor,
    groups: frozenset[str],
    is_threshold: float,
) -> dict[str, Tensor]:
    """The ``[B]`` row reductions of :data:`ROW_FIELDS` that ``groups`` need (:func:`rows_for`).

    Element-wise work runs in float32 (float64 for float64 inputs); products and every
    sum are float64, so the centred moments that follow from these power sums round
    below ``1e-16 * (mean / std)^2`` relative. Counts are integers, maxima keep the
    element dtype (``-inf`` for a row without counting tokens).
    """
    f64 = torch.float64
    needed = rows_for(groups)
    a, b, r, masked, finite = counting_tokens(rollout_log_probs, old_log_probs, mask)
    counting = masked & finite

    def row_sum(value: Tensor) -> Tensor:
        return value.to(f64).sum(1)

    def row_count_of(flags: Tensor) -> Tensor:  # integer lanes are cheaper than float64 ones
        return flags.sum(1, dtype=torch.int32)

    def row_max(value: Tensor) -> Tensor:
        return torch.where(counting, value, -math.inf).amax(1)

    rows = {
        "count": row_count_of(counting),
        "nonfinite": row_count_of(masked & ~finite),
        # The largest log-probs: above 0 they are no log-probabilities (found without a sync).
        "max_actor_log_prob": row_max(a),
        "max_rollout_log_prob": row_max(b),
    }
    if needed & {"sum_actor_log_prob", "log_ratio"}:
        wide_a, wide_b = a.to(f64), b.to(f64)
    if "sum_actor_log_prob" in needed:
        rows["sum_actor_log_prob"], rows["sum_rollout_log_prob"] = wide_a.sum(1), wide_b.sum(1)
    if "neighbour_pairs" in needed:
        rows.update(_neighbour_sums(a, b, counting))
        rows["masked_actor_log_prob"] = masked_actor(rollout_log_probs, old_log_probs, counting)
    values: dict[str, Tensor] = {}
    if needed & {*_PROBS, "max_prob_diff", *_RATIO_ROWS}:
        prob_rollout = exp(b)
        prob_actor = exp(a)
        diff = prob_diff(prob_actor, prob_rollout, r)
        values.update(prob_actor=prob_actor, prob_rollout=prob_rollout, prob_diff=diff)
    if "max_prob_diff" in needed:
        rows["max_prob_diff"] = row_max(diff)
    if "max_log_ratio" in needed:
        # The extremes of abs(r) and of clamp(r) all follow from those of r (clamp is
        # monotone): two running maxima instead of four.
        rows["max_log_ratio"], rows["max_neg_log_ratio"] = row_max(r), row_max(-r)
    if "log_diff" in needed:
        values["log_diff"] = r.abs()
    # Masked before widening: float64 lanes are the expensive ones.
    wide = {
        name: torch.where(counting, value, 0.0).to(f64)
        for name, value in values.items()
        if name in needed
    }
    for name, value in wide.items():
        rows[name] = value.sum(1)
    for left, right in _COMOMENTS:
        if f"{left}*{right}" in needed:
            rows[f"{left}*{right}"] = (wide[left] * wide[right]).sum(1)
    if "log_ratio" in needed:
        # The float64 differences of the float32 values, exact: a float32 r rounds (by up
        # to 1e-6 at |r| = 20), and a difference of the two sides' sums cancels.
        rows["log_ratio"] = (wide_a - wide_b).sum(1)
    if needed & _RATIO_ROWS:
        # No exponential of its own: rho = pa / pb (clamped like r), and near r = 0 the
        # series of e^r - 1 - r (shared with prob_diff) keeps the digits rho - 1 would lose.
        near_zero = r.abs() < 0.5
        curvature = r * r * exp_tail(r)  # e^r - 1 - r
        far = (prob_actor / prob_rollout).clamp(RATIO_MIN, RATIO_MAX)
        ratio = torch.where(near_zero, 1.0 + (r + curvature), far)
        ratio_m1 = torch.where(near_zero, r + curvature, far - 1.0)
    if "kl_k3" in needed:
        rows["kl_k3"] = row_sum(kl_k3_tokens(prob_actor, prob_rollout, r))
        # e^|r| - 1 = |pa - pb| / min(pa, pb): no cancellation, and no clamp (|r| > 20 only
        # comes from positive "log-probs").
        rows["mult_error_m1"] = row_sum(diff / torch.minimum(prob_actor, prob_rollout))
    if "ratio_m1" in needed:
        rows["ratio_m1"] = row_sum(ratio_m1)
        rows["ratio_sq_m1"] = row_sum(ratio_m1 * (ratio_m1 + 2.0))  # rho^2 - 1
        # Plain sums for the ESS: n + sum(rho - 1) loses every digit when rho << 1.
        rows["ratio"] = row_sum(torch.where(counting, ratio, 0.0))
        rows["ratio_sq"] = row_sum(torch.where(counting, ratio * ratio, 0.0))
        rows["ratio_high"] = row_count_of(counting & (ratio_m1 > is_threshold - 1.0))
        rows["ratio_low"] = row_count_of(counting & (ratio_m1 < 1.0 / is_threshold - 1.0))
    return rows


def token_id_slots(
    mask: Tensor, rollout_token_ids: Tensor | None, trainer_token_ids: Tensor | None
) -> dict[str, Tensor]:
    """The slots of the token-id comparison of a block (none without both ids)."""
    if rollout_token_ids is None or trainer_token_ids is None:
        return {}
    f64 = torch.float64
    masked = mask != 0
    differs = masked & (rollout_token_ids != trainer_token_ids)
    values = (
        torch.ones((), dtype=f64, device=mask.device),
        masked.any(1).sum(dtype=f64),
        differs.sum(1, dtype=torch.int32).to(f64).sum(),
        differs.any(1).sum(dtype=f64),
    )
    return dict(zip(TOKEN_ID_SLOTS, values, strict=True))


def check_slots(
    mask: Tensor,
    rollout_token_ids: Tensor | None = None,
    trainer_token_ids: Tensor | None = None,
    pad_ids: Tensor | None = None,
    pad_token_id: int | None = None,
) -> dict[str, Tensor]:
    """The slots of a block's checks of token ids (:data:`CHECK_SLOTS`) it has the ids for.

    The comparison of the rollout's and the trainer's ids (:func:`token_id_slots`, with
    both), and the pad count (:func:`pad_slots`, with ``pad_ids`` and ``pad_token_id``).
    """
    slots = token_id_slots(mask, rollout_token_ids, trainer_token_ids)
    if pad_ids is not None and pad_token_id is not None:
        slots |= pad_slots(mask, pad_ids, pad_token_id)
    return slots


def pad_slots(mask: Tensor, token_ids: Tensor, pad_token_id: int) -> dict[str, Tensor]:
    """The slots of the padding check of a block: the pad ids that pad a row's response.

    Padding is the run of pad ids that ends a row's masked tokens (no masked id of another
    token after it), the first of that run excepted: it is taken for an EOS, which counts,
    as many tokenizers (Llama, Qwen, GPT-2) end a response with the id they pad with. A pad
    id with a masked token of another id after it is no padding: the model sampled it as
    an ordinary token, or it ends a sequence or a turn of a packed or multi-turn row.
    Integer counts, no host synchronisation.

    Example:
        >>> ids = torch.tensor([[5, 0, 0, 5, 0, 0, 0]])  # 0 sampled mid-row; 0 0 0 ends it
        >>> pad_slots(torch.ones(1, 7), ids, 0)["pad_in_mask"].item()
        2.0
    """
    f64 = torch.float64
    is_pad = token_ids == pad_token_id
    masked = mask != 0
    pads = masked & is_pad
    counted = (masked ^ pads).cumsum(1)  # the masked tokens of other ids so far
    ending = pads & (counted == counted[:, -1:])  # none of them after it
    padding = ending[:, 1:] & is_pad[:, :-1]
    values = (torch.ones((), dtype=f64, device=mask.device), padding.sum(dtype=f64))
    return dict(zip(PAD_SLOTS, values, strict=True))


def _neighbour_sums(a: Tensor, b: Tensor, counting: Tensor) -> dict[str, Tensor]:
    """The row sums of the health group from ``a`` and ``b`` (zero where not counting).

    Each pair ``(t, t + 1)`` is summed at column ``t``, from the next column's values
    shifted left (zero past the end): every sum runs over the row's ``T`` columns, so a
    compiler reduces them in the same loop as the others.
    """
    f64 = torch.float64
    wide_a, wide_b = a.to(f64), b.to(f64)
    next_a, next_b = next_column(wide_a), next_column(wide_b)
    pair = counting & next_column(counting)
    zero = counting & (b == 0.0) & (a < PADDING_ACTOR_LOG_PROB)
    sides = {
        "plus_actor": wide_a,  # the pairs (a_t, b_(t+1))
        "plus_rollout": next_b,
        "minus_actor": next_a,  # the pairs (a_(t+1), b_t)
        "minus_rollout": wide_b,
    }
    sums = {
        "zero_rollout_log_prob": zero.sum(1, dtype=torch.int32),
        "zero_rollout_log_prob_run": zero_run(zero, counting),
        "neighbour_pairs": pair.sum(1, dtype=torch.int32),
        "sum_actor_log_prob_sq": (wide_a * wide_a).sum(1),
        "sum_rollout_log_prob_sq": (wide_b * wide_b).sum(1),
        "sum_actor_x_rollout": (wide_a * wide_b).sum(1),
        "sum_actor_x_next_rollout": (wide_a * next_b).sum(1),
        "sum_next_actor_x_rollout": (next_a * wide_b).sum(1),
    }
    for name, side in sides.items():
        kept = torch.where(pair, side, 0.0)
        sums[name], sums[f"{name}_sq"] = kept.sum(1), (kept * kept).sum(1)
    return sums


def paired_moments(x: Tensor, y: Tensor, keep: Tensor) -> Tensor:
    """``[n, mean_x, mean_y, M_xx, M_yy, M_xy]`` of the pairs where ``keep`` holds, in float64.

    The co-moments are sums of products of deviations from the means, taken in a second
    pass: a mean far larger than the spread costs no digits. No host synchronisation.

    Example:
        >>> x = torch.tensor([1e8 + 1.0, 1e8 + 2.0, 1e8 + 3.0], dtype=torch.float64)
        >>> paired_moments(x, -x, torch.ones(3, dtype=torch.bool))[3:].tolist()
        [2.0, 2.0, -2.0]
    """
    f64 = torch.float64
    count = keep.sum(dtype=f64)
    scale = 1.0 / count.clamp(min=1.0)
    means, deviations = [], []
    for values in (x, y):
        values = torch.where(keep, values.to(f64), 0.0)
        mean = values.sum() * scale
        means.append(mean)
        deviations.append(torch.where(keep, values - mean, 0.0))
    dx, dy = deviations
    return torch.stack([count, *means, (dx * dx).sum(), (dy * dy).sum(), (dx * dy).sum()])
