"""From the sums of one pass or many to packed states: the finishing of a window's batches.

:func:`~.token_pass.token_sums` leaves each batch as :class:`~.token_pass.TokenSums`:
sums, extremes and centred squares per row, counted bins and candidates per batch. A
window keeps them as they come and finishes them together when it folds: every row of
every waiting batch is a small window of its own, and :func:`finish_statistics` merges
them all into one packed state of :data:`~.layout.STATE` (Chan's formulas for the second
moments, sums and extremes for the rest), :func:`finish_extras` into one packed extras
state. A fold of many batches costs what a fold of one does.

Everything is float64 arithmetic on a few vectors, on the batches' device.

Example:
    >>> import torch
    >>> from lightning_rollout_debug.metrics.token_pass import PassPlan, read_sums, token_sums
    >>> plan = PassPlan(frozenset({"seed"}))
    >>> rollout, old = torch.log(torch.tensor([[0.5, 0.25]])), torch.log(torch.tensor([[0.5, 0.2]]))
    >>> sums = read_sums(plan, 2, token_sums(plan, rollout, old, torch.ones(1, 2)))
    >>> state = finish_statistics([sums])
    >>> from lightning_rollout_debug.metrics.layout import STATE
    >>> state[STATE.at["count"]].item(), round(state[STATE.at["max_prob_diff"]].item(), 6)
    (2.0, 0.05)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from lightning_rollout_debug.metrics.layout import STATE, Layout, filled, ranked
from lightning_rollout_debug.metrics.token_pass import POSITION_PLANES, TokenSums, places
from lightning_rollout_debug.metrics.tokens import LOG_RATIO_CLAMP
from lightning_rollout_debug.metrics.worst_tokens import PLACEHOLDER, WORST_FIELDS, WORST_TIES


def _rows(batches: Sequence[TokenSums], field: str) -> Tensor:
    """The per-row ``field`` of every batch, side by side along the rows, in float64.

    A compiled pass leaves lists of ``[B]`` rows (``[2 * 16]`` of them for the lag
    products), stacked here.
    """
    parts = [_stacked(getattr(sums, field), field) for sums in batches]
    joined = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return joined.to(torch.float64)


def _log_ratios(batches: Sequence[TokenSums]) -> Tensor:
    """Each row's float64 sum of ``r``."""
    parts = [_stacked(sums.log_ratio, "log_ratio").to(torch.float64) for sums in batches]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _row_count(sums: TokenSums) -> int:
    first = sums.first
    return first.shape[1] if isinstance(first, Tensor) else len(first[0])


def _stacked(rows: Tensor | Sequence[Tensor], field: str) -> Tensor:
    if isinstance(rows, Tensor):
        return rows
    stacked = torch.stack(list(rows))
    if field == "lag":
        return stacked.view(2, 4, 4, -1).permute(0, 3, 1, 2)
    return stacked.unsqueeze(-1) if field == "first" else stacked


class RowSums:
    """The rows of a window's waiting batches, and what they merge to.

    ``totals``, ``top`` and ``bottom`` are each plane's sum, largest and smallest value
    over every counting token; ``moments`` the centred second moment ``M`` of each
    centred plane and ``means`` their means, merged over the rows with Chan's formula.
    """

    def __init__(self, batches: Sequence[TokenSums]) -> None:
        plan = batches[0].plan
        self.plan = plan
        self.at = plan.at
        first = _rows(batches, "first").squeeze(-1)  # [planes, rows]
        self.first = first
        self.n = first[self.at["one"]]
        self.count = self.n.sum()
        self.totals = first.sum(1)
        self.row_top = _rows(batches, "top")
        self.top = self.row_top.amax(1)
        self.bottom = _rows(batches, "bottom").amin(1)
        centred = first[plan.centred]
        rows = self.n.clamp(min=1.0)
        shift = torch.cat(
            [  # a compiled pass leaves its values where they are
                torch.zeros_like(centred[:, :1].expand(-1, len(_stacked(sums.top, "top")[0])))
                if sums.shift is None
                else sums.shift.squeeze(-1).to(torch.float64)
                for sums in batches
            ],
            dim=1,
        )
        offset = centred - self.n * shift  # each row's sum of its centred values, about 0
        row_means = centred / rows
        self.means = self.totals[plan.centred] / self.count.clamp(min=1.0)
        deviation = row_means - self.means.unsqueeze(1)
        second = _rows(batches, "second")
        squares = len(offset)
        # Chan: each row's own centred sums, plus its mean's deviation from the window's.
        within = second[:squares] - offset * offset / rows
        self.moments = (within + self.n * deviation * deviation).sum(1)
        self._products = {}
        for i, (left, right) in enumerate((("pa", "pb"), ("a", "b"))):
            x, y = self.at[left] - plan.centred.start, self.at[right] - plan.centred.start
            within = second[squares + i] - offset[x] * offset[y] / rows
            self._products[left, right] = (within + self.n * deviation[x] * deviation[y]).sum()
        self.shift = shift
        self.lag = _rows(batches, "lag") if batches[0].lag is not None else None  # [2, rows, 4, 4]
        self.log_ratio = _log_ratios(batches)
        """Each row's sum of ``r``, in float64."""
        self.widths = [sums.width for sums in batches]

    def total(self, name: str) -> Tensor:
        """The sum of plane ``name`` over every counting token."""
        return self.totals[self.at[name]]

    def moment(self, name: str) -> Tensor:
        """``M`` of centred plane ``name``: the sum of squared deviations from its mean."""
        return self.moments[self.at[name] - self.plan.centred.start]

    def mean(self, name: str) -> Tensor:
        """The mean of centred plane ``name``."""
        return self.means[self.at[name] - self.plan.centred.start]

    def squares(self, name: str) -> Tensor:
        """The plain sum of squares of centred plane ``name``: ``M + (sum x)^2 / n``."""
        return self.moment(name) + self.total(name) ** 2 / self.count.clamp(min=1.0)

    def comoment(self, left: str, right: str) -> Tensor:
        """``M_xy``: the sum of the products of the deviations of ``pa, pb`` or ``a, b``."""
        return self._products[left, right]

    def extreme(self, kind: str, name: str) -> Tensor:
        """The largest (``"max"``) or smallest (``"min"``) of plane ``name``."""
        return (self.top if kind == "max" else self.bottom)[self.at[name]]


def finish_statistics(
    batches: Sequence[TokenSums], seq_ratio_bounds: tuple[float, float] = (0.99, 1.01)
) -> Tensor:
    """The packed statistics (:data:`~.layout.STATE`) of the tokens of ``batches``.

    The batches share one plan (a window's). Slots of groups the plan leaves out stay
    empty, as do those of the token-id checks (their own states).
    """
    rows = RowSums(batches)
    groups = rows.plan.groups
    slots: dict[str, Tensor] = {
        "count": rows.count,
        "nonfinite": rows.total("masked") - rows.count,
        "max_actor_log_prob": rows.extreme("max", "a"),
        "max_rollout_log_prob": rows.extreme("max", "b"),
    }
    if "seed" in groups:
        slots |= {
            "prob_actor": rows.mean("pa"),
            "prob_rollout": rows.mean("pb"),
            "prob_diff": rows.mean("d"),
            "prob_actor*prob_actor": rows.moment("pa"),
            "prob_rollout*prob_rollout": rows.moment("pb"),
            "prob_actor*prob_rollout": rows.comoment("pa", "pb"),
            "prob_diff*prob_diff": rows.moment("d"),
            "max_prob_diff": rows.extreme("max", "d"),
        }
    if "log_space" in groups:
        slots |= {
            "log_diff": rows.mean("l"),
            "log_diff*log_diff": rows.moment("l"),
            "max_log_diff": rows.extreme("max", "l"),
        }
    if {"kl", "importance_ratio"} & groups:
        slots["log_ratio"] = rows.log_ratio.sum()
    if "kl" in groups:
        slots["kl_k3"] = rows.total("k3")
        slots["mult_error_m1"] = rows.total("mult")
    if "importance_ratio" in groups:
        slots |= _importance_ratio(rows)
    if "sequence" in groups or "health" in groups:
        slots |= _sequences(rows, seq_ratio_bounds, "sequence" in groups)
    if "health" in groups:
        slots |= _health(rows)
    return STATE.pack(slots)


def _importance_ratio(rows: RowSums) -> dict[str, Tensor]:
    ratio_m1 = rows.total("e")  # e = rho - 1
    extremes = (rows.extreme("max", "r"), rows.extreme("min", "r"))
    clamped = [
        torch.where(x.isinf(), x, x.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)) for x in extremes
    ]
    return {
        "ratio_m1": ratio_m1,
        "ratio_sq_m1": rows.squares("e") + 2.0 * ratio_m1,  # rho^2 - 1 = e^2 + 2 e
        "ratio": rows.total("rho"),
        "ratio_sq": rows.squares("rho"),
        "ratio_high": rows.total("hi"),
        "ratio_low": rows.total("hilo") - rows.total("hi"),
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
    at = rows.at
    count = rows.count.clamp(min=1.0)
    sum_a, sum_b = rows.total("a"), rows.total("b")
    m_ab = rows.comoment("a", "b")
    slots = {
        "zero_rollout_log_prob": rows.total("zero"),
        "masked_actor_log_prob": rows.total("ninf_a"),
        "sum_actor_log_prob": sum_a,
        "sum_rollout_log_prob": sum_b,
        "sum_actor_log_prob_sq": rows.squares("a"),
        "sum_rollout_log_prob_sq": rows.squares("b"),
        "sum_actor_x_rollout": m_ab + sum_a * sum_b / count,
    }
    # Each row's products of neighbours x_t y_(t+1), and of their squares (the lag planes).
    plain, squared = rows.lag.sum(1).unbind()  # [4, 4] each, summed over the rows
    plane = {name: i for i, name in enumerate(("zero", "one", "a", "b"))}

    def g(left: str, right: str, of: Tensor = plain) -> Tensor:
        return of[plane[left], plane[right]]

    plain_sums = {
        "neighbour_pairs": g("one", "one"),
        "plus_actor": g("a", "one"),
        "plus_actor_sq": g("a", "one", squared),
        "plus_rollout": g("one", "b"),
        "plus_rollout_sq": g("one", "b", squared),
        "minus_actor": g("one", "a"),
        "minus_actor_sq": g("one", "a", squared),
        "minus_rollout": g("b", "one"),
        "minus_rollout_sq": g("b", "one", squared),
        "sum_actor_x_next_rollout": g("a", "b"),
        "sum_next_actor_x_rollout": g("b", "a"),
    }
    plain = plain_sums
    slots |= plain
    # A row's padding zeros: each right after another, and a lone one at its last token.
    code = rows.row_top[at["code"]]  # 4 t + 2 zero_t + zero_(t-1) at each row's last token
    lone_last = (code >= 0) & (torch.remainder(code, 4) >= 2) & (torch.remainder(code, 2) == 0)
    slots["zero_rollout_log_prob_run"] = g("zero", "zero") + lone_last.sum(dtype=torch.float64)
    return slots


def finish_extras(batches: Sequence[TokenSums], layout: Layout) -> Tensor:
    """The packed extras (laid out by ``layout``) of the tokens of ``batches``.

    The histograms' bins and moments, the ``k`` worst tokens of all the batches'
    candidates, and the profile, as :class:`~.extras.TokenExtras` lays them out.
    """
    plan = batches[0].plan
    rows = RowSums(batches)
    device = rows.count.device
    parts: dict[str, Tensor] = {}
    if plan.parts:
        counts = _summed(batches, "counts").split([size for _, size in plan.parts])
        parts = dict(zip((name for name, _ in plan.parts), counts, strict=True))
        _drop_uncounted(parts, batches, rows)
    pieces = []
    if plan.histograms:
        for value, bins in (("r", parts["ratio"]), ("d", parts.get("diff"))):
            if bins is None:  # |pa - pb|'s bins add up its fine bins
                bins = torch.zeros(_DIFF_BINS, dtype=torch.float64, device=device)
                bins.index_add_(0, _fine_to_diff(device), parts["fine_d"])
            square_root = "l" if value == "r" else "d"  # r^2 = |r|^2
            moments = [
                rows.count,
                rows.extreme("min", value),
                rows.extreme("max", value),
                rows.log_ratio.sum() if value == "r" else rows.total(value),
                rows.squares(square_root),
            ]
            pieces += [bins, torch.stack(moments)]
    if plan.worst_tokens_k:
        pieces.append(_worst_block(batches, plan.worst_tokens_k, device))
    if plan.profile:
        position = _by_position(batches)
        probability = _summed(batches, "probability")
        width = torch.full((), float(max(rows.widths)), dtype=torch.float64, device=device)
        pieces += [
            parts["fine_d"],
            parts["fine_l"],
            position[0],
            parts["probability"],
            parts["joint"].flip(0),  # counted backwards
            position[1],
            position[2],
            probability[0],
            probability[1],
            torch.stack([rows.extreme("max", "d"), rows.extreme("max", "l"), width]),
        ]
    return torch.cat(pieces)


def _by_position(batches: Sequence[TokenSums]) -> Tensor:
    """The tokens, ``|pa - pb|`` and k3 summed by position bucket over the batches."""
    rows = [
        torch.stack([sums.position[sums.position_planes.index(name)] for name in POSITION_PLANES])
        for sums in batches
    ]
    return (rows[0] if len(rows) == 1 else torch.stack(rows).sum(0)).to(torch.float64)


def _drop_uncounted(parts: dict[str, Tensor], batches: Sequence[TokenSums], rows: RowSums) -> None:
    """Take the tokens that do not count out of the counted bins an eager pass filled.

    An eager pass counts them too, every one in its part's bin of 0 values (their values
    are cleared to 0).
    """
    eager = [sums for sums in batches if sums.uncounted]
    if not eager:
        return
    tokens = sum(_row_count(sums) * sums.width for sums in eager)
    if len(eager) == len(batches):
        counted = rows.count
    else:
        at = rows.at["one"]
        counted = sum(_stacked(sums.first, "first")[at].to(torch.float64).sum() for sums in eager)
    for name, part in parts.items():
        part[ZERO_BINS[name]] -= tokens - counted


def _zero_bins() -> dict[str, int]:
    """The bin of a token whose values are all 0, in each counted part."""
    from lightning_rollout_debug.metrics.bins import LOG_RATIO_BINS
    from lightning_rollout_debug.metrics.profile import JOINT_BINS
    from lightning_rollout_debug.metrics.token_pass import _JOINT_EDGES, _PROBABILITY_EDGES

    zero = torch.zeros(())
    ratio = int(torch.bucketize(zero, torch.tensor(LOG_RATIO_BINS.edges), right=True))
    probability = int(torch.bucketize(zero, torch.tensor(_PROBABILITY_EDGES[torch.float32])))
    joint = int(torch.bucketize(zero, torch.tensor(_JOINT_EDGES)))
    side = len(JOINT_BINS.edges) + 1
    return {
        "ratio": ratio,
        "diff": 0,
        "fine_d": 0,
        "fine_l": 0,
        "probability": probability,
        "joint": joint * side + joint,  # a's bin and b's, counted backwards
    }


ZERO_BINS = _zero_bins()
"""The bin, in each counted part, of a token whose values are all 0."""


def _summed(batches: Sequence[TokenSums], field: str) -> Tensor:
    parts = [getattr(sums, field) for sums in batches]
    total = parts[0] if len(parts) == 1 else torch.stack(parts).sum(0)
    return total.to(torch.float64)


_DIFF_BINS = 110
_FINE_TO_DIFF: dict[torch.device, Tensor] = {}


def _fine_to_diff(device: torch.device) -> Tensor:
    """The ``|pa - pb|`` histogram's bin of each of its fine bins (the first two nest)."""
    if device not in _FINE_TO_DIFF:
        from lightning_rollout_debug.metrics.bins import PROBS_DIFF_BINS
        from lightning_rollout_debug.metrics.profile import QUANTILE_BINS

        fine, bins = QUANTILE_BINS[0][2], PROBS_DIFF_BINS
        steps = torch.arange(-1, len(fine.edges), device=device)
        steps = (steps >> (fine.bits - bins.bits)) - bins.steps * (bins.low - fine.low)
        _FINE_TO_DIFF[device] = steps.clamp(-1, bins.top) + 1
    return _FINE_TO_DIFF[device]


def _worst_block(batches: Sequence[TokenSums], k: int, device: torch.device) -> Tensor:
    """The best ``k`` of every batch's worst-token candidates, as the packed ``"top"`` block."""
    found = [sums.worst for sums in batches]
    keys = torch.cat([w[0] for w in found])
    place = places(keys).to(torch.float64)
    a, b = torch.cat([w[1] for w in found], dim=1).unbind()
    ids = [w[2] for w in found]
    sizes = [len(w[0]) for w in found]

    def label(value: Callable[[TokenSums], int]) -> Tensor:  # each candidate's, by fills
        return torch.cat(
            [
                torch.full((n,), float(value(s)), dtype=torch.float64, device=device)
                for s, n in zip(batches, sizes, strict=True)
            ]
        )

    batch, rank = label(lambda s: s.batch), label(lambda s: s.rank)
    width, first = label(lambda s: s.width), label(lambda s: s.first_row * s.width)
    place = place + first
    r = (a - b).to(torch.float64)  # float32 r, as it was ranked (and as the kernel reports it)
    if all(i is None for i in ids):
        token_id = torch.full_like(r, -1.0)
    else:
        token_id = torch.cat(
            [
                torch.full((n,), -1.0, dtype=torch.float64, device=device)
                if i is None
                else i.to(torch.float64)
                for i, n in zip(ids, sizes, strict=True)
            ]
        )
    row = torch.div(place, width, rounding_mode="floor")
    columns = [
        r.abs(),
        r,
        a.to(torch.float64).exp(),
        b.to(torch.float64).exp(),
        batch,
        row,
        place - row * width,
        token_id,
        rank,
    ]
    candidates = torch.stack(columns, dim=1)
    placeholder = filled(PLACEHOLDER, dtype=torch.float64, device=device)
    counted = keys > -(1 << 32)  # a token that does not count has -inf's bits above
    candidates = torch.where(counted.unsqueeze(1), candidates, placeholder)
    if len(candidates) < k:
        candidates = torch.cat([candidates, placeholder.repeat(k - len(candidates), 1)])
    best = ranked(candidates, [WORST_FIELDS.index(name) for name in WORST_TIES])
    return candidates.index_select(0, best[:k]).flatten()
