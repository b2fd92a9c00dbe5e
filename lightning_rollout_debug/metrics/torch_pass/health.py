"""The health group's values of a pass: rollout zeros as padding, the masked actor, lags.

Each token's padding zero (a rollout log-prob of exactly 0 where the trainer's is below
e^-1), the masked actor (a trainer log-prob of -inf where the rollout's is neither -inf
nor 0) and the code of a row's last zero are planes of the pass (:mod:`.sums`); the sums
of the products of neighbouring tokens are one batched matrix product of float64 copies.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from lightning_rollout_debug.metrics.tokens import PADDING_ACTOR_LOG_PROB
from lightning_rollout_debug.metrics.torch_pass.constants import by_shape
from lightning_rollout_debug.metrics.torch_pass.planes import Planes, keeps, kept

WIDE = ("zero", "one", "a^2", "a", "b", "b^2")
"""The float64 planes of an eager pass (:func:`wide_planes`), once their neighbours'
products are taken: copies of the planes from ``zero`` to ``rc``, where ``b2``'s copy holds
``a - b`` until its rows are summed and then ``a^2``, and ``rc``'s holds ``rc`` until
``k3`` is taken and then ``b^2``."""

LAG = ("zero", "one", "a", "b", "a^2", "b^2")
"""The planes whose products at neighbouring tokens the finishing reads."""

LAG_PAIRS = (
    ("zero", "zero"),
    ("one", "one"),
    ("a", "one"),
    ("a^2", "one"),
    ("b", "one"),
    ("b^2", "one"),
    ("one", "a"),
    ("one", "a^2"),
    ("one", "b"),
    ("one", "b^2"),
    ("a", "b"),
    ("b", "a"),
)
"""The pairs ``(x, y)`` of planes of :data:`LAG` whose sums of ``x_t y_(t+1)`` the
finishing reads, in order: the neighbouring pairs that both count, the moments of ``a``
and ``b`` over the first and the second of such pairs, and the products across them."""


def health_values(p: Planes) -> None:
    """The health group's values: rollout zeros as padding, the masked actor, the code.

    ``zb`` (``b = 0``), ``ninf_a`` and ``ninf_b`` (-inf log-probs) are written with the
    log-probs (:mod:`.values`).
    """
    one = p["one"]
    p.write("zero", torch.lt, p["a"], PADDING_ACTOR_LOG_PROB)  # 0 where a token does not count
    p.update("zero", "zero", lambda z: z.mul_(p["zb"]))
    # The masked actor (a = -inf where b is neither -inf nor 0) counts ninf_a less the
    # products ninf_a ninf_b and ninf_a zb (the two exclude each other).
    if p.traced:
        for name in ("ninf_b", "zb"):
            p.values[name] = p.values[name] * p.values["ninf_a"]
    else:
        p.spaced("zb", "ninf_b").mul_(p["ninf_a"])
    # 4 t + 2 zero_t + zero_(t-1): its largest over a row's counting tokens tells whether
    # the last one is a zero and whether the column before it is one too.
    width = one.shape[-1]
    steps = by_shape(
        ("steps", p.dtype),
        one,
        lambda device: torch.arange(0, 4 * width, 4, dtype=p.dtype, device=device),
    )
    code = p.write("code", torch.add, steps, p["zero"], alpha=2.0)
    if p.traced:
        p.values["code"] = code + torch.nn.functional.pad(p["zero"], (1, -1))  # zero_(t-1)
        return
    later, earlier = p.derived("code", lambda: (code[:, 1:], p["zero"][:, :-1]))
    later.add_(earlier)


class Wide(NamedTuple):
    """The float64 copies of an eager pass's planes of :data:`WIDE`, and views of them."""

    planes: Tensor
    """``[6, B, T]``: every plane, first the copies of the planes from ``zero`` to ``rc``."""
    sides: Tensor
    """``[2, B, T]``: ``a`` and ``b``."""
    a: Tensor
    """``[B, T]``: ``a``."""
    b: Tensor
    """``[B, T]``: ``b``."""
    squares: Tensor
    """``[2, B, T]``: ``a^2`` and ``b^2``, in the places of ``b2`` and ``rc``."""
    now: Tensor
    """``[6, B, T - 1]``: the planes of :data:`WIDE` at each token but the last."""
    following: Tensor
    """The same at each token but the first."""
    rc: Tensor
    """``[B, T]``: ``rc``, ``r`` clamped."""
    difference: Tensor
    """``[B, T]``: room for ``a - b`` (``b2``'s copy)."""
    pair: Tensor
    """``[2, B T]``: the copies of ``zero`` and ``one``, flat: room for two float64 planes
    once the lag products are taken."""


def wide_planes(p: Planes) -> Wide:
    """Float64 copies of the planes from ``zero`` to ``rc`` (eagerly), written from ``p``.

    The planes are 0 where a token does not count; in float64 the log-probs' squares and
    products are exact, and no TF32 rounds them. Six planes: ``a^2`` and ``b^2`` take the
    places of ``a - b`` and ``rc`` once those are read (:data:`WIDE`).
    """
    one = p["one"]
    rows, width = one.shape
    size = len(WIDE) * rows * width

    def make(flat: Tensor) -> Wide:
        wide = flat.view(len(WIDE), rows, width)
        at = WIDE.index
        return Wide(
            wide,
            wide[at("a") : at("b") + 1],
            wide[at("a")],
            wide[at("b")],
            wide[at("a^2") :: at("b^2") - at("a^2")],
            wide[..., :-1],
            wide[..., 1:],
            wide[at("b^2")],  # rc's copy
            wide[at("a^2")],  # b2's copy
            wide[:2].view(2, -1),
        )

    if keeps(one):
        wide = kept("lag", size, torch.float64, (rows, width), make)
    else:
        wide = make(torch.empty(size, dtype=torch.float64, device=one.device))
    wide.planes.copy_(p.run("zero", "rc"))
    return wide


def lag_products(wide: Wide) -> Tensor:
    """``[6, 6, B]``: each row's sums of ``x_t y_(t+1)`` over the planes of :data:`WIDE`.

    The planes are 0 where a token does not count, so a product counts a pair of
    neighbours that both count; the finishing reads those of :data:`LAG_PAIRS`. One
    square and one batched matrix product (float64: no TF32 rounds it).
    """
    torch.square(wide.sides, out=wide.squares)
    return torch.einsum("ibt,jbt->ijb", wide.now, wide.following)
