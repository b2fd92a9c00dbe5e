"""The fused CPU pass of an update: ``row_sums.cpp``, built once per machine and user.

On CPUs one hand-vectorised loop computes every row reduction of an update
(``rows.row_sums``) with float64 sums kept in registers, about twice as fast as the
code ``torch.compile`` generates for the same arithmetic. It is built on first use with
the system C++ compiler (``$CXX``, else ``c++``, ``g++`` or ``clang++``) and loaded with
:mod:`ctypes`. Where it cannot be built or loaded, one warning says why and updates use
``torch.compile`` or eager arithmetic instead, with the same results.

The cache is the user's own and is checked before anything is loaded from it:

* it lives in :func:`cache_folder`: ``$LIGHTNING_ROLLOUT_DEBUG_CACHE``, else
  ``$XDG_CACHE_HOME/lightning-rollout-debug``, else ``~/.cache/lightning-rollout-debug``,
  created with mode 0700;
* the folder and every file read from it must belong to the current user and be
  writable by nobody else, and no folder above it may be open to others (unless sticky,
  as ``/tmp`` is);
* a library is loaded only when its bytes match the SHA-256 digest written beside it
  after a successful build; anything else is rebuilt, never loaded;
* one build at a time (a lock in the folder, and one in the process), into a unique
  temporary name that is renamed into place;
* the loaded library must name its output columns exactly as the Python side does, and
  lay out the profile block with the sizes and constants of :mod:`..profile`.

``LIGHTNING_ROLLOUT_DEBUG_NATIVE=0`` turns the kernel off. ``python -m
lightning_rollout_debug.native`` builds it ahead of time (for a container image) and
prints where it is.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import logging
import os
import platform
import shlex
import shutil
import stat
import subprocess
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_rollout_debug.layout import STATE
from lightning_rollout_debug.profile import (
    _LOG2_E,
    JOINT_BINS,
    POSITION_BUCKETS,
    PROBABILITY_BUCKETS,
    PROFILE_SIZE,
    QUANTILE_BINS,
    profile_blocks,
)
from lightning_rollout_debug.rows import ROW_FIELDS, ROWS_OF_GROUP

SOURCE = Path(__file__).with_name("row_sums.cpp")
CACHE_ENV = "LIGHTNING_ROLLOUT_DEBUG_CACHE"
"""Environment variable naming the cache folder (overrides the XDG location)."""
SWITCH_ENV = "LIGHTNING_ROLLOUT_DEBUG_NATIVE"
"""Environment variable: ``0`` (or ``false``, ``off``, ``no``) turns the kernel off."""

_FLAGS = (
    "-O3",
    "-fno-trapping-math",  # lets selects on floats vectorise; results are unchanged
    "-fno-math-errno",
    "-ffp-contract=fast",  # fused multiply-adds: one rounding instead of two
    "-std=c++17",
    "-shared",
    "-fPIC",
    "-pthread",
)
# Some compilers lack -march=native or OpenMP; the kernel then does without.
_FLAG_SETS = (
    ("-march=native", "-fopenmp", *_FLAGS),
    ("-fopenmp", *_FLAGS),
    ("-march=native", *_FLAGS),
    _FLAGS,
)
_PROBE_SOURCE = 'extern "C" int rollout_probe() { return 0; }\n'
_PROBE_BYTES = 1 << 20  # more than a built kernel takes (about 200 KB)
VECTOR_LANES = (4, 8, 16)
"""The vector widths the kernel is built with, in float32 lanes (``ROLLOUT_LANES``)."""
_OFF = frozenset({"0", "false", "off", "no"})
_ON = frozenset({"", "1", "true", "on", "yes"})
_LOG_PROB_KINDS = {torch.float32: 0, torch.bfloat16: 1}
_MASK_KINDS = {torch.bool: 0, torch.uint8: 0, torch.int32: 1, torch.int64: 2, torch.float32: 3}
# The columns the kernel computes only at its catalog level (bit 0 of `level`): those of
# the groups beyond the seed group.
_CATALOG_COLUMNS = frozenset().union(
    *(ROWS_OF_GROUP[group] for group in ("log_space", "kl", "importance_ratio"))
)

_LOG = logging.getLogger(__name__)
_LOG.setLevel(logging.INFO)
if not logging.getLogger().hasHandlers():  # as Lightning does: say it unless told otherwise
    _LOG.addHandler(logging.StreamHandler())
    _LOG.propagate = False

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


class KernelUnavailable(RuntimeError):
    """The kernel cannot be built or loaded here; the message says why and what to do."""


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


def cache_folder() -> Path:
    """Where the kernel is cached: the user's own folder, never a shared temporary one.

    ``$LIGHTNING_ROLLOUT_DEBUG_CACHE`` if set, else ``$XDG_CACHE_HOME/lightning-rollout-debug``
    (for an absolute ``$XDG_CACHE_HOME``), else ``~/.cache/lightning-rollout-debug``.

    Example:
        >>> folder = cache_folder()
        >>> folder.is_absolute(), folder == Path(os.environ.get(CACHE_ENV) or folder)
        (True, True)
    """
    chosen = os.environ.get(CACHE_ENV, "")
    if chosen:
        return Path(chosen).expanduser().absolute()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "lightning-rollout-debug"


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
    path = _build()
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
    out (:func:`_profile_parts`, :func:`_profile_constants`).
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
    parts, constants = _profile_parts(), _profile_constants()
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
    return function, (finish_state, finish_extras), lanes()


def _profile_parts() -> dict[str, int]:
    """The parts of the profile block in order: the stem of their slots' names, and their size.

    ``profile_blocks()`` names slots ``stem[i]`` (or ``stem`` alone); consecutive slots of
    one stem make a part.
    """
    stems = [name.split("[", 1)[0] for block in profile_blocks() for name in block.names]
    return {stem: len(list(run)) for stem, run in itertools.groupby(stems)}


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


# ----------------------------------------------------------------- building
def _build() -> Path:
    """A verified kernel in the cache folder: found there, or built now."""
    compiler = _compiler()
    source = SOURCE.read_bytes()
    folder = _private_folder()
    targets = [folder / f"row_sums_{_key(source, compiler, flags)}.so" for flags in _FLAG_SETS]
    found = _first_verified(targets)
    if found is not None:
        return found
    with _folder_lock(folder):  # concurrent processes: one builds, the others wait
        found = _first_verified(targets)
        if found is not None:
            return found
        _check_writable(folder)
        for flags, target in zip(_FLAG_SETS, targets, strict=True):
            if _compiles(compiler, flags, folder):
                return _compile(compiler, flags, folder, target)
    raise KernelUnavailable(f"{shlex.join(compiler)} builds no shared library here")


def _first_verified(targets: Sequence[Path]) -> Path | None:
    """The first target that is complete (its digest matches); ``None`` if none is."""
    for target in targets:
        if os.path.lexists(target) and _verified(target):
            return target
    return None


def _verified(target: Path) -> bool:
    """Whether ``target`` is safe to load: the user's own, and its digest matches.

    Raises:
        KernelUnavailable: the file or its digest is open to other users.
    """
    record = _record(target)
    for path in (target, record):
        if os.path.lexists(path):
            _check_private(path, folder=False)
    try:
        expected = record.read_text().strip()
    except OSError:
        return False  # not (yet) finished by a build: rebuilt, never loaded
    return hashlib.sha256(target.read_bytes()).hexdigest() == expected


def _record(target: Path) -> Path:
    return target.with_suffix(".sha256")


def _compile(compiler: list[str], flags: Sequence[str], folder: Path, target: Path) -> Path:
    _LOG.info("lightning_rollout_debug: building the native CPU kernel into %s", folder)
    started = time.perf_counter()
    with _temporary(folder, ".so") as partial:
        result = _run([*compiler, *flags, str(SOURCE), "-o", str(partial)])
        if result.returncode != 0:
            raise KernelUnavailable(
                f"{shlex.join(compiler)} failed: {result.stderr.strip()[-2000:]}"
            )
        os.chmod(partial, 0o700)  # whatever the umask: writable by the user alone
        digest = hashlib.sha256(partial.read_bytes()).hexdigest()
        _fsync(partial)
        os.replace(partial, target)
    with _temporary(folder, ".sha256") as partial:  # written last: it marks a whole build
        partial.write_text(digest + "\n")
        _fsync(partial)
        os.replace(partial, _record(target))
    _LOG.info(
        "lightning_rollout_debug: built the native CPU kernel in %.1f s: %s",
        time.perf_counter() - started,
        target,
    )
    return target


def _compiles(compiler: list[str], flags: Sequence[str], folder: Path) -> bool:
    """Whether ``compiler`` links a trivial library with ``flags`` (a fraction of a second)."""
    with _temporary(folder, ".so") as probe:
        result = _run([*compiler, *flags, "-x", "c++", "-", "-o", str(probe)], _PROBE_SOURCE)
    return result.returncode == 0


def _run(command: list[str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            command, input=stdin, capture_output=True, text=True, timeout=300, check=False
        )
    except (OSError, subprocess.SubprocessError) as error:
        raise KernelUnavailable(f"{shlex.join(command[:2])} could not run ({error})") from error


@contextmanager
def _temporary(folder: Path, suffix: str) -> Iterator[Path]:
    """A fresh file name in ``folder``, unique to this call; removed unless renamed away."""
    handle, name = tempfile.mkstemp(prefix=".partial-", suffix=suffix, dir=folder)
    os.close(handle)
    path = Path(name)
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


def _fsync(path: Path) -> None:
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())


@contextmanager
def _folder_lock(folder: Path) -> Iterator[None]:
    """Hold ``build.lock`` in ``folder``: one build at a time for every process here.

    Where the file system cannot lock (some network file systems), builds go on without:
    unique temporary names and atomic renames keep concurrent builds correct, only
    repeated.
    """
    import fcntl  # POSIX only, as the kernel is

    lock = folder / "build.lock"
    handle = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        _check_private(lock, folder=False)
        with suppress(OSError):
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        os.close(handle)  # releases the lock


def _check_writable(folder: Path) -> None:
    """Write (and remove) a file of a kernel's size first: a full disk fails here, at once."""
    try:
        with _temporary(folder, ".probe") as probe, open(probe, "wb") as handle:
            handle.write(bytes(_PROBE_BYTES))
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as error:
        raise KernelUnavailable(
            f"the cache folder {folder} is not writable ({error.strerror or error}); set "
            f"{CACHE_ENV} to a folder of your own, or {SWITCH_ENV}=0"
        ) from error


def _compiler() -> list[str]:
    """The compiler command: ``$CXX`` (words, as in ``ccache g++``), else the first found."""
    chosen = os.environ.get("CXX", "").strip()
    if chosen:
        words = shlex.split(chosen)
        found = shutil.which(words[0])
        if found is None:
            raise KernelUnavailable(
                f"CXX={chosen!r} names no program on the PATH; set CXX to a C++ compiler "
                "command such as 'g++' or 'ccache g++'"
            )
        return [found, *words[1:]]
    for name in ("c++", "g++", "clang++"):
        found = shutil.which(name)
        if found:
            return [found]
    raise KernelUnavailable("no C++ compiler found; install one or set CXX")


def _key(source: bytes, compiler: list[str], flags: Sequence[str]) -> str:
    parts = [source, *map(str.encode, compiler), *map(str.encode, flags), _cpu_signature()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:24]


def _cpu_signature() -> bytes:
    """What ``-march=native`` depends on: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    wanted = [line for line in lines if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(wanted)) or [platform.processor(), platform.machine()]).encode()


# ------------------------------------------------------------------ trust
def _private_folder() -> Path:
    """The cache folder, created with mode 0700, once it is shown to be the user's alone."""
    try:
        folder = cache_folder()
    except RuntimeError as error:  # no home folder to be found
        raise KernelUnavailable(f"{error}; set {CACHE_ENV} to a folder of your own") from error
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as error:
        raise KernelUnavailable(
            f"the cache folder {folder} cannot be created ({error.strerror or error}); set "
            f"{CACHE_ENV} to a folder of your own, or {SWITCH_ENV}=0"
        ) from error
    _check_private(folder, folder=True)
    return folder


def _check_private(path: Path, *, folder: bool) -> None:
    """Raise unless ``path`` and every folder above it are closed to other users.

    ``path`` itself (no link) must belong to the current user and be writable by nobody
    else. A folder above it must belong to the user or to root, and may be writable by
    others only when sticky (as ``/tmp``): then nobody else can rename what is in it.
    """
    user = os.geteuid()
    info = os.lstat(path)
    kind = stat.S_ISDIR if folder else stat.S_ISREG
    problem = None
    if not kind(info.st_mode):
        problem = f"is not a {'folder' if folder else 'regular file'}"
    elif info.st_uid != user:
        problem = f"belongs to user {info.st_uid}, not to you ({user})"
    elif info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        problem = f"is writable by other users (mode {stat.filemode(info.st_mode)})"
    if problem is not None:
        where = path if folder else path.parent
        raise KernelUnavailable(
            f"{path} {problem}, so it is not trusted; remove {where} (it is rebuilt as a "
            f"folder of mode 0700) or set {CACHE_ENV} to a folder of your own"
        )
    for parent in Path(os.path.realpath(path)).parents:
        info = os.stat(parent)
        open_to_others = info.st_mode & stat.S_IWOTH or (
            info.st_mode & stat.S_IWGRP and info.st_gid != os.getegid()
        )
        if info.st_uid not in (0, user) or (open_to_others and not info.st_mode & stat.S_ISVTX):
            raise KernelUnavailable(
                f"{parent}, above the cache folder, is open to other users (owner "
                f"{info.st_uid}, mode {stat.filemode(info.st_mode)}); set {CACHE_ENV} to a "
                "folder of your own"
            )
