"""The fused CPU pass of an update: ``row_sums.cpp``, built with the package.

On CPUs one hand-vectorised loop computes every row reduction of an update
(``rows.row_sums``) with float64 sums kept in registers, about twice as fast as the
code ``torch.compile`` generates for the same arithmetic. The package's build compiles it
once per vector width (``setup.py``); the first CPU batch loads the widest build the CPU
runs with :mod:`ctypes` (:mod:`.loader`), after checking that it names its output
columns and state slots exactly as the Python side does, writes every slot of the state
it finishes, and lays out the profile block with the sizes and constants of
:mod:`..profile`. Where it is not installed or does not load, one warning says why and
updates use ``torch.compile`` or eager arithmetic instead, with the same results.

:mod:`.kernel` keeps the build this process runs (or why there is none), :mod:`.passes`
runs it over a batch and finishes the packed states, the segments' too (:mod:`.segments`:
the labels a pass reads). ``LIGHTNING_ROLLOUT_DEBUG_NATIVE=0`` turns the kernel off.
``python -m lightning_rollout_debug.metrics.native`` prints the build this CPU runs, or
why there is none.
"""

from __future__ import annotations

from lightning_rollout_debug.metrics.native.kernel import available, load, prepare, vector_lanes
from lightning_rollout_debug.metrics.native.loader import (
    EXTRAS_MOMENTS,
    HISTOGRAM_MOMENTS,
    MAX_WORST_TOKENS,
    SWITCH_ENV,
    VECTOR_LANES,
    WORST_FIELDS,
    KernelUnavailable,
    builds,
)
from lightning_rollout_debug.metrics.native.passes import (
    LOG_PROB_DTYPES,
    ExtrasRequest,
    SegmentRequest,
    StateRequest,
    row_sums,
    states,
)

__all__ = [
    "EXTRAS_MOMENTS",
    "HISTOGRAM_MOMENTS",
    "LOG_PROB_DTYPES",
    "MAX_WORST_TOKENS",
    "SWITCH_ENV",
    "VECTOR_LANES",
    "WORST_FIELDS",
    "ExtrasRequest",
    "KernelUnavailable",
    "SegmentRequest",
    "StateRequest",
    "available",
    "builds",
    "load",
    "prepare",
    "row_sums",
    "states",
    "vector_lanes",
]
