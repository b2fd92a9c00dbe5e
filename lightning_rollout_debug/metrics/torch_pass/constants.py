"""The constants of a pass (bin edges, fills, offsets): made once, copied once a device.

An update never makes a tensor from Python values, which an accelerator's host would wait
to copy: :func:`constants` and :func:`on_device` hand out the device's copy made before,
:func:`by_shape` the small tensors that depend on a batch's shape.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from dataclasses import fields as fields_of
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily

from lightning_rollout_debug.metrics.bins import LOG_RATIO_BINS, PROBS_DIFF_BINS
from lightning_rollout_debug.metrics.layout import compiling
from lightning_rollout_debug.metrics.profile import (
    _LOG2_E,
    JOINT_BINS,
    POSITION_BUCKETS,
    PROBABILITY_BUCKETS,
    QUANTILE_BINS,
)
from lightning_rollout_debug.metrics.torch_pass.planes import FINE, counted_parts, counted_planes

INF = math.inf


def _probability_edges(dtype: type) -> list[float]:
    """Sorted edges for which ``bucketize(a, edges)`` is ``28 - clamp(floor(-a log2 e), 0, 28)``.

    Computed in ``dtype`` (numpy's float32 or float64), as the buckets of
    :func:`~.profile.probability_buckets` round: the highest ``a`` of each bucket.
    """
    log2e = dtype(_LOG2_E)
    edges = []
    for k in range(1, PROBABILITY_BUCKETS):
        a = dtype(-k * math.log(2.0))
        while not np.floor(-a * log2e) >= k:
            a = np.nextafter(a, dtype(-INF))
        while np.floor(-np.nextafter(a, dtype(INF)) * log2e) >= k:
            a = np.nextafter(a, dtype(INF))
        edges.append(float(a))
    return sorted(edges)


@dataclass(frozen=True)
class Constants:
    """The bin edges of one pass, as tensors of its dtype on its device."""

    fine_d: Tensor
    fine_l: Tensor
    ratio: Tensor
    diff: Tensor
    probability: Tensor
    joint: Tensor  # the edges of -log p, negated and sorted: bins of a and b counted backwards
    position: Tensor  # the powers of two from 1 to 2**22: the position buckets' edges


JOINT_EDGES = tuple(sorted(-edge for edge in JOINT_BINS.edges))
"""The edges of the joint bins of ``-log p``, negated: bins of ``a`` counted backwards."""


PROBABILITY_EDGES = {
    torch.float32: _probability_edges(np.float32),
    torch.float64: _probability_edges(np.float64),
}
"""The probability buckets' edges in each working dtype (found once, at import)."""


def _host_constants(dtype: torch.dtype) -> Constants:
    """The bin edges in ``dtype``, on the CPU."""

    def tensor(values: Sequence[float]) -> Tensor:
        return torch.tensor(values, dtype=dtype)

    return Constants(
        fine_d=tensor(QUANTILE_BINS[0][2].edges),
        fine_l=tensor(QUANTILE_BINS[1][2].edges),
        ratio=tensor(LOG_RATIO_BINS.edges),
        diff=tensor(PROBS_DIFF_BINS.edges),
        probability=tensor(PROBABILITY_EDGES[dtype]),
        joint=tensor(JOINT_EDGES),
        position=tensor([2.0**k for k in range(POSITION_BUCKETS - 1)]),
    )


HOST: dict[Any, Any] = {dtype: _host_constants(dtype) for dtype in PROBABILITY_EDGES}
"""The constants of the pass, made on the CPU at import: an update never makes a tensor
from Python values, which an accelerator's host would wait to copy."""


_ON_DEVICE: dict[tuple[Any, torch.device], Any] = {}


def on_device(key: Any, like: Tensor) -> Any:
    """``HOST[key]`` (a tensor or :class:`Constants`) on the device of ``like``.

    Copied once a device from pinned memory, without waiting for it; a fake tensor (that
    of a ``FakeTensorMode``) gets fake copies, never kept.
    """
    host = HOST[key]
    if compiling():  # copied before the trace (see :func:`constants`): read as they are
        return host if like.device.type == "cpu" else _ON_DEVICE[key, like.device]
    one = isinstance(host, Tensor)
    fields = [host] if one else [getattr(host, field.name) for field in fields_of(host)]

    def made(copy: Callable[[Tensor], Tensor]) -> Any:
        copies = [copy(value) for value in fields]
        return copies[0] if one else Constants(*copies)

    if is_fake(like):
        return made(like.fake_mode.from_tensor)  # type: ignore[attr-defined]
    device = like.device
    if device.type == "cpu":
        return host
    if (key, device) not in _ON_DEVICE:
        pinned = device.type == "cuda"
        _ON_DEVICE[key, device] = made(
            lambda t: (t.pin_memory() if pinned else t).to(device, non_blocking=pinned)
        )
    return _ON_DEVICE[key, device]


_SHAPED: dict[tuple[Any, tuple[int, ...], torch.device], Tensor] = {}


def by_shape(key: Any, like: Tensor, make: Callable[[torch.device], Tensor]) -> Tensor:
    """``make(device)`` (a small tensor that depends on ``like``'s shape) on ``like``'s device.

    Eagerly made once a shape and device on the CPU, and copied as :func:`on_device` copies
    (the last 64 kept); traced, made in the graph.
    """
    if compiling():
        return make(like.device)
    if is_fake(like):
        with unset_fake_temporarily():
            host = make(torch.device("cpu"))
        return like.fake_mode.from_tensor(host)  # type: ignore[attr-defined]
    cached = (key, tuple(like.shape), like.device)
    if cached not in _SHAPED:
        if len(_SHAPED) >= 64:
            _SHAPED.clear()
        host = make(torch.device("cpu"))
        pinned = like.device.type == "cuda"
        _SHAPED[cached] = (host.pin_memory() if pinned else host).to(
            like.device, non_blocking=pinned
        )
    return _SHAPED[cached]


def constants(dtype: torch.dtype, like: Tensor) -> Constants:
    """The bin edges for a pass in ``dtype`` on the device of ``like``.

    A compiled pass reads the device's copy made before it was traced.
    """
    return on_device(dtype, like)


@functools.lru_cache(maxsize=64)
def plane_starts(parts: tuple[tuple[str, int], ...]) -> tuple[int, ...]:
    """Where the part of each plane of :func:`.planes.counted_planes` starts in the bins."""
    starts = dict(zip([name for name, _ in parts], part_starts(parts), strict=False))
    return tuple(starts[name] for name in counted_planes(parts))


@functools.lru_cache(maxsize=64)
def part_starts(parts: tuple[tuple[str, int], ...]) -> tuple[int, ...]:
    """Where each counted part starts in the counted bins, then their total."""
    starts, start = [], 0
    for _, size in parts:
        starts.append(start)
        start += size
    return (*starts, start)


HOST["one"] = torch.ones(())


HOST |= {"-inf": torch.tensor(-INF), "inf": torch.tensor(INF), "zero": torch.tensor(0.0)}


for _histograms, _profile in ((True, False), (True, True), (False, True)):
    _starts = plane_starts(counted_parts(_histograms, _profile))
    HOST["offsets", _starts] = torch.tensor(_starts, dtype=torch.int32).view(-1, 1, 1)


FINE_STEPS: tuple[int, int] = QUANTILE_BINS[1][2].layout(torch.float32)[1:]
"""The right shift of the float32 bits of ``|a - b|`` and ``|pa - pb|`` that gives their fine
bins' steps, and the step of the lowest edge: the same for the two (:meth:`.LogBins.layout`)."""

_FINE_TOPS = {"fine_d": QUANTILE_BINS[0][2].top + 1, "fine_l": QUANTILE_BINS[1][2].top + 1}
HOST["fine floor"] = torch.zeros((), dtype=torch.int32)
HOST["fine top"] = torch.tensor([[[_FINE_TOPS[name]]] for name in FINE], dtype=torch.int32)
