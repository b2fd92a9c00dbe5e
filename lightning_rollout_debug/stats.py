"""The statistics of the rollout/trainer mismatch: update, merge, compute.

Everything the package reports is computed here. :class:`MismatchStats` keeps one packed
float64 vector on the batch's device: a token count, means and centred co-moments
(merged with Chan's parallel formulas), sums, maxima and minima. An update is masked
arithmetic on the device with no host synchronisation; merging two windows (or the
windows of several ranks) is exact; :meth:`MismatchStats.compute` copies the packed
vector to the host once and derives every metric of ``docs/metrics.md`` from it.
"""

from __future__ import annotations

import copy
import math
import numbers
import threading
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_rollout_debug import native
from lightning_rollout_debug.batch import MismatchInputs, check_inputs

LOG_PROB_FLOOR = -20.0
"""Log-probabilities are floored here first, so ``-inf`` counts as -20 nats."""

LOG_RATIO_CLAMP = 20.0
"""The log importance ratio is clamped to ``[-20, 20]`` before exponentiation."""

_RATIO_MIN, _RATIO_MAX = math.exp(-LOG_RATIO_CLAMP), math.exp(LOG_RATIO_CLAMP)

GROUPS: tuple[str, ...] = (
    "seed",
    "log_space",
    "kl",
    "importance_ratio",
    "sequence",
    "health",
    "token_ids",
)
"""The metric groups, in the order of ``docs/metrics.md``."""

METRIC_NAMES: dict[str, tuple[str, ...]] = {
    "seed": (
        "rollout_probs_diff_valid",
        "rollout_probs_diff_max",
        "rollout_probs_diff_mean",
        "rollout_probs_diff_std",
        "rollout_actor_probs_pearson_corr",
    ),
    "log_space": (
        "rollout_log_probs_diff_max",
        "rollout_log_probs_diff_mean",
        "rollout_log_probs_diff_std",
    ),
    "kl": ("rollout_actor_kl_k1", "rollout_actor_kl_k3", "rollout_actor_mult_prob_error"),
    "importance_ratio": (
        "rollout_is_ratio_mean",
        "rollout_is_ratio_min",
        "rollout_is_ratio_max",
        "rollout_is_ratio_frac_high",
        "rollout_is_ratio_frac_low",
        "rollout_is_chi2",
        "rollout_is_ess",
    ),
    "sequence": (
        "actor_ppl",
        "rollout_ppl",
        "rollout_actor_log_ppl_diff",
        "rollout_actor_log_ppl_abs_diff_max",
        "rollout_seq_geo_ratio_min",
        "rollout_seq_geo_ratio_max",
        "rollout_seq_frac_outside",
    ),
    "health": ("rollout_tokens", "rollout_sequences", "rollout_nonfinite_tokens"),
    "token_ids": ("rollout_token_diff_count", "rollout_token_diff_seq_frac"),
}
"""The un-prefixed metric names of each group."""

# The packed state. Token-level variables keep a mean each and the centred co-moments
# of the listed pairs; all of them share the token count in slot 0.
_MEANS = ("prob_actor", "prob_rollout", "prob_diff", "log_diff")
_COMOMENTS = (
    ("prob_actor", "prob_actor"),
    ("prob_rollout", "prob_rollout"),
    ("prob_actor", "prob_rollout"),
    ("prob_diff", "prob_diff"),
    ("log_diff", "log_diff"),
)
_SUMS = (
    "nonfinite",
    "log_ratio",
    "kl_k3",
    "mult_error_m1",
    "ratio_m1",
    "ratio_sq_m1",
    "ratio",
    "ratio_sq",
    "ratio_high",
    "ratio_low",
    "sequences",
    "seq_ppl_actor",
    "seq_ppl_rollout",
    "seq_log_ratio",
    "seq_outside",
    "id_updates",
    "id_rows",
    "id_diff",
    "id_diff_rows",
)
_MAXES = (
    "prob_diff",
    "log_diff",
    "log_ratio",
    "seq_abs_log_ratio",
    "seq_log_ratio",
    "actor_log_prob",
    "rollout_log_prob",
)
_MINS = ("log_ratio", "seq_log_ratio")


def _offsets(names: Sequence[Any], start: int) -> dict[Any, int]:
    return {name: start + i for i, name in enumerate(names)}


_COUNT = 0
_MEAN_AT = _offsets(_MEANS, 1)
_COMOMENT_AT = _offsets(_COMOMENTS, 1 + len(_MEANS))
_SUM_AT = _offsets(_SUMS, 1 + len(_MEANS) + len(_COMOMENTS))
_MAX_AT = _offsets(_MAXES, 1 + len(_MEANS) + len(_COMOMENTS) + len(_SUMS))
_MIN_AT = _offsets(_MINS, 1 + len(_MEANS) + len(_COMOMENTS) + len(_SUMS) + len(_MAXES))
STATE_SIZE = 1 + len(_MEANS) + len(_COMOMENTS) + len(_SUMS) + len(_MAXES) + len(_MINS)
"""Length of the packed float64 state vector."""

_MEAN_SLICE = slice(1, 1 + len(_MEANS))
_COMOMENT_SLICE = slice(_MEAN_SLICE.stop, _MEAN_SLICE.stop + len(_COMOMENTS))
_SUM_SLICE = slice(_COMOMENT_SLICE.stop, _COMOMENT_SLICE.stop + len(_SUMS))
_MAX_SLICE = slice(_SUM_SLICE.stop, _SUM_SLICE.stop + len(_MAXES))
_MIN_SLICE = slice(_MAX_SLICE.stop, _MAX_SLICE.stop + len(_MINS))
_PAIRS = [(_MEANS.index(left), _MEANS.index(right)) for left, right in _COMOMENTS]

# A side of the Pearson correlation counts as constant when its spread is below what
# float32 arithmetic can resolve.
_CONSTANT_RELATIVE_STD = 8 * torch.finfo(torch.float32).eps


def identity_state(device: torch.device | str | None = None) -> Tensor:
    """Return the packed state of an empty window (merging with it changes nothing).

    Built with fill kernels, so making it on an accelerator copies nothing from the host.
    """
    options: dict[str, Any] = {"dtype": torch.float64, "device": device}
    return torch.cat(
        [
            torch.zeros(_MAX_SLICE.start, **options),
            torch.full((len(_MAXES),), -math.inf, **options),
            torch.full((len(_MINS),), math.inf, **options),
        ]
    )


_ID_COUNTS = ("id_updates", "id_rows", "id_diff", "id_diff_rows")
_COUNTED = ("nonfinite", "ratio_high", "ratio_low", "sequences", "seq_outside", *_ID_COUNTS)
"""The sums that count tokens or rows: whole numbers."""


def state_problems(state: Any, what: str = "the window") -> list[str]:
    """Why ``state`` cannot be a packed window of real tokens (nothing wrong: ``[]``).

    Checks the type, dtype and shape, then the values: counts are whole numbers, extremes
    are no NaN, squared spreads are not negative, and an empty window is the identity.

    Example:
        >>> state_problems(identity_state())
        []
        >>> state_problems(torch.zeros(STATE_SIZE, dtype=torch.int64))
        ['the window has dtype torch.int64; expected float64']
    """
    problems = tensor_problems(state, (STATE_SIZE,), what)
    if problems:
        return problems
    values = state.tolist()
    count = values[_COUNT]
    for name, value in [("the token count", count)] + [
        (f"the count `{name}`", values[_SUM_AT[name]]) for name in _COUNTED
    ]:
        if not (math.isfinite(value) and value >= 0 and value == int(value)):
            problems.append(f"{name} of {what} is {value!r}; expected a whole number >= 0")
    for table, kind in ((_MAX_AT, "maximum"), (_MIN_AT, "minimum")):
        problems += [
            f"the {kind} `{name}` of {what} is NaN"
            for name, at in table.items()
            if math.isnan(values[at])
        ]
    for (left, right), at in _COMOMENT_AT.items():
        if left == right and values[at] < 0:
            problems.append(f"the squared spread of `{left}` in {what} is negative")
    if count == 0 and not problems:
        empty = identity_state().tolist()
        # Tokens that did not count, and token ids, are compared without counting tokens.
        kept = {_SUM_AT[name] for name in ("nonfinite", *_ID_COUNTS)}
        if any(values[i] != empty[i] for i in range(STATE_SIZE) if i not in kept):
            problems.append(f"{what} holds no tokens but its other statistics are not empty")
    return problems


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


def merge_states(states: Tensor) -> Tensor:
    """Merge packed states stacked as ``[n, STATE_SIZE]`` into one, exactly.

    Counts and sums add, maxima and minima fold, and means with their centred
    co-moments combine with Chan's formulas generalised to ``n`` parts:
    ``M = sum_k M_k + sum_k n_k (mean_k - mean)_i (mean_k - mean)_j``.

    Example:
        >>> import torch
        >>> a, b = MismatchStats(), MismatchStats()
        >>> a.update(torch.tensor([[-0.1, -2.0]]), torch.tensor([[-0.2, -2.0]]), torch.ones(1, 2))
        >>> b.update(torch.tensor([[-0.5]]), torch.tensor([[-0.4]]), torch.ones(1, 1))
        >>> merged = merge_states(torch.stack([a.state, b.state]))
        >>> round(MismatchStats.from_state(merged).compute()["rollout_tokens"])
        3
    """
    counts = states[:, _COUNT]
    total = counts.sum()
    weights = counts / total.clamp(min=1.0)
    means = states[:, _MEAN_SLICE]
    mean = (weights.unsqueeze(1) * means).sum(0)
    deviation = means - mean
    # Column by column: indexing with a list would copy the indices to the device first.
    spread = counts.unsqueeze(1) * torch.stack(
        [deviation[:, left] * deviation[:, right] for left, right in _PAIRS], dim=1
    )
    comoments = states[:, _COMOMENT_SLICE].sum(0) + spread.sum(0)
    return torch.cat(
        [
            total.unsqueeze(0),
            mean,
            comoments,
            states[:, _SUM_SLICE].sum(0),
            states[:, _MAX_SLICE].amax(0),
            states[:, _MIN_SLICE].amin(0),
        ]
    )


class ThreadSafeWindow:
    """A window whose changes hold a lock, so several threads may feed one instance.

    Copies and pickles get a lock of their own (a lock itself cannot be pickled).
    """

    _lock: threading.Lock

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_lock", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


class MismatchStats(ThreadSafeWindow):
    """Mergeable statistics of the mismatch between rollout and trainer log-probabilities.

    Feed it ``[batch, response_length]`` tensors with :meth:`update` (any device, any
    floating dtype, any number of batches); read every metric with :meth:`compute`. The
    window is everything since construction or :meth:`reset`. Two instances merge
    exactly with :meth:`merge`, so per-rank or per-batch windows combine into the
    statistics of all their tokens. :meth:`update` and :meth:`merge` are safe to call from
    several threads at once: each batch's arithmetic runs unlocked, and only adding its
    state to the window holds a lock.

    Args:
        is_threshold: ``C`` of the importance-ratio group: ``rho > C`` counts as high,
            ``rho < 1/C`` as low. Must be greater than 1.
        seq_ratio_bounds: ``(lo, hi)`` with ``0 < lo <= 1 <= hi``: a sequence whose
            geometric-mean ratio falls outside counts in ``rollout_seq_frac_outside``.
        groups: the metric groups to compute, a subset of :data:`GROUPS`
            (default: all). Leaving groups out skips their arithmetic.
        compile: fuse an update into one pass: on CPUs with float32 or bfloat16
            log-probs the package's native kernel (built on first use with the system
            C++ compiler), elsewhere ``torch.compile``. ``None`` (the default) does so
            for blocks of at least 65,536 tokens and falls back to eager arithmetic,
            with one warning, where neither is available; ``False`` never fuses;
            ``True`` fuses every block.
        chunk_tokens: without compilation, rows are processed in chunks of about this
            many tokens, which bounds the temporary memory of an update (default:
            65,536 on the CPU, 4,194,304 on accelerators).

    Example:
        >>> import torch
        >>> stats = MismatchStats()
        >>> rollout = torch.log(torch.tensor([[0.5, 0.25, 0.9]]))
        >>> actor = torch.log(torch.tensor([[0.5, 0.20, 0.9]]))
        >>> stats.update(rollout, actor, torch.tensor([[1, 1, 0]]))
        >>> metrics = stats.compute()
        >>> metrics["rollout_tokens"], round(metrics["rollout_probs_diff_max"], 6)
        (2.0, 0.05)
    """

    def __init__(
        self,
        *,
        is_threshold: float = 2.0,
        seq_ratio_bounds: tuple[float, float] = (0.99, 1.01),
        groups: Iterable[str] | None = None,
        compile: bool | None = None,
        chunk_tokens: int | None = None,
    ) -> None:
        self.is_threshold = validate_is_threshold(is_threshold)
        self.seq_ratio_bounds = validate_seq_ratio_bounds(seq_ratio_bounds)
        self.groups = validate_groups(groups)
        for problem in compile_problems(compile):
            raise ValueError(problem)
        if chunk_tokens is not None and (
            isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1
        ):
            raise ValueError(
                f"`chunk_tokens` must be None (auto) or a positive int, got {chunk_tokens!r}."
            )
        self.compile = compile
        self.chunk_tokens = chunk_tokens
        self._state: Tensor | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ state
    @property
    def state(self) -> Tensor:
        """The packed float64 state vector (the identity when nothing was added)."""
        return identity_state() if self._state is None else self._state

    @property
    def device(self) -> torch.device | None:
        """Where the state lives: the device of the first update, ``None`` before it."""
        return None if self._state is None else self._state.device

    @classmethod
    def from_state(cls, state: Tensor, **kwargs: Any) -> MismatchStats:
        """Build statistics holding a packed ``state`` (for example a merged one)."""
        stats = cls(**kwargs)
        stats.load_state(state)
        return stats

    def load_state(self, state: Tensor) -> None:
        """Replace the window with a packed state vector of length :data:`STATE_SIZE`."""
        if state.shape != (STATE_SIZE,):
            raise ValueError(f"A packed state has shape ({STATE_SIZE},); got {tuple(state.shape)}.")
        copied = state.detach().to(torch.float64).clone()
        with self._lock:
            self._state = copied

    def reset(self) -> None:
        """Start a new, empty window."""
        with self._lock:
            self._state = None

    def merge(self, other: MismatchStats | Tensor) -> MismatchStats:
        """Add the window of ``other`` (statistics or a packed state) to this one."""
        incoming = other.state if isinstance(other, MismatchStats) else other
        if incoming.shape != (STATE_SIZE,):
            raise ValueError(
                f"A packed state has shape ({STATE_SIZE},); got {tuple(incoming.shape)}."
            )
        self._add([incoming.detach().to(torch.float64).clone()])
        return self

    def _add(self, parts: list[Tensor], device: torch.device | None = None) -> None:
        """Merge packed states into the window, under the lock.

        The window ends on ``device`` (by default where it is, else where ``parts`` are).
        """
        with self._lock:
            if self._state is not None:
                parts = [self._state, *parts]
            device = parts[0].device if device is None else device
            parts = [part.to(device) for part in parts]
            self._state = parts[0] if len(parts) == 1 else merge_states(torch.stack(parts))

    def synced(
        self,
        all_gather: Callable[[Tensor], Tensor],
        device: torch.device | str | None = None,
    ) -> MismatchStats:
        """Return the window of all processes merged, with one collective; ``self`` is unchanged.

        ``all_gather`` maps this process's packed state to the ``[world_size,
        STATE_SIZE]`` stack of every process's (for example
        ``trainer.strategy.all_gather``). Every process must call it, empty window or
        not, so the shapes agree. ``device`` is where the collective runs (the
        strategy's root device); by default the device of the window.
        """
        local = self.state if device is None else self.state.to(device)
        gathered = all_gather(local).reshape(-1, STATE_SIZE).to(torch.float64)
        merged = copy.copy(self)
        merged._state = merge_states(gathered)
        return merged

    # ----------------------------------------------------------------- update
    @torch.no_grad()
    def update(
        self,
        rollout_log_probs: Tensor,
        old_log_probs: Tensor,
        mask: Tensor,
        rollout_token_ids: Tensor | None = None,
        trainer_token_ids: Tensor | None = None,
    ) -> None:
        """Add one batch to the window.

        Args:
            rollout_log_probs: ``[B, T]`` log-probs the rollout engine recorded (``b``).
            old_log_probs: ``[B, T]`` log-probs the trainer recomputed (``a``).
            mask: ``[B, T]``; a position counts where it is non-zero.
            rollout_token_ids: optional ``[B, T]`` token ids the rollout produced.
            trainer_token_ids: optional ``[B, T]`` token ids the trainer used.

        Raises:
            ValueError: the tensors have the wrong type, rank, shape, dtype or devices.
        """
        inputs = check_inputs(
            rollout_log_probs, old_log_probs, mask, rollout_token_ids, trainer_token_ids
        )
        batch, width = inputs.mask.shape
        device = inputs.mask.device
        if batch * width > 0:
            parts = self._block_states(inputs)
        else:
            parts = [identity_state(device)]
            if "token_ids" in self.groups and inputs.rollout_token_ids is not None:
                # An empty batch with token ids still compared ids: zero differences, not NaN.
                parts[0][_SUM_AT["id_updates"]] = 1.0
        self._add(parts, device)

    def _block_states(self, inputs: MismatchInputs) -> list[Tensor]:
        """Packed states of the batch: one fused block, or eager chunks of rows."""
        tensors = (
            inputs.rollout_log_probs,
            inputs.old_log_probs,
            inputs.mask,
            inputs.rollout_token_ids,
            inputs.trainer_token_ids,
        )
        options = {
            "groups": self.groups,
            "is_threshold": self.is_threshold,
            "seq_ratio_bounds": self.seq_ratio_bounds,
        }
        batch, width = inputs.mask.shape
        cpu = inputs.mask.device.type == "cpu"

        def blocks(state_of: Callable[..., Tensor], fused: bool) -> list[Tensor]:
            # The compiled pass stores nothing per token, so one call takes the whole batch
            # (up to 2^26 tokens, which keeps its per-row partial sums small); eager
            # arithmetic goes in chunks that bound its temporaries.
            eager_chunk = self.chunk_tokens or (1 << 16 if cpu else 1 << 22)
            rows = max(1, (1 << 26 if fused else eager_chunk) // width)
            return [
                state_of(
                    *(None if t is None else t[start : start + rows] for t in tensors), **options
                )
                for start in range(0, batch, rows)
            ]

        if cpu and fusion_wanted(self.compile, batch * width):
            state = self._native_state(inputs)
            if state is not None:
                return [state]
        return run_fused(_batch_state, self.compile, batch * width, blocks)

    def _native_state(self, inputs: MismatchInputs) -> Tensor | None:
        """Packed state of a CPU batch from the native kernel; ``None`` where it does not apply."""
        rows = native.row_sums(
            inputs.rollout_log_probs,
            inputs.old_log_probs,
            inputs.mask,
            self.groups,
            self.is_threshold,
            ROW_FIELDS,
        )
        if rows is None:
            return None
        ids = (inputs.rollout_token_ids, inputs.trainer_token_ids)
        return _state_from_rows(rows, inputs.mask, *ids, self.groups, self.seq_ratio_bounds)

    # ---------------------------------------------------------------- compute
    def compute(self) -> dict[str, float]:
        """Return every metric of the enabled groups as Python floats (NaN if undefined).

        One device-to-host copy of the packed state; the rest is host arithmetic.
        """
        values = self.state.tolist()
        metrics = _metrics_from_state(values, self.is_threshold, self.seq_ratio_bounds)
        return {
            name: metrics[name]
            for group in GROUPS
            if group in self.groups
            for name in METRIC_NAMES[group]
        }

    def largest_log_probs(self) -> tuple[float, float]:
        """The largest counting ``(old_log_probs, rollout_log_probs)`` of the window.

        Log-probabilities are at most 0; a positive maximum means the inputs are
        something else (logits, negative log-likelihoods). ``-inf`` for an empty window.
        Reads the state, so call it on a host copy to avoid a second transfer.
        """
        values = self.state.tolist()
        return values[_MAX_AT["actor_log_prob"]], values[_MAX_AT["rollout_log_prob"]]

    # ------------------------------------------------------------ persistence
    def state_dict(self) -> dict[str, Any]:
        """The window and the configuration, on the CPU, for checkpoints."""
        return {
            "state": self.state.detach().cpu().clone(),
            "is_threshold": self.is_threshold,
            "seq_ratio_bounds": tuple(self.seq_ratio_bounds),
            "groups": sorted(self.groups),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a window saved by :meth:`state_dict` (the configuration stays as built)."""
        self.load_state(state_dict["state"])


# ---------------------------------------------------------------------- validation
def validate_is_threshold(value: float) -> float:
    """Return ``value`` as a float if it is a finite number greater than 1."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not (1.0 < float(value) < math.inf)
    ):
        raise ValueError(f"`is_threshold` must be a finite number greater than 1, got {value!r}.")
    return float(value)


def validate_seq_ratio_bounds(value: Sequence[float]) -> tuple[float, float]:
    """Return ``(lo, hi)`` if ``0 < lo <= 1 <= hi < inf``."""
    try:
        lo, hi = (float(bound) for bound in value)
    except (TypeError, ValueError):
        lo = hi = math.nan
    if not (0.0 < lo <= 1.0 <= hi < math.inf):
        raise ValueError(
            f"`seq_ratio_bounds` must be (lo, hi) with 0 < lo <= 1 <= hi, got {value!r}."
        )
    return lo, hi


def compile_problems(compile: object) -> list[str]:
    """What is wrong with a ``compile`` argument (nothing: ``[]``)."""
    if compile in (None, True, False):
        return []
    return [f"`compile` must be None (auto), True or False, got {compile!r}."]


def validate_groups(groups: Iterable[str] | None) -> frozenset[str]:
    """Return the chosen groups as a set, or all of :data:`GROUPS` for ``None``."""
    if groups is None:
        return frozenset(GROUPS)
    if isinstance(groups, str):
        groups = [groups]
    chosen = frozenset(groups)
    unknown = sorted(chosen - set(GROUPS))
    if unknown:
        raise ValueError(f"Unknown metric groups {unknown}; valid groups are {list(GROUPS)}.")
    return chosen


# ---------------------------------------------------------------------- the math
_FUSE_MIN_TOKENS = 1 << 16
_fusion: dict[str, Any] = {"functions": {}, "disabled": None}
# Inductor stores a reused element-wise result in memory once its expression exceeds 50
# operations on CPUs; recomputing it in registers is cheaper than a round trip to memory.
# Fused multiply-adds round once instead of twice: faster and no less exact.
# Up to 64 reductions share one loop (16 by default), so the catalog reads the batch once.
_COMPILE_OPTIONS = {
    "realize_cpu_opcount_threshold": 1000,
    "cpp.enable_floating_point_contract_flag": "fast",
    "cpp.max_horizontal_fusion_size": 64,
}


def run_fused(
    function: Callable[..., Tensor],
    compile: bool | None,
    tokens: int,
    blocks: Callable[[Callable[..., Tensor], bool], list[Tensor]],
) -> list[Tensor]:
    """``blocks(function, fused)`` with ``function`` compiled when this batch should be.

    ``compile`` is ``None`` (compile batches of at least 65,536 tokens), ``True`` or
    ``False``. Where compilation fails, one warning says so and the process stays eager.
    """
    if fusion_wanted(compile, tokens) and _fusion["disabled"] is None:
        try:  # torch.compile may raise when called, or at the first call of its result
            return blocks(_compiled(function), True)
        except Exception as error:  # compilation unavailable here: stay eager from now on
            _disable_fusion(error)
    return blocks(function, False)


def fusion_wanted(compile: bool | None, tokens: int) -> bool:
    """Whether a batch of ``tokens`` goes through a fused pass under this ``compile``."""
    return compile is True or (compile is None and tokens >= _FUSE_MIN_TOKENS)


def _compiled(function: Callable[..., Tensor]) -> Callable[..., Tensor]:
    if function not in _fusion["functions"]:
        import torch._inductor.config as inductor_config  # imported only when compiling

        # Options an older inductor does not know are left out (it would reject them).
        options = {k: v for k, v in _COMPILE_OPTIONS.items() if _has_option(inductor_config, k)}
        _fusion["functions"][function] = torch.compile(function, dynamic=True, options=options)
    return _fusion["functions"][function]


def _has_option(config: Any, dotted: str) -> bool:
    for part in dotted.split("."):
        if not hasattr(config, part):
            return False
        config = getattr(config, part)
    return True


def _disable_fusion(error: Exception) -> None:
    _fusion["disabled"] = repr(error)
    warnings.warn(
        f"torch.compile is not usable here ({error!r}); the rollout statistics use eager "
        "arithmetic (the same results to float32 rounding, slower). Pass compile=False to "
        "skip the attempt.",
        RuntimeWarning,
        stacklevel=3,
    )


ROW_FIELDS: tuple[str, ...] = (
    "count",
    "nonfinite",
    "max_actor_log_prob",
    "max_rollout_log_prob",
    "sum_actor_log_prob",
    "sum_rollout_log_prob",
    "prob_actor",
    "prob_rollout",
    "prob_diff",
    "prob_actor*prob_actor",
    "prob_rollout*prob_rollout",
    "prob_actor*prob_rollout",
    "prob_diff*prob_diff",
    "max_prob_diff",
    "max_log_ratio",
    "max_neg_log_ratio",
    "log_diff",
    "log_diff*log_diff",
    "log_ratio",
    "kl_k3",
    "mult_error_m1",
    "ratio_m1",
    "ratio_sq_m1",
    "ratio",
    "ratio_sq",
    "ratio_high",
    "ratio_low",
)
"""The per-row reductions of an update, in the column order of the native CPU kernel."""


def _batch_state(
    rollout_log_probs: Tensor,
    old_log_probs: Tensor,
    mask: Tensor,
    rollout_token_ids: Tensor | None,
    trainer_token_ids: Tensor | None,
    *,
    groups: frozenset[str],
    is_threshold: float,
    seq_ratio_bounds: tuple[float, float],
) -> Tensor:
    """Packed state of one ``[B, T]`` block: masked arithmetic only, nothing leaves the device.

    Every token-level quantity is reduced along the rows first (one pass over the
    block that a compiler fuses into a single kernel), then the ``[B]`` row sums are
    combined.
    """
    rows = _row_sums(rollout_log_probs, old_log_probs, mask, groups, is_threshold)
    return _state_from_rows(
        rows, mask, rollout_token_ids, trainer_token_ids, groups, seq_ratio_bounds
    )


def _row_sums(
    rollout_log_probs: Tensor,
    old_log_probs: Tensor,
    mask: Tensor,
    groups: frozenset[str],
    is_threshold: float,
) -> dict[str, Tensor]:
    """The ``[B]`` row reductions of :data:`ROW_FIELDS` that ``groups`` need.

    Element-wise work runs in float32 (float64 for float64 inputs); products and every
    sum are float64, so the centred moments that follow from these power sums round
    below ``1e-16 * (mean / std)^2`` relative. Counts are integers, maxima keep the
    element dtype (``-inf`` for a row without counting tokens).
    """
    f64 = torch.float64
    a, b, r, masked, finite = counting_tokens(rollout_log_probs, old_log_probs, mask)
    counting = masked & finite

    def row_sum(value: Tensor) -> Tensor:
        return value.to(f64).sum(1)

    def row_count_of(flags: Tensor) -> Tensor:  # integer lanes are cheaper than float64 ones
        return flags.sum(1, dtype=torch.int32)

    def row_max(value: Tensor) -> Tensor:
        return torch.where(counting, value, -math.inf).amax(1)

    rows = {
        "count": row_count_of(counting),
        "nonfinite": row_count_of(masked & ~finite),
        # The largest log-probs: above 0 they are no log-probabilities (found without a sync).
        "max_actor_log_prob": row_max(a),
        "max_rollout_log_prob": row_max(b),
    }
    if "sequence" in groups:
        # Exact sums of the inputs, whereas a float32 r rounds by up to 1e-6 at |r| = 20
        # and can move g_i across a bound.
        rows["sum_actor_log_prob"], rows["sum_rollout_log_prob"] = row_sum(a), row_sum(b)
    values: dict[str, Tensor] = {}
    if {"seed", "kl", "importance_ratio"} & groups:
        prob_rollout = exp(b)
        prob_actor = exp(a)
        diff = prob_diff(prob_actor, prob_rollout, r)
        values.update(prob_actor=prob_actor, prob_rollout=prob_rollout, prob_diff=diff)
    if "seed" in groups:
        rows["max_prob_diff"] = row_max(diff)
    if "log_space" in groups or "importance_ratio" in groups:
        # The extremes of abs(r) and of clamp(r) all follow from those of r (clamp is
        # monotone): two running maxima instead of four.
        rows["max_log_ratio"], rows["max_neg_log_ratio"] = row_max(r), row_max(-r)
    if "log_space" in groups:
        values["log_diff"] = r.abs()
    # Masked before widening: float64 lanes are the expensive ones.
    wide = {name: torch.where(counting, values[name], 0.0).to(f64) for name in _moments_of(groups)}
    for name, value in wide.items():
        rows[name] = value.sum(1)
    for left, right in _COMOMENTS:
        if left in wide and right in wide:
            rows[f"{left}*{right}"] = (wide[left] * wide[right]).sum(1)
    if "kl" in groups or "importance_ratio" in groups:
        # No exponential of its own: rho = pa / pb (clamped like r), and near r = 0 the
        # series of e^r - 1 - r (shared with prob_diff) keeps the digits rho - 1 would lose.
        near_zero = r.abs() < 0.5
        curvature = r * r * _exp_tail(r)  # e^r - 1 - r
        far = (prob_actor / prob_rollout).clamp(_RATIO_MIN, _RATIO_MAX)
        ratio = torch.where(near_zero, 1.0 + (r + curvature), far)
        ratio_m1 = torch.where(near_zero, r + curvature, far - 1.0)
        if "sequence" not in groups:  # otherwise from the exact row sums of the inputs
            rows["log_ratio"] = row_sum(r)
    if "kl" in groups:
        rows["kl_k3"] = row_sum(torch.where(near_zero, curvature, ratio_m1 - r))
        # e^|r| - 1 = |pa - pb| / min(pa, pb): no cancellation, and no clamp (|r| > 20 only
        # comes from positive "log-probs").
        rows["mult_error_m1"] = row_sum(diff / torch.minimum(prob_actor, prob_rollout))
    if "importance_ratio" in groups:
        rows["ratio_m1"] = row_sum(ratio_m1)
        rows["ratio_sq_m1"] = row_sum(ratio_m1 * (ratio_m1 + 2.0))  # rho^2 - 1
        # Plain sums for the ESS: n + sum(rho - 1) loses every digit when rho << 1.
        rows["ratio"] = row_sum(torch.where(counting, ratio, 0.0))
        rows["ratio_sq"] = row_sum(torch.where(counting, ratio * ratio, 0.0))
        rows["ratio_high"] = row_count_of(counting & (ratio_m1 > is_threshold - 1.0))
        rows["ratio_low"] = row_count_of(counting & (ratio_m1 < 1.0 / is_threshold - 1.0))
    return rows


def _state_from_rows(
    rows: dict[str, Tensor],
    mask: Tensor,
    rollout_token_ids: Tensor | None,
    trainer_token_ids: Tensor | None,
    groups: frozenset[str],
    seq_ratio_bounds: tuple[float, float],
) -> Tensor:
    """Packed state of a block from its row reductions (and its token ids, if compared)."""
    f64 = torch.float64

    def total(name: str) -> Tensor:
        return rows[name].to(f64).sum()

    def largest(name: str) -> Tensor:
        return rows[name].amax().to(f64)

    row_count = rows["count"].to(f64)
    count = row_count.sum()
    sums = {"nonfinite": total("nonfinite")}
    maxes = {
        "actor_log_prob": largest("max_actor_log_prob"),
        "rollout_log_prob": largest("max_rollout_log_prob"),
    }
    mins: dict[str, Tensor] = {}
    moments = _moments_of(groups)
    power = {name: total(name) for name in moments}
    cross = {
        (left, right): total(f"{left}*{right}")
        for left, right in _COMOMENTS
        if left in moments and right in moments
    }
    if "seed" in groups:
        maxes["prob_diff"] = largest("max_prob_diff")
    if "log_space" in groups or "importance_ratio" in groups:
        # An empty block keeps +-inf.
        r_max, r_min = largest("max_log_ratio"), -largest("max_neg_log_ratio")
    if "log_space" in groups:
        maxes["log_diff"] = torch.maximum(r_max, -r_min)
    if "sequence" in groups:
        sum_a, sum_b = rows["sum_actor_log_prob"], rows["sum_rollout_log_prob"]
    if "kl" in groups or "importance_ratio" in groups:
        sums["log_ratio"] = (sum_a - sum_b).sum() if "sequence" in groups else total("log_ratio")
    if "kl" in groups:
        sums["kl_k3"] = total("kl_k3")
        sums["mult_error_m1"] = total("mult_error_m1")
    if "importance_ratio" in groups:
        for name in ("ratio_m1", "ratio_sq_m1", "ratio", "ratio_sq", "ratio_high", "ratio_low"):
            sums[name] = total(name)
        maxes["log_ratio"], mins["log_ratio"] = (
            torch.where(x.isinf(), x, x.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
            for x in (r_max, r_min)
        )
    if "health" in groups or "sequence" in groups:
        sums["sequences"] = (row_count > 0).sum(dtype=f64)
    if "sequence" in groups:
        _sequence_sums(sum_a, sum_b, sum_a - sum_b, row_count, seq_ratio_bounds, sums, maxes, mins)
    if "token_ids" in groups and rollout_token_ids is not None and trainer_token_ids is not None:
        masked = mask != 0
        differs = masked & (rollout_token_ids != trainer_token_ids)
        sums["id_updates"] = torch.ones((), dtype=f64, device=mask.device)
        sums["id_rows"] = masked.any(1).sum(dtype=f64)
        sums["id_diff"] = differs.sum(1, dtype=torch.int32).to(f64).sum()
        sums["id_diff_rows"] = differs.any(1).sum(dtype=f64)
    means, comoments = _centre(count, power, cross)
    return _pack(count, means, comoments, sums, maxes, mins)


def _moments_of(groups: frozenset[str]) -> tuple[str, ...]:
    """The token-level variables whose means and co-moments ``groups`` report."""
    seed = ("prob_actor", "prob_rollout", "prob_diff") if "seed" in groups else ()
    return seed + (("log_diff",) if "log_space" in groups else ())


def counting_tokens(
    rollout_log_probs: Tensor, old_log_probs: Tensor, mask: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The handling rules of the catalog, element-wise: ``(a, b, r, masked, finite)``.

    Log-probs are floored at :data:`LOG_PROB_FLOOR` in float32 (float64 for float64
    inputs); a token counts where ``masked & finite`` (mask non-zero, neither log-prob
    NaN or +inf). ``a`` (old), ``b`` (rollout) and ``r = a - b`` are zero where a token
    does not count, so plain sums skip those tokens.
    """
    f64 = torch.float64
    dtype = f64 if f64 in (old_log_probs.dtype, rollout_log_probs.dtype) else torch.float32
    a = old_log_probs.to(dtype).clamp(min=LOG_PROB_FLOOR)
    b = rollout_log_probs.to(dtype).clamp(min=LOG_PROB_FLOOR)
    masked = mask != 0
    finite = (a < math.inf) & (b < math.inf)  # floored: neither NaN nor +inf
    counting = masked & finite
    a = torch.where(counting, a, 0.0)
    b = torch.where(counting, b, 0.0)
    return a, b, a - b, masked, finite


def prob_diff(prob_actor: Tensor, prob_rollout: Tensor, r: Tensor) -> Tensor:
    """``abs(pa - pb)`` without losing digits, from ``pa = exp(a)``, ``pb = exp(b)``, ``r``.

    ``pa - pb = pb * expm1(r)``, with the series of ``expm1``, for ``|r| < 1/2``: no
    cancellation when the two are close. Farther apart the subtraction loses at most a
    factor 5 of rounding, whereas the rounding of ``r`` (up to 1e-6 at ``|r| = 20``) would
    cost digits.
    """
    close = r.abs() < 0.5
    return torch.where(close, prob_rollout * _expm1_near_zero(r), prob_actor - prob_rollout).abs()


def _centre(
    count: Tensor, power: dict[str, Tensor], cross: dict[tuple[str, str], Tensor]
) -> tuple[dict[str, Tensor], dict[tuple[str, str], Tensor]]:
    """Means and centred co-moments from float64 power sums: ``M_xy = S_xy - S_x S_y / n``."""
    scale = 1.0 / count.clamp(min=1.0)
    means = {name: total * scale for name, total in power.items()}
    comoments = {
        (left, right): (total - power[left] * power[right] * scale).clamp(
            min=0.0 if left == right else -math.inf
        )
        for (left, right), total in cross.items()
    }
    return means, comoments


def _sequence_sums(
    sum_a: Tensor,
    sum_b: Tensor,
    sum_r: Tensor,
    row_count: Tensor,
    bounds: tuple[float, float],
    sums: dict[str, Tensor],
    maxes: dict[str, Tensor],
    mins: dict[str, Tensor],
) -> None:
    """Sequence statistics from the float64 row sums of ``a``, ``b`` and ``r``."""
    has_tokens = row_count > 0
    per_row = row_count.clamp(min=1.0)
    mean_r = sum_r / per_row  # log of the geometric-mean ratio; zero for empty rows
    zero = torch.zeros((), dtype=sum_r.dtype, device=sum_r.device)
    sums["seq_ppl_actor"] = torch.where(has_tokens, torch.exp(-sum_a / per_row), zero).sum()
    sums["seq_ppl_rollout"] = torch.where(has_tokens, torch.exp(-sum_b / per_row), zero).sum()
    sums["seq_log_ratio"] = mean_r.sum()
    geo = torch.exp(mean_r)
    outside = has_tokens & ((geo < bounds[0]) | (geo > bounds[1]))
    sums["seq_outside"] = outside.sum(dtype=sum_r.dtype)
    maxes["seq_abs_log_ratio"] = torch.where(has_tokens, mean_r.abs(), -math.inf).amax()
    maxes["seq_log_ratio"] = torch.where(has_tokens, mean_r, -math.inf).amax()
    mins["seq_log_ratio"] = torch.where(has_tokens, mean_r, math.inf).amin()


def exp(x: Tensor) -> Tensor:
    """``e^x`` as ``2^(x log2 e)``, element-wise.

    The same function, but a compiler that stores every reused ``exp`` result in memory
    (inductor on CPUs) keeps this one in registers. Rounding ``x log2 e`` costs at most
    ``|x| * 6e-8`` relative in float32: 1.2e-6 at the log-prob floor, 6e-8 at ``x = -1``.
    """
    return torch.exp2(x * 1.4426950408889634)  # a literal: dynamo lifts global floats


def _exp_tail(x: Tensor) -> Tensor:
    """``(e^x - 1 - x) / x^2 = sum_{n >= 2} x^(n-2) / n!`` for ``|x| < 1/2`` (Horner).

    Summed up to ``x^8 / 8!`` in float32 and ``x^14 / 14!`` in float64: for ``|x| < 1/2``
    the truncation is below the dtype's resolution (relative to ``e^x - 1``: 1.1e-8 and
    5e-17; to ``e^x - 1 - x``: 4.3e-8 and 1.9e-16). Compilers may lower ``expm1`` to
    ``exp(x) - 1``, which loses every digit for tiny ``x``; the series keeps them, and
    one evaluation serves ``expm1`` and ``e^x - 1 - x`` alike.
    """
    highest = 14 if x.dtype == torch.float64 else 8
    tail = torch.full_like(x, 1.0 / math.factorial(highest))
    for order in range(highest - 1, 1, -1):
        tail = tail * x + 1.0 / math.factorial(order)
    return tail


def _expm1_near_zero(x: Tensor) -> Tensor:
    """``e^x - 1`` for ``|x| < 1/2``, to a few ulp."""
    return x + x * x * _exp_tail(x)


def _pack(
    count: Tensor,
    means: dict[str, Tensor],
    comoments: dict[tuple[str, str], Tensor],
    sums: dict[str, Tensor],
    maxes: dict[str, Tensor],
    mins: dict[str, Tensor],
) -> Tensor:
    slots = list(identity_state(count.device).unbind())
    slots[_COUNT] = count
    for table, offsets in (
        (means, _MEAN_AT),
        (comoments, _COMOMENT_AT),
        (sums, _SUM_AT),
        (maxes, _MAX_AT),
        (mins, _MIN_AT),
    ):
        for name, value in table.items():
            slots[offsets[name]] = value
    return torch.stack(slots)


# ------------------------------------------------------------------- the metrics
def _metrics_from_state(
    state: list[float], is_threshold: float, bounds: tuple[float, float]
) -> dict[str, float]:
    """Every metric of every group from a packed state on the host (NaN if undefined)."""
    nan = math.nan
    n = state[_COUNT]

    def mean(name: str) -> float:
        return state[_MEAN_AT[name]] if n >= 1 else nan

    def std(name: str) -> float:
        return math.sqrt(max(state[_COMOMENT_AT[(name, name)]], 0.0) / (n - 1)) if n >= 2 else nan

    def total(name: str) -> float:
        return state[_SUM_AT[name]]

    def per_token(name: str) -> float:
        return total(name) / n if n >= 1 else nan

    def extreme(value: float) -> float:
        return value if n >= 1 and math.isfinite(value) else nan

    seqs = total("sequences")
    id_rows = total("id_rows")
    sum_ratio = total("ratio")
    sum_ratio_sq = total("ratio_sq")
    max_log_ratio = state[_MAX_AT["log_ratio"]]
    min_log_ratio = state[_MIN_AT["log_ratio"]]
    seq_max = state[_MAX_AT["seq_log_ratio"]]
    seq_min = state[_MIN_AT["seq_log_ratio"]]
    has_seqs = seqs >= 1
    return {
        "rollout_probs_diff_valid": 1.0 if n >= 1 else 0.0,
        "rollout_probs_diff_max": extreme(state[_MAX_AT["prob_diff"]]),
        "rollout_probs_diff_mean": mean("prob_diff"),
        "rollout_probs_diff_std": std("prob_diff"),
        "rollout_actor_probs_pearson_corr": _pearson(state, n),
        "rollout_log_probs_diff_max": extreme(state[_MAX_AT["log_diff"]]),
        "rollout_log_probs_diff_mean": mean("log_diff"),
        "rollout_log_probs_diff_std": std("log_diff"),
        "rollout_actor_kl_k1": -per_token("log_ratio"),
        "rollout_actor_kl_k3": per_token("kl_k3"),
        "rollout_actor_mult_prob_error": 1.0 + per_token("mult_error_m1"),
        "rollout_is_ratio_mean": 1.0 + per_token("ratio_m1"),
        "rollout_is_ratio_min": math.exp(min_log_ratio) if n >= 1 else nan,
        "rollout_is_ratio_max": math.exp(max_log_ratio) if n >= 1 else nan,
        "rollout_is_ratio_frac_high": per_token("ratio_high"),
        "rollout_is_ratio_frac_low": per_token("ratio_low"),
        "rollout_is_chi2": per_token("ratio_sq_m1"),
        "rollout_is_ess": sum_ratio**2 / (n * sum_ratio_sq) if sum_ratio_sq > 0 else nan,
        "actor_ppl": total("seq_ppl_actor") / seqs if has_seqs else nan,
        "rollout_ppl": total("seq_ppl_rollout") / seqs if has_seqs else nan,
        "rollout_actor_log_ppl_diff": -total("seq_log_ratio") / seqs if has_seqs else nan,
        "rollout_actor_log_ppl_abs_diff_max": state[_MAX_AT["seq_abs_log_ratio"]]
        if has_seqs
        else nan,
        "rollout_seq_geo_ratio_min": _exp(seq_min) if has_seqs else nan,
        "rollout_seq_geo_ratio_max": _exp(seq_max) if has_seqs else nan,
        "rollout_seq_frac_outside": total("seq_outside") / seqs if has_seqs else nan,
        "rollout_tokens": n,
        "rollout_sequences": seqs,
        "rollout_nonfinite_tokens": total("nonfinite"),
        "rollout_token_diff_count": total("id_diff") if total("id_updates") >= 1 else nan,
        "rollout_token_diff_seq_frac": total("id_diff_rows") / id_rows if id_rows >= 1 else nan,
    }


def _exp(x: float) -> float:
    """``math.exp`` that overflows to ``inf`` instead of raising (absurd positive log-probs)."""
    return math.exp(x) if x < 709.0 else math.inf


def _pearson(state: list[float], n: float) -> float:
    return pearson_from_moments(
        n,
        state[_MEAN_AT["prob_actor"]],
        state[_MEAN_AT["prob_rollout"]],
        state[_COMOMENT_AT[("prob_actor", "prob_actor")]],
        state[_COMOMENT_AT[("prob_rollout", "prob_rollout")]],
        state[_COMOMENT_AT[("prob_actor", "prob_rollout")]],
    )


def pearson_from_moments(
    n: float, mean_x: float, mean_y: float, m_xx: float, m_yy: float, m_xy: float
) -> float:
    """Pearson correlation from a count, two means and the centred co-moments.

    NaN when ``n < 2`` or when either side is constant: its standard deviation is
    below what float32 arithmetic resolves relative to its mean.
    """
    if n < 2:
        return math.nan
    for m_self, center in ((m_xx, mean_x), (m_yy, mean_y)):
        if math.sqrt(max(m_self, 0.0) / n) <= _CONSTANT_RELATIVE_STD * abs(center):
            return math.nan
        if m_self <= 0.0:
            return math.nan
    return max(-1.0, min(1.0, m_xy / math.sqrt(m_xx * m_yy)))


def paired_moments(x: Tensor, y: Tensor, keep: Tensor) -> Tensor:
    """``[n, mean_x, mean_y, M_xx, M_yy, M_xy]`` of the pairs where ``keep`` holds, in float64.

    The same masked power-sum arithmetic as the window statistics; no host
    synchronisation.
    """
    f64 = torch.float64
    x = torch.where(keep, x, 0).to(f64)
    y = torch.where(keep, y, 0).to(f64)
    count = keep.sum(dtype=f64)
    pairs = (("x", "x"), ("y", "y"), ("x", "y"))
    values = {"x": x, "y": y}
    power = {name: value.sum() for name, value in values.items()}
    cross = {(left, right): (values[left] * values[right]).sum() for left, right in pairs}
    means, comoments = _centre(count, power, cross)
    return torch.stack([count, means["x"], means["y"], *(comoments[pair] for pair in pairs)])
