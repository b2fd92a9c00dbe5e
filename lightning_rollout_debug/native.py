"""The fused CPU pass of an update: ``row_sums.cpp``, built once per machine.

On CPUs one hand-vectorised loop computes every row reduction of an update
(``stats._row_sums``) with float64 sums kept in registers, about twice as fast as the
code ``torch.compile`` generates for the same arithmetic. It is built on first use with
the system C++ compiler (``$CXX``, else ``c++``, ``g++`` or ``clang++``) into a cache
folder under the temporary directory, keyed by the source, the compiler and the CPU, and
loaded with :mod:`ctypes`. Where it cannot be built, one warning says so and updates use
``torch.compile`` or eager arithmetic instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

SOURCE = Path(__file__).with_name("row_sums.cpp")
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
_LOG_PROB_KINDS = {torch.float32: 0, torch.bfloat16: 1}
_MASK_KINDS = {torch.bool: 0, torch.uint8: 0, torch.int32: 1, torch.int64: 2, torch.float32: 3}
_CATALOG_GROUPS = frozenset({"log_space", "kl", "importance_ratio"})
_library: dict[str, Any] = {"function": None, "problem": None, "slots": None}


def available() -> bool:
    """Whether the kernel is built (building it now if needed); warns once if it cannot be."""
    return _function() is not None


def row_sums(
    rollout_log_probs: Tensor,
    old_log_probs: Tensor,
    mask: Tensor,
    groups: frozenset[str],
    is_threshold: float,
    fields: tuple[str, ...],
) -> dict[str, Tensor] | None:
    """The ``[B]`` row reductions named by ``fields`` (``stats.ROW_FIELDS``), or ``None``.

    ``None`` when the kernel does not apply: tensors off the CPU, log-probs that are not
    both float32 or both bfloat16, or a kernel that could not be built. Reads the
    tensors in place when they are contiguous.
    """
    kind = _LOG_PROB_KINDS.get(rollout_log_probs.dtype)
    if (
        kind is None
        or old_log_probs.dtype != rollout_log_probs.dtype
        or mask.device.type != "cpu"
        or rollout_log_probs.device.type != "cpu"
        or old_log_probs.device.type != "cpu"
    ):
        return None
    function = _function()
    if function is None:
        return None
    if _library["slots"] != len(fields):
        raise RuntimeError(f"row_sums.cpp has {_library['slots']} columns, not {len(fields)}.")
    if mask.dtype not in _MASK_KINDS:
        mask = mask != 0
    rollout, old, mask = (t.contiguous() for t in (rollout_log_probs, old_log_probs, mask))
    rows, width = mask.shape
    out = torch.empty(rows, len(fields), dtype=torch.float64)
    level = bool(groups & _CATALOG_GROUPS) | (2 if "sequence" in groups else 0)
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
        torch.get_num_threads(),
        out.data_ptr(),
    )
    if status != 0:
        raise RuntimeError(f"row_sums.cpp rejected its arguments (status {status}).")
    return dict(zip(fields, out.unbind(1), strict=True))


def _function() -> Any:
    if _library["function"] is None and _library["problem"] is None:
        try:
            _library["function"] = _load(_build())
        except (OSError, subprocess.SubprocessError, RuntimeError) as error:
            _library["problem"] = str(error)
            warnings.warn(
                f"The native CPU kernel could not be built ({error}); CPU updates use "
                "torch.compile or eager arithmetic instead (the same results to float32 "
                "rounding, slower).",
                RuntimeWarning,
                stacklevel=4,
            )
    return _library["function"]


def _build() -> Path:
    """Compile ``row_sums.cpp`` into the cache folder unless it is there already."""
    compiler = _compiler()
    source = SOURCE.read_bytes()
    # Some compilers lack -march=native or OpenMP; the kernel then does without.
    for flags in (
        ("-march=native", "-fopenmp", *_FLAGS),
        ("-fopenmp", *_FLAGS),
        ("-march=native", *_FLAGS),
        _FLAGS,
    ):
        key = hashlib.sha256(
            b"\0".join([source, compiler.encode(), *map(str.encode, flags), _cpu_signature()])
        ).hexdigest()[:24]
        target = _cache_folder() / f"row_sums_{key}.so"
        if target.exists():
            return target
        partial = target.with_suffix(f".{os.getpid()}.tmp")
        result = subprocess.run(
            [compiler, *flags, str(SOURCE), "-o", str(partial)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if result.returncode == 0:
            os.replace(partial, target)  # atomic: concurrent processes may build it too
            return target
        partial.unlink(missing_ok=True)
    raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")


def _load(path: Path) -> Any:
    library = ctypes.CDLL(str(path))
    _library["slots"] = library.rollout_row_slots()
    function = library.rollout_row_sums
    function.restype = ctypes.c_int
    function.argtypes = [
        *(ctypes.c_void_p,) * 3,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int,
        ctypes.c_float,
        ctypes.c_float,
        ctypes.c_int,
        ctypes.c_void_p,
    ]
    return function


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        found = name and shutil.which(name)
        if found:
            return found
    raise RuntimeError("no C++ compiler found (set $CXX)")


def _cache_folder() -> Path:
    user = os.getuid() if hasattr(os, "getuid") else os.environ.get("USERNAME", "user")
    folder = Path(tempfile.gettempdir()) / f"lightning_rollout_debug_{user}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _cpu_signature() -> bytes:
    """What ``-march=native`` depends on: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    wanted = [line for line in lines if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(wanted)) or [platform.processor(), platform.machine()]).encode()
