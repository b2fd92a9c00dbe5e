"""One-shot functions on tensors and batches, for use outside Lightning.

The first four keep the names and call shapes of the original debug-metrics module;
:func:`mismatch_metrics` returns the whole catalog, :func:`mismatch_profile` where the
mismatch lives and :func:`segment_metrics` the mismatch of each segment (turn, data source,
task). :func:`calculate_debug_metrics` goes through
:class:`~lightning_rollout_debug.metrics.stats.MismatchStats`, :func:`mismatch_profile` through
:class:`~lightning_rollout_debug.metrics.extras.TokenExtras` and :func:`mismatch_metrics`
through both, :func:`segment_metrics` through
:class:`~lightning_rollout_debug.metrics.segments.SegmentWindow`; the other three are plain
tensor arithmetic.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_rollout_debug.metrics import caller
from lightning_rollout_debug.metrics.backends import add_batch
from lightning_rollout_debug.metrics.batch import extract_inputs, tensor_sources
from lightning_rollout_debug.metrics.catalog import METRIC_NAMES, SEED_FUNCTION_NAMES
from lightning_rollout_debug.metrics.extras import TokenExtras
from lightning_rollout_debug.metrics.formulas import pearson_from_moments
from lightning_rollout_debug.metrics.inputs import (
    check_inputs,
    check_segment_ids,
    check_token_ids,
)
from lightning_rollout_debug.metrics.rows import paired_moments
from lightning_rollout_debug.metrics.segments import (
    DEFAULT_SEGMENT_METRICS,
    MAX_SEGMENTS,
    OTHER,
    SegmentWindow,
    segment_problems,
    segment_values,
)
from lightning_rollout_debug.metrics.settings import prefix_problems
from lightning_rollout_debug.metrics.stats import MismatchStats

__all__ = [
    "calculate_debug_metrics",
    "calculate_log_prob_diff",
    "calculate_token_list_diff",
    "mismatch_metrics",
    "mismatch_profile",
    "pearson_correlation_coefficient",
    "segment_metrics",
]

DEFAULT_PREFIX = "training/"
_FLOAT64_RESOLUTION = 8 * torch.finfo(torch.float64).eps
"""A side of :func:`pearson_correlation_coefficient` spread less than this relative to
its mean is constant."""


def calculate_token_list_diff(tensor1: Tensor, tensor2: Tensor, mask: Tensor) -> Tensor:
    """Count, per row, the masked positions where two token-id tensors differ.

    A position is masked in where ``mask`` is non-zero.

    Example:
        >>> import torch
        >>> ids = torch.tensor([[5, 6, 7], [1, 2, 3]])
        >>> calculate_token_list_diff(ids, torch.tensor([[5, 0, 0], [1, 2, 3]]),
        ...                           torch.tensor([[1, 1, 0], [1, 1, 1]]))
        tensor([1, 0])
    """
    check_token_ids(tensor1, tensor2, mask, names=("tensor1", "tensor2", "mask"))
    return ((tensor1 != tensor2) & (mask != 0)).sum(dim=1)


def pearson_correlation_coefficient(tensor1: Tensor, tensor2: Tensor, mask: Tensor) -> float:
    """Pearson correlation of ``tensor1`` and ``tensor2`` over the masked positions.

    Positions where either value is NaN or infinite are left out. Computed in float64
    about the means, so an offset far larger than the spread costs no digits. Returns
    NaN when fewer than two positions count or when either side is constant (its
    spread within float64 rounding of its mean).

    Example:
        >>> import torch
        >>> x = torch.tensor([[0.1, 0.5, 0.9, 0.3]])
        >>> round(pearson_correlation_coefficient(x, 2 * x + 1, torch.ones(1, 4)), 6)
        1.0
    """
    check_inputs(tensor1, tensor2, mask, names=("tensor1", "tensor2", "mask"))
    keep = (mask != 0) & torch.isfinite(tensor1) & torch.isfinite(tensor2)
    moments = paired_moments(tensor1, tensor2, keep).tolist()
    return pearson_from_moments(*moments, resolution=_FLOAT64_RESOLUTION)


def calculate_log_prob_diff(log_probs1: Tensor, log_probs2: Tensor, mask: Tensor) -> Tensor:
    """``abs(log_probs1 - log_probs2)`` at the masked positions, as a 1-D tensor in row-major order.

    Its length depends on the mask, so (unlike the statistics) it waits for the device.

    Example:
        >>> import torch
        >>> calculate_log_prob_diff(torch.tensor([[0.5, 0.2]]), torch.tensor([[0.25, 0.7]]),
        ...                         torch.tensor([[1, 0]]))
        tensor([0.2500])
    """
    check_inputs(log_probs1, log_probs2, mask, names=("log_probs1", "log_probs2", "mask"))
    return (log_probs1 - log_probs2).abs()[mask != 0]


def calculate_debug_metrics(data: Any, prefix: str = DEFAULT_PREFIX) -> dict[str, float]:
    """The original five debug metrics of a batch, in probability space.

    ``data`` is a mapping of tensors, a ``TensorDict``, or an object whose ``.batch`` is
    one (verl's ``DataProto``). It must hold ``rollout_log_probs`` and
    ``old_log_probs``; the mask is ``response_mask``, else ``attention_mask``, cut to the
    last ``responses.shape[1]`` columns when ``responses`` is present, else all ones
    (with a warning). An empty mask gives ``valid = 0`` and NaN for the other four.

    Raises:
        ValueError: a key is missing, a tensor has the wrong type, rank, shape or dtype, or
            ``prefix`` is not a string.

    Example:
        >>> import torch
        >>> batch = {
        ...     "rollout_log_probs": torch.log(torch.tensor([[0.5, 0.3, 0.2]])),
        ...     "old_log_probs": torch.log(torch.tensor([[0.6, 0.3, 0.1]])),
        ...     "response_mask": torch.ones(1, 3),
        ... }
        >>> {name: round(value, 4) for name, value in calculate_debug_metrics(batch).items()}
        {'training/rollout_probs_diff_valid': 1.0, 'training/rollout_probs_diff_max': 0.1, 'training/rollout_probs_diff_mean': 0.0667, 'training/rollout_probs_diff_std': 0.0577, 'training/rollout_actor_probs_pearson_corr': 0.9972}
    """  # noqa: E501
    _check_prefix(prefix)
    inputs, fallback = extract_inputs(tensor_sources(data), batch_type=type(data))
    if fallback is not None:
        caller.warn(fallback, UserWarning)
    stats = MismatchStats(groups=["seed"])
    stats._update_inputs(inputs)  # extract_inputs checked them
    metrics = stats.compute()
    return _prefixed({name: metrics[name] for name in SEED_FUNCTION_NAMES}, prefix)


def mismatch_metrics(
    rollout_log_probs: Tensor,
    old_log_probs: Tensor,
    response_mask: Tensor,
    *,
    prefix: str = DEFAULT_PREFIX,
    is_threshold: float = 2.0,
    seq_ratio_bounds: tuple[float, float] = (0.99, 1.01),
    rollout_token_ids: Tensor | None = None,
    trainer_token_ids: Tensor | None = None,
) -> dict[str, float]:
    """Every metric of the catalog for one batch (NaN where a value is undefined).

    The token-id metrics are included when both token-id tensors are given; one without
    the other raises a ``ValueError``.

    Example:
        >>> import torch
        >>> rollout = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
        >>> actor = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
        >>> metrics = mismatch_metrics(rollout, actor, torch.ones(1, 3))
        >>> metrics["training/rollout_actor_kl_k3"], metrics["training/rollout_is_ess"]
        (0.0, 1.0)
    """
    _check_prefix(prefix)
    with_ids = rollout_token_ids is not None or trainer_token_ids is not None
    stats = MismatchStats(
        is_threshold=is_threshold,
        seq_ratio_bounds=seq_ratio_bounds,
        groups=[group for group in METRIC_NAMES if with_ids or group != "token_ids"],
    )
    extras = TokenExtras(histograms=False, worst_tokens_k=0, profile=True)
    inputs = check_inputs(
        rollout_log_probs, old_log_probs, response_mask, rollout_token_ids, trainer_token_ids
    )
    add_batch(inputs, None, stats=stats, extras=extras)  # one read for both
    profile = extras.summary(extras.state).profile
    return _prefixed(stats.compute(profile), prefix)


def mismatch_profile(
    rollout_log_probs: Tensor,
    old_log_probs: Tensor,
    response_mask: Tensor,
    segment_ids: Tensor | None = None,
    segment: int | None = None,
) -> dict[str, Any]:
    """Where the mismatch of one batch lives: quantiles, two profiles and the joint counts.

    With ``segment_ids`` (``[B]`` or ``[B, T]`` integer labels) and ``segment``, of the
    tokens labelled ``segment`` alone: a turn's mismatch by position, say.

    Returns a dict of plain Python values (see ``docs/metrics.md``, "Profiles"):

    * ``"quantiles"``: the quantile metrics by un-prefixed name
      (``rollout_probs_diff_p50`` ... ``rollout_log_probs_diff_p999``);
    * ``"by_position"``: ``{"start", "stop", "tokens", "probs_diff_mean", "kl_k3"}`` per
      bucket of columns ``[0, 1), [1, 2), [2, 4), ...`` up to the width;
    * ``"by_probability"``: ``{"low", "high", "tokens", "probs_diff_mean",
      "log_probs_diff_mean"}`` per power-of-two bucket of the trainer's probability
      ``exp(old_log_probs)``, from ``(2**-29, 2**-28]`` to ``(1/2, 1]``;
    * ``"joint_histogram"``: ``{"edges", "counts"}``, ``counts[i][j]`` the tokens whose
      trainer log-prob is in bin ``i`` and rollout log-prob in bin ``j``.

    Means are NaN for buckets without tokens.

    Example:
        >>> import torch
        >>> rollout = torch.log(torch.tensor([[0.6, 0.25, 0.9, 0.1]]))
        >>> actor = torch.log(torch.tensor([[0.6, 0.20, 0.9, 0.1]]))
        >>> profile = mismatch_profile(rollout, actor, torch.ones(1, 4))
        >>> round(profile["quantiles"]["rollout_probs_diff_p999"], 6)
        0.05
        >>> [(b["start"], b["stop"], b["tokens"]) for b in profile["by_position"]]
        [(0, 1, 1.0), (1, 2, 1.0), (2, 4, 2.0)]
        >>> top = profile["by_probability"][-1]
        >>> top["low"], top["high"], top["tokens"]
        (0.5, 1.0, 2.0)
    """
    if (segment_ids is None) != (segment is None):
        raise ValueError("`segment_ids` and `segment` go together: give both or neither.")
    if segment_ids is not None:
        check_inputs(rollout_log_probs, old_log_probs, response_mask)
        check_segment_ids(segment_ids, response_mask)
        if not isinstance(segment, int) or isinstance(segment, bool):
            raise ValueError(f"`segment` must be an int label, got {segment!r}.")
        labels = segment_ids if segment_ids.dim() == 2 else segment_ids.unsqueeze(1)
        response_mask = (response_mask != 0) & (labels == segment)
    extras = TokenExtras(histograms=False, worst_tokens_k=0, profile=True)
    extras.update(rollout_log_probs, old_log_probs, response_mask)
    profile = extras.summary(extras.state).profile
    assert profile is not None
    return profile.as_dict()


def segment_metrics(
    rollout_log_probs: Tensor,
    old_log_probs: Tensor,
    response_mask: Tensor,
    segment_ids: Tensor,
    num_segments: int | None = None,
    metrics: Sequence[str] | None = None,
) -> dict[int | str, dict[str, float]]:
    """The mismatch of each segment of one batch: ``{segment: {metric: value}}``.

    Args:
        rollout_log_probs: ``[B, T]`` log-probs the rollout engine recorded.
        old_log_probs: ``[B, T]`` log-probs the trainer recomputed.
        response_mask: ``[B, T]``; a token counts where it is non-zero.
        segment_ids: integer labels, ``[B]`` (a data source or task a sequence) or
            ``[B, T]`` (a turn a token).
        num_segments: labels ``0`` to ``num_segments - 1`` are segments (at most 256);
            tokens of any other label are under ``"other"``. By default the largest
            label plus one.
        metrics: un-prefixed names of ``SEGMENT_METRIC_CHOICES`` (default
            ``DEFAULT_SEGMENT_METRICS``).

    Returns:
        The segments with at least one counting token, each with its metrics, computed
        as the window's are, over its tokens alone.

    Example:
        >>> import torch
        >>> rollout = torch.log(torch.tensor([[0.5, 0.25, 0.9, 0.1]]))
        >>> actor = torch.log(torch.tensor([[0.5, 0.20, 0.9, 0.1]]))
        >>> turns = torch.tensor([[0, 0, 1, 1]])
        >>> found = segment_metrics(rollout, actor, torch.ones(1, 4), turns,
        ...                         metrics=["rollout_tokens", "rollout_probs_diff_max"])
        >>> {turn: [round(v, 4) for v in values.values()] for turn, values in found.items()}
        {0: [2.0, 0.05], 1: [2.0, 0.0]}
    """
    inputs = check_inputs(rollout_log_probs, old_log_probs, response_mask)
    check_segment_ids(segment_ids, inputs.mask)
    if num_segments is None:
        largest = int(segment_ids.max()) if segment_ids.numel() else -1
        num_segments = min(max(largest + 1, 1), MAX_SEGMENTS)
    chosen = DEFAULT_SEGMENT_METRICS if metrics is None else metrics
    problems = segment_problems(max_segments=num_segments, segment_metrics=list(chosen))
    if problems:
        raise ValueError("Invalid segment_metrics arguments:\n- " + "\n- ".join(problems))
    window = SegmentWindow(num_segments, metrics=chosen)
    add_batch(inputs, None, stats=None, extras=None, segments=(window, segment_ids))
    found = segment_values(window.state, num_segments, tuple(chosen))
    return {OTHER if key == num_segments else key: values for key, values in found.items()}


def _prefixed(metrics: dict[str, float], prefix: str) -> dict[str, float]:
    return {f"{prefix}{name}": value for name, value in metrics.items()}


def _check_prefix(prefix: Any) -> None:
    for problem in prefix_problems(prefix):
        raise ValueError(problem)
