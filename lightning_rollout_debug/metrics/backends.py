"""The road of a batch: which pass reads it, and the one call that adds it to the windows.

:func:`add_batch` reads a checked batch once and adds it to a window of statistics and a
window of extras (either may be absent):

* On CPUs, float32 and bfloat16 log-probs go through the native kernel (:mod:`.native`)
  unless ``compile=False``: one pass, finished into packed states.
* On accelerators, :func:`~.token_pass.token_sums` compiled with ``torch.compile``
  (unless ``compile=False``; on CPUs only with ``compile=True``): one graph for every
  batch size.
* Everywhere else, and where compiling fails, :func:`~.token_pass.token_sums` eagerly:
  a fixed number of torch operations at every size (one pass per 4,194,304 tokens of
  rows, which bounds the memory of larger batches).

Every path counts the same tokens into the same packed states, to float32 rounding. A
compiled pass that fails falls back to the eager one with one warning, and the batch is
counted in full.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_rollout_debug.metrics import native
from lightning_rollout_debug.metrics.inputs import MismatchInputs
from lightning_rollout_debug.metrics.layout import STATE
from lightning_rollout_debug.metrics.pass_constants import constants
from lightning_rollout_debug.metrics.planes import PassPlan
from lightning_rollout_debug.metrics.rows import token_id_slots
from lightning_rollout_debug.metrics.token_pass import TokenSums, read_sums, token_sums

CHUNK_TOKENS = 1 << 22
"""The most tokens one pass reads: a larger batch is read in passes of whole rows."""


class Window(Protocol):
    """A window a batch is added to: statistics or extras."""

    def _add(self, parts: list[Any], device: torch.device | None = None) -> None: ...


def add_batch(
    inputs: MismatchInputs,
    token_ids: Tensor | None,
    *,
    stats: Any | None,
    extras: Any | None,
    batch: int = 0,
    rank: int = 0,
) -> None:
    """Add a checked batch to ``stats`` and ``extras`` (either may be ``None``), in one read.

    ``token_ids`` label the worst tokens; ``batch`` and ``rank`` too. The statistics'
    token-id comparison is added as a packed state of its own.
    """
    device = inputs.mask.device
    rows, width = inputs.mask.shape
    compile = (stats if stats is not None else extras).compile
    if rows * width == 0:
        if stats is not None:
            stats._add(_empty_statistics(inputs, stats.groups), device)
        return
    if _native_pass(inputs, token_ids, stats, extras, batch, rank, compile):
        return
    plan = pass_plan(stats, extras)
    chunks = [w.chunk_tokens for w in (stats, extras) if w is not None and w.chunk_tokens]
    step = max(1, min(chunks, default=CHUNK_TOKENS) // width)
    tensors = (inputs.rollout_log_probs, inputs.old_log_probs, inputs.mask, token_ids)
    for first in range(0, rows, step):
        part = (
            tensors
            if step >= rows
            else [t if t is None else t[first : first + step] for t in tensors]
        )
        with torch.no_grad():  # out= arguments refuse tensors that require grad
            sums = read_pass(plan, *part, compile=compile, batch=batch, rank=rank, first_row=first)
        if stats is not None:
            stats._add([sums], device)
        if extras is not None:
            extras._add([sums], device)
    if stats is not None and "token_ids" in stats.groups:
        stats._add(_token_id_states(inputs), device)


def pass_plan(stats: Any | None, extras: Any | None) -> PassPlan:
    """What one pass computes for ``stats`` and ``extras``."""
    return PassPlan(
        groups=frozenset() if stats is None else stats.groups,
        is_threshold=2.0 if stats is None else stats.is_threshold,
        histograms=extras is not None and bool(extras.histograms),
        worst_tokens_k=0 if extras is None else extras.worst_tokens_k,
        profile=extras is not None and extras.profile,
    )


def read_pass(
    plan: PassPlan,
    rollout_log_probs: Tensor,
    old_log_probs: Tensor,
    mask: Tensor,
    token_ids: Tensor | None,
    *,
    compile: bool | None,
    batch: int = 0,
    rank: int = 0,
    first_row: int = 0,
) -> TokenSums:
    """The :class:`~.token_pass.TokenSums` of one pass, compiled or eagerly.

    Compiled on accelerators unless ``compile=False``, on CPUs only with ``True``; where
    compiling fails, eagerly from then on, with one warning.
    """
    cpu = mask.device.type == "cpu"
    tensors = (rollout_log_probs, old_log_probs, mask, token_ids)
    width = mask.shape[1]
    labels = {"batch": batch, "rank": rank, "first_row": first_row}
    if (compile if cpu else compile is not False) and plan not in _compiling["failed"]:
        f64 = torch.float64
        dtype = f64 if f64 in (rollout_log_probs.dtype, old_log_probs.dtype) else torch.float32
        constants(dtype, mask)  # made once, before the trace reads them
        try:  # torch.compile may raise when called, or at the first call of its result
            fields = _compiled(plan)(*tensors)
            return read_sums(plan, width, fields, compiled=True, **labels)
        except Exception as error:  # this plan stays eager from now on
            _compile_failed(plan, error)
    return read_sums(plan, width, token_sums(plan, *tensors), **labels)


def compile_problems(compile: object) -> list[str]:
    """What is wrong with a ``compile`` argument (nothing: ``[]``)."""
    if compile is None or isinstance(compile, bool):
        return []
    return [f"`compile` must be None (auto), True or False, got {compile!r}."]


def native_wanted(compile: bool | None) -> bool:
    """Whether a CPU batch goes through the native kernel: at every size, unless ``False``.

    The kernel's fixed cost is below that of eager arithmetic, so there is no size under
    which the torch path would be faster, and no cliff in cost between two sizes.
    """
    return compile is not False


def prepare_native(compile: bool | None) -> bool:
    """Load the kernel now where CPU batches will use it; whether it is usable.

    For a loop about to feed CPU batches (the callback calls it at the Trainer's
    ``setup``), so that the first step does not wait for it (see :func:`.native.prepare`).
    """
    return native_wanted(compile) and native.prepare()


def token_id_states(inputs: MismatchInputs, groups: frozenset[str]) -> list[Tensor]:
    """The token-id comparison of a batch as a packed state of its own (``[]``: none)."""
    return _token_id_states(inputs) if "token_ids" in groups else []


def _token_id_states(inputs: MismatchInputs) -> list[Tensor]:
    slots = token_id_slots(inputs.mask, inputs.rollout_token_ids, inputs.trainer_token_ids)
    return [STATE.pack(slots, inputs.mask.device)] if slots else []


def _empty_statistics(inputs: MismatchInputs, groups: frozenset[str]) -> list[Tensor]:
    """The statistics of a batch without tokens: empty, but for token ids compared."""
    state = STATE.identity(inputs.mask.device)
    if "token_ids" in groups and inputs.rollout_token_ids is not None:
        # An empty batch with token ids still compared ids: zero differences, not NaN.
        state[STATE.at["id_updates"]] = 1.0
    return [state]


def _native_pass(
    inputs: MismatchInputs,
    token_ids: Tensor | None,
    stats: Any | None,
    extras: Any | None,
    batch: int,
    rank: int,
    compile: bool | None,
) -> bool:
    """Add a CPU batch with one pass of the native kernel; whether it did."""
    if inputs.mask.device.type != "cpu" or not native_wanted(compile):
        return False
    device = inputs.mask.device
    if extras is not None:
        taken, statistics = extras._kernel_add(inputs, token_ids, batch, rank, stats)
        if taken and stats is not None:
            stats._add([statistics, *token_id_states(inputs, stats.groups)], device)
        return taken
    if stats is None:
        return False
    found = native.states(
        inputs.rollout_log_probs,
        inputs.old_log_probs,
        inputs.mask,
        _rows_for(stats.groups),
        stats.is_threshold,
        _row_fields(),
        statistics=native.StateRequest(stats.groups, stats.seq_ratio_bounds),
    )
    if found is None:
        return False
    stats._add([found[0], *token_id_states(inputs, stats.groups)], device)
    return True


def _rows_for(groups: frozenset[str]) -> frozenset[str]:
    from lightning_rollout_debug.metrics.rows import rows_for

    return rows_for(groups)


def _row_fields() -> tuple[str, ...]:
    from lightning_rollout_debug.metrics.rows import ROW_FIELDS

    return ROW_FIELDS


# ------------------------------------------------------------ torch.compile
_compiling: dict[str, Any] = {"functions": {}, "failed": {}}
"""The compiled passes by plan, and why those that failed to compile stay eager (by plan:
the error)."""
# Every row reduction of a pass has the shape [B, T] -> [B]: reductions of one shape
# share a kernel up to `max_fusion_size` nodes (a default update has about 150).
# Inductor's CPU code stores a reused element-wise result once its expression exceeds 50
# operations; recomputing it in registers is cheaper than a round trip to memory.
# Fused multiply-adds round once instead of twice: faster and no less exact.
# A concatenation of the tokens' slots and values feeding the scatter-add is computed in
# its loop, never stored. A reduction over long rows, few of them, stays one kernel.
_COMPILE_OPTIONS = {
    "max_fusion_size": 256,
    "realize_cpu_opcount_threshold": 1000,
    "cpp.enable_floating_point_contract_flag": "fast",
    "cpp.max_horizontal_fusion_size": 256,
    "force_pointwise_cat": True,
    "split_reductions": False,
}


def _compiled(plan: PassPlan) -> Callable[..., tuple[Any, ...]]:
    """:func:`~.token_pass.token_sums` for ``plan``, compiled once (``dynamic=True``)."""
    if plan not in _compiling["functions"]:
        import torch._inductor.config as inductor_config  # imported only when compiling

        # Options an older inductor does not know are left out (it would reject them), and
        # one it takes as a switch (the contraction flag, before torch 2.7) is switched on.
        options = {
            name: _as_its_type(_option(inductor_config, name), value)
            for name, value in _COMPILE_OPTIONS.items()
            if _option(inductor_config, name) is not _MISSING
        }
        function = functools.partial(token_sums, plan)
        _compiling["functions"][plan] = torch.compile(function, dynamic=True, options=options)
    return _compiling["functions"][plan]


_MISSING = object()


def _option(config: Any, dotted: str) -> Any:
    """The current value of inductor's option ``dotted`` (``_MISSING``: no such option)."""
    for part in dotted.split("."):
        config = getattr(config, part, _MISSING)
        if config is _MISSING:
            break
    return config


def _as_its_type(current: Any, value: Any) -> Any:
    return bool(value) if isinstance(current, bool) else value


def _compile_failed(plan: PassPlan, error: Exception) -> None:
    """Keep ``plan`` eager from now on; warn at the first plan that fails."""
    _compiling["failed"][plan] = repr(error)
    if len(_compiling["failed"]) > 1:
        return
    warnings.warn(
        f"torch.compile of the rollout metrics failed with torch {torch.__version__} "
        f"({error!r}); they are computed eagerly from now on, the same values to float32 "
        "rounding, in a fixed number of operations a batch. Pass compile=False to skip "
        "the attempt.",
        RuntimeWarning,
        stacklevel=4,
    )
