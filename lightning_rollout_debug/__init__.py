"""See the mismatch between rollout-engine and trainer log-probabilities in RL fine-tuning.

The statistics (:mod:`.metrics`) and the checks (:mod:`.checks`) load with the package;
the names of the training-loop side (the callback, the monitor, their settings and
warning, in :mod:`.loop`) load with Lightning when one of them is first used, so that the
statistics and the one-shot functions (:mod:`.functional`) run without Lightning,
TensorBoard or Pillow imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_rollout_debug.checks.alerts import (
    DEFAULT_ALERT_RANGES,
    RolloutAlertError,
    RolloutAlertWarning,
)
from lightning_rollout_debug.checks.diagnosis import RolloutDiagnosisError, RolloutDiagnosisWarning
from lightning_rollout_debug.checks.drift import DEFAULT_DRIFT_FACTORS
from lightning_rollout_debug.metrics.alignment import response_log_probs
from lightning_rollout_debug.metrics.catalog import GROUPS, METRIC_NAMES
from lightning_rollout_debug.metrics.inputs import BatchError
from lightning_rollout_debug.metrics.stats import MismatchStats

if TYPE_CHECKING:
    from lightning_rollout_debug.loop.batch_updates import RolloutDebugWarning
    from lightning_rollout_debug.loop.callback import RolloutDebugCallback
    from lightning_rollout_debug.loop.config import RolloutDebugConfig
    from lightning_rollout_debug.loop.monitor import RolloutDebugMonitor

__all__ = [
    "DEFAULT_ALERT_RANGES",
    "DEFAULT_DRIFT_FACTORS",
    "GROUPS",
    "METRIC_NAMES",
    "BatchError",
    "MismatchStats",
    "RolloutAlertError",
    "RolloutAlertWarning",
    "RolloutDebugCallback",
    "RolloutDebugConfig",
    "RolloutDebugMonitor",
    "RolloutDebugWarning",
    "RolloutDiagnosisError",
    "RolloutDiagnosisWarning",
    "response_log_probs",
]
__version__ = "0.1.0"

_LOOP_NAMES = {
    "RolloutDebugCallback": "lightning_rollout_debug.loop.callback",
    "RolloutDebugConfig": "lightning_rollout_debug.loop.config",
    "RolloutDebugMonitor": "lightning_rollout_debug.loop.monitor",
    "RolloutDebugWarning": "lightning_rollout_debug.loop.batch_updates",
}
"""The public names of the training-loop side, and the module each is defined in."""


def __getattr__(name: str) -> Any:
    """A name of the training-loop side, imported on first use (Lightning with it)."""
    module = _LOOP_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LOOP_NAMES})
