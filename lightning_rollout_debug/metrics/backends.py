"""The road of a batch: the one call that adds it to the windows, and the pass that reads it.

:func:`add_batch` adds a checked batch to a window of statistics and a window of extras
(either may be absent) with one read of it. It chooses the road once, up front
(:func:`roads`), and adds what the pass finished with one call into the windows
(:func:`~.packed_window.add_pass` or :func:`~.packed_window.add_states`):

* On CPUs, float32 and bfloat16 log-probs go through the native kernel (:mod:`.native`)
  unless ``compile=False``: one pass, finished into packed states.
* On accelerators, :func:`~.torch_pass.sums.token_sums` compiled with ``torch.compile``
  (unless ``compile=False``; on CPUs only with ``compile=True``): one graph for every
  batch size.
* Everywhere else, and where compiling fails, :func:`~.torch_pass.sums.token_sums` eagerly:
  a fixed number of torch operations at every size (one pass per 4,194,304 tokens of
  rows, which bounds the memory of larger batches).

Where the kernel does not take a batch (other dtypes, a kernel that is not there or gave
up), the torch road chosen with it does. Every road counts the same tokens into the same
packed states, to float32 rounding. A compiled pass that fails falls back to the eager
one with one warning, and the batch is counted in full.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_rollout_debug.metrics import caller, native
from lightning_rollout_debug.metrics.inputs import MismatchInputs
from lightning_rollout_debug.metrics.layout import STATE
from lightning_rollout_debug.metrics.packed_window import Finish, add_pass, add_states
from lightning_rollout_debug.metrics.rows import ROW_FIELDS, check_slots, rows_for
from lightning_rollout_debug.metrics.torch_pass.bins import POSITION_PLANES
from lightning_rollout_debug.metrics.torch_pass.constants import constants
from lightning_rollout_debug.metrics.torch_pass.planes import PassPlan
from lightning_rollout_debug.metrics.torch_pass.sums import TokenSums, token_sums

CHUNK_TOKENS = 1 << 22
"""The most tokens one pass reads: a larger batch is read in passes of whole rows."""

NATIVE, COMPILED, EAGER = "native", "compiled", "eager"
"""The roads of a batch: the native kernel, torch compiled, torch eagerly."""


def add_batch(
    inputs: MismatchInputs,
    token_ids: Tensor | None,
    *,
    stats: Any | None,
    extras: Any | None,
    batch: int = 0,
    rank: int = 0,
    pad_token_id: int | None = None,
    series: Any | None = None,
    shifts: Any | None = None,
    segments: tuple[Any, Tensor] | None = None,
) -> None:
    """Add a checked batch to ``stats`` and ``extras`` (either may be ``None``), in one read.

    ``token_ids`` label the worst tokens; ``batch`` and ``rank`` too. The statistics'
    token-id comparison, and with ``pad_token_id`` the count of the padding among
    ``token_ids``, are added as a state of their own (:func:`check_states`).
    ``series`` (a :class:`~.series.MismatchSeries`, with ``stats``) keeps the batch's
    statistics as the pass left them: its packed state, or its passes' sums; ``shifts``
    (a :class:`~.shifts.ShiftSample`) the first rows of a window's first batch.
    ``segments``: a :class:`~.segments.SegmentWindow` and the batch's labels (``[B]`` or
    ``[B, T]``), which the pass reduces its tokens by too (on the kernel's road, each row's
    runs of equal label summed apart in the same loop, or its tokens put in their
    segments' buckets; labels the kernel cannot read, a torch pass of the segments alone).
    """
    device = inputs.mask.device
    if shifts is not None:
        shifts.add(inputs)
    if inputs.mask.numel() == 0:
        if stats is not None:
            pads = check_states(inputs, frozenset(), token_ids, pad_token_id)
            add_states([(stats, [*_empty_statistics(inputs, stats.groups), *pads])], device)
        return
    more = [] if stats is None else check_states(inputs, stats.groups, token_ids, pad_token_id)
    window, labels = (None, None) if segments is None else segments
    plan = pass_plan(stats, extras, window)
    owner = next(w for w in (stats, extras, window) if w is not None)
    chosen = roads(inputs, owner.compile, plan)
    for road in chosen:
        if road == NATIVE:
            request = None if extras is None else extras.kernel_request(add_profile=True)
            finish = _kernel_pass(inputs, token_ids, stats, request, batch, rank, segments)
            found = add_pass(finish, (stats, extras, window), device, more, series)
            if found is None:
                continue
            if window is not None and found[2] is None:  # labels the kernel cannot read
                alone = _torch_sums(inputs, (None, labels), pass_plan(None, None, window),
                                    (window, None), chosen[-1], batch, rank)  # fmt: skip
                add_states(((window, alone),), device)
            return
        else:
            sums = _torch_sums(
                inputs, (token_ids, labels), plan, (stats, extras), road, batch, rank
            )
            if series is not None and stats is not None:
                series.add(sums)
            add_states(((stats, [*sums, *more]), (extras, sums), (window, sums)), device)
            return


def roads(inputs: MismatchInputs, compile: bool | None, plan: PassPlan) -> tuple[str, ...]:
    """The roads a batch takes, in order, until one takes it.

    On a CPU the native kernel first, for log-probs of one dtype it reads, unless
    ``compile=False`` or ``plan`` asks for more worst tokens than it keeps (where it is
    not there, or gives up, the next road takes the batch); then the torch road:
    compiled on accelerators unless ``compile=False``, on CPUs only with ``True``, and
    never a ``plan`` that failed to compile; else eager.
    """
    cpu = inputs.mask.device.type == "cpu"
    compiled = (compile if cpu else compile is not False) and plan not in _compiling["failed"]
    torch_road = COMPILED if compiled else EAGER
    dtype = inputs.rollout_log_probs.dtype
    kernel = (
        cpu
        and native_wanted(compile)
        and dtype == inputs.old_log_probs.dtype
        and dtype in native.LOG_PROB_DTYPES
        and plan.worst_tokens_k <= native.MAX_WORST_TOKENS
    )
    return (NATIVE, torch_road) if kernel else (torch_road,)


def pass_plan(stats: Any | None, extras: Any | None, segments: Any | None = None) -> PassPlan:
    """What one pass computes for ``stats``, ``extras`` and ``segments`` (made once each).

    The groups are the statistics' (a window of segments alone: its own).
    """
    settings = stats if stats is not None else segments
    return _plan(
        frozenset() if settings is None else settings.groups,
        2.0 if settings is None else settings.is_threshold,
        extras is not None and bool(extras.histograms),
        0 if extras is None else extras.worst_tokens_k,
        extras is not None and extras.profile,
        0 if segments is None else segments.segments,
    )


@functools.lru_cache(maxsize=64)
def _plan(
    groups: frozenset[str],
    is_threshold: float,
    histograms: bool,
    k: int,
    profile: bool,
    segments: int = 0,
) -> PassPlan:
    """The :class:`~.torch_pass.planes.PassPlan` of these settings, made once."""
    return PassPlan(
        groups=groups,
        is_threshold=is_threshold,
        histograms=histograms,
        worst_tokens_k=k,
        profile=profile,
        segments=segments,
    )


def _torch_sums(
    inputs: MismatchInputs,
    labels: tuple[Tensor | None, Tensor | None],
    plan: PassPlan,
    windows: tuple[Any | None, Any | None],
    road: str,
    batch: int,
    rank: int,
) -> list[TokenSums]:
    """The sums of a batch's torch passes, each of whole rows (at most one chunk's tokens).

    ``labels``: the token ids and segment labels; ``windows``: the statistics and extras.
    """
    rows, width = inputs.mask.shape
    chunks = [w.chunk_tokens for w in windows if w is not None and w.chunk_tokens]
    step = max(1, min(chunks, default=CHUNK_TOKENS) // width)
    tensors = (inputs.rollout_log_probs, inputs.old_log_probs, inputs.mask, *labels)
    sums = []
    for first in range(0, rows, step):
        part = (
            tensors
            if step >= rows
            else [t if t is None else t[first : first + step] for t in tensors]
        )
        with torch.no_grad():  # out= arguments refuse tensors that require grad
            labels = {"batch": batch, "rank": rank, "first_row": first}
            sums.append(read_pass(plan, *part, compiled=road == COMPILED, **labels))
    return sums


def read_pass(
    plan: PassPlan,
    rollout_log_probs: Tensor,
    old_log_probs: Tensor,
    mask: Tensor,
    token_ids: Tensor | None,
    segment_ids: Tensor | None = None,
    *,
    compiled: bool,
    batch: int = 0,
    rank: int = 0,
    first_row: int = 0,
) -> TokenSums:
    """The :class:`~.torch_pass.sums.TokenSums` of one pass, ``compiled`` or eagerly.

    Where compiling fails, eagerly, and the plan eagerly from then on, with one warning.
    """
    tensors = (rollout_log_probs, old_log_probs, mask, token_ids, segment_ids)
    width = mask.shape[1]
    labels = {"batch": batch, "rank": rank, "first_row": first_row}
    if compiled and plan not in _compiling["failed"]:
        f64 = torch.float64
        dtype = f64 if f64 in (rollout_log_probs.dtype, old_log_probs.dtype) else torch.float32
        constants(dtype, mask)  # made once, before the trace reads them
        try:  # torch.compile may raise when called, or at the first call of its result
            fields = _compiled(plan)(*tensors)
            return read_sums(plan, width, fields, **labels)
        except Exception as error:  # this plan stays eager from now on
            _compile_failed(plan, error)
    return read_sums(plan, width, token_sums(plan, *tensors), **labels)


def kernel_states(
    inputs: MismatchInputs,
    token_ids: Tensor | None = None,
    *,
    stats: Any | None = None,
    extras: Any | None = None,
    batch: int = 0,
    rank: int = 0,
    into: Tensor | None = None,
    segments: tuple[Any, Tensor] | None = None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None] | None:
    """One pass of the kernel over a CPU batch: ``(statistics, extras, segments)``.

    The packed states of ``stats``, ``extras`` and ``segments`` (a
    :class:`~.segments.SegmentWindow` and the labels; ``None``: not computed, or, for the
    segments, left to the torch road), added to no window. ``None`` where the kernel does
    not apply (off the CPU, an empty batch, ``k`` above :data:`~.native.MAX_WORST_TOKENS`,
    other dtypes). ``into``: with the profile, a packed extras state the batch's is
    finished into, its profile block added to (the extras' state returned).
    """
    request = None if extras is None else extras.kernel_request(add_profile=into is not None)
    cpu = inputs.mask.device.type == "cpu"
    if not (cpu and inputs.mask.numel() > 0 and (extras is None or request is not None)):
        return None
    return _kernel_pass(inputs, token_ids, stats, request, batch, rank, segments)(into=into)


def _kernel_pass(
    inputs: MismatchInputs,
    token_ids: Tensor | None,
    stats: Any | None,
    request: native.ExtrasRequest | None,
    batch: int,
    rank: int,
    segments: tuple[Any, Tensor] | None = None,
) -> Finish:
    """The kernel's pass over a batch, finished into the packed states of the windows.

    Those of ``stats``, of the extras ``request`` asks for and of ``segments`` (a window
    and the labels); call it with ``into`` (see :func:`.native.states`). Without
    statistics, the pass computes the row quantities of the segments' groups.
    """
    window, labels = (None, None) if segments is None else segments
    settings = stats if stats is not None else window
    by_segment = None
    if window is not None:
        groups = stats.groups if stats is not None else window.groups
        by_segment = native.SegmentRequest(labels, window.segments, groups, window.rows)
    return functools.partial(
        native.states,
        inputs.rollout_log_probs,
        inputs.old_log_probs,
        inputs.mask,
        frozenset() if settings is None else _rows_for(settings.groups),
        2.0 if settings is None else settings.is_threshold,
        ROW_FIELDS,
        statistics=None
        if stats is None
        else native.StateRequest(stats.groups, stats.seq_ratio_bounds),
        extras=request,
        segments=by_segment,
        token_ids=token_ids,
        batch_index=batch,
        rank=rank,
    )


@functools.lru_cache(maxsize=64)
def _rows_for(groups: frozenset[str]) -> frozenset[str]:
    """The row quantities the kernel computes for ``groups`` (made once per groups)."""
    return rows_for(groups)


def read_sums(
    plan: PassPlan,
    width: int,
    fields: Sequence[Any],
    *,
    batch: int = 0,
    rank: int = 0,
    first_row: int = 0,
) -> TokenSums:
    """:class:`TokenSums` from the fields of :func:`token_sums`, labelled with the batch's place.

    The last field says whether they were traced: a compiled function that dynamo runs
    eagerly (past its recompile limit, say) returns an eager pass's fields, read as such.
    """
    *fields, compiled = fields
    planes = POSITION_PLANES if compiled else plan.planes
    labels = {"batch": batch, "rank": rank, "first_row": first_row}
    mode = {"position_planes": planes, "uncounted": not compiled}
    return TokenSums(plan, width, *fields, **mode, **labels)


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


def check_states(
    inputs: MismatchInputs,
    groups: frozenset[str],
    token_ids: Tensor | None = None,
    pad_token_id: int | None = None,
) -> list[dict[str, Tensor]]:
    """A batch's checks of token ids as one state of its own (``[]``: none).

    The comparison of the rollout's and the trainer's ids with the ``token_ids`` group,
    the count of the padding among ``token_ids`` with ``pad_token_id`` (``pad_slots``): slots
    of :data:`~.layout.STATE` by name, packed when the window folds.
    """
    compared = "token_ids" in groups
    if not compared and (token_ids is None or pad_token_id is None):
        return []
    slots = check_slots(
        inputs.mask,
        inputs.rollout_token_ids if compared else None,
        inputs.trainer_token_ids if compared else None,
        token_ids,
        pad_token_id,
    )
    return [slots] if slots else []


def _empty_statistics(inputs: MismatchInputs, groups: frozenset[str]) -> list[Tensor]:
    """The statistics of a batch without tokens: empty, but for token ids compared."""
    state = STATE.identity(inputs.mask.device)
    if "token_ids" in groups and inputs.rollout_token_ids is not None:
        # An empty batch with token ids still compared ids: zero differences, not NaN.
        state[STATE.at["id_updates"]] = 1.0
    return [state]


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
    """:func:`~.torch_pass.sums.token_sums` for ``plan``, compiled once (``dynamic=True``)."""
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
    caller.warn(
        f"torch.compile of the rollout metrics failed with torch {torch.__version__} "
        f"({error!r}); they are computed eagerly from now on, the same values to float32 "
        "rounding, in a fixed number of operations a batch. Pass compile=False to skip "
        "the attempt.",
        RuntimeWarning,
    )
