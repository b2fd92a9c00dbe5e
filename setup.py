"""The package's one compiled part: the CPU kernel, built with the package.

``pip install .``, ``pip install -e .`` and ``python -m build`` compile
``lightning_rollout_debug/metrics/native/row_sums.cpp`` into plain shared libraries, one per vector
width the platform has (on x86-64: 16 float32 lanes with AVX-512, 8 with AVX2, 4 with
SSE4.2, which every x86-64 CPU since 2009 has; elsewhere 4), which the package loads
with ``ctypes``, choosing at run time by what the CPU supports. They call nothing of Python or
torch, so one wheel serves every Python from 3.10 (``abi3``) and every torch.

Each library is an optional extension: where it cannot be compiled (no C++ compiler),
the install goes on without it and the package computes on the torch path. Windows
builds none (the kernel is written with the vector extensions of GCC and Clang, which
MSVC lacks).
"""

from __future__ import annotations

import sys
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

SOURCE = "lightning_rollout_debug/metrics/native/row_sums.cpp"
FLAGS = [
    "-O3",
    "-g0",  # no debugging sections (Python's own flags may ask for them): a seventh of the size
    "-fno-trapping-math",  # lets selects on floats vectorise; results are unchanged
    "-fno-math-errno",
    "-ffp-contract=fast",  # fused multiply-adds: one rounding instead of two
    "-std=c++17",
    "-pthread",
    "-fopenmp",  # torch's own OpenMP pool, where the compiler has OpenMP (else threads)
]
X86_64_WIDTHS = {
    16: [
        "-mavx512f",
        "-mavx512dq",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx2",
        "-mfma",
        "-mbmi2",
        "-msse4.2",
        "-mpopcnt",
    ],
    8: ["-mavx2", "-mfma", "-mbmi2", "-msse4.2", "-mpopcnt"],
    4: ["-msse4.2", "-mpopcnt"],
}
"""The instruction sets of each width on x86-64, as ``rollout_cpu_lanes`` checks them."""


def widths() -> dict[int, list[str]]:
    """The vector widths built for the target machine, and the flags of each."""
    if sys.platform == "win32":
        return {}
    machine = sysconfig.get_platform().rsplit("-", 1)[-1]  # the target's, when cross-building
    return X86_64_WIDTHS if machine in ("x86_64", "amd64") else {4: []}


def kernel(lanes: int, flags: list[str]) -> Extension:
    """The kernel of ``lanes`` float32 lanes."""
    return Extension(
        f"lightning_rollout_debug.metrics.native._row_sums_{lanes}",
        sources=[SOURCE],
        language="c++",
        define_macros=[("ROLLOUT_LANES", str(lanes))],
        extra_compile_args=[*FLAGS, *flags],
        extra_link_args=["-pthread", "-fopenmp"],
        py_limited_api=True,
        optional=True,
    )


class BuildKernels(build_ext):
    """``build_ext``, retried without OpenMP where the compiler has none (Apple Clang)."""

    def build_extension(self, ext: Extension) -> None:
        """Build ``ext``; where that fails with OpenMP, once more without it."""
        try:
            super().build_extension(ext)
        except Exception:
            if "-fopenmp" not in ext.extra_compile_args:
                raise
            ext.extra_compile_args = [flag for flag in ext.extra_compile_args if flag != "-fopenmp"]
            ext.extra_link_args = [flag for flag in ext.extra_link_args if flag != "-fopenmp"]
            super().build_extension(ext)


if __name__ == "__main__":  # as setuptools runs it; the tests read the flags alone
    setup(
        ext_modules=[kernel(lanes, flags) for lanes, flags in widths().items()],
        cmdclass={"build_ext": BuildKernels},
        options={"bdist_wheel": {"py_limited_api": "cp310"}},
    )
