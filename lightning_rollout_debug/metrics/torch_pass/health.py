"""The health group's values of a pass: rollout zeros as padding, the masked actor, lags.

Each token's padding zero (a rollout log-prob of exactly 0 where the trainer's is below
e^-1), the masked actor (a trainer log-prob of -inf where the rollout's is neither -inf
nor 0) and the code of a row's last zero are planes of the pass (:mod:`.sums`); the sums
of the products of neighbouring tokens are one batched matrix product.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_rollout_debug.metrics.tokens import PADDING_ACTOR_LOG_PROB
from lightning_rollout_debug.metrics.torch_pass.constants import by_shape
from lightning_rollout_debug.metrics.torch_pass.planes import Planes, keeps, kept


def health_values(p: Planes) -> None:
    """The health group's values: rollout zeros as padding, the masked actor, the code."""
    one = p["one"]
    zb = p.write("zb", torch.eq, p["b"], 0.0)
    p.write("zero", torch.lt, p["a"], PADDING_ACTOR_LOG_PROB)  # 0 where a token does not count
    p.update("zero", "zero", lambda z: z.mul_(zb))
    # The masked actor (a = -inf where b is neither -inf nor 0) counts ninf_a less the
    # products ninf_a ninf_b and ninf_a zb (the two exclude each other).
    p.update("ninf_b", "zb", lambda x: x.mul_(p["ninf_a"]))
    # 4 t + 2 zero_t + zero_(t-1): its largest over a row's counting tokens tells whether
    # the last one is a zero and whether the column before it is one too.
    width = one.shape[-1]
    steps = by_shape(
        ("steps", p.dtype),
        one,
        lambda device: torch.arange(0, 4 * width, 4, dtype=p.dtype, device=device),
    )
    p.write("code", zero_code, p["zero"], steps)


def zero_code(zero: Tensor, steps: Tensor, out: Tensor | None = None) -> Tensor:
    """``4 t + 2 zero_t + zero_(t-1)`` at column ``t`` (``zero_(-1)`` is 0)."""
    code = torch.add(steps, zero, alpha=2.0, out=out)
    return code.add_(torch.nn.functional.pad(zero, (1, -1)))  # zero_(t-1)


def lag_products(p: Planes) -> Tensor:
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
    if keeps(one):
        made = kept("lag", size, torch.float64, (rows, width), views)
    else:
        made = views(torch.empty(size, dtype=torch.float64, device=one.device))
    plain, sides, squares, now, following = made
    plain.copy_(p.run("zero", "b"))
    torch.square(sides, out=squares)
    return torch.einsum("ibt,jbt->ijb", now, following)
