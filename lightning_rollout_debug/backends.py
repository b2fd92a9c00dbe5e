"""Which path serves an update: the native CPU kernel, ``torch.compile``, or eager torch.

* On CPUs, float32 and bfloat16 log-probs go through the native kernel (:mod:`.native`)
  at every size, unless ``compile=False``: one pass, finished into the packed state.
* On accelerators, every batch goes through ``torch.compile`` of the same torch
  arithmetic (:mod:`.rows`), unless ``compile=False``: it keeps nothing per token in
  memory and takes the whole batch in one call. One compilation serves every size (a
  handful of kernel launches for the statistics, where eager arithmetic launches
  hundreds).
* Everything else (other dtypes on CPUs, ``compile=False``, and every case where the
  kernel or the compiler is unavailable) runs eagerly, in chunks of rows that bound the
  temporary memory.

Every path computes the same row quantities (:data:`~.rows.ROWS_OF_GROUP`) and the same
packed state, to float32 rounding. A path that fails falls back to the next with one
warning, and the batch is counted in full.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_rollout_debug import native
from lightning_rollout_debug.batch import MismatchInputs
from lightning_rollout_debug.layout import STATE
from lightning_rollout_debug.rows import ROW_FIELDS, batch_state, rows_for, token_id_slots


def statistics_states(
    inputs: MismatchInputs,
    *,
    groups: frozenset[str],
    is_threshold: float,
    seq_ratio_bounds: tuple[float, float],
    compile: bool | None,
    chunk_tokens: int | None,
) -> list[Tensor]:
    """Packed states of a non-empty batch: one fused block, or eager chunks of rows."""
    tensors = (
        inputs.rollout_log_probs,
        inputs.old_log_probs,
        inputs.mask,
        inputs.rollout_token_ids,
        inputs.trainer_token_ids,
    )
    options = {"groups": groups, "is_threshold": is_threshold, "seq_ratio_bounds": seq_ratio_bounds}
    batch, width = inputs.mask.shape
    cpu = inputs.mask.device.type == "cpu"

    def blocks(state_of: Callable[..., Tensor], fused: bool) -> list[Tensor]:
        # The compiled pass stores nothing per token, so one call takes the whole batch
        # (up to 2^26 tokens, which keeps its per-row partial sums small); eager
        # arithmetic goes in chunks that bound its temporaries.
        eager_chunk = chunk_tokens or (1 << 16 if cpu else 1 << 22)
        rows = max(1, (1 << 26 if fused else eager_chunk) // width)
        return [
            state_of(*(None if t is None else t[start : start + rows] for t in tensors), **options)
            for start in range(0, batch, rows)
        ]

    if cpu and native_wanted(compile):
        found = native.states(
            inputs.rollout_log_probs,
            inputs.old_log_probs,
            inputs.mask,
            rows_for(groups),
            is_threshold,
            ROW_FIELDS,
            statistics=native.StateRequest(groups, seq_ratio_bounds),
        )
        if found is not None:
            return [found[0], *token_id_states(inputs, groups)]
    # On CPUs torch.compile only when asked for: where the kernel cannot serve, a
    # compilation (tens of seconds) costs more than eager arithmetic saves.
    return run_fused(batch_state, bool(compile) if cpu else compile, blocks)


def token_id_states(inputs: MismatchInputs, groups: frozenset[str]) -> list[Tensor]:
    """The token-id comparison of a batch as a packed state of its own (``[]``: none)."""
    if "token_ids" not in groups:
        return []
    slots = token_id_slots(inputs.mask, inputs.rollout_token_ids, inputs.trainer_token_ids)
    return [STATE.pack(slots, inputs.mask.device)] if slots else []


def compile_problems(compile: object) -> list[str]:
    """What is wrong with a ``compile`` argument (nothing: ``[]``)."""
    if compile is None or isinstance(compile, bool):
        return []
    return [f"`compile` must be None (auto), True or False, got {compile!r}."]


# ------------------------------------------------------------ torch.compile
_fusion: dict[str, Any] = {"functions": {}, "failed": {}}
"""The compiled functions, and why those that failed to compile stay eager (by function:
the error; the others stay compiled)."""
# Inductor stores a reused element-wise result in memory once its expression exceeds 50
# operations on CPUs; recomputing it in registers is cheaper than a round trip to memory.
# Fused multiply-adds round once instead of twice: faster and no less exact.
# Up to 64 reductions share one loop (16 by default), so the catalog reads the batch once.
# A packed state is a concatenation of dozens of scalars: written by one kernel, not by
# one kernel each (planned for a GPU, 45 of the statistics' 62 kernels wrote its slots).
# A reduction over long rows, few of them, stays one kernel: split in two, each of the
# dozens of row sums would take a second kernel of its own (58 kernels for 1 x 65,536).
_COMPILE_OPTIONS = {
    "realize_cpu_opcount_threshold": 1000,
    "cpp.enable_floating_point_contract_flag": "fast",
    "cpp.max_horizontal_fusion_size": 64,
    "force_pointwise_cat": True,
    "split_reductions": False,
}


def run_fused(
    function: Callable[..., Tensor],
    compile: bool | None,
    blocks: Callable[[Callable[..., Tensor], bool], list[Tensor]],
) -> list[Tensor]:
    """``blocks(function, fused)`` with ``function`` compiled unless ``compile`` is False.

    Where compilation fails, one warning says so and ``function`` stays eager.
    """
    if compile is not False and function not in _fusion["failed"]:
        try:  # torch.compile may raise when called, or at the first call of its result
            return blocks(_compiled(function), True)
        except Exception as error:  # this function stays eager from now on
            _compile_failed(function, error)
    return blocks(function, False)


def native_wanted(compile: bool | None) -> bool:
    """Whether a CPU batch goes through the native kernel: at every size, unless ``False``.

    The kernel's fixed cost is below that of eager arithmetic, so there is no size under
    which the torch path would be faster, and no cliff in cost between two sizes.
    """
    return compile is not False


def prepare_native(compile: bool | None) -> bool:
    """Start building the kernel in the background where CPU batches will use it.

    For a loop about to feed CPU batches (the callback calls it at the Trainer's
    ``setup``): the build runs while the model is set up and the first batch is made.
    Whether a build or load started (see :func:`.native.prepare`).
    """
    return native_wanted(compile) and native.prepare()


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


def _compile_failed(function: Callable[..., Tensor], error: Exception) -> None:
    """Keep ``function`` eager from now on; warn at the first function that fails."""
    _fusion["failed"][function] = repr(error)
    if len(_fusion["failed"]) > 1:
        return
    warnings.warn(
        f"torch.compile is not usable here ({error!r}); `{function.__qualname__}` of the "
        "rollout metrics, and any other part that fails to compile, runs eagerly from now on "
        "(the same results to float32 rounding, slower). Pass compile=False to skip the "
        "attempt.",
        RuntimeWarning,
        stacklevel=3,
    )
