"""The mismatch per segment: a window of statistics for each turn, data source or task.

A batch may label its tokens with segments: ``[B]`` labels (one a sequence: its data
source or task) or ``[B, T]`` labels (one a token: the turn of a multi-turn rollout).
:class:`SegmentWindow` keeps, beside the window's statistics, the same statistics for
each of ``S`` segments and a last one, ``other``, for every label outside ``[0, S)``: a
packed float64 state of ``S + 1`` copies of :data:`~.layout.STATE`, on the batch's
device, of a size fixed by ``S``. The pass that reads a batch reduces its tokens by
segment row as well (:mod:`.torch_pass.segments`), the finishing merges the segment rows
of each segment exactly as the rows of the window (:func:`~.finish.finish_segments`), and
windows and ranks merge each segment on its own. :func:`segment_values` reads a merged
state into the catalog's formulas, segment by segment.

Example:
    >>> import torch
    >>> window = SegmentWindow(segments=2)
    >>> rollout = torch.log(torch.tensor([[0.5, 0.25, 0.9, 0.1]]))
    >>> actor = torch.log(torch.tensor([[0.5, 0.20, 0.9, 0.1]]))
    >>> window.update(rollout, actor, torch.ones(1, 4), torch.tensor([[0, 0, 1, 5]]))
    >>> values = segment_values(window.state, 2, ("rollout_tokens", "rollout_probs_diff_max"))
    >>> {segment: [round(v, 4) for v in found.values()] for segment, found in values.items()}
    {0: [2.0, 0.05], 1: [1.0, 0.0], 2: [1.0, 0.0]}
"""

from __future__ import annotations

import numbers
import threading
from collections.abc import Collection, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_rollout_debug.metrics.backends import add_batch
from lightning_rollout_debug.metrics.catalog import CATALOG, metrics_from_state
from lightning_rollout_debug.metrics.inputs import check_inputs, check_segment_ids
from lightning_rollout_debug.metrics.layout import STATE, Layout, tensor_problems
from lightning_rollout_debug.metrics.packed_window import Part, ThreadSafeWindow
from lightning_rollout_debug.metrics.rows import SEGMENT_GROUPS, rows_for, segment_rows_of

MAX_SEGMENTS = 256
"""The most segments a window keeps (besides ``other``)."""

OTHER = "other"
"""The name of the last segment: the tokens whose label is outside ``[0, S)``."""

SEGMENT_METRIC_CHOICES: tuple[str, ...] = (
    "rollout_tokens",
    "rollout_nonfinite_tokens",
    *(metric.name for metric in CATALOG if metric.group in SEGMENT_GROUPS and not metric.series),
)
"""The metrics a segment can be logged with: those of the token-level groups, the tokens
and the non-finite tokens."""

DEFAULT_SEGMENT_METRICS: tuple[str, ...] = (
    "rollout_tokens",
    "rollout_probs_diff_mean",
    "rollout_probs_diff_max",
    "rollout_log_probs_diff_mean",
    "rollout_actor_kl_k1",
    "rollout_actor_kl_k3",
    "rollout_is_ratio_frac_high",
    "rollout_is_ratio_frac_low",
)
"""The metrics of each segment by default (those of their groups that are on)."""

_GROUP_OF = {metric.name: metric.group for metric in CATALOG}
_ALWAYS = frozenset({"rollout_tokens", "rollout_nonfinite_tokens"})  # from every pass


class Copies:
    """``k`` copies of a layout side by side, each merging on its own (a segment each).

    Example:
        >>> copies = Copies(STATE, 3)
        >>> copies.size == 3 * STATE.size, copies.problems(copies.identity())
        (True, [])
    """

    def __init__(self, inner: Layout, k: int) -> None:
        self.inner, self.k = inner, k
        self.size = inner.size * k
        """Length of the packed vector."""

    def identity(self, device: torch.device | str | None = None) -> Tensor:
        """The state of ``k`` empty windows."""
        return self.inner.identity(device).repeat(self.k)

    def merge(self, states: Tensor, candidates: Tensor | None = None) -> Tensor:
        """Merge states stacked as ``[n, size]`` into one: each copy down its own ``n``."""
        merged = self.inner.merge(states.unflatten(-1, (self.k, self.inner.size)))
        return merged.flatten()

    def problems(self, state: Any, what: str = "the state") -> list[str]:
        """Why ``state`` cannot be ``k`` windows of real tokens (``[]``: it can)."""
        found = tensor_problems(state, (self.size,), what)
        if found:
            return found
        for i, copy in enumerate(state.view(self.k, self.inner.size).unbind()):
            name = OTHER if i == self.k - 1 else str(i)
            found += self.inner.problems(copy, f"segment {name} of {what}")
        return found


class SegmentWindow(ThreadSafeWindow):
    """The statistics of each segment of a window, kept on the batch's device.

    Args:
        segments: ``S``, the segments named by labels ``0`` to ``S - 1`` (1 to
            :data:`MAX_SEGMENTS`); one more, ``other``, takes every other label.
        groups: the metric groups whose slots are filled (a segment's are those of
            :data:`SEGMENT_GROUPS`; by default all of them).
        metrics: the metrics the segments are read for (:data:`SEGMENT_METRIC_CHOICES`);
            the CPU kernel computes their row quantities alone
            (:data:`~.rows.ROWS_OF_SEGMENT_METRIC`). ``None``: every metric of ``groups``.
        is_threshold: ``C`` of the importance-ratio fractions.
        compile: as :class:`~lightning_rollout_debug.MismatchStats`'s.
    """

    segments_window: ClassVar[bool] = True

    def __init__(
        self,
        segments: int = 16,
        *,
        groups: Collection[str] | None = None,
        metrics: Collection[str] | None = None,
        is_threshold: float = 2.0,
        compile: bool | None = None,
    ) -> None:
        chosen = None if metrics is None else list(metrics)
        problems = segment_problems(max_segments=segments, segment_metrics=chosen)
        if problems:
            raise ValueError("Invalid SegmentWindow arguments:\n- " + "\n- ".join(problems))
        self.segments = segments
        self.groups = frozenset(SEGMENT_GROUPS if groups is None else groups)
        self.rows = rows_for(self.groups) if metrics is None else segment_rows_of(metrics)
        """The row quantities the segments are read for."""
        self.is_threshold = is_threshold
        self.compile = compile
        self.chunk_tokens: int | None = None
        self.layout = Copies(STATE, segments + 1)  # type: ignore[assignment]
        self.size = self.layout.size
        self._state: Tensor | None = None
        self._pending: list[Part] = []
        self._lock = threading.Lock()

    def identity_state(self, device: torch.device | str | None = None) -> Tensor:
        """The packed state of an empty window."""
        return self.layout.identity(device)

    def merge_states(self, states: Tensor) -> Tensor:
        """Merge packed states stacked as ``[n, size]`` into one, each segment on its own."""
        return self.layout.merge(states)

    def state_problems(self, state: Any, what: str = "the segments' window") -> list[str]:
        """Why ``state`` cannot be a packed window of segments of real tokens (or ``[]``)."""
        return self.layout.problems(state, what)

    def settings(self) -> dict[str, Any]:
        """What the packed state is laid out by, as plain values (a checkpoint keeps them)."""
        return {"max_segments": self.segments, "size": self.size}

    @torch.no_grad()
    def update(
        self, rollout_log_probs: Tensor, old_log_probs: Tensor, mask: Tensor, segment_ids: Tensor
    ) -> None:
        """Add one batch: ``[B, T]`` log-probs and mask, ``[B]`` or ``[B, T]`` labels."""
        inputs = check_inputs(rollout_log_probs, old_log_probs, mask)
        check_segment_ids(segment_ids, mask)
        add_batch(inputs, None, stats=None, extras=None, segments=(self, segment_ids))


def segment_values(
    state: Tensor | Sequence[float],
    segments: int,
    metrics: Sequence[str] = DEFAULT_SEGMENT_METRICS,
) -> dict[int, dict[str, float]]:
    """Each segment's ``metrics`` from a (merged) packed state, for segments with tokens.

    Keys ``0`` to ``S - 1``, and ``S`` for ``other``; values the catalog's formulas over the
    segment's tokens (NaN where undefined).
    """
    values = state.tolist() if isinstance(state, Tensor) else list(state)
    size = STATE.size
    groups = {_GROUP_OF[name] for name in metrics}
    found: dict[int, dict[str, float]] = {}
    for segment in range(segments + 1):
        block = values[segment * size : (segment + 1) * size]
        if block[0] < 1:  # no token counted
            continue
        computed = metrics_from_state(block, groups=groups)
        found[segment] = {name: computed[name] for name in metrics}
    return found


def segment_problems(
    *,
    max_segments: Any = 16,
    segment_names: Any = None,
    segment_metrics: Any = None,
    segment_alerts: Any = False,
    segment_key: Any = "segment_ids",
    groups: Collection[str] | None = None,
) -> list[str]:
    """What is wrong with the segments' settings (``[]``: nothing).

    ``groups``: the metric groups that are on (the metrics of others cannot be chosen).
    """
    problems = []
    if not isinstance(segment_key, str) or not segment_key:
        problems.append(f"`segment_key` must be a non-empty string, got {segment_key!r}.")
    whole = isinstance(max_segments, numbers.Integral) and not isinstance(max_segments, bool)
    valid = whole and 1 <= max_segments <= MAX_SEGMENTS
    if not valid:
        problems.append(
            f"`max_segments` must be an int from 1 to {MAX_SEGMENTS}, got {max_segments!r}."
        )
    if not isinstance(segment_alerts, bool):
        problems.append(f"`segment_alerts` must be True or False, got {segment_alerts!r}.")
    problems += _name_problems(segment_names, max_segments if valid else MAX_SEGMENTS)
    problems += _metric_problems(segment_metrics, groups)
    return problems


def _name_problems(names: Any, most: int) -> list[str]:
    if names is None:
        return []
    if isinstance(names, str) or not isinstance(names, Sequence):
        return [f"`segment_names` must be a sequence of strings (index to name), got {names!r}."]
    problems = []
    if len(names) > most:
        problems.append(f"`segment_names` has {len(names)} names; `max_segments` is {most}.")
    bad = [n for n in names if not isinstance(n, str) or not n or "/" in n or n == OTHER]
    if bad:
        problems.append(
            f"`segment_names` must be non-empty strings without '/', not {OTHER!r}; got {bad!r}."
        )
    elif len(set(names)) < len(names):
        problems.append(f"`segment_names` must be unique, got {list(names)!r}.")
    return problems


def _metric_problems(metrics: Any, groups: Collection[str] | None) -> list[str]:
    if metrics is None:
        return []
    if isinstance(metrics, str) or not isinstance(metrics, Sequence) or not metrics:
        return [f"`segment_metrics` must be a non-empty sequence of metric names, got {metrics!r}."]
    unknown = [name for name in metrics if name not in SEGMENT_METRIC_CHOICES]
    if unknown:
        return [
            f"`segment_metrics` has {unknown!r}, which a segment does not have; valid: "
            f"{', '.join(SEGMENT_METRIC_CHOICES)}."
        ]
    off = [
        name
        for name in metrics
        if groups is not None and name not in _ALWAYS and _GROUP_OF[name] not in groups
    ]
    if off:
        return [f"`segment_metrics` has {off!r}, whose groups are off (`groups`)."]
    return []


def default_segment_metrics(groups: Collection[str]) -> tuple[str, ...]:
    """:data:`DEFAULT_SEGMENT_METRICS` of the groups that are on."""
    return tuple(
        name for name in DEFAULT_SEGMENT_METRICS if name in _ALWAYS or _GROUP_OF[name] in groups
    )


def segment_name(segment: int, segments: int, names: Sequence[str] | None = None) -> str:
    """The name of segment ``segment`` of ``S`` in tags: its name, its number, or ``other``."""
    if segment >= segments:
        return OTHER
    if names is not None and segment < len(names):
        return names[segment]
    return str(segment)


def segment_metric_names(
    values: dict[int, dict[str, float]], segments: int, names: Sequence[str] | None = None
) -> dict[str, float]:
    """``values`` of :func:`segment_values` by un-prefixed tag: ``segments/<name>/<metric>``.

    Example:
        >>> segment_metric_names({0: {"rollout_tokens": 3.0}, 2: {"rollout_tokens": 1.0}}, 2)
        {'segments/0/rollout_tokens': 3.0, 'segments/other/rollout_tokens': 1.0}
    """
    return {
        f"segments/{segment_name(segment, segments, names)}/{metric}": value
        for segment, found in values.items()
        for metric, value in found.items()
    }


def for_each_segment(
    limits: Mapping[str, Any], metrics: Sequence[str], segments: int, names: Sequence[str] | None
) -> dict[str, Any]:
    """``limits`` (alert ranges, drift factors) of ``metrics`` for every segment's tag.

    Example:
        >>> list(for_each_segment({"rollout_tokens": (1, None)}, ["rollout_tokens"], 1, None))
        ['segments/0/rollout_tokens', 'segments/other/rollout_tokens']
    """
    return {
        f"segments/{segment_name(segment, segments, names)}/{metric}": limits[metric]
        for segment in range(segments + 1)
        for metric in metrics
        if metric in limits
    }
