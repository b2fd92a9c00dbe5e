"""The torch arithmetic of one update: a batch's tokens reduced to row sums, in one pass.

:func:`token_sums` reads a checked batch once and returns :class:`TokenSums`: for every
row of the batch its sums, extremes and centred second moments (the statistics), and for
the whole batch its counted bins, its sums by position and by probability and its
worst-token candidates (the extras). Nothing leaves the device and no operation depends
on the batch's values, so an update costs the same number of torch operations at every
size. :mod:`.finish` turns the sums of any number of batches into the packed states of
:mod:`.layout`, exactly (the window finishes them together when it folds).

The per-token values follow the catalog's rules (:mod:`.tokens`): log-probs floored at
-20 nats, a token counting where the mask is non-zero and neither log-prob is NaN or
+inf. Each is a named plane of a :class:`Planes` set: eagerly one buffer, written in
place, so an update holds a fixed amount of memory and reduces every plane in one
operation; traced by ``torch.compile``, plain values that the compiler fuses into the
kernels reading them.

Sums along a row are float32 (float64 for float64 log-probs), rows and batches are added
in float64. Second moments are summed about each row's own mean (the row sums first, then
the centred squares), so no digits are lost however far the values are from zero.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
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
from lightning_rollout_debug.metrics.tokens import (
    LOG_PROB_FLOOR,
    LOG_RATIO_CLAMP,
    PADDING_ACTOR_LOG_PROB,
    RATIO_MAX,
    RATIO_MIN,
    exp_tail,
)

INF = math.inf
NEAR = 0.5
"""Below this ``|r|``, ``|pa - pb|`` is taken as ``pb |e^r - 1|``."""


# ----------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class PassPlan:
    """What one pass computes: the metric groups and the extras that are on.

    Args:
        groups: the statistics' metric groups (those of ``catalog.GROUPS``).
        is_threshold: ``C`` of the importance-ratio group.
        histograms: count the two histograms' bins.
        worst_tokens_k: find this many worst-token candidates (0: none).
        profile: count the profile's bins and sum its buckets.

    The layout of the pass's planes follows from these, once (:attr:`planes`).
    """

    groups: frozenset[str]
    is_threshold: float = 2.0
    histograms: bool = False
    worst_tokens_k: int = 0
    profile: bool = False
    planes: tuple[str, ...] = field(init=False, compare=False, repr=False)
    """The planes of the pass, in pairs (one operation writes or reads a pair).

    The order keeps together what is reduced, centred or compared at once: the lag
    products read ``zero`` to ``b``, the centred planes run from ``a`` to ``rho``, their
    products follow, and ``masked`` comes last."""
    at: dict[str, int] = field(init=False, compare=False, repr=False)
    """The index of each plane."""
    parts: tuple[tuple[str, int], ...] = field(init=False, compare=False, repr=False)
    """The parts of the extras' counted bins, in order after the unused bin 0: name and size."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "parts", _counted_parts(self.histograms, self.profile))
        lean = not (self.extras or {"kl", "importance_ratio", "health"} & self.groups)
        planes = LEAN_PLANES if lean else _planes(self, self.index_planes)
        object.__setattr__(self, "planes", planes)
        object.__setattr__(self, "at", {name: i for i, name in enumerate(planes)})

    @property
    def extras(self) -> bool:
        """Whether any extra is on."""
        return self.histograms or self.profile or self.worst_tokens_k > 0

    @property
    def index_planes(self) -> int:
        """The planes of the extras' bin indices: one a counted part, two for the joint bins."""
        return len(self.parts) + int(self.profile)

    @property
    def centred(self) -> slice:
        """The planes centred at their rows' means: from ``a`` to ``rho`` (or ``d``)."""
        return slice(self.at["a"], self.at["rho" if "rho" in self.at else "d"] + 1)

    @property
    def products(self) -> tuple[tuple[str, str], ...]:
        """The pairs of centred planes whose products are summed: ``pa pb``, then ``a b``."""
        return (("pa", "pb"), ("a", "b")) if "ab" in self.at else (("pa", "pb"),)

    @property
    def tail(self) -> str:
        """The first of the planes that are not read once the rows are summed."""
        return self.planes[self.at["ab" if "ab" in self.at else "papb"] + 1]

    @property
    def log_ratio(self) -> bool:
        """Whether the rows' sums of ``r`` are needed (in float64, from ``a - b``)."""
        return self.histograms or bool({"kl", "importance_ratio", "sequence"} & self.groups)


LEAN_PLANES = ("one", "a", "b", "l", "pa", "pb", "d", "papb", "masked")
"""The planes of a pass of the seed, log-space and sequence groups alone."""


def _planes(plan: PassPlan, index_planes: int) -> tuple[str, ...]:
    """The planes of :attr:`PassPlan.planes` for the other groups and the extras."""
    groups, profile = plan.groups, plan.profile
    health = "health" in groups
    pairs = [
        ("zero", "one"),
        ("a", "b"),
        ("r", "l"),
        ("pa", "pb"),
        ("e", "mult"),
        ("d", "rho"),
        ("papb", "ab"),  # the centred products pa pb and a b
    ]
    # Read only until the rows are summed: the extras' bin indices then take their place.
    # Pairs first (one operation writes each), then single planes.
    # Smallest values are the largest of the negated: nr = -r and nd = -d.
    names = []
    if "importance_ratio" in groups:
        names += ["hi", "hilo"]
    if health:
        names += ["ninf_a", "ninf_b", "zb", "code"]
    if {"kl", "importance_ratio"} & groups or profile:
        names.append("k3")
    if "importance_ratio" in groups or plan.histograms:
        names.append("nr")
    if plan.histograms:
        names.append("nd")
    while len(names) < index_planes or len(names) % 2 == 0:
        names.append(f"spare{len(names)}")
    names.append("masked")  # last: kept out of the clearing (its tokens need not count)
    pairs += list(zip(names[::2], names[1::2], strict=True))
    return tuple(name for pair in pairs for name in pair)


# ----------------------------------------------------------------------------- planes
class Planes:
    """The named ``[B, T]`` planes of one pass.

    Eagerly, one ``[len(names), B, T]`` buffer holds them all (``buffer``: a new one, or
    planes of another set that are no longer needed, seen as ``dtype``): each plane is
    written in place (``out=``), so the pass allocates once, and a run of planes is a view
    that one operation reads or writes. Traced by ``torch.compile``, each plane is a value
    of its own and a run a stack of them, which the compiler fuses into the kernels that
    read it.
    """

    def __init__(
        self,
        names: Sequence[str],
        like: Tensor,
        dtype: torch.dtype,
        buffer: Tensor | None = None,
        *,
        pairs: bool = True,
    ) -> None:
        self.names = tuple(names)
        self.at = {name: i for i, name in enumerate(self.names)}
        self.traced = compiling()
        self.dtype = dtype
        self.values: dict[str, Tensor] = {}
        self._runs: dict[tuple[int, int], Tensor] = {}
        self._derived: dict[Any, Any] = {}
        if not self.traced:
            rows, width = like.shape
            if buffer is None:
                buffer = torch.empty(
                    (len(self.names), rows, width), dtype=dtype, device=like.device
                )
            self.buffer = buffer
            self.values = dict(zip(self.names, buffer.unbind(), strict=True))
            if pairs and len(self.names) % 2 == 0:
                pairs = buffer.view(-1, 2, rows, width).unbind()
                self._runs = {(2 * i, 2 * i + 2): pair for i, pair in enumerate(pairs)}
            self._runs[0, len(self.names)] = buffer

    def __getitem__(self, name: str) -> Tensor:
        return self.values[name]

    def derived(self, key: Any, make: Callable[[], Any]) -> Any:
        """``make()``, made once for this set of planes (a set of views of them)."""
        if key not in self._derived:
            self._derived[key] = make()
        return self._derived[key]

    def run(self, first: str, last: str) -> Tensor:
        """The planes from ``first`` to ``last`` as one ``[k, B, T]`` tensor.

        Traced, a plane not written yet is zeros (eagerly its buffer holds anything).
        """
        start, stop = self.at[first], self.at[last] + 1
        if self.traced:
            planes = [self.values.get(name) for name in self.names[start:stop]]
            like = next(plane for plane in planes if plane is not None)
            return torch.stack([torch.zeros_like(like) if p is None else p for p in planes])
        if (start, stop) not in self._runs:
            self._runs[start, stop] = self.buffer[start:stop]
        return self._runs[start, stop]

    def tail(self, first: str, count: int, dtype: torch.dtype) -> Tensor | None:
        """Eagerly, ``count`` planes from ``first`` on, seen as ``dtype`` (of the same size)."""
        if self.traced:
            return None
        start = self.at[first]
        if self.buffer.element_size() == dtype.itemsize:
            return self.buffer[start : start + count].view(dtype)
        _, rows, width = self.buffer.shape  # float64 planes: two int32 planes each
        flat = self.buffer[start:].reshape(-1).view(dtype)
        return flat[: count * rows * width].view(count, rows, width)

    def plane(self, run: Tensor, name: str) -> Tensor:
        """Plane ``name`` of ``run``, the value of the whole set being updated."""
        return self.values[name] if not self.traced else run[self.at[name]]

    def write(
        self,
        names: str | tuple[str, str],
        function: Callable[..., Tensor],
        *args: Any,
        **kwargs: Any,
    ) -> Tensor:
        """``function(*args, **kwargs)`` into the plane ``names`` (or the run of the two named).

        ``function`` takes ``out=`` (eagerly it writes there; traced it returns a value).
        """
        if not self.traced:
            target = self.values[names] if isinstance(names, str) else self.run(*names)
            function(*args, **kwargs, out=target)
            return target
        result = function(*args, **kwargs).to(self.dtype)
        self._bind(names, result)
        return result

    def map(
        self,
        targets: tuple[str, str],
        function: Callable[..., Tensor],
        sources: tuple[str, str],
        *args: Any,
    ) -> None:
        """``function(source, *args)`` of each plane of a pair into the pair ``targets``.

        Eagerly one operation on the pairs (``out=``); traced, one value a plane.
        """
        if not self.traced:
            function(self.run(*sources), *args, out=self.run(*targets))
            return
        for target, source in zip(targets, sources, strict=True):
            self.values[target] = function(self.values[source], *args).to(self.dtype)

    def update(self, first: str, last: str, function: Callable[[Tensor], Tensor]) -> Tensor:
        """Replace the run ``first`` to ``last`` with ``function`` of it (in place eagerly).

        ``function`` must work in place on its argument and return it; traced, it is
        applied to a copy of each plane of the run.
        """
        if not self.traced:
            run = self.values[first] if first == last else self.run(first, last)
            function(run)
            return run
        for name in self.names[self.at[first] : self.at[last] + 1]:
            self.values[name] = function(self.values[name].clone())
        return self.values[first] if first == last else self.run(first, last)

    def _bind(self, names: str | tuple[str, str], value: Tensor) -> None:
        if isinstance(names, str):
            self.values[names] = value
            return
        named = self.names[self.at[names[0]] : self.at[names[1]] + 1]
        for name, plane in zip(named, value.unbind(), strict=True):
            self.values[name] = plane


# ----------------------------------------------------------------------------- constants
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


_JOINT_EDGES = tuple(sorted(-edge for edge in JOINT_BINS.edges))
"""The edges of the joint bins of ``-log p``, negated: bins of ``a`` counted backwards."""

_PROBABILITY_EDGES = {
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
        probability=tensor(_PROBABILITY_EDGES[dtype]),
        joint=tensor(_JOINT_EDGES),
        position=tensor([2.0**k for k in range(POSITION_BUCKETS - 1)]),
    )


_HOST: dict[Any, Any] = {dtype: _host_constants(dtype) for dtype in _PROBABILITY_EDGES}
"""The constants of the pass, made on the CPU at import: an update never makes a tensor
from Python values, which an accelerator's host would wait to copy."""

_ON_DEVICE: dict[tuple[Any, torch.device], Any] = {}


def _on_device(key: Any, like: Tensor) -> Any:
    """``_HOST[key]`` (a tensor or :class:`Constants`) on the device of ``like``.

    Copied once a device from pinned memory, without waiting for it; a fake tensor (that
    of a ``FakeTensorMode``) gets fake copies, never kept.
    """
    host = _HOST[key]
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


def _by_shape(key: Any, like: Tensor, make: Callable[[torch.device], Tensor]) -> Tensor:
    """``make(device)`` (a small tensor that depends on ``like``'s shape) on ``like``'s device.

    Eagerly made once a shape and device on the CPU, and copied as :func:`_on_device` copies
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
    return _on_device(dtype, like)


class _Kept(threading.local):
    """This thread's workspaces: flat buffers by role and dtype, and what is made over them."""

    def __init__(self) -> None:
        self.flat: dict[tuple[str, torch.dtype], Tensor] = {}
        self.made: dict[tuple[Any, ...], Any] = {}


_KEPT = _Kept()
_KEPT_SHAPES = 4
"""How many batch shapes a thread keeps the planes (and their views) of."""


def _kept(role: str, size: int, dtype: torch.dtype, key: Any, make: Callable[[Tensor], Any]) -> Any:
    """``make`` of ``size`` elements of this thread's ``role`` buffer, made once a ``key``.

    The buffer grows to the largest pass seen and is reused: a fresh buffer of this size
    costs more in page faults than the whole pass computes, and what is made over it (the
    views of its planes) costs torch operations at every pass.
    """
    kept = _KEPT
    flat = kept.flat.get((role, dtype))
    if flat is None or flat.numel() < size:
        kept.flat.pop((role, dtype), None)  # freed before the larger one is made
        kept.made = {k: v for k, v in kept.made.items() if k[:2] != (role, dtype)}
        flat = kept.flat[role, dtype] = torch.empty(size, dtype=dtype)
    made = [k for k in kept.made if k[:2] == (role, dtype)]
    if (role, dtype, key) not in kept.made and len(made) >= _KEPT_SHAPES:
        del kept.made[made[0]]
    if (role, dtype, key) not in kept.made:
        kept.made[role, dtype, key] = make(flat[:size])
    return kept.made[role, dtype, key]


def _keeps(like: Tensor) -> bool:
    """Whether a pass over ``like`` keeps its workspaces: an eager CPU pass.

    An accelerator's caching allocator keeps its memory by itself.
    """
    return not compiling() and like.device.type == "cpu" and not is_fake(like)


def _planes_for(plan: PassPlan, like: Tensor, dtype: torch.dtype) -> Planes:
    """The planes of a pass over a batch shaped like ``like``, kept where :func:`_keeps`."""
    if not _keeps(like):
        return Planes(plan.planes, like, dtype)
    count, (rows, width) = len(plan.planes), like.shape

    def make(flat: Tensor) -> Planes:
        return Planes(plan.planes, like, dtype, flat.view(count, rows, width))

    return _kept("planes", count * rows * width, dtype, (plan.planes, rows, width), make)


# ----------------------------------------------------------------------------- the pass
@dataclass(frozen=True)
class TokenSums:
    """What one pass keeps of a batch (see :func:`token_sums`).

    Row sums are in the working dtype (float32, or float64 for float64 log-probs); the
    extras' sums by probability bucket are float64, their counts exact whole numbers.
    """

    plan: PassPlan
    width: int
    first: Tensor
    """``[planes, B]``: each row's sum of every plane over its counting tokens."""
    top: Tensor
    """``[planes, B]``: each row's largest value of every plane (``-inf``: no token); the
    smallest of ``r`` and ``d`` are those of the planes ``nr = -r`` and ``nd = -d``."""
    shift: Tensor | None
    """``[centred, B, 1]``: each row's mean of the centred planes, the values are centred at
    (``None``: not centred, the sums of squares are plain ones)."""
    second: Tensor
    """``[seconds, B]``: each row's sums of the squared centred values, then of the products
    ``pa pb`` and ``a b`` of centred values (:attr:`PassPlan.seconds`)."""
    lag: Tensor | None = None
    """``[6, 6, B]``: each row's sums of ``x_t y_(t+1)`` over ``zero, one, a, b, a^2, b^2``
    (health)."""
    counts: Tensor | None = None
    """``[bins]``: the counted bins of the extras' parts (:attr:`PassPlan.parts`). Eagerly
    they count every token: those that do not count in their part's bin of 0 values
    (:attr:`uncounted`)."""
    position: Tensor | None = None
    """``[planes, POSITION_BUCKETS]``: planes summed by position bucket (profile): every plane
    eagerly, ``one, d, k3`` compiled (:attr:`position_planes`)."""
    probability: Tensor | None = None
    """``[2, PROBABILITY_BUCKETS]``: ``|pa - pb|`` and ``|a - b|`` summed by bucket."""
    worst: tuple[Tensor, Tensor, Tensor | None] | None = None
    """The ``k`` worst candidates: their keys (:func:`places` finds them), ``[a, b]``, ids."""
    log_ratio: Tensor | None = None
    """``[B]``: each row's sum of ``r`` from the float64 differences ``a - b`` (``None``: a
    plan that needs none, :attr:`PassPlan.log_ratio`)."""
    position_planes: tuple[str, ...] = ()
    """The planes of :attr:`position`, in order."""
    uncounted: bool = False
    """Whether :attr:`counts` hold the tokens that do not count too (an eager pass)."""
    batch: int = 0
    """The batch's index in its window."""
    rank: int = 0
    """The rank of the process that read it."""
    first_row: int = 0
    """The row of the batch that row 0 is (a batch too large for one pass takes several)."""


def _counted_parts(histograms: bool, profile: bool) -> tuple[tuple[str, int], ...]:
    """The parts of :attr:`PassPlan.parts`."""
    parts = []
    if histograms:
        parts.append(("ratio", len(LOG_RATIO_BINS.edges) + 1))
        if not profile:  # with the profile, |pa - pb|'s bins add up its fine bins
            parts.append(("diff", len(PROBS_DIFF_BINS.edges) + 1))
    if profile:
        parts += [
            ("fine_d", len(QUANTILE_BINS[0][2].edges) + 1),
            ("fine_l", len(QUANTILE_BINS[1][2].edges) + 1),
            ("probability", PROBABILITY_BUCKETS),
            ("joint", (len(JOINT_BINS.edges) + 1) ** 2),  # last: its second plane follows
        ]
    return tuple(parts)


def _as_plane(flags: Tensor, out: Tensor | None = None) -> Tensor:
    """Boolean flags as 0.0 and 1.0."""
    return flags.float() if out is None else out.copy_(flags)


def read_sums(
    plan: PassPlan,
    width: int,
    fields: Sequence[Any],
    *,
    compiled: bool = False,
    batch: int = 0,
    rank: int = 0,
    first_row: int = 0,
) -> TokenSums:
    """:class:`TokenSums` from the fields :func:`token_sums` returns (``compiled``: traced)."""
    planes = POSITION_PLANES if compiled else plan.planes
    labels = {"batch": batch, "rank": rank, "first_row": first_row}
    mode = {"position_planes": planes, "uncounted": not compiled}
    return TokenSums(plan, width, *fields, **mode, **labels)


def token_sums(
    plan: PassPlan,
    rollout_log_probs: Tensor,
    old_log_probs: Tensor,
    mask: Tensor,
    token_ids: Tensor | None = None,
) -> tuple[Tensor | None, ...]:
    """The sums of one checked ``[B, T]`` batch (``B * T > 0``), as :class:`TokenSums`'s fields.

    Returns the tuple of the fields after ``plan`` and ``width`` (:func:`read_sums` makes
    the dataclass): a fixed number of torch operations, none of which waits for the
    device. The values of the tokens are the same eagerly and compiled; how they are
    reduced is each one's own (:func:`_reduce_eagerly`, :func:`_reduce_compiled`).
    """
    f64 = torch.float64
    dtype = f64 if f64 in (rollout_log_probs.dtype, old_log_probs.dtype) else torch.float32
    p = _planes_for(plan, mask, dtype)
    _token_values(plan, p, rollout_log_probs, old_log_probs, mask)
    edges = constants(dtype, mask)
    reduce = _reduce_compiled if p.traced else _reduce_eagerly
    return reduce(plan, p, edges, token_ids)


def _token_values(
    plan: PassPlan, p: Planes, rollout_log_probs: Tensor, old_log_probs: Tensor, mask: Tensor
) -> None:
    """Each token's values, written into ``p`` (anything where a token does not count)."""
    on = plan.groups
    # The floored log-probs, and the tokens that count.
    if p.traced:
        p.values["a"], p.values["b"] = old_log_probs.to(p.dtype), rollout_log_probs.to(p.dtype)
    elif old_log_probs.dtype == rollout_log_probs.dtype == p.dtype:
        torch.stack([old_log_probs, rollout_log_probs], out=p.run("a", "b"))
    else:  # converted as they are copied: a stack would convert into temporaries first
        p["a"].copy_(old_log_probs)
        p["b"].copy_(rollout_log_probs)
    if "health" in on:  # a log-prob of -inf, before the floor
        p.map(("ninf_a", "ninf_b"), torch.eq, ("a", "b"), -INF)
    p.update("a", "b", lambda x: x.clamp_(min=LOG_PROB_FLOOR))
    if "r" in p.at:
        r = p.write("r", torch.sub, p["a"], p["b"])
        p.write("l", torch.abs, r)
    else:  # the lean planes keep |r| alone
        p.write("l", torch.sub, p["a"], p["b"])
        p.update("l", "l", torch.abs_)
    p.write("masked", torch.ne, mask, 0)
    p.write("one", torch.lt, p["l"], INF)
    one = p.update("one", "one", lambda x: x.mul_(p["masked"]))
    p.map(("pa", "pb"), torch.exp, ("a", "b"))
    # |pa - pb| near r = 0 without cancellation: pb |e^r - 1|, or min(pa, pb) (e^|r| - 1);
    # farther out (where r has rounded) the difference itself, as the CPU kernel takes it.
    # papb is free until the centring.
    if "e" in p.at:
        p.map(("e", "mult"), _expm1, ("r", "l"))  # pa / pb - 1, e^|r| - 1
        p.write("d", torch.mul, p["e"], p["pb"])
    else:
        p.write("d", _expm1, p["l"])
        p.write("papb", torch.minimum, p["pa"], p["pb"])
        p.write("d", torch.mul, p["d"], p["papb"])
    p.write("papb", torch.sub, p["pa"], p["pb"])
    p.write("d", torch.where, p["l"] < NEAR, p["d"], p["papb"])
    p.update("d", "d", torch.abs_)
    if {"kl", "importance_ratio"} & on:  # rho - 1 = e^clamp(r) - 1 from here on
        p.update("e", "e", lambda e: e.clamp_(RATIO_MIN - 1.0, RATIO_MAX - 1.0))
    if "k3" in p.at:
        p.write("k3", _kl_k3, r, p["e"])
    if "nr" in p.at:
        p.write("nr", torch.neg, r)
    if "nd" in p.at:
        p.write("nd", torch.neg, p["d"])
    if "importance_ratio" in on:
        p.write("rho", torch.clamp, r, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        p.update("rho", "rho", torch.exp_)
        p.map(("hi", "hilo"), torch.gt, ("r", "l"), math.log(plan.is_threshold))
    if "health" in on:
        zb = p.write("zb", torch.eq, p["b"], 0.0)
        p.write("zero", torch.lt, p["a"], PADDING_ACTOR_LOG_PROB)
        p.update("zero", "zero", lambda z: z.mul_(zb).mul_(one))
        # The masked actor (a = -inf where b is neither -inf nor 0) counts ninf_a less the
        # products ninf_a ninf_b and ninf_a zb (the two exclude each other).
        p.update("ninf_b", "zb", lambda x: x.mul_(p["ninf_a"]))
        # 4 t + 2 zero_t + zero_(t-1): its largest over a row's counting tokens tells
        # whether the last one is a zero and whether the column before it is one too.
        width = one.shape[-1]
        steps = _by_shape(
            ("steps", p.dtype),
            one,
            lambda device: torch.arange(0, 4 * width, 4, dtype=p.dtype, device=device),
        )
        p.write("code", _zero_code, p["zero"], steps)


def _reduce_eagerly(
    plan: PassPlan, p: Planes, edges: Constants, token_ids: Tensor | None
) -> tuple[Tensor | None, ...]:
    """The sums of the planes, eagerly: few operations, each in place on the planes.

    The values of tokens that do not count are cleared in place, with -inf put there just
    long enough to take each row's largest value; rows are summed in the planes' dtype,
    second moments about each row's mean; the extras' bins are counted in one
    scatter-add, sums by bucket each in one of their own.
    """
    one = p["one"]
    width = one.shape[-1]
    counted = torch.gt(one, 0.0)
    fills = [_on_device(fill, one) for fill in ("-inf", "zero")]
    extremes: dict[str, Tensor] = {}

    def clear(planes: Tensor) -> Tensor:
        torch.where(counted, planes, fills[0], out=planes)
        if plan.worst_tokens_k:
            extremes["key"] = _keys(p["l"])
        extremes["top"] = planes.amax(-1)
        return torch.where(counted, planes, fills[1], out=planes)

    p.update(p.names[0], p.names[-2], clear)  # masked, last, counts masked tokens
    every = p.run(p.names[0], p.names[-1])
    first = every.sum(-1, keepdim=True)
    # Sums of the float64 differences a - b: k1 keeps the digits of small log-ratios.
    log_ratio = torch.sub(p["a"].double(), p["b"]).sum(-1) if plan.log_ratio else None
    position = probability = counts = worst = None
    if plan.parts:  # the tokens that do not count land in each part's bin of 0 values
        if plan.profile:
            position = _by_position(every.sum(1), width, edges.position)
        indices = _bin_indices(plan, p, edges)
        if plan.profile:
            probability = _by_probability(p, indices["probability"])
        counts = _count(plan, indices)
    if plan.worst_tokens_k:
        worst = _worst(extremes["key"], p, token_ids, plan.worst_tokens_k, width)
    lag = _lag_products(p) if "health" in plan.groups else None
    # Centre each row's values at its mean, then sum their squares and products.
    start, stop = p.names[plan.centred.start], p.names[plan.centred.stop - 1]
    shift = first[plan.centred] / first[p.at["one"]].clamp(min=1.0)
    p.update(start, stop, lambda x: x.addcmul_(one, shift, value=-1.0))
    p.write("papb", torch.mul, p["pa"], p["pb"])
    if "health" in plan.groups:
        p.write("ab", torch.mul, p["a"], p["b"])
    p.update(start, stop, torch.square_)
    second = p.run(start, p.names[p.at[plan.tail] - 1]).sum(-1)
    fields = (first, extremes["top"], shift, second, lag, counts, position, probability, worst)
    return (*fields, log_ratio)


def _reduce_compiled(
    plan: PassPlan, p: Planes, edges: Constants, token_ids: Tensor | None
) -> tuple[Tensor | None, ...]:
    """The sums of the planes, traced by torch.compile: one loop over the rows, one scatter.

    Written as values, not updates, and each reduced on its own from ``[B, T]`` to ``[B]``:
    reductions of one shape share one kernel, which computes every plane it reads. Every
    row sum, largest value, square, product and lag product is in that loop
    (float64 sums, so nothing needs centring); every counted bin and sum by bucket is in
    one scatter-add.
    """
    f64 = torch.float64
    one = p["one"]
    width = one.shape[-1]
    counted = one > 0
    names = p.names[:-1]  # masked, last, counts masked tokens
    raw = {name: p.values.get(name, torch.zeros_like(one)) for name in names}
    value = {name: torch.where(counted, plane, 0.0) for name, plane in raw.items()}
    rows = [*value.values(), p["masked"]]
    centred = names[plan.centred]
    rows += [value[name] * value[name] for name in centred]
    health = "health" in plan.groups
    rows += [
        value[x] * value[y] if (x, y) == ("pa", "pb") or health else one * 0.0
        for x, y in plan.products
    ]
    if health:  # x_t y_(t+1) of zero, one, a, b, a^2, b^2 (0 after the last)
        now = [value[name].double() for name in ("zero", "one", "a", "b")]
        now += [now[2] * now[2], now[3] * now[3]]
        following = [torch.nn.functional.pad(x[:, 1:], (0, 1)) for x in now]
        rows += [x * y for x in now for y in following]
    # Lists of [B] rows, each written where its reduction is: stacked when a window folds.
    rows.append(value["a"].double() - value["b"].double())  # r's exact float64 sum
    sums = [row.sum(-1, dtype=f64) for row in rows]
    top = [torch.where(counted, raw[n], -INF).amax(-1) for n in names]
    first = sums[: len(names) + 1]
    at = len(names) + 1 + len(centred) + len(plan.products)
    second = sums[len(names) + 1 : at]
    lag = sums[at:-1] if health else None
    counts = position = probability = worst = None
    if plan.parts:
        counts, position, probability = _scattered(plan, value, edges, width)
    if plan.worst_tokens_k:
        keys = _keys(torch.where(counted, raw["l"], -INF))
        worst = _worst(keys, p, token_ids, plan.worst_tokens_k, width, value)
    fields = (first, top, None, second, lag, counts, position, probability, worst)
    return (*fields, sums[-1])


def _expm1(x: Tensor, out: Tensor | None = None) -> Tensor:
    """``e^x - 1`` without cancellation near 0.

    Eagerly ``torch.expm1``. Traced, the series of :func:`~.tokens.exp_tail` for
    ``|x| < 1/2``: compilers may lower ``expm1`` to ``exp(x) - 1`` (inductor's CPU code
    does), which loses every digit of a small difference.
    """
    if out is not None or not compiling():
        return torch.expm1(x, out=out)
    return torch.where(x.abs() < 0.5, x + x * x * exp_tail(x), torch.exp(x) - 1.0)


def _kl_k3(r: Tensor, e: Tensor, out: Tensor | None = None) -> Tensor:
    """``k3 = rho - 1 - r`` (``e``: ``rho - 1``) without cancellation near ``r = 0``.

    Eagerly from ``e^r - 1`` in float64, whose rounding is far below ``k3``'s; traced, the
    series of :func:`~.tokens.exp_tail` near 0 (the kernel's fused float32 arithmetic).
    """
    if out is None:
        near = r * r * exp_tail(r)
        return torch.where(r.abs() < NEAR, near, e.clamp(RATIO_MIN - 1.0, RATIO_MAX - 1.0) - r)
    wide = r.clone() if r.dtype == torch.float64 else r.double()
    wide.expm1_().clamp_(RATIO_MIN - 1.0, RATIO_MAX - 1.0)
    return torch.sub(wide, r, out=out)


def _zero_code(zero: Tensor, steps: Tensor, out: Tensor | None = None) -> Tensor:
    """``4 t + 2 zero_t + zero_(t-1)`` at column ``t`` (``zero_(-1)`` is 0)."""
    code = torch.add(steps, zero, alpha=2.0, out=out)
    return code.add_(torch.nn.functional.pad(zero, (1, -1)))  # zero_(t-1)


def _keys(abs_r: Tensor) -> Tensor:
    """Each token's worst-token key: ``|r|``'s bits above, less the token's place.

    ``abs_r`` holds ``|r|`` (``-inf`` where a token does not count). Non-negative floats order
    as their bits do, so a larger key is a larger ``|r|``, then an earlier token (row, then
    column); a token that does not count has a negative key. Float64 values are ranked at
    float32 precision (ties go to the earlier token).
    """
    bits = (abs_r if abs_r.dtype == torch.float32 else abs_r.float()).view(torch.int32)
    rows, width = abs_r.shape
    if compiling():
        places = torch.arange(0, -abs_r.numel(), -1, device=abs_r.device).view(abs_r.shape)
        return torch.add(places, bits, alpha=1 << 32)

    def starts(device: torch.device) -> Tensor:  # -(each row's first place), [B, 1]
        return torch.arange(0, -rows * width, -width, device=device).view(rows, 1)

    keys = torch.add(_by_shape("row starts", abs_r, starts), bits, alpha=1 << 32)
    return keys.sub_(_by_shape("columns", abs_r, lambda device: torch.arange(width, device=device)))


def _bin_indices(plan: PassPlan, p: Planes, edges: Constants) -> Planes:
    """Each token's bin in every counted part (:func:`counted_parts`), from 0 in its part.

    ``joint`` counts the bins of ``a`` and ``b`` backwards (``3843 - bin``): the
    finishing reverses the part.
    """
    names = [name for name, _ in plan.parts]
    if plan.profile:  # the joint bins take two planes: a's, then b's, added into a's
        names.append("joint_b")

    def make() -> Planes:
        buffer = p.tail(plan.tail, len(names), torch.int32)
        return Planes(names, p["one"], torch.int32, buffer, pairs=False)

    index: Planes = p.derived(("index", *names), make)
    sources = {"fine_d": "d", "fine_l": "l", "ratio": "r", "diff": "d", "probability": "a"}
    for name in names:
        if name in sources:
            right = name != "probability"
            values, bins = p[sources[name]], getattr(edges, name)
            index.write(name, torch.bucketize, values, bins, out_int32=True, right=right)
    if plan.profile:
        index.write(
            ("joint", "joint_b"), torch.bucketize, p.run("a", "b"), edges.joint, out_int32=True
        )
        side = len(JOINT_BINS.edges) + 1
        index.write("joint", torch.add, index["joint_b"], index["joint"], alpha=side)
    return index


@functools.lru_cache(maxsize=64)
def part_starts(parts: tuple[tuple[str, int], ...]) -> tuple[int, ...]:
    """Where each counted part starts in the counted bins, then their total."""
    starts, start = [], 0
    for _, size in parts:
        starts.append(start)
        start += size
    return (*starts, start)


_HOST["one"] = torch.ones(())
_HOST |= {"-inf": torch.tensor(-INF), "inf": torch.tensor(INF), "zero": torch.tensor(0.0)}
for _histograms, _profile in ((True, False), (True, True), (False, True)):
    _starts = part_starts(_counted_parts(_histograms, _profile))[:-1]
    _HOST["offsets", _starts] = torch.tensor(_starts, dtype=torch.int32).view(-1, 1, 1)


def _count(plan: PassPlan, index: Planes) -> Tensor:
    """The counted bins of every token, those that do not count too: one scatter-add."""
    parts = plan.parts
    starts = part_starts(parts)
    like = index[parts[0][0]]
    run = index.update(parts[0][0], parts[-1][0], lambda i: i.add_(_offsets(starts[:-1], like)))
    flat = run.reshape(-1)
    counts = torch.zeros(starts[-1], dtype=torch.float32, device=like.device)
    return counts.index_put_((flat,), _one(like), accumulate=True)


def _offsets(starts: tuple[int, ...], like: Tensor) -> Tensor:
    """``starts`` as an int32 ``[parts, 1, 1]`` tensor on the device of ``like``."""
    return _on_device(("offsets", starts), like)


def _one(like: Tensor) -> Tensor:
    """A float32 1 on the device of ``like``."""
    return _on_device("one", like)


def _by_position(columns: Tensor, width: int, edges: Tensor) -> Tensor:
    """Every plane's column sums ``[planes, T]`` summed by position bucket, in float64.

    Column ``t`` is in bucket ``floor(log2 t) + 1`` (0 for column 0): the powers of two up
    to ``t``, of ``edges``.
    """

    def buckets(device: torch.device) -> Tensor:  # eagerly: on the CPU
        host = _HOST[edges.dtype].position
        return torch.bucketize(torch.arange(width, dtype=edges.dtype), host, right=True)

    bucket = _by_shape("position", columns, buckets)
    sums = torch.zeros(len(columns), POSITION_BUCKETS, dtype=torch.float64, device=columns.device)
    return sums.index_add_(1, bucket, columns.double())


def _by_probability(p: Planes, bucket: Tensor) -> Tensor:
    """``|pa - pb|`` and ``|a - b|`` summed by the trainer's probability bucket, in float64."""
    values = torch.stack([p["d"], p["l"]]).view(2, -1).double()
    sums = torch.zeros(2, PROBABILITY_BUCKETS, dtype=torch.float64, device=bucket.device)
    return sums.index_add_(1, bucket.reshape(-1), values)


def _worst(
    keys: Tensor,
    p: Planes,
    token_ids: Tensor | None,
    k: int,
    width: int,
    value: dict[str, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """The ``k`` tokens of largest key: their keys, ``[a, b]`` and ids.

    Each row's best first (rows in parallel), then the best of those.
    """
    best = keys.topk(min(k, width), dim=-1).values
    found = best.flatten().topk(min(k, best.numel())).values
    flat = places(found)
    ab = p.run("a", "b") if value is None else torch.stack([value["a"], value["b"]])
    ab = ab.reshape(2, -1).index_select(1, flat)
    ids = None if token_ids is None else token_ids.reshape(-1).index_select(0, flat)
    return found, ab, ids


def places(keys: Tensor) -> Tensor:
    """The place in the batch (``row * T + t``) of each worst-token key."""
    return keys.neg().bitwise_and_(0xFFFFFFFF)


def _lag_products(p: Planes) -> Tensor:
    """``[6, 6, B]``: each row's sums of ``x_t y_(t+1)`` over ``zero, one, a, b, a^2, b^2``.

    Eagerly; the planes are 0 where a token does not count, so a product counts a pair of
    neighbours that both count. In float64: the log-probs' squares and products are exact,
    and no TF32 rounds them. One batched matrix product.
    """
    one = p["one"]
    rows, width = one.shape

    def views(flat: Tensor) -> tuple[Tensor, ...]:
        wide = flat.view(6, rows, width)
        return wide[:4], wide[2:4], wide[4:], wide[..., :-1], wide[..., 1:]

    size = 6 * rows * width
    if _keeps(one):
        made = _kept("lag", size, torch.float64, (rows, width), views)
    else:
        made = views(torch.empty(size, dtype=torch.float64, device=one.device))
    plain, sides, squares, now, following = made
    plain.copy_(p.run("zero", "b"))
    torch.square(sides, out=squares)
    return torch.einsum("ibt,jbt->ijb", now, following)


POSITION_PLANES = ("one", "d", "k3")
"""The planes a compiled pass sums by position: the tokens, ``|pa - pb|`` and k3."""


def _scattered(
    plan: PassPlan, p: dict[str, Tensor], edges: Constants, width: int
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Compiled, every counted bin and every sum by bucket in one float64 scatter-add.

    The counted parts add each token's weight (1 where it counts, 0 elsewhere), the
    position and probability buckets their values; compiled, one kernel computes each
    token's slots and adds to them, and the concatenations are never stored.
    """
    one = p["one"]
    slots: list[Tensor] = []
    values: list[Tensor] = []
    start = 0
    sources = {"fine_d": "d", "fine_l": "l", "ratio": "r", "diff": "d", "probability": "a"}
    for name, size in plan.parts:
        if name == "joint":
            ia, ib = (torch.bucketize(p[side], edges.joint) for side in ("a", "b"))
            bins = ia * (len(JOINT_BINS.edges) + 1) + ib
        else:
            values_of = p[sources[name]]
            bins = torch.bucketize(values_of, getattr(edges, name), right=name != "probability")
        slots.append(bins + start)
        values.append(one)
        start += size
    position = probability = None
    if plan.profile:
        # The powers of two up to each column, as comparisons the compiler keeps in its loop.
        columns = torch.arange(width, device=one.device).expand_as(one)
        bucket = sum((columns >= 1 << k).long() for k in range(POSITION_BUCKETS - 1))
        for name in POSITION_PLANES:
            slots.append(bucket + start)
            values.append(p[name])
            start += POSITION_BUCKETS
        prob = torch.bucketize(p["a"], edges.probability)
        for name in ("d", "l"):
            slots.append(prob + start)
            values.append(p[name])
            start += PROBABILITY_BUCKETS
    summed = torch.zeros(start, dtype=torch.float64, device=one.device)
    index = torch.cat([slot.flatten() for slot in slots])
    summed.scatter_add_(0, index, torch.cat([value.flatten() for value in values]).double())
    bins_end = sum(size for _, size in plan.parts)
    if plan.profile:
        at = bins_end
        position = summed[at : at + 3 * POSITION_BUCKETS].view(3, POSITION_BUCKETS)
        at += 3 * POSITION_BUCKETS
        probability = summed[at : at + 2 * PROBABILITY_BUCKETS].view(2, PROBABILITY_BUCKETS)
    return summed[:bins_end], position, probability
