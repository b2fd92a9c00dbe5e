"""Loading the kernel: the build this CPU runs, and a check that every name and constant match.

The package is installed with one build of ``row_sums.cpp`` per vector width
(``_row_sums_16``, ``_row_sums_8``, ``_row_sums_4`` beside this module, made by the
package's ``setup.py``). :func:`load_checked` loads the widest build the CPU supports (the
4-lane build, which every CPU of its architecture runs, says which: ``rollout_cpu_lanes``)
with :mod:`ctypes`, and :func:`bind` checks it: it must name its output columns, state
slots, groups and worst-token fields exactly as the Python side does, lay out its profile
block with the sizes and constants of :mod:`..profile` (:func:`profile_constants`), its
finishing step must write every slot of the state, and that of the segments those of the
token-level groups in each copy. Anything else raises
:class:`KernelUnavailable`, naming what differs. Nothing is compiled or written.

Example:
    >>> profile_constants()["position_buckets"]
    24.0
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import os
import sys
from pathlib import Path
from typing import Any

import torch

from lightning_rollout_debug.metrics.layout import STATE
from lightning_rollout_debug.metrics.profile import (
    _LOG2_E,
    JOINT_BINS,
    POSITION_BUCKETS,
    PROBABILITY_BUCKETS,
    PROFILE_SIZE,
    QUANTILE_BINS,
    profile_blocks,
    profile_parts,
)
from lightning_rollout_debug.metrics.rows import CHECK_SLOTS, SEGMENT_GROUPS
from lightning_rollout_debug.metrics.worst_tokens import WORST_FIELDS

VECTOR_LANES = (4, 8, 16)
"""The vector widths the kernel is built with, in float32 lanes (``ROLLOUT_LANES``)."""
EXTRAS_MOMENTS = 8
"""Per-row moments of the extras the kernel writes before the worst-token pairs."""
MAX_WORST_TOKENS = 64
"""The most worst tokens per row the kernel keeps (``kMaxWorst``)."""
HISTOGRAM_MOMENTS = 5
"""What a packed histogram holds after its bins: num, min, max, sum, sum of squares."""
GROUP_ORDER = ("seed", "log_space", "kl", "importance_ratio", "sequence", "health")
"""The groups the kernel's finishing step knows, in the order of its bits."""
SWITCH_ENV = "LIGHTNING_ROLLOUT_DEBUG_NATIVE"
"""Environment variable: ``0`` (or ``false``, ``off``, ``no``) turns the kernel off."""
_OFF = frozenset({"0", "false", "off", "no"})
_ON = frozenset({"", "1", "true", "on", "yes"})
_FOLDER = Path(__file__).parent
NO_KERNEL = (
    "this installation of lightning-rollout-debug has no CPU kernel: it was built from "
    "source where no C++ compiler was found. Install g++ or clang++ and reinstall it "
    "(`pip install --force-reinstall --no-deps lightning-rollout-debug`, or `pip install "
    "-e .` in a checkout), or install a wheel"
)
"""Why the kernel is not there, and how to get it."""


class KernelUnavailable(RuntimeError):
    """The kernel cannot be loaded here; the message says why and what to do."""


class Off(KernelUnavailable):
    """Turned off by the environment."""


def builds() -> dict[int, Path]:
    """The kernel's builds installed with the package, by vector width (float32 lanes).

    Example:
        >>> set(builds()) <= set(VECTOR_LANES)
        True
    """
    found = {}
    for lanes in VECTOR_LANES:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = _FOLDER / f"_row_sums_{lanes}{suffix}"
            if path.is_file():
                found[lanes] = path
                break
    return found


def cpu_lanes() -> int:
    """The widest vector width this CPU runs the kernel at (``rollout_cpu_lanes``; 0: none).

    Raises:
        KernelUnavailable: the package was installed without the kernel.
    """
    baseline = builds().get(4)
    if baseline is None:
        raise KernelUnavailable(NO_KERNEL)
    function = _library(baseline).rollout_cpu_lanes
    function.restype, function.argtypes = ctypes.c_int, []
    return int(function())


def load_checked(fields: tuple[str, ...], lanes: int | None = None) -> tuple[Path, Any]:
    """The path of the kernel's build of ``lanes`` lanes and its checked entry points.

    By default the widest build this CPU runs; :func:`bind` checks it.

    Raises:
        Off: the kernel is turned off (``LIGHTNING_ROLLOUT_DEBUG_NATIVE=0``), or this is
            Windows, which has no build.
        KernelUnavailable: it is not installed, the CPU cannot run that width, or the build
            does not match this package.
    """
    switch = os.environ.get(SWITCH_ENV, "").strip().lower()
    if switch in _OFF:
        raise Off(f"turned off by {SWITCH_ENV}={os.environ[SWITCH_ENV]}")
    if switch not in _ON:
        raise KernelUnavailable(
            f"{SWITCH_ENV}={os.environ[SWITCH_ENV]!r} is not one of 0, false, off, no "
            "(turn the kernel off) or 1, true, on, yes (use it)"
        )
    if sys.platform == "win32":  # no build there (setup.py), and nothing for the user to do
        raise Off("the kernel is not built for Windows")
    installed = builds()
    if not installed:
        raise KernelUnavailable(NO_KERNEL)
    widest = cpu_lanes()
    if widest == 0:
        raise KernelUnavailable("this CPU lacks SSE4.2, which every build of the kernel needs")
    if lanes is None:
        lanes = max(width for width in installed if width <= widest)
    elif lanes not in installed or lanes > widest:
        raise KernelUnavailable(
            f"no build of {lanes} lanes this CPU runs: the builds installed are "
            f"{sorted(installed)} lanes, and this CPU runs up to {widest}"
        )
    path = installed[lanes]
    return path, bind(_library(path), path, fields)


def _library(path: Path) -> ctypes.CDLL:
    try:
        return ctypes.CDLL(str(path))
    except OSError as error:
        raise KernelUnavailable(f"{path} does not load ({error})") from error


def bind(library: ctypes.CDLL, path: Path, fields: tuple[str, ...]) -> tuple[Any, Any, int]:
    """The entry points of a loaded kernel whose columns are exactly ``fields``.

    They are the pass, and the three steps that finish it into packed states (the
    statistics', the extras', the segments'); then the kernel's vector width in float32
    lanes.

    The statistics' state slots, the groups and the worst-token fields must be named as
    on the Python side too, and the profile block laid out as :mod:`..profile` lays it
    out (:func:`~lightning_rollout_debug.metrics.profile.profile_parts`, :func:`profile_constants`).
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
        name, finish_state, finish_extras, finish_segments = (
            library.rollout_name,
            library.rollout_finish_state,
            library.rollout_finish_extras,
            library.rollout_finish_segments,
        )
    except AttributeError as error:
        raise KernelUnavailable(f"{path} lacks the kernel's entry points ({error})") from error
    parts, constants = profile_parts(profile_blocks()), profile_constants()
    _check_names(name, path, parts, constants)
    _check_profile(library, path, parts, constants)
    int64, pointer = ctypes.c_int64, ctypes.c_void_p
    for entry, arguments in (
        (function, [*(pointer,) * 3, *(ctypes.c_int,) * 2, int64, int64, ctypes.c_int,
                    ctypes.c_float, ctypes.c_float, ctypes.c_int, *(pointer,) * 5,
                    *(ctypes.c_int,) * 3, ctypes.c_uint64, pointer]),
        (finish_state, [pointer, int64, ctypes.c_uint64, ctypes.c_int, ctypes.c_double,
                        ctypes.c_double, pointer]),
        (finish_extras, [pointer, pointer, ctypes.c_int, pointer, ctypes.c_int, int64, int64,
                         *(pointer,) * 3, ctypes.c_double, ctypes.c_double, pointer,
                         *(ctypes.c_int,) * 3, pointer]),
        (finish_segments, [pointer, ctypes.c_int, ctypes.c_uint64, ctypes.c_int, pointer]),
    ):  # fmt: skip
        entry.restype, entry.argtypes = ctypes.c_int, arguments
    _check_finishing(finish_state, path, fields)
    _check_segments((function, finish_state, finish_segments), path, fields)
    return function, (finish_state, finish_extras, finish_segments), lanes()


def _check_names(name: Any, path: Path, parts: dict[str, int], constants: dict[str, float]) -> None:
    """Raise unless the kernel's tables (``rollout_name``) name what this package names."""
    name.restype, name.argtypes = ctypes.c_char_p, [ctypes.c_int, ctypes.c_int]
    slots = tuple(slot for block in STATE.blocks for slot in block.names)
    for table, (what, expected) in enumerate(
        (
            ("state slots", slots),
            ("groups", GROUP_ORDER),
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


def _check_finishing(finish_state: Any, path: Path, fields: tuple[str, ...]) -> None:
    """Raise unless the kernel's finishing step writes every slot but the id checks'.

    With every column computed and every group on, a row table of ones leaves no slot as
    it was (NaN here), apart from :data:`~lightning_rollout_debug.metrics.rows.CHECK_SLOTS`.
    """
    table = torch.ones(1, len(fields), dtype=torch.float64)
    state = torch.full((STATE.size,), float("nan"), dtype=torch.float64)
    everything = (1 << len(fields)) - 1, (1 << len(GROUP_ORDER)) - 1
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


def _check_segments(entries: tuple[Any, Any, Any], path: Path, fields: tuple[str, ...]) -> None:
    """Raise unless the pass's segments are finished as copies of its rows' state.

    A pass over one token of segment 0 of 1, finished with every column and every group
    asked for: each of the two copies holds exactly the slots the finishing step writes
    for the token-level groups (:data:`~lightning_rollout_debug.metrics.rows.SEGMENT_GROUPS`),
    the first with the values it writes from the pass's row.
    """
    function, finish_state, finish_segments = entries
    everything, groups = (1 << len(fields)) - 1, (1 << len(GROUP_ORDER)) - 1
    token_level = sum(1 << GROUP_ORDER.index(group) for group in SEGMENT_GROUPS)
    log_probs, mask = torch.full((1, 1), -0.5), torch.ones(1, 1, dtype=torch.bool)
    labels = torch.zeros(1, dtype=torch.int64)
    table, rows = (torch.zeros(n, len(fields), dtype=torch.float64) for n in (1, 2))
    pointers = (t.data_ptr() for t in (log_probs, log_probs, mask))
    status = function(*pointers, 0, 0, 1, 1, 3, 1.0, -0.5, 1, table.data_ptr(), None, None,
                      None, labels.data_ptr(), 2, 0, 1, everything, rows.data_ptr())  # fmt: skip
    want = torch.full((STATE.size,), float("nan"), dtype=torch.float64)
    finish_state(table.data_ptr(), 1, everything, token_level, 0.5, 2.0, want.data_ptr())
    got = torch.full((2, STATE.size), float("nan"), dtype=torch.float64)
    status = status or finish_segments(rows.data_ptr(), 1, everything, groups, got.data_ptr())
    same = status == 0 and all(torch.equal(copy.isnan(), want.isnan()) for copy in got)
    if not same or not torch.equal(got[0].nan_to_num(), want.nan_to_num()):
        raise KernelUnavailable(
            f"{path} finishes the segments otherwise than this package (status {status}): "
            "each copy should hold the slots of the token-level groups alone, the first "
            "those of the pass's one row"
        )


def profile_constants() -> dict[str, float]:
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
