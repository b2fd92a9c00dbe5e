"""``python -m lightning_rollout_debug.metrics.native``: the kernel's build this CPU runs.

Prints the path of the build an update loads and its vector width, after checking it as
an update does; exits with 1, saying why, where there is none (installed without a
compiler, or turned off).
"""

from __future__ import annotations

import sys

from lightning_rollout_debug.metrics.native import KernelUnavailable, load, vector_lanes


def main() -> int:
    """Load and check the kernel, and print which build it is."""
    try:
        path = load()
    except KernelUnavailable as error:
        print(f"The native CPU kernel is not available: {error}.", file=sys.stderr)
        return 1
    print(f"{path} ({vector_lanes()} float32 lanes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
