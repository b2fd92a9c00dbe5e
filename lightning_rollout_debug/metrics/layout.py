"""Packed states: named float64 slots, each declaring how it merges.

A window's state is one float64 vector on the batch's device, so a window crosses ranks
in one collective and reaches the host in one copy. A :class:`Layout` names its slots
in blocks, and each block declares its merge rule, as torchmetrics states declare their
``dist_reduce_fx``:

* ``"count"``: the token count that weights the means (one slot, first);
* ``"mean"``: means, combined by weight;
* ``"comoment"``: centred co-moments ``M_xy`` of pairs of means, combined with Chan's
  formulas: ``M = sum_k M_k + sum_k n_k (mean_k - mean)_x (mean_k - mean)_y``;
* ``"sum"``: sums (``whole=True``: counts, whole numbers ``>= 0``);
* ``"max"``, ``"min"``: extremes;
* ``"top"``: ``k`` candidates of ``len(names)`` fields each, of which the ``k`` with the
  largest first field are kept.

Everything else is generated from the declaration: the identity (an empty window),
the merge of ``n`` states, packing named values, and the checks of a state read from
a checkpoint.

Example:
    >>> import torch
    >>> layout = Layout([Block("sum", ("tokens",), whole=True), Block("max", ("largest",))])
    >>> a = layout.pack({"tokens": torch.tensor(3.0), "largest": torch.tensor(0.5)})
    >>> merged = layout.merge(torch.stack([a, layout.identity()]))
    >>> merged.tolist(), layout.problems(merged)
    ([3.0, 0.5], [])
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

RULES = ("count", "mean", "comoment", "sum", "max", "min", "top")
"""The merge rules a block may declare."""

_EMPTY = {"max": -math.inf, "min": math.inf}  # every other rule starts at 0
_FOLDS = ("sum", "max", "min")  # the rules a merge folds down the states
_EXTREME = {"max": torch.amax, "min": torch.amin}
_FINITE = ("mean", "comoment", "sum")  # never infinite in a state of real tokens
_KINDS = {"mean": "mean", "comoment": "co-moment", "sum": "sum", "max": "maximum", "min": "minimum"}

compiling = getattr(torch.compiler, "is_compiling", None) or torch._dynamo.is_compiling
"""Whether torch.compile is tracing the caller (``torch.compiler`` has it from torch 2.3)."""


def filled(values: Sequence[float], **options: Any) -> Tensor:
    """A vector of ``values`` made with fill kernels: an accelerator gets no host copy.

    ``torch.tensor(values, device=...)`` copies from the host, which the host waits for.

    Example:
        >>> filled((-math.inf, 0.0, -1.0), dtype=torch.float64).tolist()
        [-inf, 0.0, -1.0]
    """
    return torch.cat([torch.full((1,), value, **options) for value in values])


@dataclass(frozen=True)
class Block:
    """Slots that merge alike.

    Args:
        rule: one of :data:`RULES`.
        names: the slots' names; for ``"comoment"`` each name is ``"x*y"`` for the means
            ``x`` and ``y``; for ``"top"``, the fields of one candidate.
        whole: the slots hold counts (whole numbers ``>= 0``).
        k: for ``"top"``: how many candidates are kept.
        empty: for ``"top"``: the fields of a placeholder candidate (its first field must
            lose against any real one).
        ties: for ``"top"``: the fields that order candidates of equal first field, most
            significant first; the smaller value wins.
    """

    rule: str
    names: tuple[str, ...]
    whole: bool = False
    k: int = 0
    empty: tuple[float, ...] = ()
    ties: tuple[str, ...] = ()

    @property
    def size(self) -> int:
        """How many slots the block takes."""
        return len(self.names) * (self.k if self.rule == "top" else 1)


def ranked(candidates: Tensor, ties: Sequence[int]) -> Tensor:
    """The order of ``candidates`` (rows), best first.

    The largest first field first; of equal ones the smallest ``ties`` columns, most
    significant first. Stable sorts, no host synchronisation.
    """
    order = torch.arange(len(candidates), device=candidates.device)
    for column, descending in [*((column, False) for column in reversed(ties)), (0, True)]:
        keys = candidates[:, column].index_select(0, order)
        by_key = torch.sort(keys, descending=descending, stable=True).indices
        order = order.index_select(0, by_key)
    return order


class Layout:
    """A packed float64 state: blocks of named slots and their merge rules.

    The sums merge in one reduction down the states, and adjacent blocks of maxima or of
    minima in one operation each, so a merge costs a handful of kernels whatever the number
    of slots.
    """

    def __init__(self, blocks: Sequence[Block]) -> None:
        for block in blocks:
            if block.rule not in RULES:
                raise ValueError(f"Unknown merge rule {block.rule!r}; valid rules: {RULES}.")
        counts = [block for block in blocks if block.rule == "count"]
        if counts and (blocks[0] is not counts[0] or len(counts) > 1 or counts[0].size != 1):
            raise ValueError("A layout has at most one count slot, and it comes first.")
        self.blocks = tuple(blocks)
        self.at: dict[str, int] = {}
        """The offset of each slot (of the first candidate's fields for ``"top"``)."""
        self.slices: list[tuple[Block, slice]] = []
        offset = 0
        for block in self.blocks:
            for i, name in enumerate(block.names):
                self.at[name] = offset + i
            self.slices.append((block, slice(offset, offset + block.size)))
            offset += block.size
        self.size = offset
        """Length of the packed vector."""
        means = [name for block in self.blocks if block.rule == "mean" for name in block.names]
        self._pairs = [
            tuple(means.index(side) for side in name.split("*"))
            for block in self.blocks
            if block.rule == "comoment"
            for name in block.names
        ]
        self._folds = self._fold_runs()
        self._has_sums = any(rule == "sum" for rule, _ in self._folds)
        self._empty: dict[torch.device, tuple[Tensor, tuple[Tensor, ...]]] = {}
        self._pair_columns: dict[torch.device, tuple[Tensor, Tensor]] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_empty"] = {}  # tensors made on this process's devices
        state["_pair_columns"] = {}
        return state

    def _fold_runs(self) -> list[tuple[str, slice]]:
        """Maximal runs of adjacent blocks that fold with the same reduction."""
        runs: list[tuple[str, slice]] = []
        for block, where in self.slices:
            if block.rule not in _FOLDS:
                continue
            if runs and runs[-1][0] == block.rule and runs[-1][1].stop == where.start:
                runs[-1] = (block.rule, slice(runs[-1][1].start, where.stop))
            else:
                runs.append((block.rule, where))
        return runs

    def identity(self, device: torch.device | str | None = None) -> Tensor:
        """The state of an empty window: merging with it changes nothing.

        Made with fill kernels once per device, so making it on an accelerator copies
        nothing from the host; each call returns a new tensor.
        """
        return self._empty_of(device)[0].clone()

    def _empty_of(self, device: torch.device | str | None) -> tuple[Tensor, tuple[Tensor, ...]]:
        """The empty state on ``device`` and its slots (views of it), made once per device."""
        key = torch.device("cpu") if device is None else torch.device(device)
        if key not in self._empty:
            empty = self._new_empty(key)
            self._empty[key] = (empty, empty.unbind())
        return self._empty[key]

    def _pair_index(self, states: Tensor) -> tuple[Tensor, Tensor]:
        """The columns of each co-moment's two means, as index tensors on the states' device.

        Made once per device; a tensor subclass (fake tensors) gets its own, made with it.
        """
        device = states.device
        if type(states) is not Tensor or device not in self._pair_columns:
            sides = zip(*self._pairs, strict=True)
            x, y = (filled(side, dtype=torch.int64, device=device) for side in sides)
            if type(states) is not Tensor:
                return x, y
            self._pair_columns[device] = (x, y)
        return self._pair_columns[device]

    def _new_empty(self, device: torch.device) -> Tensor:
        options: dict[str, Any] = {"dtype": torch.float64, "device": device}
        parts = []
        for block in self.blocks:
            if block.rule == "top":
                parts.append(filled(block.empty, **options).repeat(block.k))
            else:
                parts.append(torch.full((block.size,), _EMPTY.get(block.rule, 0.0), **options))
        return torch.cat(parts) if parts else torch.zeros(0, **options)

    def pack(self, values: Mapping[str, Tensor], device: torch.device | None = None) -> Tensor:
        """A state holding ``values`` (0-d tensors by slot name); other slots stay empty."""
        sample = next(iter(values.values()), None)
        if device is None:
            device = None if sample is None else sample.device
        if compiling() or (sample is not None and type(sample) is not Tensor):
            # Traced, the empty slots are constants of the kernel that packs the state (a
            # cached tensor made in the trace would be remade, as an output, every call);
            # a tensor subclass (fake tensors) does not mix with cached plain tensors.
            slots = list(self._new_empty(torch.device(device)).unbind())
        else:
            slots = list(self._empty_of(device)[1])
        for name, value in values.items():
            slots[self.at[name]] = value
        return torch.stack(slots)

    def merge(self, states: Tensor, candidates: Tensor | None = None) -> Tensor:
        """Merge states stacked as ``[n, size]`` into one, exactly, on their device.

        ``candidates``: more rows of the top block's fields, ranked with the states' own.
        ``[n, m, size]`` merge into ``[m, size]``, each of the ``m`` on its own (no top).
        """
        # One sum down the whole states serves every run of sums: not one a strided run.
        total = states.sum(0) if self._has_sums else states.new_empty(0)
        parts = [(where.start, _folded(rule, states, total, where)) for rule, where in self._folds]
        count = None
        for block, where in self.slices:
            if block.rule == "count":
                count = states[..., where.start]
                parts.append((where.start, count.sum(0).unsqueeze(-1)))
            elif block.rule == "mean":
                mean_at = where
                weights = count / count.sum(0).clamp(min=1.0)  # type: ignore[union-attr]
                mean = (weights.unsqueeze(-1) * states[..., where]).sum(0)
                parts.append((where.start, mean))
            elif block.rule == "comoment":
                deviation = states[..., mean_at] - mean
                x, y = self._pair_index(states)
                spread = count.unsqueeze(-1) * (  # type: ignore[union-attr]
                    deviation.index_select(-1, x) * deviation.index_select(-1, y)
                )
                parts.append((where.start, states[..., where].sum(0) + spread.sum(0)))
            elif block.rule == "top":
                rows = states[:, where].reshape(-1, len(block.names))
                rows = rows if candidates is None else torch.cat([rows, candidates])
                best = ranked(rows, [block.names.index(name) for name in block.ties])
                parts.append((where.start, rows.index_select(0, best[: block.k]).flatten()))
        if not parts:
            return torch.empty(0, dtype=torch.float64, device=states.device)
        return torch.cat([part for _, part in sorted(parts, key=lambda item: item[0])], dim=-1)

    def problems(self, state: Any, what: str = "the state") -> list[str]:
        """Why ``state`` cannot be a state of this layout built from real tokens (or ``[]``).

        The type, dtype and shape first; then counts are whole numbers ``>= 0``, sums,
        means and co-moments are finite, extremes and candidate keys are no NaN (an
        extreme of an empty window is infinite), squared spreads (``"x*x"``) are not
        negative, and a window without tokens holds empty means and co-moments.
        """
        found = tensor_problems(state, (self.size,), what)
        if found:
            return found
        values = state.tolist()
        for block, where in self.slices:
            for offset, name in zip(range(where.start, where.stop), block.names, strict=False):
                value = values[offset]
                if (block.whole or block.rule == "count") and not _whole(value):
                    label = "the token count" if block.rule == "count" else f"the count `{name}`"
                    found.append(f"{label} of {what} is {value!r}; expected a whole number >= 0")
                elif block.rule in _FINITE and not math.isfinite(value):
                    kind = _KINDS[block.rule]
                    found.append(
                        f"the {kind} `{name}` of {what} is {value!r}; expected a finite number"
                    )
                elif block.rule in ("max", "min") and math.isnan(value):
                    found.append(f"the {_KINDS[block.rule]} `{name}` of {what} is NaN")
                elif block.rule == "comoment" and len(set(name.split("*"))) == 1 and value < 0:
                    found.append(f"the squared spread `{name}` of {what} is negative")
            if block.rule == "top":
                keys = values[where][:: len(block.names)]
                if any(math.isnan(key) for key in keys):
                    found.append(f"a candidate of {what} has a NaN `{block.names[0]}`")
        counted = bool(self.blocks) and self.blocks[0].rule == "count"
        if not found and counted and values[0] == 0 and not self._empty_ok(values):
            found.append(f"{what} holds no tokens but its other statistics are not empty")
        return found

    def _empty_ok(self, values: list[float]) -> bool:
        """Whether a window without tokens is empty but for its counts (``whole`` sums)."""
        empty = self.identity().tolist()
        return all(
            values[offset] == empty[offset]
            for block, where in self.slices
            if not block.whole
            for offset in range(where.start, where.stop)
        )


def _folded(rule: str, states: Tensor, total: Tensor, where: slice) -> Tensor:
    return total[..., where] if rule == "sum" else _EXTREME[rule](states[..., where], 0)


def _whole(value: float) -> bool:
    return math.isfinite(value) and value >= 0 and value == int(value)


def merge_all(
    merges: Sequence[tuple[Layout, Sequence[Tensor | Mapping[str, Tensor]], Tensor | None]],
) -> list[Tensor]:
    """Each layout's states (packed, or named values to pack) and top candidates, merged."""
    merged = []
    for layout, states, candidates in merges:
        packed = [s if isinstance(s, Tensor) else layout.pack(s) for s in states]
        alone = len(packed) == 1 and candidates is None
        merged.append(packed[0] if alone else layout.merge(torch.stack(packed), candidates))
    return merged


def tensor_problems(value: Any, shape: tuple[int, ...], what: str) -> list[str]:
    """Why ``value`` is not a float64 tensor of ``shape`` with readable data (or ``[]``)."""
    if not isinstance(value, Tensor):
        return [f"{what} is a {type(value).__name__}; expected a float64 tensor"]
    if value.is_meta or value.layout != torch.strided:
        return [f"{what} is a {value.device.type} {value.layout} tensor whose data cannot be read"]
    if value.dtype != torch.float64:
        return [f"{what} has dtype {value.dtype}; expected float64"]
    if tuple(value.shape) != shape:
        return [f"{what} has shape {tuple(value.shape)}; expected {shape}"]
    return []


# ------------------------------------------------------------------ the statistics
LAG_MOMENTS = (
    "sum_actor_log_prob_sq",
    "sum_rollout_log_prob_sq",
    "sum_actor_x_rollout",
    "sum_actor_x_next_rollout",
    "sum_next_actor_x_rollout",
    "plus_actor",
    "plus_actor_sq",
    "plus_rollout",
    "plus_rollout_sq",
    "minus_actor",
    "minus_actor_sq",
    "minus_rollout",
    "minus_rollout_sq",
)
"""Sums of ``a^2``, ``b^2`` and ``a_t b_t`` over the counting tokens; over the pairs of
neighbouring tokens that both count, ``a_t b_(t+1)`` and ``a_(t+1) b_t``, and each side's
own sum and sum of squares at lag +1 (``a_t``, ``b_(t+1)``: ``plus_*``) and -1
(``a_(t+1)``, ``b_t``: ``minus_*``)."""

STATE = Layout(
    [
        Block("count", ("count",)),
        # Token-level variables: a mean each, and the centred co-moments of some pairs.
        Block("mean", ("prob_actor", "prob_rollout", "prob_diff", "log_diff")),
        Block(
            "comoment",
            (
                "prob_actor*prob_actor",
                "prob_rollout*prob_rollout",
                "prob_actor*prob_rollout",
                "prob_diff*prob_diff",
                "log_diff*log_diff",
            ),
        ),
        Block("sum", ("nonfinite",), whole=True),
        Block(
            "sum",
            ("log_ratio", "kl_k3", "mult_error_m1", "ratio_m1", "ratio_sq_m1", "ratio", "ratio_sq"),
        ),
        Block("sum", ("ratio_high", "ratio_low", "sequences"), whole=True),
        Block("sum", ("seq_ppl_actor", "seq_ppl_rollout", "seq_log_ratio")),
        Block(
            "sum",
            (
                "seq_outside",
                "id_updates",
                "id_rows",
                "id_diff",
                "id_diff_rows",
                "zero_rollout_log_prob",
                "zero_rollout_log_prob_run",
                "masked_actor_log_prob",
                "neighbour_pairs",
                "pad_updates",
                "pad_in_mask",
            ),
            whole=True,
        ),
        # The moments of the log-probs at lags -1, 0 and +1 along the response.
        Block("sum", ("sum_actor_log_prob", "sum_rollout_log_prob", *LAG_MOMENTS)),
        Block(
            "max",
            (
                "max_prob_diff",
                "max_log_diff",
                "max_log_ratio",
                "max_seq_abs_log_ratio",
                "max_seq_log_ratio",
                "max_actor_log_prob",
                "max_rollout_log_prob",
            ),
        ),
        Block("min", ("min_log_ratio", "min_seq_log_ratio")),
    ]
)
"""The window of :class:`~lightning_rollout_debug.MismatchStats`: counts, means and
co-moments, sums, extremes (the order is that of the checkpoints)."""

STATE_SIZE = STATE.size
"""Length of the packed float64 state vector."""


def identity_state(device: torch.device | str | None = None) -> Tensor:
    """The statistics of an empty window (merging with it changes nothing)."""
    return STATE.identity(device)


def merge_states(states: Tensor) -> Tensor:
    """Merge statistics stacked as ``[n, STATE_SIZE]`` into one, exactly.

    Example:
        >>> import torch
        >>> from lightning_rollout_debug import MismatchStats
        >>> a, b = MismatchStats(), MismatchStats()
        >>> a.update(torch.tensor([[-0.1, -2.0]]), torch.tensor([[-0.2, -2.0]]), torch.ones(1, 2))
        >>> b.update(torch.tensor([[-0.5]]), torch.tensor([[-0.4]]), torch.ones(1, 1))
        >>> merged = merge_states(torch.stack([a.state, b.state]))
        >>> round(MismatchStats.from_state(merged).compute()["rollout_tokens"])
        3
    """
    return STATE.merge(states)


def state_problems(state: Any, what: str = "the window") -> list[str]:
    """Why ``state`` cannot be a window of statistics of real tokens (nothing wrong: ``[]``).

    Example:
        >>> state_problems(identity_state())
        []
        >>> state_problems(torch.zeros(STATE_SIZE, dtype=torch.int64))
        ['the window has dtype torch.int64; expected float64']
    """
    return STATE.problems(state, what)
