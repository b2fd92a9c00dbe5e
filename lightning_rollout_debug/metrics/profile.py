"""Where the mismatch lives: quantiles, profiles by position and by probability, joint counts.

A window's profile is a block of the packed extras state (:mod:`.extras`), accumulated in
the same pass as everything else and merged exactly (every slot is a sum, but for two
maxima), so it stays the same size whatever the window holds (:data:`PROFILE_SIZE`
float64 values). :func:`read_profile` turns a merged block into a :class:`Profile` on the
host:

* **quantiles** of ``|pa - pb|`` and ``|a - b|`` from fine log-spaced bins (32 per octave,
  read off a float's bits): the inverted-CDF quantile, the smallest ``v`` with at least
  ``q * N`` values ``<= v``, estimated by the middle of its bin (at most 1/64 = 1.6 %
  from the true value, never above the largest value), 0 where it lies below ``2**-27``
  (exact zeros among them);
* **by position**: the column of the ``[B, T]`` tensors (the position in the response
  when they hold the response) in buckets ``[0, 1), [1, 2), [2, 4), [4, 8), ...``;
* **by probability**: the trainer's probability ``pa = exp(old_log_probs)`` in
  power-of-two buckets ``(2**-(k+1), 2**-k]``, the bucket being ``k = floor(-a / ln 2)``
  computed in the log-probs' precision;
* **joint**: counts over (trainer log-prob bin, rollout log-prob bin), four bins per
  octave of ``-log p``, so that the confident tokens, where most of them are, are spread
  out as well as the rare ones.

Example:
    >>> import torch
    >>> rollout = torch.log(torch.tensor([[0.5, 0.25, 0.9, 0.1]]))
    >>> actor = torch.log(torch.tensor([[0.5, 0.20, 0.9, 0.1]]))
    >>> from lightning_rollout_debug.metrics.extras import TokenExtras
    >>> extras = TokenExtras(histograms=False, worst_tokens_k=0, profile=True)
    >>> extras.update(rollout, actor, torch.ones(1, 4))
    >>> profile = read_profile(extras.state[-PROFILE_SIZE:].tolist())
    >>> round(profile.quantiles["rollout_probs_diff_p999"], 4)
    0.05
    >>> [(bucket.start, bucket.stop, bucket.tokens) for bucket in profile.by_position]
    [(0, 1, 1.0), (1, 2, 1.0), (2, 4, 2.0)]
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch import Tensor

from lightning_rollout_debug.metrics.bins import LogBins
from lightning_rollout_debug.metrics.layout import Block

QUANTILES: tuple[tuple[str, int], ...] = (("p50", 500), ("p90", 900), ("p99", 990), ("p999", 999))
"""The quantiles: name suffix and ``q`` in thousandths (integers keep ``q * N`` exact)."""

QUANTILE_BINS: tuple[tuple[str, str, LogBins], ...] = (
    ("rollout_probs_diff", "probs_diff", LogBins(-27, 28, signed=False, steps=32)),
    ("rollout_log_probs_diff", "log_diff", LogBins(-27, 32, signed=False, steps=32)),
)
"""Metric stem, slot stem and fine bins of each quantity with quantiles: ``|pa - pb|``
from ``2**-27`` (7.5e-9) to 2 (a float32 difference just below 1 may round to 1) and
``|a - b|`` from ``2**-27`` to 32 nats."""

POSITION_BUCKETS = 24
"""Buckets of positions: ``[0, 1), [1, 2), [2, 4), ..., [2**21, 2**22)``, then
``[2**22, inf)``."""

PROBABILITY_BUCKETS = 29
"""Buckets of the trainer's probability, ``(2**-29, 2**-28], ..., (1/2, 1]``: the floor
of -20 nats is ``2**-28.9``."""

JOINT_BINS = LogBins(-10, 15, signed=False, steps=4)
"""Bins of ``-log p`` for the joint histogram: below ``2**-10`` (``p > 0.999``), four
per octave up to ``2**5`` nats, above (62 bins a side)."""

JOINT_EDGES: tuple[float, ...] = tuple(-edge for edge in reversed(JOINT_BINS.edges))
"""The joint histogram's edges in ascending log-prob (``JointHistogram.edges``)."""

_LOG2_E = 1.4426950408889634


def _names(stem: str, count: int) -> tuple[str, ...]:
    return tuple(f"{stem}[{i}]" for i in range(count))


def profile_blocks() -> list[Block]:
    """The profile's slots: counts and sums (one fold), then the maxima."""
    whole: list[str] = []
    for _, slot, bins in QUANTILE_BINS:
        whole += _names(f"{slot}_bins", len(bins.edges) + 1)
    whole += _names("position_tokens", POSITION_BUCKETS)
    whole += _names("probability_tokens", PROBABILITY_BUCKETS)
    joint = len(JOINT_BINS.edges) + 1
    whole += _names("joint", joint * joint)
    sums = [
        *_names("position_probs_diff", POSITION_BUCKETS),
        *_names("position_kl_k3", POSITION_BUCKETS),
        *_names("probability_probs_diff", PROBABILITY_BUCKETS),
        *_names("probability_log_diff", PROBABILITY_BUCKETS),
    ]
    return [
        Block("sum", tuple(whole), whole=True),
        Block("sum", tuple(sums)),
        Block("max", ("probs_diff_max", "log_diff_max", "width")),
    ]


PROFILE_SIZE = sum(block.size for block in profile_blocks())
"""Length of the profile's block of the packed extras state."""


def profile_parts(blocks: Sequence[Block] | None = None) -> dict[str, int]:
    """The parts of the profile block in order: the stem of their slots' names, and their size.

    ``blocks`` (by default :func:`profile_blocks`) name slots ``stem[i]`` (or ``stem``
    alone); consecutive slots of one stem make a part.

    Example:
        >>> parts = profile_parts()
        >>> list(parts)[:3], parts["joint"], sum(parts.values()) == PROFILE_SIZE
        (['probs_diff_bins', 'log_diff_bins', 'position_tokens'], 3844, True)
    """
    found = profile_blocks() if blocks is None else blocks
    stems = [name.split("[", 1)[0] for block in found for name in block.names]
    return {stem: len(list(run)) for stem, run in itertools.groupby(stems)}


# ---------------------------------------------------------------------- accumulation


def probability_buckets(a: Tensor) -> Tensor:
    """The bucket of each trainer log-prob ``a``: 28 for ``pa`` in ``(1/2, 1]``, down to 0."""
    k = (-a * _LOG2_E).floor().clamp(0, PROBABILITY_BUCKETS - 1)
    return (PROBABILITY_BUCKETS - 1) - k.long()


# ---------------------------------------------------------------------- reading
@dataclass(frozen=True)
class PositionBucket:
    """The counting tokens at columns ``[start, stop)`` and their mean ``|pa - pb|`` and k3."""

    start: int
    stop: int
    tokens: float
    probs_diff_mean: float
    kl_k3: float


@dataclass(frozen=True)
class ProbabilityBucket:
    """The counting tokens whose trainer probability is in ``(low, high]``, and their means.

    The means are of ``|pa - pb|`` and ``|a - b|``.
    """

    low: float
    high: float
    tokens: float
    probs_diff_mean: float
    log_probs_diff_mean: float


@dataclass(frozen=True)
class JointHistogram:
    """Counts over (trainer log-prob bin, rollout log-prob bin).

    ``edges`` ascend; bin 0 is ``(-inf, edges[0]]``, bin ``i`` is ``(edges[i-1],
    edges[i]]`` and the last ``(edges[-1], inf)``. ``counts[i][j]`` counts the tokens whose
    trainer log-prob is in bin ``i`` and rollout log-prob in bin ``j``: on the diagonal
    the two agree to the bin.
    """

    edges: tuple[float, ...]
    counts: tuple[tuple[float, ...], ...]


class Profile:
    """Where a window's mismatch lives: quantiles, two profiles and the joint histogram.

    Made by :func:`read_profile` from a merged block. ``tokens`` and ``quantiles`` are read
    at once (the quantile scalars need them at every logged step); ``by_position``,
    ``by_probability`` and ``joint_histogram`` when first asked for (the pictures and
    :meth:`as_dict`), from the profile's own read-only copy of the block.
    """

    def __init__(self, block: np.ndarray) -> None:
        self._parts = _split(np.array(block, dtype=np.float64))
        self.tokens: float = float(self._parts["position_tokens"].sum())
        """The tokens that count."""
        self.quantiles: dict[str, float] = {}
        """Quantile by un-prefixed metric name (``rollout_probs_diff_p50``, ...)."""
        for stem, slot, spec in QUANTILE_BINS:
            largest = float(self._parts[f"{slot}_max"][0])
            found = bin_quantiles(
                self._parts[f"{slot}_bins"], spec.edges, largest, [q for _, q in QUANTILES]
            )
            self.quantiles.update(
                (f"{stem}_{suffix}", value)
                for (suffix, _), value in zip(QUANTILES, found, strict=True)
            )

    @functools.cached_property
    def by_position(self) -> list[PositionBucket]:
        """The position buckets that start below the widest batch's width."""
        parts = self._parts
        widest = float(parts["width"][0])
        return _position_buckets(
            parts["position_tokens"].tolist(),
            parts["position_probs_diff"].tolist(),
            parts["position_kl_k3"].tolist(),
            int(widest) if widest > 0 else 0,
        )

    @functools.cached_property
    def by_probability(self) -> list[ProbabilityBucket]:
        """The buckets of the trainer's probability, ``(2**-29, 2**-28]`` to ``(1/2, 1]``."""
        parts = self._parts
        return [
            ProbabilityBucket(
                low=2.0 ** (i - PROBABILITY_BUCKETS),
                high=2.0 ** (i + 1 - PROBABILITY_BUCKETS),
                tokens=count,
                probs_diff_mean=_mean(diff, count),
                log_probs_diff_mean=_mean(log_diff, count),
            )
            for i, (count, diff, log_diff) in enumerate(
                zip(
                    parts["probability_tokens"].tolist(),
                    parts["probability_probs_diff"].tolist(),
                    parts["probability_log_diff"].tolist(),
                    strict=True,
                )
            )
        ]

    @functools.cached_property
    def joint_histogram(self) -> JointHistogram:
        """Counts over (trainer log-prob bin, rollout log-prob bin)."""
        return JointHistogram(JOINT_EDGES, tuple(map(tuple, self.joint_counts.tolist())))

    @property
    def joint_counts(self) -> np.ndarray:
        """``joint_histogram.counts`` as a read-only ``[bins, bins]`` float64 array.

        A view of the block: what the heatmap draws, without building the tuples.
        """
        side = len(JOINT_EDGES) + 1
        # The block's bins are of -log p: both axes reversed give ascending log-probs.
        return self._parts["joint"].reshape(side, side)[::-1, ::-1]

    def __repr__(self) -> str:
        return (
            f"Profile(tokens={self.tokens!r}, quantiles={self.quantiles!r}, "
            f"by_position={self.by_position!r}, by_probability={self.by_probability!r})"
        )

    def as_dict(self) -> dict[str, Any]:
        """Plain dicts and lists, as ``functional.mismatch_profile`` returns them."""
        return {
            "quantiles": dict(self.quantiles),
            "by_position": [vars(bucket).copy() for bucket in self.by_position],
            "by_probability": [vars(bucket).copy() for bucket in self.by_probability],
            "joint_histogram": {
                "edges": list(self.joint_histogram.edges),
                "counts": [list(row) for row in self.joint_histogram.counts],
            },
        }


def read_profile(values: Sequence[float] | np.ndarray) -> Profile:
    """A :class:`Profile` from a (merged) profile block read on the host."""
    block = np.asarray(values, dtype=np.float64)
    if block.shape != (PROFILE_SIZE,):
        raise ValueError(f"A profile block has {PROFILE_SIZE} values; got {block.size}.")
    return Profile(block)


def _split(block: np.ndarray) -> dict[str, np.ndarray]:
    """The parts of a profile block by stem (:func:`profile_parts`), as read-only views."""
    block.flags.writeable = False
    return {stem: block[part] for stem, part in _part_slices().items()}


@functools.lru_cache(maxsize=1)
def _part_slices() -> dict[str, slice]:
    slices, start = {}, 0
    for stem, size in profile_parts().items():
        slices[stem] = slice(start, start + size)
        start += size
    return slices


def bin_quantiles(
    counts: Sequence[float] | np.ndarray,
    edges: Sequence[float],
    largest: float,
    per_milles: Sequence[int],
) -> list[float]:
    """The ``per_mille / 1000`` inverted-CDF quantiles from fixed unsigned bins.

    The bin holding the ``ceil(q N)``-th smallest value is found exactly (one cumulative
    sum serves every quantile); the estimate is its middle, at most ``largest`` (the
    largest value), 0 for the bin below ``edges[0]`` and ``largest`` for the one above
    ``edges[-1]``. NaN without values.

    Example:
        >>> bin_quantiles([1, 2, 1], (1.0, 2.0), 2.5, [500, 999])  # (-inf, 1), [1, 2), [2, inf)
        [1.5, 2.5]
    """
    # Whole-number counts: the running sums are exact in float64 up to 2**53 tokens.
    cumulative = np.cumsum(np.asarray(counts, dtype=np.float64))
    total = round(float(cumulative[-1])) if cumulative.size else 0
    if total < 1:
        return [math.nan] * len(per_milles)
    ranks = [(per_mille * total + 999) // 1000 for per_mille in per_milles]  # ceil(q N)
    found = []
    for i in np.searchsorted(cumulative, ranks, side="left").tolist():
        if i == 0:
            found.append(0.0)
        elif i >= len(edges):
            found.append(float(largest))
        else:
            found.append(min(0.5 * (edges[i - 1] + edges[i]), float(largest)))
    return found


def _mean(total: float, count: float) -> float:
    return total / count if count >= 1 else math.nan


def _position_buckets(
    tokens: list[float], diff: list[float], k3: list[float], width: int
) -> list[PositionBucket]:
    """The buckets that start below ``width`` (the widest batch), the last cut at it."""
    buckets = []
    for i in range(POSITION_BUCKETS):
        start = 0 if i == 0 else 2 ** (i - 1)
        if start >= width:
            break
        stop = width if i == POSITION_BUCKETS - 1 else min(2**i, width)
        buckets.append(
            PositionBucket(
                start, stop, tokens[i], _mean(diff[i], tokens[i]), _mean(k3[i], tokens[i])
            )
        )
    return buckets
