"""The fused CPU pass of an update: ``row_sums.cpp``, built once per machine and user.

On CPUs one hand-vectorised loop computes every row reduction of an update
(``rows.row_sums``) with float64 sums kept in registers, about twice as fast as the
code ``torch.compile`` generates for the same arithmetic. It is built on first use with
the system C++ compiler (``$CXX``, else ``c++``, ``g++`` or ``clang++``) and loaded with
:mod:`ctypes`. Where it cannot be built or loaded, one warning says why and updates use
``torch.compile`` or eager arithmetic instead, with the same results.

The build lives in the user's own cache (:mod:`.cache`: :func:`cache_folder`, checked
before anything is loaded from it). Once loaded, the library must name its output
columns and state slots exactly as the Python side does, write every slot of the state
it finishes, and lay out the profile block with the sizes and constants of
:mod:`..profile`; one build per process, other threads wait for it.

``LIGHTNING_ROLLOUT_DEBUG_NATIVE=0`` turns the kernel off. ``python -m
lightning_rollout_debug.native`` builds it ahead of time (for a container image) and
prints where it is; a process that finds no compiler uses such a build of the same
source for the same CPU.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_rollout_debug.layout import STATE
from lightning_rollout_debug.native.cache import (
    CACHE_ENV,
    SOURCE,
    SWITCH_ENV,
    KernelUnavailable,
    cache_folder,
    verified_build,
)
from lightning_rollout_debug.profile import (
    _LOG2_E,
    JOINT_BINS,
    POSITION_BUCKETS,
    PROBABILITY_BUCKETS,
    PROFILE_SIZE,
    QUANTILE_BINS,
    profile_blocks,
    profile_parts,
)
from lightning_rollout_debug.rows import CHECK_SLOTS, ROW_FIELDS, ROWS_OF_GROUP

VECTOR_LANES = (4, 8, 16)
"""The vector widths the kernel is built with, in float32 lanes (``ROLLOUT_LANES``)."""
__all__ = [
    "CACHE_ENV",
    "EXTRAS_MOMENTS",
    "HISTOGRAM_MOMENTS",
    "MAX_WORST_TOKENS",
    "SOURCE",
    "SWITCH_ENV",
    "VECTOR_LANES",
    "WORST_FIELDS",
    "ExtrasRequest",
    "KernelUnavailable",
    "StateRequest",
    "available",
    "build",
    "cache_folder",
    "row_sums",
    "states",
    "vector_lanes",
]
_OFF = frozenset({"0", "false", "off", "no"})
_ON = frozenset({"", "1", "true", "on", "yes"})
_LOG_PROB_KINDS = {torch.float32: 0, torch.bfloat16: 1}
_MASK_KINDS = {torch.bool: 0, torch.uint8: 0, torch.int32: 1, torch.int64: 2, torch.float32: 3}
# The columns the kernel computes only at its catalog level (bit 0 of `level`): those of
# the groups beyond the seed group, but `log_ratio`, which the sums of the inputs (bit 1)
# come with too.
_CATALOG_COLUMNS = frozenset().union(
    *(ROWS_OF_GROUP[group] for group in ("log_space", "kl", "importance_ratio"))
) - {"log_ratio"}


_kernel: dict[str, Any] = {
    "function": None,
    "problem": None,
    "columns": (),
    "finish": None,
    "lanes": None,
}
_process_lock = threading.Lock()


EXTRAS_MOMENTS = 8
"""Per-row moments of the extras the kernel writes before the worst-token pairs."""
MAX_WORST_TOKENS = 64
"""The most worst tokens per row the kernel keeps (``kMaxWorst``)."""
HISTOGRAM_MOMENTS = 5
"""What a packed histogram holds after its bins: num, min, max, sum, sum of squares."""
WORST_FIELDS: tuple[str, ...] = (
    "abs_log_ratio",
    "log_ratio",
    "actor_prob",
    "rollout_prob",
    "batch",
    "row",
    "position",
    "token_id",
    "rank",
)
"""Columns of a worst-token candidate in the packed extras (``token_id`` is -1 if unknown)."""
_GROUP_ORDER = ("seed", "log_space", "kl", "importance_ratio", "sequence", "health")
"""The groups the kernel's finishing step knows, in the order of its bits."""
_ID_KINDS = {torch.int32: 1, torch.int64: 2}
_TOKENS_PER_THREAD = 1 << 16
_identity: dict[str, Tensor | None] = {"state": None}


@dataclass(frozen=True)
class ExtrasRequest:
    """What the kernel accumulates for the TensorBoard extras in the same pass.

    ``ratio_bins`` and ``diff_bins`` are ``(low, octaves)`` of quarter-octave bins: signed
    for ``r``, unsigned for ``|pa - pb|`` (``bins.QuarterOctaveBins``). ``profile`` adds
    the profile block of :mod:`..profile` (its bins and buckets are the kernel's own,
    checked against that module when the kernel is loaded).
    """

    ratio_bins: tuple[int, int]
    diff_bins: tuple[int, int]
    histograms: bool
    k: int
    profile: bool = False

    def settings(self) -> list[int]:
        """The integers the kernel reads."""
        flags = [int(self.histograms), self.k, int(self.profile)]
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


def vector_lanes() -> int | None:
    """The float32 values one step of the kernel's loop takes, or ``None`` without a kernel.

    It follows the CPU the kernel is built on: 16 with AVX-512, 8 with AVX2, 4 otherwise.

    Example:
        >>> vector_lanes() in (*VECTOR_LANES, None)
        True
    """
    return _kernel["lanes"] if _function(None) is not None else None


def available(fields: Sequence[str] | None = None) -> bool:
    """Whether the kernel is usable (building it now if needed); warns once if it is not.

    ``fields`` are the column names the caller expects (``rows.ROW_FIELDS`` by default).
    """
    return _function(fields) is not None


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
    token_ids: Tensor | None = None,
    batch_index: int = 0,
    rank: int = 0,
) -> tuple[Tensor | None, Tensor | None] | None:
    """One pass over a CPU batch, finished into packed states: ``(statistics, extras)``.

    The statistics' state is that of ``rows.state_from_rows`` for ``statistics.groups``
    (the token-id slots stay empty); the extras' that of ``TokenExtras``, the worst tokens
    labelled with ``batch_index``, ``rank`` and ``token_ids`` (``[B, T]`` integers, or
    ``None``). Either is ``None`` when not asked for; the whole result is ``None`` where
    :func:`row_sums` would be.
    """
    done = _pass(rollout_log_probs, old_log_probs, mask, needed, is_threshold, fields, extras)
    if done is None:
        return None
    try:
        return _finish(done, needed, fields, statistics, extras, token_ids, batch_index, rank)
    except Exception as error:  # ctypes refusing the arguments: the torch path takes over
        _give_up(f"the kernel's finishing step failed ({error!r})")
        return None


def _finish(
    done: _Pass,
    needed: frozenset[str],
    fields: tuple[str, ...],
    statistics: StateRequest | None,
    extras: ExtrasRequest | None,
    token_ids: Tensor | None,
    batch_index: int,
    rank: int,
) -> tuple[Tensor | None, Tensor | None] | None:
    """The packed states of a pass (see :func:`states`); ``None`` if the kernel refused."""
    finish_state, finish_extras = _kernel["finish"]
    rows, width = done.mask.shape
    statistics_state = extras_state = None
    if statistics is not None:
        statistics_state = _identity_state()
        bits, groups = _state_bits(tuple(fields), needed, statistics.groups)
        low, high = statistics.seq_ratio_bounds
        finish_state(done.table.data_ptr(), rows, bits, groups, low, high,
                     statistics_state.data_ptr())  # fmt: skip
    if extras is not None:
        extras_state = torch.empty(extras.state_size(), dtype=torch.float64)
        ids, id_kind = None, 0
        if token_ids is not None:
            ids = token_ids if token_ids.dtype in _ID_KINDS else token_ids.to(torch.int64)
            ids = ids.contiguous()
            id_kind = _ID_KINDS[ids.dtype]
        status = finish_extras(
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
            extras_state.data_ptr(),
        )
        if status != 0:
            _give_up(f"the kernel rejected the extras (status {status})")
            return None
    return statistics_state, extras_state


@dataclass
class _Pass:
    """What one kernel pass read and wrote."""

    rollout: Tensor
    old: Tensor
    mask: Tensor
    kind: int
    table: Tensor
    settings: Tensor | None = None
    extras_rows: Tensor | None = None
    bins: Tensor | None = None


def _pass(
    rollout_log_probs: Tensor,
    old_log_probs: Tensor,
    mask: Tensor,
    needed: frozenset[str],
    is_threshold: float,
    fields: tuple[str, ...],
    extras: ExtrasRequest | None,
) -> _Pass | None:
    kind = _LOG_PROB_KINDS.get(rollout_log_probs.dtype)
    tensors = (rollout_log_probs, old_log_probs, mask)
    if (
        kind is None
        # Plain tensors only: a subclass (a fake tensor) may hold no memory to read.
        or any(type(t) is not Tensor for t in tensors)
        or old_log_probs.dtype != rollout_log_probs.dtype
        or mask.device.type != "cpu"
        or rollout_log_probs.device.type != "cpu"
        or old_log_probs.device.type != "cpu"
    ):
        return None
    function = _function(fields)
    if function is None or tuple(fields) != _kernel["columns"]:
        return None
    if mask.dtype not in _MASK_KINDS:
        mask = mask != 0
    rollout, old, mask = (t.contiguous() for t in (rollout_log_probs, old_log_probs, mask))
    rows, width = mask.shape
    done = _Pass(rollout, old, mask, kind, torch.empty(rows, len(fields), dtype=torch.float64))
    level = bool(needed & _CATALOG_COLUMNS) | (2 if "sum_actor_log_prob" in needed else 0)
    pointers: list[int | None] = [None, None, None]
    if extras is not None:
        if not 0 <= extras.k <= MAX_WORST_TOKENS:
            return None
        done.settings = _settings(extras)
        done.extras_rows = torch.empty(rows, EXTRAS_MOMENTS + 2 * extras.k, dtype=torch.float64)
        done.bins = torch.zeros(extras.summed_size(), dtype=torch.float64)
        pointers = [done.settings.data_ptr(), done.extras_rows.data_ptr(), done.bins.data_ptr()]
    try:
        status = function(
            rollout.data_ptr(),
            old.data_ptr(),
            mask.data_ptr(),
            kind,
            _MASK_KINDS[mask.dtype],
            rows,
            width,
            level,
            is_threshold - 1.0,
            1.0 / is_threshold - 1.0,
            _threads(rows * width, profile=extras is not None and extras.profile),
            done.table.data_ptr(),
            *pointers,
        )
    except Exception as error:  # ctypes refusing the arguments: the torch path takes over
        status = repr(error)
    if status != 0:
        _give_up(f"the kernel rejected its arguments (status {status})")
        return None
    return done


@functools.lru_cache(maxsize=64)
def _state_bits(
    fields: tuple[str, ...], needed: frozenset[str], groups: frozenset[str]
) -> tuple[int, int]:
    """The bits of the columns computed and of the groups on, as the kernel reads them."""
    columns = sum(1 << i for i, name in enumerate(fields) if name in needed)
    return columns, sum(1 << i for i, name in enumerate(_GROUP_ORDER) if name in groups)


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


def _identity_state() -> Tensor:
    """A new empty window of the statistics, on the CPU."""
    if _identity.get("state") is None:
        _identity["state"] = STATE.identity()
    return _identity["state"].clone()


def build(fields: Sequence[str] | None = None) -> Path:
    """Build the kernel (unless a verified build is cached), load and check it; its path.

    Raises:
        KernelUnavailable: it is turned off, or cannot be built, loaded or checked here.
    """
    with _process_lock:
        path, _ = _load_checked(_expected(fields))
    return path


# ------------------------------------------------------------------ loading
def _function(fields: Sequence[str] | None) -> Any:
    if _kernel["function"] is None and _kernel["problem"] is None:
        with _process_lock:  # one build per process; other threads wait for it
            if _kernel["function"] is None and _kernel["problem"] is None:
                try:
                    _kernel["columns"] = _expected(fields)
                    _, entries = _load_checked(_kernel["columns"])
                    _kernel["function"], _kernel["finish"], _kernel["lanes"] = entries
                except _Off as off:
                    _kernel["problem"] = str(off)  # the user's choice: no warning
                except Exception as error:  # anything at all: the torch path takes over
                    _give_up(str(error))
    return _kernel["function"]


def _give_up(problem: str) -> None:
    _kernel["function"], _kernel["problem"] = None, problem
    warnings.warn(
        f"The native CPU kernel is not used: {problem}. CPU updates use torch.compile or "
        "eager arithmetic instead (the same results to float32 rounding, slower).",
        RuntimeWarning,
        stacklevel=5,
    )


class _Off(KernelUnavailable):
    """Turned off by the environment."""


def _expected(fields: Sequence[str] | None) -> tuple[str, ...]:
    return tuple(ROW_FIELDS if fields is None else fields)


def _load_checked(fields: tuple[str, ...]) -> tuple[Path, Any]:
    switch = os.environ.get(SWITCH_ENV, "").strip().lower()
    if switch in _OFF:
        raise _Off(f"turned off by {SWITCH_ENV}={os.environ[SWITCH_ENV]}")
    if switch not in _ON:
        raise KernelUnavailable(
            f"{SWITCH_ENV}={os.environ[SWITCH_ENV]!r} is not one of 0, false, off, no "
            "(turn the kernel off) or 1, true, on, yes (use it)"
        )
    if os.name != "posix":
        raise KernelUnavailable("the kernel is built on Linux and macOS only")
    path = verified_build()
    try:
        library = ctypes.CDLL(str(path))
    except OSError as error:
        raise KernelUnavailable(f"{path} does not load ({error})") from error
    return path, _bind(library, path, fields)


def _bind(library: ctypes.CDLL, path: Path, fields: tuple[str, ...]) -> tuple[Any, Any, int]:
    """The entry points of a loaded kernel whose columns are exactly ``fields``.

    They are the pass, and the two steps that finish its rows into packed states; then
    the kernel's vector width in float32 lanes.

    The statistics' state slots, the groups and the worst-token fields must be named as
    on the Python side too, and the profile block laid out as :mod:`..profile` lays it
    out (:func:`~lightning_rollout_debug.profile.profile_parts`, :func:`_profile_constants`).
    """
    try:
        column, function = library.rollout_row_column, library.rollout_row_sums
    except AttributeError as error:
        raise KernelUnavailable(f"{path} lacks the kernel's entry points ({error})") from error
    column.restype, column.argtypes = ctypes.c_char_p, [ctypes.c_int]
    columns = []
    while len(columns) <= len(fields) and (name := column(len(columns))) is not None:
        columns.append(name.decode())
    if tuple(columns) != fields:
        raise KernelUnavailable(
            f"{path} computes the columns {columns}, but the statistics expect {list(fields)}"
        )
    shape = getattr(library, "rollout_extras_shape", None)
    if shape is None or (shape(0), shape(1)) != (EXTRAS_MOMENTS, MAX_WORST_TOKENS):
        raise KernelUnavailable(f"{path} lays out the extras otherwise than this package")
    lanes = getattr(library, "rollout_vector_lanes", None)
    if lanes is None or lanes() not in VECTOR_LANES:
        raise KernelUnavailable(f"{path} names no vector width of {list(VECTOR_LANES)} lanes")
    try:
        name, finish_state, finish_extras = (
            library.rollout_name,
            library.rollout_finish_state,
            library.rollout_finish_extras,
        )
    except AttributeError as error:
        raise KernelUnavailable(f"{path} lacks the kernel's entry points ({error})") from error
    name.restype, name.argtypes = ctypes.c_char_p, [ctypes.c_int, ctypes.c_int]
    slots = tuple(slot for block in STATE.blocks for slot in block.names)
    parts, constants = profile_parts(profile_blocks()), _profile_constants()
    for table, (what, expected) in enumerate(
        (
            ("state slots", slots),
            ("groups", _GROUP_ORDER),
            ("worst-token fields", WORST_FIELDS),
            ("parts of the profile block", tuple(parts)),
            ("profile constants", tuple(constants)),
        ),
        start=1,
    ):
        names = []
        while len(names) <= len(expected) and (found := name(table, len(names))) is not None:
            names.append(found.decode())
        if tuple(names) != expected:
            raise KernelUnavailable(
                f"{path} names the {what} {names}, but this package expects {list(expected)}"
            )
    _check_profile(library, path, parts, constants)
    int64, pointer = ctypes.c_int64, ctypes.c_void_p
    for entry, arguments in (
        (function, [*(pointer,) * 3, *(ctypes.c_int,) * 2, int64, int64, ctypes.c_int,
                    ctypes.c_float, ctypes.c_float, ctypes.c_int, *(pointer,) * 4]),
        (finish_state, [pointer, int64, ctypes.c_uint64, ctypes.c_int, ctypes.c_double,
                        ctypes.c_double, pointer]),
        (finish_extras, [pointer, pointer, ctypes.c_int, pointer, ctypes.c_int, int64, int64,
                         *(pointer,) * 3, ctypes.c_double, ctypes.c_double, pointer]),
    ):  # fmt: skip
        entry.restype, entry.argtypes = ctypes.c_int, arguments
    _check_finishing(finish_state, path, fields)
    return function, (finish_state, finish_extras), lanes()


def _check_finishing(finish_state: Any, path: Path, fields: tuple[str, ...]) -> None:
    """Raise unless the kernel's finishing step writes every slot but the id checks'.

    With every column computed and every group on, a row table of ones leaves no slot as
    it was (NaN here), apart from :data:`~lightning_rollout_debug.rows.CHECK_SLOTS`.
    """
    table = torch.ones(1, len(fields), dtype=torch.float64)
    state = torch.full((STATE.size,), float("nan"), dtype=torch.float64)
    everything = (1 << len(fields)) - 1, (1 << len(_GROUP_ORDER)) - 1
    finish_state(table.data_ptr(), 1, *everything, 0.5, 2.0, state.data_ptr())
    slots = (slot for block in STATE.blocks for slot in block.names)
    unwritten = {slot for slot, kept in zip(slots, state.isnan().tolist(), strict=True) if kept}
    if unwritten != set(CHECK_SLOTS):
        forgotten = sorted(unwritten - set(CHECK_SLOTS))
        taken = sorted(set(CHECK_SLOTS) - unwritten)
        raise KernelUnavailable(
            f"{path} finishes the state otherwise than this package: its `StateOf::write` "
            f"leaves the slots {forgotten} unwritten and writes {taken}; it should write "
            f"every slot but {list(CHECK_SLOTS)}"
        )


def _profile_constants() -> dict[str, float]:
    """The constants of :mod:`..profile` the kernel is built with, by the kernel's names."""
    constants: dict[str, float] = {}
    for stem, bins in (*((slot, bins) for _, slot, bins in QUANTILE_BINS), ("joint", JOINT_BINS)):
        for field in ("low", "octaves", "steps", "signed"):
            constants[f"{stem}.{field}"] = float(getattr(bins, field))
    constants["position_buckets"] = float(POSITION_BUCKETS)
    constants["probability_buckets"] = float(PROBABILITY_BUCKETS)
    # The probability bucket is floor(-a * log2 e) in float32, as torch computes it.
    constants["log2_e"] = ctypes.c_float(_LOG2_E).value
    constants["size"] = float(PROFILE_SIZE)
    return constants


def _check_profile(
    library: ctypes.CDLL, path: Path, parts: dict[str, int], constants: dict[str, float]
) -> None:
    """Raise unless the kernel's profile parts and constants (named as expected) are these."""
    value = getattr(library, "rollout_profile_value", None)
    if value is None:
        raise KernelUnavailable(f"{path} lacks the kernel's entry point rollout_profile_value")
    value.restype, value.argtypes = ctypes.c_double, [ctypes.c_int, ctypes.c_int]
    for table, (what, expected) in (
        (4, ("sizes of the parts of the profile block", parts)),
        (5, ("profile constants", constants)),
    ):
        found = {name: value(table, index) for index, name in enumerate(expected)}
        wrong = [
            f"{name} = {found[name]:.9g} (profile.py: {want:.9g})"
            for name, want in expected.items()
            if found[name] != want
        ]
        if wrong:
            raise KernelUnavailable(
                f"{path} was built with other {what} than this package: {', '.join(wrong)}"
            )
