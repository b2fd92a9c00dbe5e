"""The kernel this process runs: loaded once, checked, or the one reason it is not used.

The first CPU batch (or :func:`prepare`, which the callback calls at the Trainer's
``setup``) loads the widest build the CPU runs, checked by :mod:`.loader`, once per
process under a lock; :func:`load` replaces it with another build. Where it cannot be
loaded, or a pass later fails (:func:`give_up`), one ``RuntimeWarning`` says why and
updates take the torch path. A pass asks for the build with one call, :func:`loaded`:
one :class:`Kernel`, its row function, its finishing steps (the segments' too) and the
columns it was checked against.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_rollout_debug.metrics import caller
from lightning_rollout_debug.metrics.native.loader import (
    Off,
    load_checked,
)
from lightning_rollout_debug.metrics.rows import ROW_FIELDS


@dataclass(frozen=True)
class Kernel:
    """A loaded and checked build: what a pass calls, and what the build was checked against.

    ``rows`` is the row function (the pass over a batch), ``finish_state`` and
    ``finish_extras`` the finishing steps into the statistics' and the extras' packed
    states, ``finish_segments`` the step that finishes a pass's segments into theirs,
    ``columns`` the row quantities it names (``rows.ROW_FIELDS`` by default) and
    ``lanes`` its vector width.
    """

    rows: Any
    finish_state: Any
    finish_extras: Any
    finish_segments: Any
    columns: tuple[str, ...]
    lanes: int


_kernel: dict[str, Any] = {"kernel": None, "problem": None}
"""The :class:`Kernel` this process runs (``None``: none yet, or none usable) and why there
is none (``None``: no problem known)."""


_process_lock = threading.Lock()


def vector_lanes() -> int | None:
    """The float32 values one step of the kernel's loop takes, or ``None`` without a kernel.

    It follows the CPU: 16 with AVX-512, 8 with AVX2, 4 otherwise (:func:`load` chooses).

    Example:
        >>> from lightning_rollout_debug.metrics.native.loader import VECTOR_LANES
        >>> vector_lanes() in (*VECTOR_LANES, None)
        True
    """
    kernel = loaded(None)
    return None if kernel is None else kernel.lanes


def available(fields: Sequence[str] | None = None) -> bool:
    """Whether the kernel is usable (loading it now if needed); warns once if it is not.

    ``fields`` are the column names the caller expects (``rows.ROW_FIELDS`` by default).
    """
    return loaded(fields) is not None


def load(lanes: int | None = None, fields: Sequence[str] | None = None) -> Path:
    """Load the kernel's build of ``lanes`` lanes for every update from now on; its path.

    By default the widest build this CPU runs; it takes the place of the one in use.

    Raises:
        KernelUnavailable: it is turned off, not installed, or this CPU cannot run it.

    Example:
        >>> from lightning_rollout_debug.metrics.native.loader import KernelUnavailable
        >>> try:
        ...     print(load().name.startswith("_row_sums_"))
        ... except KernelUnavailable:
        ...     print(True)
        True
    """
    with _process_lock:
        columns = _expected(fields)
        path, entries = load_checked(columns, lanes)
        _kernel.update(kernel=_kernel_of(entries, columns), problem=None)
    return path


def prepare() -> bool:
    """Load and check the kernel now (milliseconds); whether it is usable.

    A loop calls it before its first CPU batch (the callback does at the Trainer's
    ``setup``), so that the first training step does not pay for it. A problem found is
    warned about by the first CPU batch, as without it.

    Example:
        >>> prepare() in (True, False)
        True
    """
    _load_once(None)
    return _kernel["kernel"] is not None


def loaded(fields: Sequence[str] | None) -> Kernel | None:
    """The kernel this process runs, loaded now if needed; ``None`` where it is not usable.

    ``fields`` are the columns the caller expects, should this call load it
    (``rows.ROW_FIELDS`` by default). The first caller after a failed load warns,
    whichever thread loaded.
    """
    _load_once(fields)
    unsaid = _kernel.pop("unsaid", None)  # said by the first caller, whichever thread loaded
    if unsaid is not None:
        _warn(unsaid)
    return _kernel["kernel"]


def _load_once(fields: Sequence[str] | None) -> None:
    """Load the kernel unless it is loaded or known to be unusable; never raises."""
    if _kernel["kernel"] is None and _kernel["problem"] is None:
        with _process_lock:  # one load per process; other threads wait for it
            if _kernel["kernel"] is None and _kernel["problem"] is None:
                _load(_kernel, fields)


def _load(kernel: dict[str, Any], fields: Sequence[str] | None) -> None:
    """Load the kernel into ``kernel`` (the caller holds the lock); never raises."""
    try:
        columns = _expected(fields)
        _, entries = load_checked(columns)
        kernel["kernel"] = _kernel_of(entries, columns)
    except Off as off:
        kernel["problem"] = str(off)  # the user's choice: no warning
    except Exception as error:  # anything at all: the torch path takes over
        kernel["kernel"], kernel["problem"], kernel["unsaid"] = None, str(error), str(error)


def _kernel_of(entries: tuple[Any, tuple[Any, Any, Any], int], columns: tuple[str, ...]) -> Kernel:
    """The :class:`Kernel` of the loader's checked entry points, checked against ``columns``."""
    function, (finish_state, finish_extras, finish_segments), lanes = entries
    return Kernel(function, finish_state, finish_extras, finish_segments, columns, lanes)


def give_up(problem: str) -> None:
    """Stop using the kernel in this process, with one warning saying why."""
    _kernel["kernel"], _kernel["problem"] = None, problem
    _warn(problem)


def _warn(problem: str) -> None:
    """The warning that the kernel is not used."""
    caller.warn(
        f"The native CPU kernel is not used: {problem}. CPU updates use torch.compile or "
        "eager arithmetic instead (the same results to float32 rounding, slower).",
        RuntimeWarning,
    )


def _expected(fields: Sequence[str] | None) -> tuple[str, ...]:
    return tuple(ROW_FIELDS if fields is None else fields)
