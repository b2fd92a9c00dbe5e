"""Row reductions: one pass over a ``[B, T]`` block, then one packed state.

Every token-level quantity of the catalog (:mod:`.tokens`) is reduced along the rows first
(:func:`row_sums`: one pass over the block, which a compiler fuses into a single loop
and the native CPU kernel computes by hand), then the ``[B]`` row sums are combined into
a packed state of :data:`~lightning_rollout_debug.layout.STATE`
(:func:`state_from_rows`). :data:`ROWS_OF_GROUP` says which row quantities each metric
group needs; the torch code, the compiled code and the native kernel all follow it, and
the kernel's columns are checked against :data:`ROW_FIELDS` by name.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

from lightning_rollout_debug.layout import LAG_MOMENTS, STATE
from lightning_rollout_debug.tokens import (
    LOG_RATIO_CLAMP,
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
    # From the profile of the extras (lightning_rollout_debug.profile), not from rows.
    "quantiles": (),
}
"""The row quantities (of :data:`ROW_FIELDS`) each metric group needs, besides the token
counts and the largest log-probs that every update keeps."""


def rows_for(groups: frozenset[str]) -> frozenset[str]:
    """The row quantities an update of ``groups`` computes."""
    return frozenset(set(_ALWAYS).union(*(ROWS_OF_GROUP[group] for group in groups)))


def batch_state(
    rollout_log_probs: Tensor,
    old_log_probs: Tensor,
    mask: Tensor,
    rollout_token_ids: Tensor | None,
    trainer_token_ids: Tensor | None,
    *,
    groups: frozenset[str],
    is_threshold: float,
    seq_ratio_bounds: tuple[float, float],
) -> Tensor:
    """Packed state of one ``[B, T]`` block: masked arithmetic only, nothing leaves the device.

    Every token-level quantity is reduced along the rows first (one pass over the
    block that a compiler fuses into a single kernel), then the ``[B]`` row sums are
    combined.
    """
    rows = row_sums(rollout_log_probs, old_log_probs, mask, groups, is_threshold)
    return state_from_rows(
        rows, mask, rollout_token_ids, trainer_token_ids, groups, seq_ratio_bounds
    )


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


def over_rows(per_row: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Each ``[B]`` column of ``per_row`` reduced over the rows: summed, or its largest.

    The largest where its name starts with ``max_`` (or ``neg_``: negated values, whose
    largest is minus the smallest), the sum elsewhere. The columns are stacked and
    reduced both ways at once: compiled, one kernel reads the rows once, whatever the
    number of columns (each reduced on its own would be a kernel of its own).

    Example:
        >>> per_row = {"n": torch.tensor([1.0, 2.0]), "max_x": torch.tensor([3.0, -1.0])}
        >>> totals = over_rows(per_row)
        >>> {name: value.item() for name, value in totals.items()}
        {'n': 3.0, 'max_x': 3.0}
    """
    stacked = torch.stack([value.to(torch.float64) for value in per_row.values()])
    sums, maxima = stacked.sum(1).unbind(), stacked.amax(1).unbind()
    return {
        name: maxima[i] if name.startswith(("max_", "neg_")) else sums[i]
        for i, name in enumerate(per_row)
    }


def state_from_rows(
    rows: dict[str, Tensor],
    mask: Tensor,
    rollout_token_ids: Tensor | None,
    trainer_token_ids: Tensor | None,
    groups: frozenset[str],
    seq_ratio_bounds: tuple[float, float],
) -> Tensor:
    """Packed state of a block from its row reductions (and its token ids, if compared).

    Reads the rows :func:`rows_for` names for ``groups`` (``rows`` may hold more).
    """
    f64 = torch.float64
    needed = rows_for(groups)
    row_count = rows["count"].to(f64)
    per_row = {name: rows[name].to(f64) for name in ROW_FIELDS if name in needed}
    if "health" in groups or "sequence" in groups:
        per_row["sequences"] = (row_count > 0).to(f64)
    if "sequence" in groups:
        sides = (per_row[name] for name in ("sum_actor_log_prob", "sum_rollout_log_prob"))
        per_row.update(_sequence_rows(*sides, per_row["log_ratio"], row_count, seq_ratio_bounds))
    reduced = over_rows(per_row)

    def total(name: str) -> Tensor:
        return reduced[name]

    largest = total
    count = total("count")
    slots = {
        "count": count,
        "nonfinite": total("nonfinite"),
        "max_actor_log_prob": largest("max_actor_log_prob"),
        "max_rollout_log_prob": largest("max_rollout_log_prob"),
    }
    moments = [
        name for name in ("prob_actor", "prob_rollout", "prob_diff", "log_diff") if name in needed
    ]
    power = {name: total(name) for name in moments}
    cross = {
        (left, right): total(f"{left}*{right}")
        for left, right in _COMOMENTS
        if f"{left}*{right}" in needed
    }
    means, comoments = _centre(count, power, cross)
    slots.update(means)
    slots.update({f"{left}*{right}": value for (left, right), value in comoments.items()})
    if "max_prob_diff" in needed:
        slots["max_prob_diff"] = largest("max_prob_diff")
    if "max_log_ratio" in needed:
        # An empty block keeps +-inf.
        r_max, r_min = largest("max_log_ratio"), -largest("max_neg_log_ratio")
    if "log_diff" in needed:
        slots["max_log_diff"] = torch.maximum(r_max, -r_min)
    if {"kl", "importance_ratio"} & groups:
        slots["log_ratio"] = total("log_ratio")
    for name in ("kl_k3", "mult_error_m1", "ratio_m1", "ratio_sq_m1", "ratio", "ratio_sq"):
        if name in needed:
            slots[name] = total(name)
    if "ratio_high" in needed:
        slots["ratio_high"], slots["ratio_low"] = total("ratio_high"), total("ratio_low")
        slots["max_log_ratio"], slots["min_log_ratio"] = (
            torch.where(x.isinf(), x, x.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
            for x in (r_max, r_min)
        )
    if "health" in groups or "sequence" in groups:
        slots["sequences"] = total("sequences")
    if "health" in groups:
        slots.update({name: total(name) for name in HEALTH_SUMS})
    if "sequence" in groups:
        slots.update({name: total(name) for name in _SEQUENCE_SLOTS})
        slots["min_seq_log_ratio"] = -total("neg_min_seq_log_ratio")
    if "token_ids" in groups:
        slots.update(token_id_slots(mask, rollout_token_ids, trainer_token_ids))
    return STATE.pack(slots)


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


def pad_slots(mask: Tensor, token_ids: Tensor, pad_token_id: int) -> dict[str, Tensor]:
    """The slots of the padding check of a block: pad ids inside the mask.

    The first pad id of each run of them is taken for an EOS, which counts: many
    tokenizers (Llama, Qwen, GPT-2) end a response with the id they pad with, and packed
    or multi-turn rows end each sequence or turn with one. A pad id right after another
    one inside the mask is padding.
    """
    f64 = torch.float64
    is_pad = token_ids == pad_token_id
    padding = (mask[:, 1:] != 0) & is_pad[:, 1:] & is_pad[:, :-1]
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


def _centre(
    count: Tensor, power: dict[str, Tensor], cross: dict[tuple[str, str], Tensor]
) -> tuple[dict[str, Tensor], dict[tuple[str, str], Tensor]]:
    """Means and centred co-moments from float64 power sums: ``M_xy = S_xy - S_x S_y / n``."""
    scale = 1.0 / count.clamp(min=1.0)
    means = {name: total * scale for name, total in power.items()}
    comoments = {
        (left, right): (total - power[left] * power[right] * scale).clamp(
            min=0.0 if left == right else -math.inf
        )
        for (left, right), total in cross.items()
    }
    return means, comoments


_SEQUENCE_SLOTS = (
    "seq_ppl_actor",
    "seq_ppl_rollout",
    "seq_log_ratio",
    "seq_outside",
    "max_seq_abs_log_ratio",
    "max_seq_log_ratio",
)


def _sequence_rows(
    sum_a: Tensor,
    sum_b: Tensor,
    sum_r: Tensor,
    row_count: Tensor,
    bounds: tuple[float, float],
) -> dict[str, Tensor]:
    """Each row's terms of the sequence statistics, from its float64 sums of ``a``, ``b``, ``r``.

    Summed over the rows, but for those named ``max_`` (maxima) and
    ``neg_min_seq_log_ratio`` (the largest of ``-mean r``: minus the smallest).
    """
    has_tokens = row_count > 0
    per_row = row_count.clamp(min=1.0)
    mean_r = sum_r / per_row  # log of the geometric-mean ratio; zero for empty rows
    zero = torch.zeros((), dtype=mean_r.dtype, device=mean_r.device)
    geo = torch.exp(mean_r)
    outside = has_tokens & ((geo < bounds[0]) | (geo > bounds[1]))
    return {
        "seq_ppl_actor": torch.where(has_tokens, torch.exp(-sum_a / per_row), zero),
        "seq_ppl_rollout": torch.where(has_tokens, torch.exp(-sum_b / per_row), zero),
        "seq_log_ratio": mean_r,
        "seq_outside": outside.to(mean_r.dtype),
        "max_seq_abs_log_ratio": torch.where(has_tokens, mean_r.abs(), -math.inf),
        "max_seq_log_ratio": torch.where(has_tokens, mean_r, -math.inf),
        "neg_min_seq_log_ratio": torch.where(has_tokens, -mean_r, -math.inf),
    }


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
