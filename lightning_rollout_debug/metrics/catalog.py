"""The metric catalog: every metric declared once.

A :class:`Metric` names its group, its formula on a merged window (read on the host, a
:class:`~.formulas.Window`, whose readings and shared formulas are in :mod:`.formulas`),
its chart on the TensorBoard dashboard and, for some, a default alert range. Everything
else is derived from :data:`CATALOG`: :data:`GROUPS` and :data:`METRIC_NAMES` (what
the callback logs, in order), :data:`DASHBOARD` (the custom-scalars layout),
:data:`DEFAULT_ALERT_RANGES`, and the documentation test, which checks that
``docs/metrics.md`` defines every name.

Adding a metric that follows from the existing state is one entry here and one row in
``docs/metrics.md``; see ``docs/contributing.md``.

Example:
    >>> from lightning_rollout_debug.metrics.layout import identity_state
    >>> empty = metrics_from_state(identity_state().tolist())
    >>> empty["rollout_tokens"], empty["rollout_probs_diff_valid"]
    (0.0, 0.0)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from lightning_rollout_debug.metrics.formulas import (
    Window,
    alignment_lag,
    effective_sample_size,
    exp_or_inf,
    one_minus_ess,
    one_minus_pearson,
    pearson,
    stale_period,
)
from lightning_rollout_debug.metrics.profile import QUANTILE_BINS, QUANTILES, Profile
from lightning_rollout_debug.metrics.sawtooth import Series

Bound = float | None


@dataclass(frozen=True)
class Metric:
    """One metric: where it is logged, how it comes from the window, where it is charted.

    Args:
        name: the un-prefixed name (``training/<name>`` by default).
        group: the group that turns it on (``groups=[...]``).
        value: its value from a merged :class:`Window` (NaN where undefined).
        chart: ``(category, chart title)`` on the dashboard; metrics sharing a title
            share a chart.
        alert: the default allowed ``(low, high)`` range (either bound ``None``), if any.
        series: it reads the run's per-batch series, not the window: only a monitor,
            which keeps one, gives it.
    """

    name: str
    group: str
    value: Callable[[Window], float]
    chart: tuple[str, str]
    alert: tuple[Bound, Bound] | None = None
    series: bool = False


AGREEMENT, DIVERGENCE, SEQUENCES, HEALTH = "agreement", "divergence", "sequences", "health"
QUANTILES_CATEGORY = "quantiles"
CATEGORIES = (AGREEMENT, DIVERGENCE, SEQUENCES, HEALTH, QUANTILES_CATEGORY)
"""The dashboard's categories, in order."""

_PROBS_DIFF = (AGREEMENT, "probability diff |pa - pb|: max, mean, std")
_LOG_DIFF = (AGREEMENT, "log-prob diff |a - b|: max, mean, std")
_RATIO = (DIVERGENCE, "importance ratio: mean, min, max")
_RATIO_FRACTIONS = (DIVERGENCE, "importance ratio: fraction above C, below 1/C")
_PPL = (SEQUENCES, "perplexity: actor, rollout")
_PPL_DIFF = (SEQUENCES, "log-perplexity diff: mean, max abs")
_GEO = (SEQUENCES, "geometric-mean ratio: min, max")
_PADDING = (HEALTH, "masked-in tokens with a rollout log-prob of exactly 0")

CATALOG: tuple[Metric, ...] = (
    # ---------------------------------------------------------------- seed
    Metric(
        "rollout_probs_diff_valid",
        "seed",
        lambda w: 1.0 if w.n >= 1 else 0.0,
        (HEALTH, "window has tokens (1) or not (0)"),
    ),
    Metric("rollout_probs_diff_max", "seed", lambda w: w.extreme("max_prob_diff"), _PROBS_DIFF),
    # verl's FAQ: below about 0.005 is normal, above 0.01 points to an engine precision bug.
    # The metric weighs each token's error by its probability, so its healthy level follows
    # the policy's confidence as much as the precision: healthy bf16-engine / fp32-trainer
    # runs (benchmarks/calibrate_alerts.py) read 0.005-0.011 and cross 0.01 in up to 84% of
    # windows. 0.02 sits above the worst healthy window seen (0.014) and matches the other
    # limits (k3 0.01, mult_prob_error 1.08); read 0.005-0.01 as "look", not as a bug.
    Metric(
        "rollout_probs_diff_mean",
        "seed",
        lambda w: w.mean("prob_diff"),
        _PROBS_DIFF,
        alert=(None, 0.02),
    ),
    Metric("rollout_probs_diff_std", "seed", lambda w: w.std("prob_diff"), _PROBS_DIFF),
    # MiniMax-M1: about 0.987 with the bf16 LM head (the bug), about 0.997 after the FP32
    # fix. 0.99 sits between the two: a fixed setup passes, the reported bug is flagged.
    Metric(
        "rollout_actor_probs_pearson_corr",
        "seed",
        pearson,
        (AGREEMENT, "Pearson correlation of pa and pb"),
        alert=(0.99, None),
    ),
    # The near-1 metrics again as their distance from 1, charted beside them: on a healthy
    # run the metric itself reads "1" at every tick of a chart.
    Metric(
        "rollout_actor_probs_one_minus_pearson_corr",
        "seed",
        one_minus_pearson,
        (AGREEMENT, "1 - Pearson correlation of pa and pb"),
    ),
    # ----------------------------------------------------------- log space
    Metric(
        "rollout_log_probs_diff_max", "log_space", lambda w: w.extreme("max_log_diff"), _LOG_DIFF
    ),
    Metric("rollout_log_probs_diff_mean", "log_space", lambda w: w.mean("log_diff"), _LOG_DIFF),
    Metric("rollout_log_probs_diff_std", "log_space", lambda w: w.std("log_diff"), _LOG_DIFF),
    Metric(
        "rollout_stale_period",
        "log_space",
        stale_period,
        (AGREEMENT, "stale weights: period of the rise and drop of |a - b| (batches)"),
        series=True,
    ),
    # ------------------------------------------------------------------ kl
    Metric(
        "rollout_actor_kl_k1",
        "kl",
        lambda w: -w.per_token("log_ratio"),
        (DIVERGENCE, "KL(rollout || actor): k1, k3"),
    ),
    # NeMo-RL: a generation KL below about 1e-3 is typical. 1e-2 is ten times that, about
    # what a token-level |r| of 0.1-0.15 gives (k3 ~ r^2 / 2): flags real drift (stale
    # weights, a wrong sampler setting) without firing on bf16 noise.
    Metric(
        "rollout_actor_kl_k3",
        "kl",
        lambda w: w.per_token("kl_k3"),
        (DIVERGENCE, "KL(rollout || actor): k1, k3"),
        alert=(None, 0.01),
    ),
    # NeMo-RL: near 1.0 is healthy; its validation guide lists 1.01-1.04 for healthy pairs
    # and investigates above 1.05, for a one-off check. As an alarm on every window 1.05
    # leaves too little headroom: healthy bf16 runs (benchmarks/calibrate_alerts.py) have
    # medians up to 1.038 and windows up to 1.048. k3 is about 1-2x (x - 1)^2, so the k3
    # limit of 0.01 corresponds to about 1.07-1.1: 1.08 alarms at the same level.
    Metric(
        "rollout_actor_mult_prob_error",
        "kl",
        lambda w: 1.0 + w.per_token("mult_error_m1"),
        (DIVERGENCE, "multiplicative probability error"),
        alert=(None, 1.08),
    ),
    Metric(
        "rollout_actor_mult_prob_error_minus_one",
        "kl",
        lambda w: w.per_token("mult_error_m1"),
        (DIVERGENCE, "multiplicative probability error - 1"),
    ),
    # ----------------------------------------------------- importance ratio
    Metric(
        "rollout_is_ratio_mean", "importance_ratio", lambda w: 1.0 + w.per_token("ratio_m1"), _RATIO
    ),
    Metric(
        "rollout_is_ratio_mean_minus_one",
        "importance_ratio",
        lambda w: w.per_token("ratio_m1"),
        (DIVERGENCE, "importance ratio: mean - 1"),
    ),
    Metric(
        "rollout_is_ratio_min",
        "importance_ratio",
        lambda w: math.exp(w["min_log_ratio"]) if w.n >= 1 else math.nan,
        _RATIO,
    ),
    Metric(
        "rollout_is_ratio_max",
        "importance_ratio",
        lambda w: math.exp(w["max_log_ratio"]) if w.n >= 1 else math.nan,
        _RATIO,
    ),
    Metric(
        "rollout_is_ratio_frac_high",
        "importance_ratio",
        lambda w: w.per_token("ratio_high"),
        _RATIO_FRACTIONS,
    ),
    Metric(
        "rollout_is_ratio_frac_low",
        "importance_ratio",
        lambda w: w.per_token("ratio_low"),
        _RATIO_FRACTIONS,
    ),
    Metric(
        "rollout_is_chi2",
        "importance_ratio",
        lambda w: w.per_token("ratio_sq_m1"),
        (DIVERGENCE, "importance ratio: chi-square"),
    ),
    Metric(
        "rollout_is_ess",
        "importance_ratio",
        effective_sample_size,
        (DIVERGENCE, "importance ratio: effective sample size (fraction)"),
    ),
    Metric(
        "rollout_is_one_minus_ess",
        "importance_ratio",
        one_minus_ess,
        (DIVERGENCE, "importance ratio: 1 - effective sample size"),
    ),
    # ------------------------------------------------------------- sequence
    Metric("actor_ppl", "sequence", lambda w: w.per_sequence("seq_ppl_actor"), _PPL),
    Metric("rollout_ppl", "sequence", lambda w: w.per_sequence("seq_ppl_rollout"), _PPL),
    Metric(
        "rollout_actor_log_ppl_diff",
        "sequence",
        lambda w: -w.per_sequence("seq_log_ratio"),
        _PPL_DIFF,
    ),
    Metric(
        "rollout_actor_log_ppl_abs_diff_max",
        "sequence",
        lambda w: w.sequence_extreme("max_seq_abs_log_ratio"),
        _PPL_DIFF,
    ),
    Metric(
        "rollout_seq_geo_ratio_min",
        "sequence",
        lambda w: exp_or_inf(w["min_seq_log_ratio"]) if w.sequences >= 1 else math.nan,
        _GEO,
    ),
    Metric(
        "rollout_seq_geo_ratio_max",
        "sequence",
        lambda w: exp_or_inf(w["max_seq_log_ratio"]) if w.sequences >= 1 else math.nan,
        _GEO,
    ),
    Metric(
        "rollout_seq_frac_outside",
        "sequence",
        lambda w: w.per_sequence("seq_outside"),
        (SEQUENCES, "fraction of sequences outside the ratio band"),
    ),
    # --------------------------------------------------------------- health
    Metric("rollout_tokens", "health", lambda w: w.n, (HEALTH, "tokens")),
    Metric("rollout_sequences", "health", lambda w: w.sequences, (HEALTH, "sequences")),
    Metric(
        "rollout_nonfinite_tokens",
        "health",
        lambda w: w["nonfinite"],
        (HEALTH, "non-finite tokens dropped"),
    ),
    Metric("rollout_alignment_lag", "health", alignment_lag, (HEALTH, "alignment: best lag")),
    Metric(
        "rollout_zero_log_prob_tokens",
        "health",
        lambda w: w["zero_rollout_log_prob"],
        _PADDING,
    ),
    # ------------------------------------------------------------ token ids
    Metric(
        "rollout_token_diff_count",
        "token_ids",
        lambda w: w["id_diff"] if w["id_updates"] >= 1 else math.nan,
        (HEALTH, "token-id diffs: count"),
    ),
    Metric(
        "rollout_token_diff_seq_frac",
        "token_ids",
        lambda w: w["id_diff_rows"] / w["id_rows"] if w["id_rows"] >= 1 else math.nan,
        (HEALTH, "token-id diffs: fraction of sequences"),
    ),
    # ------------------------------------------------------------ quantiles
    *(
        Metric(
            f"{stem}_{suffix}",
            "quantiles",
            lambda w, name=f"{stem}_{suffix}": w.quantile(name),
            (QUANTILES_CATEGORY, f"{what} quantiles: p50, p90, p99, p99.9"),
        )
        for (stem, _, _), what in zip(QUANTILE_BINS, ("|pa - pb|", "|a - b|"), strict=True)
        for suffix, _ in QUANTILES
    ),
)
"""Every metric, in the order of ``docs/metrics.md``."""

GROUPS: tuple[str, ...] = tuple(dict.fromkeys(metric.group for metric in CATALOG))
"""The metric groups, in the order of ``docs/metrics.md``."""

METRIC_NAMES: dict[str, tuple[str, ...]] = {
    group: tuple(metric.name for metric in CATALOG if metric.group == group) for group in GROUPS
}
"""The un-prefixed metric names of each group."""

SEED_FUNCTION_NAMES: tuple[str, ...] = (
    "rollout_probs_diff_valid",
    "rollout_probs_diff_max",
    "rollout_probs_diff_mean",
    "rollout_probs_diff_std",
    "rollout_actor_probs_pearson_corr",
)
"""The five metrics of the original debug module: what ``calculate_debug_metrics`` returns
(the seed group without its ``1 - x`` companion)."""

SERIES_METRICS: frozenset[str] = frozenset(metric.name for metric in CATALOG if metric.series)
"""The metrics of the run's per-batch series, left out where there is none."""

DEFAULT_ALERT_RANGES: dict[str, tuple[Bound, Bound]] = {
    metric.name: metric.alert for metric in CATALOG if metric.alert is not None
}
"""The ranges used when ``alert_ranges=None`` (metrics of disabled groups are left out)."""


def _dashboard() -> tuple[tuple[str, tuple[tuple[str, tuple[str, ...]], ...]], ...]:
    charts: dict[tuple[str, str], list[str]] = {}
    for metric in CATALOG:
        charts.setdefault(metric.chart, []).append(metric.name)
    return tuple(
        (
            category,
            tuple(
                (title, tuple(names))
                for (where, title), names in charts.items()
                if where == category
            ),
        )
        for category in CATEGORIES
    )


DASHBOARD = _dashboard()
"""The custom-scalars dashboard: ``(category, ((chart title, metric names), ...))``."""


def metrics_from_state(
    state: Sequence[float],
    profile: Profile | None = None,
    groups: Collection[str] | None = None,
    series: Series | None = None,
) -> dict[str, float]:
    """Every metric of the catalog from a packed state on the host (NaN if undefined).

    Only the metrics of ``groups`` when given (each metric's formula stands on its own).
    The quantiles come from the window's ``profile``, :data:`SERIES_METRICS` from the run's
    per-batch ``series`` (NaN without).
    """
    window = Window(state, profile, series)
    return {
        metric.name: metric.value(window)
        for metric in CATALOG
        if groups is None or metric.group in groups
    }
