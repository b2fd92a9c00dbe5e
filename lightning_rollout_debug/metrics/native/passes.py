"""One pass of the kernel over a CPU batch: its row sums, and the packed states it finishes.

:func:`row_sums` runs the kernel's loop over a batch into the ``[B]`` row reductions of
``rows.ROW_FIELDS`` (and, with an :class:`ExtrasRequest`, the extras' rows and bins in
the same read); :func:`states` finishes a pass into the statistics' packed state
(:class:`StateRequest`) and the extras', as the torch pass would, and with a
:class:`SegmentRequest` the batch's segments too (each row's runs of equal label summed
apart in the same pass). Either gives ``None`` where the kernel does not apply, and the
caller takes the torch path.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_rollout_debug.metrics.layout import STATE
from lightning_rollout_debug.metrics.native.kernel import Kernel, give_up, loaded
from lightning_rollout_debug.metrics.native.loader import (
    EXTRAS_MOMENTS,
    GROUP_ORDER,
    HISTOGRAM_MOMENTS,
    MAX_WORST_TOKENS,
)
from lightning_rollout_debug.metrics.native.segments import (
    PassLabels,
    SegmentRequest,
    column_bits,
    pass_labels,
)
from lightning_rollout_debug.metrics.profile import PROFILE_SIZE
from lightning_rollout_debug.metrics.rows import ROWS_OF_GROUP
from lightning_rollout_debug.metrics.worst_tokens import WORST_FIELDS

_LOG_PROB_KINDS = {torch.float32: 0, torch.bfloat16: 1}
LOG_PROB_DTYPES = frozenset(_LOG_PROB_KINDS)
"""The dtypes of the log-probs the kernel reads (both log-probs of one of them)."""
_MASK_KINDS = {torch.bool: 0, torch.uint8: 0, torch.int32: 1, torch.int64: 2, torch.float32: 3}
_ID_KINDS = {torch.int32: 1, torch.int64: 2}
# The columns the kernel computes only at its catalog level (bit 0 of `level`): those of
# the groups beyond the seed group, but `log_ratio`, which the sums of the inputs (bit 1)
# come with too.
_CATALOG_COLUMNS = frozenset().union(
    *(ROWS_OF_GROUP[group] for group in ("log_space", "kl", "importance_ratio"))
) - {"log_ratio"}
_TOKENS_PER_THREAD = 1 << 16
_identity: dict[int, Tensor] = {}


@dataclass(frozen=True)
class ExtrasRequest:
    """What the kernel accumulates for the TensorBoard extras in the same pass.

    ``ratio_bins`` and ``diff_bins`` are ``(low, octaves)`` of quarter-octave bins: signed
    for ``r``, unsigned for ``|pa - pb|`` (``bins.QuarterOctaveBins``). ``profile`` adds
    the profile block of :mod:`..profile` (its bins and buckets are the kernel's own,
    checked against that module when the kernel is loaded). ``add_profile``: the pass's
    profile block is added into the one of the packed extras it is finished into (a
    window's profile so far), not written over it.
    """

    ratio_bins: tuple[int, int]
    diff_bins: tuple[int, int]
    histograms: bool
    k: int
    profile: bool = False
    add_profile: bool = False

    def settings(self) -> list[int]:
        """The integers the kernel reads."""
        profile = 2 if self.profile and self.add_profile else int(self.profile)
        flags = [int(self.histograms), self.k, profile]
        return [*self.ratio_bins, *self.diff_bins, *flags]

    def bin_count(self) -> int:
        """The bins of both histograms together."""
        return 2 * (4 * self.ratio_bins[1] + 1) + 1 + 4 * self.diff_bins[1] + 2

    def summed_size(self) -> int:
        """What the pass sums over the rows: the histograms' bins, then the profile block."""
        histograms = self.bin_count() if self.histograms else 0
        return histograms + (PROFILE_SIZE if self.profile else 0)

    def state_size(self) -> int:
        """The length of the packed extras.

        Bins and five moments per histogram, then the ``k`` candidates, then the profile.
        """
        histograms = self.bin_count() + 2 * HISTOGRAM_MOMENTS if self.histograms else 0
        profile = PROFILE_SIZE if self.profile else 0
        return histograms + self.k * len(WORST_FIELDS) + profile


def row_sums(
    rollout_log_probs: Tensor,
    old_log_probs: Tensor,
    mask: Tensor,
    needed: frozenset[str],
    is_threshold: float,
    fields: tuple[str, ...],
    extras: ExtrasRequest | None = None,
) -> dict[str, Tensor] | None:
    """The ``[B]`` row reductions named by ``fields`` (``rows.ROW_FIELDS``), or ``None``.

    ``needed`` are the row quantities the update uses (``rows.rows_for(groups)``): the
    kernel skips the arithmetic of the others (their columns then mean nothing).

    With ``extras``, the same pass also fills the histograms and the worst-token
    candidates: ``"extras_rows"`` (``[B, EXTRAS_MOMENTS + 2 k]``: per row the maxima of
    ``r``, ``-r``, ``d = |pa - pb|`` and ``-d``, the sums of ``r``, ``r^2``, ``d``,
    ``d^2``, then ``k`` pairs ``(|r|, position)``, largest first not guaranteed, ``-inf``
    and ``-1`` for no token) and ``"extras_bins"`` (the bin counts of both histograms,
    then the profile block when ``extras.profile``).

    ``None`` when the kernel does not apply: tensors off the CPU or of a tensor subclass,
    log-probs that are not both float32 or both bfloat16, or a kernel that is turned off
    or could not be built, loaded or checked. Reads the tensors in place when they are
    contiguous.
    """
    done = _pass(rollout_log_probs, old_log_probs, mask, needed, is_threshold, fields, extras)
    if done is None:
        return None
    found = dict(zip(fields, done.table.unbind(1), strict=True))
    if extras is not None:
        found.update(extras_rows=done.extras_rows, extras_bins=done.bins)
    return found


@dataclass(frozen=True)
class StateRequest:
    """What the kernel finishes into the statistics' packed state (``layout.STATE``)."""

    groups: frozenset[str]
    seq_ratio_bounds: tuple[float, float]


def states(
    rollout_log_probs: Tensor,
    old_log_probs: Tensor,
    mask: Tensor,
    needed: frozenset[str],
    is_threshold: float,
    fields: tuple[str, ...],
    *,
    statistics: StateRequest | None = None,
    extras: ExtrasRequest | None = None,
    segments: SegmentRequest | None = None,
    token_ids: Tensor | None = None,
    batch_index: int = 0,
    rank: int = 0,
    into: Tensor | None = None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None] | None:
    """One pass over a CPU batch, finished into packed states: ``(statistics, extras, segments)``.

    The statistics' state is the packed state of ``statistics.groups`` that the torch
    pass would make of the batch (the token-id slots stay empty); the extras' that of
    ``TokenExtras``, the worst tokens labelled with ``batch_index``, ``rank`` and
    ``token_ids`` (``[B, T]`` integers, or ``None``); the segments' that of
    ``SegmentWindow``. Each is ``None`` when not asked for, the segments' also where the
    kernel cannot read the labels (off the CPU, not integers): the torch road takes them;
    the whole result is ``None`` where :func:`row_sums` would be.

    ``into``: with ``extras.add_profile``, the packed extras (a contiguous float64 CPU
    tensor) the extras are finished into: its profile block, a window's, gets the pass's
    added; its other slots are written. It is the extras' state returned. Nothing is
    added to it when the result is ``None``.
    """
    if extras is not None and extras.add_profile and not _packed_extras(into, extras):
        raise ValueError(
            "`into` must be a contiguous float64 CPU tensor of the packed extras "
            f"({extras.state_size()} values) when the profile is added into it"
        )
    done = _pass(
        rollout_log_probs, old_log_probs, mask, needed, is_threshold, fields, extras, segments
    )
    if done is None:
        return None
    try:
        requests = (statistics, extras, segments)
        return _finish(done, needed, fields, requests, token_ids, batch_index, rank, into)
    except Exception as error:  # ctypes refusing the arguments: the torch path takes over
        give_up(f"the kernel's finishing step failed ({error!r})")
        return None


def _packed_extras(into: Tensor | None, extras: ExtrasRequest) -> bool:
    """Whether ``into`` can be finished into: the packed extras, contiguous, on the CPU."""
    return (
        into is not None
        and type(into) is Tensor
        and into.dtype == torch.float64
        and into.device.type == "cpu"
        and into.is_contiguous()
        and into.shape == (extras.state_size(),)
    )


def _finish(
    done: _Pass,
    needed: frozenset[str],
    fields: tuple[str, ...],
    requests: tuple[StateRequest | None, ExtrasRequest | None, SegmentRequest | None],
    token_ids: Tensor | None,
    batch_index: int,
    rank: int,
    into: Tensor | None = None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None] | None:
    """The packed states of a pass (see :func:`states`); ``None`` if the kernel refused.

    The segments are finished before the extras, which may add into ``into``.
    """
    statistics, extras, segments = requests
    rows, width = done.mask.shape
    statistics_state = extras_state = None
    if statistics is not None:
        statistics_state = _identity_state()
        bits, groups = _state_bits(tuple(fields), needed, statistics.groups)
        low, high = statistics.seq_ratio_bounds
        done.kernel.finish_state(done.table.data_ptr(), rows, bits, groups, low, high,
                                 statistics_state.data_ptr())  # fmt: skip
    segments_state = None if segments is None else _segments(done, fields, segments)
    if extras is not None:
        extras_state = (
            into
            if extras.add_profile and into is not None
            else torch.empty(extras.state_size(), dtype=torch.float64)
        )
        ids, id_kind = None, 0
        if token_ids is not None:
            ids = token_ids if token_ids.dtype in _ID_KINDS else token_ids.to(torch.int64)
            ids = ids.contiguous()
            id_kind = _ID_KINDS[ids.dtype]
        status = done.kernel.finish_extras(
            done.rollout.data_ptr(),
            done.old.data_ptr(),
            done.kind,
            None if ids is None else ids.data_ptr(),
            id_kind,
            rows,
            width,
            done.settings.data_ptr(),
            done.extras_rows.data_ptr(),
            done.bins.data_ptr(),
            float(batch_index),
            float(rank),
            *done.labels.arguments[:4],  # each candidate's segment
            extras_state.data_ptr(),
        )
        if status != 0:
            give_up(f"the kernel rejected the extras (status {status})")
            return None
    return statistics_state, extras_state, segments_state


def _segments(done: _Pass, fields: tuple[str, ...], request: SegmentRequest) -> Tensor | None:
    """The packed segments of a pass (:func:`states`); ``None``: left to the torch road.

    Raises:
        RuntimeError: the kernel rejected its arguments.
    """
    if done.labels.segment_rows is None:
        return None
    columns, groups = _state_bits(tuple(fields), done.labels.needed, request.groups)
    state = _identity_state(request.segments + 1)
    rows = done.labels.segment_rows.data_ptr()
    status = done.kernel.finish_segments(rows, request.segments, columns, groups, state.data_ptr())
    if status != 0:
        raise RuntimeError(f"the kernel rejected the segments (status {status})")
    return state


@dataclass
class _Pass:
    """What one kernel pass read and wrote, and the build that ran it."""

    kernel: Kernel
    rollout: Tensor
    old: Tensor
    mask: Tensor
    kind: int
    table: Tensor
    settings: Tensor | None = None
    extras_rows: Tensor | None = None
    bins: Tensor | None = None
    labels: PassLabels = field(default_factory=PassLabels)
    """The segments' labels and rows; none where the pass left them to the torch road."""


def _pass(
    rollout_log_probs: Tensor,
    old_log_probs: Tensor,
    mask: Tensor,
    needed: frozenset[str],
    is_threshold: float,
    fields: tuple[str, ...],
    extras: ExtrasRequest | None,
    segments: SegmentRequest | None = None,
) -> _Pass | None:
    kind = _LOG_PROB_KINDS.get(rollout_log_probs.dtype)
    if kind is None or not _plain_cpu(rollout_log_probs, old_log_probs, mask):
        return None
    kernel = loaded(fields)
    if kernel is None or tuple(fields) != kernel.columns:
        return None
    if mask.dtype not in _MASK_KINDS:
        mask = mask != 0
    rollout, old, mask = (t.contiguous() for t in (rollout_log_probs, old_log_probs, mask))
    rows, width = mask.shape
    table = torch.empty(rows, len(fields), dtype=torch.float64)
    done = _Pass(kernel, rollout, old, mask, kind, table)
    labels = pass_labels(segments, tuple(fields))
    pointers: list[int | None] = [None, None, None]
    if extras is not None:
        if not 0 <= extras.k <= MAX_WORST_TOKENS:
            return None
        done.settings = _settings(extras)
        done.extras_rows = torch.empty(rows, EXTRAS_MOMENTS + 2 * extras.k, dtype=torch.float64)
        # Every bin and the whole profile block are written by the pass.
        done.bins = torch.empty(extras.summed_size(), dtype=torch.float64)
        pointers = [done.settings.data_ptr(), done.extras_rows.data_ptr(), done.bins.data_ptr()]
    try:
        status = kernel.rows(
            rollout.data_ptr(),
            old.data_ptr(),
            mask.data_ptr(),
            kind,
            _MASK_KINDS[mask.dtype],
            rows,
            width,
            _level(needed | labels.needed),
            is_threshold - 1.0,
            1.0 / is_threshold - 1.0,
            _threads(rows * width, profile=extras is not None and extras.profile),
            done.table.data_ptr(),
            *pointers,
            *labels.arguments,
        )
    except Exception as error:  # ctypes refusing the arguments: the torch path takes over
        status = repr(error)
    if status != 0:
        give_up(f"the kernel rejected its arguments (status {status})")
        return None
    done.labels = labels
    return done


def _plain_cpu(rollout_log_probs: Tensor, old_log_probs: Tensor, mask: Tensor) -> bool:
    """Whether the kernel can read the tensors: plain CPU tensors, log-probs of one dtype.

    A tensor subclass (a fake tensor) may hold no memory to read.
    """
    tensors = (rollout_log_probs, old_log_probs, mask)
    return (
        all(type(t) is Tensor and t.device.type == "cpu" for t in tensors)
        and old_log_probs.dtype == rollout_log_probs.dtype
    )


def _level(needed: frozenset[str]) -> int:
    """What the kernel's loop computes for ``needed``: bit 0 the catalog, bit 1 the inputs' sums."""
    return bool(needed & _CATALOG_COLUMNS) | (2 if "sum_actor_log_prob" in needed else 0)


@functools.lru_cache(maxsize=64)
def _state_bits(
    fields: tuple[str, ...], needed: frozenset[str], groups: frozenset[str]
) -> tuple[int, int]:
    """The bits of the columns computed and of the groups on, as the kernel reads them."""
    on = sum(1 << i for i, name in enumerate(GROUP_ORDER) if name in groups)
    return column_bits(fields, needed), on


@functools.lru_cache(maxsize=16)
def _settings(extras: ExtrasRequest) -> Tensor:
    """The integers of ``extras`` the kernel reads (and never writes): one tensor each."""
    return torch.tensor(extras.settings(), dtype=torch.int32)


def _threads(tokens: int, *, profile: bool = False) -> int:
    """Threads for a pass over ``tokens``: one per :data:`_TOKENS_PER_THREAD`, up to torch's.

    Waking a thread costs more than a few thousand tokens of arithmetic, and far more on
    a busy machine. With the profile a token costs several times more: a second thread
    pays from about 12k tokens (``tokens / (2**16 / 8)``, rounded).
    """
    if profile:
        wanted = (8 * tokens + _TOKENS_PER_THREAD // 2) // _TOKENS_PER_THREAD
    else:
        wanted = tokens // _TOKENS_PER_THREAD
    return max(1, min(torch.get_num_threads(), wanted))


def _identity_state(copies: int = 1) -> Tensor:
    """A new empty window of the statistics (``copies`` side by side), on the CPU."""
    if copies not in _identity:
        _identity[copies] = STATE.identity().repeat(copies)
    return _identity[copies].clone()
