"""From the sums of one pass or many to packed states: the finishing of a window's batches.

:func:`~.torch_pass.sums.token_sums` leaves each batch as :class:`~.torch_pass.sums.TokenSums`:
sums, extremes and centred squares per row, counted bins and candidates per batch. A
window keeps them as they come and finishes them together when it folds: every row of
every waiting batch is a small window of its own (:class:`RowSums`), and
:func:`finish_statistics` merges them all into one packed state of
:data:`~.layout.STATE` (Chan's formulas for the second moments, sums and extremes for
the rest); :func:`~.finish_extras.finish_extras` does the same for the extras. A fold of
many batches costs what a fold of one does.

Everything is float64 arithmetic on a few vectors, on the batches' device.

Example:
    >>> import torch
    >>> from lightning_rollout_debug.metrics.torch_pass.planes import PassPlan
    >>> from lightning_rollout_debug.metrics.backends import read_sums
    >>> from lightning_rollout_debug.metrics.torch_pass.sums import token_sums
    >>> plan = PassPlan(frozenset({"seed"}))
    >>> rollout, old = torch.log(torch.tensor([[0.5, 0.25]])), torch.log(torch.tensor([[0.5, 0.2]]))
    >>> sums = read_sums(plan, 2, token_sums(plan, rollout, old, torch.ones(1, 2)))
    >>> slots, _ = finish_rows([sums])
    >>> slots["count"].item(), round(slots["max_prob_diff"].item(), 6)
    (2.0, 0.05)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from lightning_rollout_debug.metrics.layout import STATE
from lightning_rollout_debug.metrics.tokens import LOG_RATIO_CLAMP
from lightning_rollout_debug.metrics.torch_pass.health import LAG_PAIRS, WIDE
from lightning_rollout_debug.metrics.torch_pass.planes import PassPlan
from lightning_rollout_debug.metrics.torch_pass.sums import TokenSums


def _rows(batches: Sequence[TokenSums], field: str) -> Tensor:
    """The per-row ``field`` of every batch, side by side along the rows, in float64.

    A compiled pass leaves lists of ``[B]`` rows, stacked here.
    """
    return _side_by_side([stacked_rows(getattr(sums, field), field) for sums in batches])


def _side_by_side(parts: Sequence[Tensor]) -> Tensor:
    """The batches' ``[k, rows]`` parts as one float64 ``[k, all rows]``."""
    joined = parts[0] if len(parts) == 1 else torch.cat(list(parts), dim=1)
    return joined.to(torch.float64)


def _tops(batches: Sequence[TokenSums]) -> Tensor:
    """``[tops, rows]``: each row's largest value of each plane of :attr:`PassPlan.tops`."""
    return _side_by_side([stacked_rows(_picked_tops(sums), "top") for sums in batches])


def _picked_tops(sums: TokenSums) -> Tensor | Sequence[Tensor]:
    """A pass's largest values of :attr:`PassPlan.tops`, picked from an eager pass's."""
    top, plan = sums.top, sums.plan
    if not isinstance(top, Tensor) or len(top) == len(plan.tops):
        return top
    start = plan.top_run.start
    return torch.stack([top[plan.at[name] - start] for name in plan.tops])


def _log_ratios(batches: Sequence[TokenSums]) -> Tensor | None:
    """Each row's float64 sum of ``r`` (``None``: a pass that needs none)."""
    if any(sums.log_ratio is None for sums in batches):
        return None
    parts = [stacked_rows(sums.log_ratio, "log_ratio").to(torch.float64) for sums in batches]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def row_count(sums: TokenSums) -> int:
    """The rows of the batch a pass read."""
    first = sums.first
    return first.shape[1] if isinstance(first, Tensor) else len(first[0])


def stacked_rows(rows: Tensor | Sequence[Tensor], field: str) -> Tensor:
    """A pass's per-row ``field`` as one tensor (a compiled pass leaves a list of rows)."""
    if isinstance(rows, Tensor) and field == "lag":  # [6, 6, B] over WIDE: LAG_PAIRS's
        rows = [rows[WIDE.index(x), WIDE.index(y)] for x, y in LAG_PAIRS]
    if isinstance(rows, Tensor):
        return rows
    stacked = torch.stack(list(rows))
    return stacked.unsqueeze(-1) if field == "first" else stacked


class RowSums:
    """The rows of a window's waiting batches, and what they merge to, each read once.

    Every reading is a plain value made here: each plane's ``total`` and ``largest``
    value over every counting token, the ``smallest`` of the planes of
    :attr:`~.torch_pass.planes.PassPlan.bottoms`; of each centred plane its ``mean``, its
    centred second moment ``moment`` (``M``, merged over the rows with Chan's formula)
    and its plain sum of ``squares`` (``M + (sum x)^2 / n``); the co-moments ``M_xy`` of
    the pairs of :attr:`~.torch_pass.planes.PassPlan.products` (``comoment``), each
    row's sum of ``r`` (``log_ratio``, ``None``: a plan that needs none), and the tokens
    that do not count that eager passes counted in their bins of 0 values
    (``uncounted``, ``None``: no eager pass).

    With ``groups``, the rows are segment rows (:mod:`.torch_pass.segments`): row ``i``
    of group ``i % groups``, and every reading is a ``[groups]`` vector, each group's.
    """

    def __init__(self, batches: Sequence[TokenSums], groups: int = 0) -> None:
        plan = batches[0].plan
        self.plan = plan
        self.groups = groups
        self.at = at = plan.at
        first = _rows(batches, "first").squeeze(-1)  # [planes, rows]
        self.first = first
        self.n = first[at["one"]]
        totals = self._over(first, torch.sum)
        self.count = totals[at["one"]]
        self.row_top = _rows(batches, "top") if groups else _tops(batches)
        self.total = dict(zip(plan.planes, totals.unbind(), strict=True))
        largest = self._over(self.row_top, torch.amax).unbind()
        tops = plan.planes[plan.segment_tops] if groups else plan.tops
        self.largest = dict(zip(tops, largest, strict=True))
        self.smallest: dict[str, Tensor] = {}
        if plan.bottoms and not groups:
            bottoms = self._over(_rows(batches, "bottom"), torch.amin).unbind()
            self.smallest = dict(zip(plan.bottoms, bottoms, strict=True))
        if "nr" in self.largest:  # nr = -r
            self.smallest["r"] = -self.largest["nr"]
        sums = totals[plan.centred]
        means = sums / self.count.clamp(min=1.0)
        about = [moment_rows(part) for part in batches]
        same = all(mine is part for mine, part in zip(about, batches, strict=True))
        moments = self._moments(about, means, first if same else None)
        plain = moments + sums * means  # M + (sum x)^2 / n
        self.squares = dict(zip(plan.planes[plan.centred], plain.unbind(), strict=True))
        self.lag = _rows(batches, "lag") if batches[0].lag is not None else None  # [12, rows]
        self.log_ratio = _log_ratios(batches)
        self.total_log_ratio = None
        """The sum of ``r`` over every row (``None``: a plan that needs none)."""
        if self.log_ratio is not None:
            self.total_log_ratio = self._over(self.log_ratio, torch.sum)
        self.widths = [sums.width for sums in batches]
        self.uncounted = None if groups else _uncounted(batches, self.count, at["one"])

    def _moments(
        self, batches: Sequence[TokenSums], means: Tensor, first: Tensor | None = None
    ) -> Tensor:
        """Each centred plane's ``moment`` and the ``comoment`` of each product; the moments.

        ``batches``: rows whose second moments are about their ``shift`` (or plain sums),
        ``first`` their sums where already read; ``means``: the window's (or each group's)
        means of the centred planes.
        """
        plan = self.plan
        first = _rows(batches, "first").squeeze(-1) if first is None else first
        n = first[self.at["one"]]
        rows = n.clamp(min=1.0)
        centred = first[plan.centred]
        shift = _shifts(batches, len(centred))
        offset = centred - n * shift  # each row's sum of its centred values, about 0
        deviation = centred / rows - self._per_row(means, n.shape[-1])
        # Chan, for every square and product at once: each row's own centred sums, plus
        # the product of its means' deviations from the window's.
        left, right = _paired(plan, torch.stack([offset, deviation]))
        within = _rows(batches, "second") - left[0] * right[0] / rows
        spread = self._over(within + n * left[1] * right[1], torch.sum)
        squares = len(centred)
        # M is a sum of squares: Chan's terms may round below zero, a sum of them cannot.
        moments = spread[:squares].clamp(min=0.0)
        names = plan.planes[plan.centred]
        self.mean = dict(zip(names, means.unbind(), strict=True))
        self.moment = dict(zip(names, moments.unbind(), strict=True))
        comoments = spread[squares:].unbind()
        self.comoment = dict(zip(plan.products, comoments, strict=True))
        return moments

    def _over(self, values: Tensor, reduce: Callable[..., Tensor]) -> Tensor:
        """``reduce`` of ``values`` over the rows (the last dimension), or of each group."""
        if not self.groups:
            return reduce(values, -1)
        return reduce(values.unflatten(-1, (-1, self.groups)), -2)

    def _per_row(self, values: Tensor, rows: int) -> Tensor:
        """Each of ``rows`` rows' value of ``values`` (``[..., groups]``: its group's)."""
        if not self.groups:
            return values.unsqueeze(-1)
        return values.repeat(1, rows // self.groups)


def _shifts(batches: Sequence[TokenSums], planes: int) -> Tensor:
    """``[planes, rows]``: what the rows' centred values are centred at (a compiled pass: 0)."""
    parts = []
    for sums in batches:
        if sums.shift is not None:
            parts.append(sums.shift.squeeze(-1).to(torch.float64))
        else:
            rows, device = row_count(sums), sums.top[0].device
            parts.append(torch.zeros((planes, rows), dtype=torch.float64, device=device))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _paired(plan: PassPlan, values: Tensor) -> tuple[Tensor, Tensor]:
    """``values`` (``[..., centred planes, rows]``) of both sides of every second moment.

    Each centred plane with itself, then the pairs of
    :attr:`~.torch_pass.planes.PassPlan.products`: ``[..., squares + products, rows]``.
    """
    start = plan.centred.start
    sides = []
    for side in zip(*plan.products, strict=True):
        at = [plan.at[name] - start for name in side]
        sides.append(torch.cat([values, *(values.narrow(-2, i, 1) for i in at)], dim=-2))
    return sides[0], sides[1]


def moment_rows(sums: TokenSums) -> TokenSums:
    """The rows of a pass whose second moments are about each one's ``shift``.

    Its rows; or, where an eager pass centred them at each segment row's mean, its segment
    rows (a compiled pass's, plain sums, serve alike).
    """
    if sums.segments is None:
        return sums
    return _segment_rows(sums, sums.plan.segments + 1)


def _uncounted(batches: Sequence[TokenSums], count: Tensor, one: int) -> Tensor | None:
    """The tokens that do not count of the eager passes (``None``: none).

    An eager pass counts them in each part's bin of 0 values (their values are cleared).
    """
    eager = [sums for sums in batches if sums.uncounted]
    if not eager:
        return None
    tokens = sum(row_count(sums) * sums.width for sums in eager)
    if len(eager) == len(batches):
        counted = count
    else:
        counted = sum(
            stacked_rows(sums.first, "first")[one].to(torch.float64).sum() for sums in eager
        )
    return tokens - counted


def finish_rows(
    statistics: Sequence[TokenSums],
    extras: Sequence[TokenSums] = (),
    seq_ratio_bounds: tuple[float, float] = (0.99, 1.01),
) -> tuple[dict[str, Tensor] | None, RowSums | None]:
    """The statistics' slots of the passes ``statistics`` and the rows of ``extras``.

    Each ``None`` where there are no such passes. The rows of a window's passes are read
    once: the extras' are the statistics' where both windows wait for the same passes.
    """
    rows = RowSums(statistics) if statistics else None
    slots = None if rows is None else finish_statistics(rows, seq_ratio_bounds)
    if not extras:
        return slots, None
    same = len(extras) == len(statistics) and all(
        mine is theirs for mine, theirs in zip(extras, statistics, strict=False)
    )
    return slots, rows if same and rows is not None else RowSums(extras)


def finish_statistics(
    rows: RowSums, seq_ratio_bounds: tuple[float, float] = (0.99, 1.01)
) -> dict[str, Tensor]:
    """The statistics' slots (of :data:`~.layout.STATE`, by name) of the passes of ``rows``.

    The passes share one plan (a window's). Slots of groups the plan leaves out are not
    given, nor those of the token-id checks (their own states).
    """
    groups = rows.plan.groups
    total, largest, mean, moment = rows.total, rows.largest, rows.mean, rows.moment
    slots: dict[str, Tensor] = {
        "count": rows.count,
        "nonfinite": total["masked"] - rows.count,
        "max_actor_log_prob": largest["a"],
        "max_rollout_log_prob": largest["b"],
    }
    if "seed" in groups:
        slots |= {
            "prob_actor": mean["pa"],
            "prob_rollout": mean["pb"],
            "prob_diff": mean["d"],
            "prob_actor*prob_actor": moment["pa"],
            "prob_rollout*prob_rollout": moment["pb"],
            "prob_actor*prob_rollout": rows.comoment["pa", "pb"],
            "prob_diff*prob_diff": moment["d"],
            "max_prob_diff": largest["d"],
        }
    if "log_space" in groups:
        slots |= {
            "log_diff": mean["l"],
            "log_diff*log_diff": moment["l"],
            "max_log_diff": largest["l"],
        }
    if {"kl", "importance_ratio"} & groups:
        assert rows.total_log_ratio is not None
        slots["log_ratio"] = rows.total_log_ratio
    if "kl" in groups:
        slots["kl_k3"] = total["k3"]
        slots["mult_error_m1"] = total["mult"]
    if "importance_ratio" in groups:
        slots |= _importance_ratio(rows)
    if rows.groups:  # segments: the token-level slots alone
        return slots
    if "sequence" in groups or "health" in groups:
        slots |= _sequences(rows, seq_ratio_bounds, "sequence" in groups)
    if "health" in groups:
        slots |= _health(rows)
    return slots


def _importance_ratio(rows: RowSums) -> dict[str, Tensor]:
    total, squares = rows.total, rows.squares
    ratio_m1 = total["e"]  # e = rho - 1
    extremes = (rows.largest["r"], rows.smallest["r"])
    clamped = [
        torch.where(x.isinf(), x, x.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)) for x in extremes
    ]
    return {
        "ratio_m1": ratio_m1,
        "ratio_sq_m1": squares["e"] + 2.0 * ratio_m1,  # rho^2 - 1 = e^2 + 2 e
        "ratio": total["rho"],
        "ratio_sq": squares["rho"],
        "ratio_high": total["hi"],
        "ratio_low": total["hilo"] - total["hi"],
        "max_log_ratio": clamped[0],
        "min_log_ratio": clamped[1],
    }


def _sequences(rows: RowSums, bounds: tuple[float, float], sequence: bool) -> dict[str, Tensor]:
    """The sequence group's slots from each row's means (and the health group's count)."""
    n, first, at = rows.n, rows.first, rows.at
    has = n > 0
    slots = {"sequences": has.sum(dtype=torch.float64)}
    if not sequence:
        return slots
    means = first[at["a"] : at["b"] + 1] / n  # NaN for a row without tokens
    ppl = torch.exp(-means)
    assert rows.log_ratio is not None
    mean_r = rows.log_ratio / n
    outside = (mean_r < math.log(bounds[0])) | (mean_r > math.log(bounds[1]))
    summed = torch.stack([ppl[0], ppl[1], mean_r, outside.to(mean_r.dtype)]).nansum(1)
    extremes = torch.stack([mean_r.abs(), mean_r, -mean_r]).nan_to_num(-math.inf).amax(1)
    return slots | {
        "seq_ppl_actor": summed[0],
        "seq_ppl_rollout": summed[1],
        "seq_log_ratio": summed[2],
        "seq_outside": summed[3],
        "max_seq_abs_log_ratio": extremes[0],
        "max_seq_log_ratio": extremes[1],
        "min_seq_log_ratio": -extremes[2],
    }


def _health(rows: RowSums) -> dict[str, Tensor]:
    """The health group's counts and the log-probs' moments at lags -1, 0 and +1."""
    assert rows.lag is not None
    total = rows.total
    count = rows.count.clamp(min=1.0)
    sum_a, sum_b = total["a"], total["b"]
    m_ab = rows.comoment["a", "b"]
    slots = {
        "zero_rollout_log_prob": total["zero"],
        # ninf_b and zb hold their products with ninf_a
        "masked_actor_log_prob": total["ninf_a"] - total["ninf_b"] - total["zb"],
        "sum_actor_log_prob": sum_a,
        "sum_rollout_log_prob": sum_b,
        "sum_actor_log_prob_sq": rows.squares["a"],
        "sum_rollout_log_prob_sq": rows.squares["b"],
        "sum_actor_x_rollout": m_ab + sum_a * sum_b / count,
    }
    # The sums of the products of neighbours x_t y_(t+1), a^2 and b^2 among the planes.
    lag = rows.lag.sum(1)  # summed over the rows

    def g(left: str, right: str) -> Tensor:
        return lag[LAG_PAIRS.index((left, right))]

    slots |= {
        "neighbour_pairs": g("one", "one"),
        "plus_actor": g("a", "one"),
        "plus_actor_sq": g("a^2", "one"),
        "plus_rollout": g("one", "b"),
        "plus_rollout_sq": g("one", "b^2"),
        "minus_actor": g("one", "a"),
        "minus_actor_sq": g("one", "a^2"),
        "minus_rollout": g("b", "one"),
        "minus_rollout_sq": g("b^2", "one"),
        "sum_actor_x_next_rollout": g("a", "b"),
        "sum_next_actor_x_rollout": g("b", "a"),
    }
    # A row's padding zeros: each right after another, and a lone one at its last token.
    code = rows.row_top[rows.plan.tops.index("code")]  # 4 t + 2 zero_t + zero_(t-1)
    lone_last = (code >= 0) & (torch.remainder(code, 4) >= 2) & (torch.remainder(code, 2) == 0)
    slots["zero_rollout_log_prob_run"] = g("zero", "zero") + lone_last.sum(dtype=torch.float64)
    return slots


def finish_segments(batches: Sequence[TokenSums]) -> Tensor:
    """The packed segments of the passes ``batches`` (:class:`~.segments.SegmentWindow`).

    Their segment rows merged by segment, as their rows are into the statistics
    (:func:`finish_statistics`, the token-level slots): ``[S + 1, STATE_SIZE]`` flattened,
    every segment's statistics laid out as the window's.
    """
    per_row = batches[0].plan.segments + 1
    rows = RowSums([_segment_rows(sums, per_row) for sums in batches], groups=per_row)
    slots = finish_statistics(rows)
    state = STATE.identity(rows.count.device).repeat(per_row, 1)
    index = torch.tensor([STATE.at[name] for name in slots], device=state.device)
    state.index_copy_(1, index, torch.stack(list(slots.values()), dim=1).to(state.dtype))
    return state.flatten()


def _segment_rows(sums: TokenSums, per_row: int) -> TokenSums:
    """A pass's segment rows as the rows of a pass of their own."""
    assert sums.segments is not None
    names = ("first", "top", "second", "log_ratio", "shift")
    fields = dict(zip(names, sums.segments, strict=True))
    first = fields["first"]
    fields["first"] = first.unsqueeze(-1) if first.dim() == 2 else first
    return dataclasses.replace(sums, **fields, bottom=None, lag=None, segments=None)
