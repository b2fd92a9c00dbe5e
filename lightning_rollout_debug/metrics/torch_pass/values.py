"""The per-token values of a pass: each a named plane of :class:`~.planes.Planes`.

:func:`token_values` writes them, following the catalog's rules (:mod:`.tokens`):
log-probs floored at -20 nats, a token counting where the mask is non-zero and neither
log-prob is NaN or +inf. Eagerly each operation writes a run of planes in place, so
that a whole update is a fixed, small number of operations; traced by ``torch.compile``,
each plane is a value of its own.

Example:
    >>> import torch
    >>> from lightning_rollout_debug.metrics.torch_pass.planes import PassPlan, Planes
    >>> plan = PassPlan(frozenset({"seed", "kl"}))
    >>> old, rollout = torch.tensor([[-0.5, -1.0]]), torch.tensor([[-0.5, -2.0]])
    >>> p = Planes(plan.planes, old, torch.float32)
    >>> _ = token_values(plan, p, rollout, old, torch.ones(1, 2))
    >>> p["r"].tolist(), p["nr"].tolist(), round(p["k3"][0, 1].item(), 6)
    ([[0.0, 1.0]], [[0.0, -1.0]], 0.718282)
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from lightning_rollout_debug.metrics.layout import compiling
from lightning_rollout_debug.metrics.tokens import (
    LOG_PROB_FLOOR,
    LOG_RATIO_CLAMP,
    RATIO_MAX,
    RATIO_MIN,
    exp_tail,
)
from lightning_rollout_debug.metrics.torch_pass.constants import by_shape, on_device
from lightning_rollout_debug.metrics.torch_pass.health import Wide, health_values, wide_planes
from lightning_rollout_debug.metrics.torch_pass.planes import PassPlan, Planes

INF = math.inf

NEAR = 0.5
"""Below this ``|r|``, ``|pa - pb|`` is taken as ``pb |e^r - 1|``."""


def token_values(
    plan: PassPlan, p: Planes, rollout_log_probs: Tensor, old_log_probs: Tensor, mask: Tensor
) -> Wide | None:
    """Each token's values, written into ``p`` (anything where a token does not count).

    Returns the float64 copies of the health group's planes (:func:`.health.wide_planes`)
    of an eager pass (``None``: none).
    """
    _log_probs(plan, p, rollout_log_probs, old_log_probs)
    if plan.lean:  # the lean planes keep |r| alone
        p.write("l", torch.sub, p["a"], p["b"])
        p.update("l", "l", torch.abs_)
    elif p.traced:
        p.write("nr", torch.neg, p.write("r", torch.sub, p["a"], p["b"]))
    else:  # [a, b] - [b2, a]: r and -r
        torch.sub(p.run("a", "b"), p.run("b2", "a"), out=p.run("r", "nr"))
    if not plan.lean:
        p.write("l", torch.abs, p["r"])
    p.write("masked", torch.ne, *_mask_and_zero(mask, p.traced))
    p.write("one", torch.lt, p["l"], INF)
    p.update("one", "one", lambda x: x.mul_(p["masked"]))
    _zero_where_uncounted(p)
    if plan.lean:  # 1 where a token does not count: 0 from here on, as every lean plane
        p.map(("pa", "pb"), torch.exp, ("a", "b"))
        p.update("pa", "pb", lambda x: x.mul_(p["one"]))
        _lean_prob_diff(p)
        return None
    # rho = e^rc, e = rho - 1 (from rc), mult = e^|r| - 1.
    p.write("rc", torch.clamp, p["r"], -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if p.traced:
        for name, source in (("pa", "a"), ("pb", "b"), ("rho", "rc")):
            p.write(name, torch.exp, p[source])
    else:
        torch.exp(p.run("a", "rc"), out=p.run("pa", "rho"))
    p.map(("e", "mult"), _expm1, ("rc", "l"))
    _flags(plan, p)
    _prob_diff(p)
    wide = None
    if "health" in plan.groups:
        health_values(p)
        wide = None if p.traced else wide_planes(p)
    if "k3" in p.at:
        _kl_k3(p, wide)
    return wide


def _log_probs(plan: PassPlan, p: Planes, rollout_log_probs: Tensor, old_log_probs: Tensor) -> None:
    """``a`` and ``b`` (and ``b2``) floored, ``zb`` and the -inf log-probs before the floor."""
    same = old_log_probs.dtype == rollout_log_probs.dtype == p.dtype
    if p.traced:
        a, b = old_log_probs.to(p.dtype), rollout_log_probs.to(p.dtype)
        if "health" in plan.groups:
            for name, value, flag in (("zb", b, 0.0), ("ninf_a", a, -INF), ("ninf_b", b, -INF)):
                p.write(name, torch.eq, value, flag)
        p.values["a"], p.values["b"] = a.clamp(min=LOG_PROB_FLOOR), b.clamp(min=LOG_PROB_FLOOR)
        return
    if plan.lean and same:  # floored as they are copied
        torch.clamp(old_log_probs, min=LOG_PROB_FLOOR, out=p["a"])
        torch.clamp(rollout_log_probs, min=LOG_PROB_FLOOR, out=p["b"])
        return
    names = ("a", "b") if plan.lean else ("b2", "a", "b")
    inputs = {"a": old_log_probs, "b": rollout_log_probs, "b2": rollout_log_probs}
    if same:
        torch.stack([inputs[name] for name in names], out=p.run(names[0], "b"))
    else:  # converted as they are copied: a stack would convert into temporaries first
        for name in names:
            p[name].copy_(inputs[name])
    if "health" in plan.groups:  # b = 0, and the log-probs of -inf before the floor
        flags = by_shape(("health flags", p.dtype), p["one"], _health_flags(p.dtype))
        torch.eq(p.run("b2", "b"), flags, out=p.run("zb", "ninf_b"))
    p.update(names[0], "b", lambda x: x.clamp_(min=LOG_PROB_FLOOR))


def _health_flags(dtype: torch.dtype) -> Callable[[torch.device], Tensor]:
    def make(device: torch.device) -> Tensor:  # a fill kernel each: no host values
        flags = torch.full((3, 1, 1), -INF, dtype=dtype, device=device)
        flags[0].fill_(0.0)
        return flags

    return make


def _mask_and_zero(mask: Tensor, traced: bool) -> tuple[Tensor, Tensor | int]:
    """The mask and the zero it is compared with, each in the form compared fastest.

    Eagerly a bool mask is compared as bytes (not widened to int64), and an int64 mask
    with a float32 zero: on the CPU a loop three times faster than against an int 0, and
    exact, since no non-zero int64 rounds to 0.
    """
    if traced:
        return mask, 0
    if mask.dtype == torch.bool:
        return mask.view(torch.uint8), 0
    if mask.dtype == torch.int64:
        return mask, on_device("zero", mask)
    return mask, 0


def _zero_where_uncounted(p: Planes) -> None:
    """The log-probs and their differences set to 0 where a token does not count.

    Every value computed from them is then finite there (the NaN or infinite log-probs
    of tokens that do not count never reach them), so that an eager pass clears those
    tokens with arithmetic: on the CPU ``torch.where`` costs ten times a product.
    """
    one = p["one"]
    if p.traced:
        for name in ("a", "b", "r", "nr", "l"):
            if name in p.values:
                p.values[name] = torch.where(one > 0, p.values[name], 0.0)
    else:  # from b2 (or a) to l; rho, not written yet, too
        first = "b2" if "b2" in p.at else "a"
        p.update(first, "l", lambda x: x.nan_to_num_(0.0, 0.0, 0.0).mul_(one))


def _flags(plan: PassPlan, p: Planes) -> None:
    """``far`` (``|r| >= NEAR``) and the importance ratio's ``hi`` and ``hilo``.

    ``hi``: ``rho > C``, ``hilo``: ``|r| > log C`` (``hilo - hi`` counts ``rho < 1 / C``).
    Eagerly one comparison of ``[rc, l]`` with two thresholds writes all four planes from
    ``hi`` to ``far`` (``k3`` comes later).
    """
    threshold = math.log(plan.is_threshold)
    if p.traced:
        if "hi" in p.at:
            p.map(("hi", "hilo"), torch.gt, ("rc", "l"), threshold)
        return
    if "hi" not in p.at:
        p.write("far", torch.ge, p["l"], NEAR)
        return
    key = ("flags", p.dtype, threshold)
    edges = by_shape(key, p["one"], _thresholds(p.dtype, threshold))
    sides, out = p.derived("flags", lambda: (p.spaced("rc", "l")[None], _square(p)))
    torch.ge(sides, edges, out=out)


def _square(p: Planes) -> Tensor:
    """The planes ``hi`` to ``far`` as ``[2, 2, B, T]``."""
    return p.run("hi", "far").view(2, 2, *p["one"].shape)


def _thresholds(dtype: torch.dtype, threshold: float) -> Callable[[torch.device], Tensor]:
    """``[2, 1, 1, 1]``: the least value above ``threshold`` (rounded to ``dtype``), and NEAR."""
    kind = np.float32 if dtype == torch.float32 else np.float64
    above = float(np.nextafter(kind(threshold), kind(INF)))

    def make(device: torch.device) -> Tensor:  # a fill kernel each: no host values
        edges = torch.full((2, 1, 1, 1), NEAR, dtype=dtype, device=device)
        edges[0].fill_(above)
        return edges

    return make


def _prob_diff(p: Planes) -> None:
    """``d = |pa - pb|``, near ``r = 0`` without cancellation.

    Near 0 ``pb |e^r - 1|``; farther out (where ``r`` has rounded) the difference itself,
    as the CPU kernel takes it. Eagerly ``lerp`` picks one of the two by ``far`` (0 or 1)
    exactly; ``papb`` is free until the centring.
    """
    p.write("d", torch.mul, p["e"], p["pb"])
    p.write("papb", torch.sub, p["pa"], p["pb"])
    if p.traced:
        p.write("d", torch.where, p["l"] < NEAR, p["d"], p["papb"])
    else:
        torch.lerp(p["d"], p["papb"], p["far"], out=p["d"])
    p.update("d", "d", torch.abs_)


def _lean_prob_diff(p: Planes) -> None:
    """``d`` of the lean planes: ``max(pa, pb) (1 - e^-|r|)``, four operations.

    No cancellation near ``r = 0``, and no overflow where ``|pa - pb|`` is finite:
    ``e^-|r| - 1`` lies in ``(-1, 0]`` however large ``|r|`` (``e^|r|`` overflows where a
    log-prob above 68 meets one floored at -20). The rounding of ``|r|`` (at most 2^-24 of
    it) moves ``d`` by less than 2^-24 of itself. The statistics alone read it; the extras'
    bins need :func:`_prob_diff`'s difference, exact for log-probs whose probabilities are.
    """
    if p.traced:
        p.write("d", torch.mul, _expm1(-p["l"]), -torch.maximum(p["pa"], p["pb"]))
        return
    p.write("d", torch.neg, p["l"])
    p.update("d", "d", torch.expm1_)
    p.write("papb", torch.maximum, p["pa"], p["pb"])
    zero = on_device("zero", p["d"])
    p.write("d", torch.addcmul, zero, p["d"], p["papb"], value=-1.0)


def _kl_k3(p: Planes, wide: Wide | None) -> None:
    """``k3 = rho - 1 - r`` without cancellation near ``r = 0``.

    Eagerly ``e^rc - 1`` in float64 (in the health group's float64 copy of ``rc``, or a
    copy of its own), whose rounding is far below ``k3``'s; traced, the series of
    :func:`~.tokens.exp_tail` near 0 (the kernel's fused float32 arithmetic).
    """
    r = p["r"]
    if p.traced:
        near = r * r * exp_tail(r)
        far = p["e"].clamp(RATIO_MIN - 1.0, RATIO_MAX - 1.0) - r
        p.write("k3", torch.where, r.abs() < NEAR, near, far)
        return
    rc = p["rc"]
    if wide is not None:
        rc = wide.rc
    elif rc.dtype != torch.float64:
        rc = rc.double()
    else:
        rc = rc.clone()
    torch.sub(rc.expm1_(), r, out=p["k3"])


def _expm1(x: Tensor, out: Tensor | None = None) -> Tensor:
    """``e^x - 1`` without cancellation near 0.

    Eagerly ``torch.expm1``. Traced, the series of :func:`~.tokens.exp_tail` for
    ``|x| < 1/2``: compilers may lower ``expm1`` to ``exp(x) - 1`` (inductor's CPU code
    does), which loses every digit of a small difference.
    """
    if out is not None or not compiling():
        return torch.expm1(x, out=out)
    return torch.where(x.abs() < 0.5, x + x * x * exp_tail(x), torch.exp(x) - 1.0)
