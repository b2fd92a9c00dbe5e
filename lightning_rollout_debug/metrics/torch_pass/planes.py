"""The planes of a pass: what it computes, its named ``[B, T]`` planes, their workspaces.

:class:`PassPlan` says what a pass computes, :class:`Planes` holds its planes, and a CPU
pass keeps them in a workspace of its thread.

Each per-token value of :mod:`.sums` is a named plane. Eagerly the planes of a
pass are one buffer, written in place, so an update holds a fixed amount of memory and
reduces a run of planes in one operation; a CPU pass keeps that buffer and its views for
the shapes it saw (:func:`planes_for`). Traced by ``torch.compile``, the planes are plain
values that the compiler fuses into the kernels reading them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from lightning_rollout_debug.metrics.bins import LOG_RATIO_BINS, PROBS_DIFF_BINS
from lightning_rollout_debug.metrics.layout import compiling
from lightning_rollout_debug.metrics.profile import (
    JOINT_BINS,
    PROBABILITY_BUCKETS,
    QUANTILE_BINS,
)

TOPS = ("code", "a", "b", "r", "nr", "l", "d")
"""The planes whose largest values the finishing reads, in the order of the planes."""


@dataclass(frozen=True)
class PassPlan:
    """What one pass computes: the metric groups and the extras that are on.

    Args:
        groups: the statistics' metric groups (those of ``catalog.GROUPS``).
        is_threshold: ``C`` of the importance-ratio group.
        histograms: count the two histograms' bins.
        worst_tokens_k: find this many worst-token candidates (0: none).
        profile: count the profile's bins and sum its buckets.
        segments: reduce the planes by segment row too, for this many segments and the
            other one (0: no segments; :mod:`.segments`).

    What follows from these (the planes, their layout, what the finishing reads) is made
    once, into plain fields.
    """

    groups: frozenset[str]
    is_threshold: float = 2.0
    histograms: bool = False
    worst_tokens_k: int = 0
    profile: bool = False
    segments: int = 0
    planes: tuple[str, ...] = field(init=False, compare=False, repr=False)
    """The planes of the pass, in an order that lets one operation write or read a run.

    ``b2, a, b`` (a second ``b`` before ``a``) are copied, compared and floored at once,
    ``[a, b] - [b2, a]`` is ``r`` and ``nr = -r``, and ``pa, pb, rho`` are the exponentials
    of ``a, b, rc`` (``rc``: ``r`` clamped); the health group's float64 copies are those
    from ``zero`` to ``rc``; the centred planes run from ``a`` to ``d``, and the planes
    whose largest values are kept from ``code`` (first) to ``d``; ``masked`` comes last."""
    at: dict[str, int] = field(init=False, compare=False, repr=False)
    """The index of each plane."""
    parts: tuple[tuple[str, int], ...] = field(init=False, compare=False, repr=False)
    """The parts of the extras' counted bins, in order after the unused bin 0: name and size."""
    extras: bool = field(init=False, compare=False, repr=False)
    """Whether any extra is on."""
    index_planes: int = field(init=False, compare=False, repr=False)
    """The planes of the extras' bin indices: one a counted part, two for the joint bins."""
    lean: bool = field(init=False, compare=False, repr=False)
    """Whether the pass is of :data:`LEAN_PLANES`: no extras, no segments, and only the
    seed, log-space and sequence groups among the statistics."""
    centred: slice = field(init=False, compare=False, repr=False)
    """The planes centred at their rows' means: from ``a`` to ``d``; the lean planes from
    ``l`` to ``pb``."""
    products: tuple[tuple[str, str], ...] = field(init=False, compare=False, repr=False)
    """The pairs of centred planes whose products are summed: ``a b``, then ``pa pb``, as
    their planes ``ab`` and ``papb``."""
    tail: str = field(init=False, compare=False, repr=False)
    """The first of the planes that are not read once the rows are summed."""
    tops: tuple[str, ...] = field(init=False, compare=False, repr=False)
    """The planes whose rows' largest values the finishing reads: ``a``, ``b``, ``r``,
    ``l``, ``d``, ``code`` and ``nr`` (the smallest ``r``), those of the pass. An eager
    pass takes them over :attr:`top_run`."""
    top_run: slice = field(init=False, compare=False, repr=False)
    """The planes from the first of :attr:`tops` to the last."""
    segment_tops: slice = field(init=False, compare=False, repr=False)
    """The planes whose largest values a segment row keeps: from ``a`` to ``d``."""
    bottoms: tuple[str, ...] = field(init=False, compare=False, repr=False)
    """The planes whose smallest values are needed: ``d`` (the histograms). The smallest
    ``r`` is the largest ``nr``."""
    log_ratio: bool = field(init=False, compare=False, repr=False)
    """Whether the rows' sums of ``r`` are needed (in float64, from ``a - b``)."""

    def __post_init__(self) -> None:
        groups, histograms, profile = self.groups, self.histograms, self.profile
        derived: dict[str, Any] = {"parts": counted_parts(histograms, profile)}
        derived["extras"] = histograms or profile or self.worst_tokens_k > 0
        derived["index_planes"] = len(derived["parts"]) + int(profile)
        others = {"kl", "importance_ratio", "health"} & groups
        lean = not (derived["extras"] or others or self.segments)
        planes = LEAN_PLANES if lean else plane_names(self, derived["index_planes"])
        at = {name: i for i, name in enumerate(planes)}
        centred = (at["l"], at["pb"]) if lean else (at["a"], at["d"])
        derived |= {
            "planes": planes,
            "at": at,
            "lean": lean,
            "centred": slice(centred[0], centred[1] + 1),
            "products": (("a", "b"), ("pa", "pb")) if "ab" in at else (("pa", "pb"),),
            "tail": planes[at["papb"] + 1],
            "tops": (tops := tuple(name for name in TOPS if name in at)),
            "top_run": slice(at[tops[0]], at[tops[-1]] + 1),
            "segment_tops": slice(at["a"], at["d"] + 1),
            "bottoms": ("d",) * histograms,
            "log_ratio": histograms or bool({"kl", "importance_ratio", "sequence"} & groups),
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)


LEAN_PLANES = ("one", "a", "b", "l", "d", "pa", "pb", "papb", "masked")
"""The planes of a pass of the seed, log-space and sequence groups alone.

Every one but ``masked`` is 0 where a token does not count, so that only ``a`` and ``b``
need clearing before their largest values are taken; those of ``l`` to ``pb`` are
centred; ``a`` to ``d`` are those whose largest values are kept."""


def plane_names(plan: PassPlan, index_planes: int) -> tuple[str, ...]:
    """The planes of :attr:`PassPlan.planes` for the other groups and the extras."""
    groups, profile = plan.groups, plan.profile
    # code first, so that the planes whose largest values are kept run from code to d.
    names = ["code"] if "health" in groups else []
    names += ["zero", "one", "b2", "a", "b", "rc", "r", "nr", "l"]  # rc: clamp(r)
    # ab, papb: a b and pa pb, of centred values (papb is pa - pb until then): one product
    # of [a, pa] and [b, pb] writes them.
    names += ["pa", "pb", "rho", "e", "mult", "d", "ab", "papb"]
    # Read only until the rows are summed: the extras' bin indices then take their place.
    # hi, hilo, k3 and far: one comparison writes the four (k3 afterwards).
    rest = []
    if "importance_ratio" in groups:
        rest += ["hi", "hilo", "k3", "far"]
    else:
        rest += ["k3"] * bool({"kl"} & groups or profile) + ["far"]
    if "health" in groups:
        rest += ["zb", "ninf_a", "ninf_b"]  # one comparison writes them
    while len(rest) < index_planes or (len(names) + len(rest)) % 2 == 0:
        rest.append(f"spare{len(rest)}")
    rest.append("masked")  # last: kept out of the clearing (its tokens need not count)
    return (*names, *rest)


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

    def spaced(self, *names: str) -> Tensor:
        """The planes ``names``, equally far apart, as one ``[k, B, T]`` view (made once).

        Traced, a stack of their values.
        """
        if self.traced:
            return torch.stack([self.values[name] for name in names])

        def make() -> Tensor:
            at = [self.at[name] for name in names]
            step = at[1] - at[0] if len(at) > 1 else 1
            assert step > 0 and at == list(range(at[0], at[-1] + 1, step)), names
            return self.buffer[at[0] : at[-1] + 1 : step]

        return self.derived(("spaced", names), make)

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

        Eagerly one operation on the pairs (``out=``), which need not be neighbours;
        traced, one value a plane.
        """
        if not self.traced:
            function(self.spaced(*sources), *args, out=self.spaced(*targets))
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


class _Kept(threading.local):
    """This thread's workspaces by role and dtype: a flat buffer and what is made over it."""

    def __init__(self) -> None:
        self.held: dict[tuple[str, torch.dtype], tuple[Tensor, dict[Any, Any]]] = {}


_KEPT = _Kept()


_KEPT_SHAPES = 4
"""How many batch shapes a thread keeps the planes (and their views) of."""


def kept(role: str, size: int, dtype: torch.dtype, key: Any, make: Callable[[Tensor], Any]) -> Any:
    """``make`` of ``size`` elements of this thread's ``role`` buffer, made once a ``key``.

    The buffer grows to the largest pass seen and is reused: a fresh buffer of this size
    costs more in page faults than the whole pass computes, and what is made over it (the
    views of its planes) costs torch operations at every pass.
    """
    held = _KEPT.held.get((role, dtype))
    if held is None or held[0].numel() < size:
        _KEPT.held.pop((role, dtype), None)  # freed, with its views, before the larger one
        held = _KEPT.held[role, dtype] = (torch.empty(size, dtype=dtype), {})
    flat, made = held
    if key not in made:
        if len(made) >= _KEPT_SHAPES:
            del made[next(iter(made))]  # the oldest shape
        made[key] = make(flat[:size])
    return made[key]


def keeps(like: Tensor) -> bool:
    """Whether a pass over ``like`` keeps its workspaces: an eager CPU pass.

    An accelerator's caching allocator keeps its memory by itself.
    """
    return not compiling() and like.device.type == "cpu" and not is_fake(like)


def planes_for(plan: PassPlan, like: Tensor, dtype: torch.dtype) -> Planes:
    """The planes of a pass over a batch shaped like ``like``, kept where :func:`keeps`."""
    if not keeps(like):
        return Planes(plan.planes, like, dtype)
    count, (rows, width) = len(plan.planes), like.shape

    def make(flat: Tensor) -> Planes:
        return Planes(plan.planes, like, dtype, flat.view(count, rows, width))

    return kept("planes", count * rows * width, dtype, (plan.planes, rows, width), make)


def counted_parts(histograms: bool, profile: bool) -> tuple[tuple[str, int], ...]:
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


FINE = ("fine_l", "fine_d")
"""The index planes of the fine bins of ``|a - b|`` and ``|pa - pb|``, as ``l`` and ``d``
lie: one chain of operations reads the two planes and writes their bins."""


def counted_planes(parts: tuple[tuple[str, int], ...]) -> tuple[str, ...]:
    """The planes of an eager pass's bin indices of ``parts``, as they lie.

    In the order of the parts, but the fine bins in the order of :data:`FINE`
    (:func:`.bins.bin_indices`).
    """
    names = [name for name, _ in parts]
    if FINE[0] in names:
        at = min(names.index(name) for name in FINE)
        names[at : at + len(FINE)] = FINE
    return tuple(names)
