"""See the mismatch between rollout-engine and trainer log-probabilities in RL fine-tuning."""

from lightning_rollout_debug.checks.alerts import (
    DEFAULT_ALERT_RANGES,
    DEFAULT_DRIFT_FACTORS,
    RolloutAlertError,
    RolloutAlertWarning,
)
from lightning_rollout_debug.checks.diagnosis import RolloutDiagnosisError, RolloutDiagnosisWarning
from lightning_rollout_debug.loop.callback import RolloutDebugCallback, RolloutDebugWarning
from lightning_rollout_debug.loop.config import RolloutDebugConfig
from lightning_rollout_debug.loop.monitor import RolloutDebugMonitor
from lightning_rollout_debug.metrics.alignment import response_log_probs
from lightning_rollout_debug.metrics.batch import BatchError
from lightning_rollout_debug.metrics.catalog import GROUPS, METRIC_NAMES
from lightning_rollout_debug.metrics.stats import MismatchStats

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
