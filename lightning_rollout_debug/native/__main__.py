"""``python -m lightning_rollout_debug.native``: build the CPU kernel now and print its path.

For container images and shared environments: run it once at build time, and training
processes find a verified kernel in the cache instead of compiling on their first large
batch, also once the image has removed its compiler. Without a compiler it prints the
prebuilt kernel it would use. Exits with 1, saying why, where the kernel cannot be built
(or found) or is turned off.
"""

from __future__ import annotations

import sys

from lightning_rollout_debug.native import KernelUnavailable, build


def main() -> int:
    """Build (or find) the kernel, check it, and print where it is."""
    try:
        path = build()
    except KernelUnavailable as error:
        print(f"The native CPU kernel is not available: {error}.", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
