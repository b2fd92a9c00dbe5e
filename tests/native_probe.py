"""CPU updates in a fresh process, reported as JSON (run by ``test_native_cache.py``).

``python tests/native_probe.py [CACHE ...]`` feeds :func:`probe_batch` to
``MismatchStats(compile=True)`` once per cache folder (by default the one the environment
names), each time as a process that has not loaded the kernel yet, and prints a list of
``{"metrics", "native", "warnings"}``: the statistics, whether the native kernel served
the update, and the message of every warning raised. While a folder is tried,
``PLANTED_MARKER`` is ``<folder>.marker``.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch


def probe_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(rollout_log_probs, old_log_probs, mask)``: 64 x 1100 float32, about 80 % masked in."""
    generator = torch.Generator().manual_seed(0)
    rollout = torch.log(torch.rand(64, 1100, generator=generator) * 0.99 + 0.0025)
    old = (rollout + 0.05 * torch.randn(64, 1100, generator=generator)).clamp(max=0.0)
    mask = torch.rand(64, 1100, generator=generator) < 0.8
    return rollout, old, mask


def main(folders: list[str]) -> None:
    from lightning_rollout_debug import MismatchStats, native

    reports = []
    for folder in folders or [os.environ[native.CACHE_ENV]]:
        os.environ[native.CACHE_ENV] = folder
        os.environ["PLANTED_MARKER"] = f"{folder}.marker"
        native._kernel.update(function=None, problem=None, columns=())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            stats = MismatchStats(compile=True)
            stats.update(*probe_batch())
            metrics = stats.compute()
        reports.append(
            {
                "metrics": metrics,
                "native": native._kernel["function"] is not None,
                "warnings": [str(warning.message) for warning in caught],
            }
        )
    json.dump(reports, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1:])
