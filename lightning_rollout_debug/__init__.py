"""See the mismatch between rollout-engine and trainer log-probabilities in RL fine-tuning."""

from lightning_rollout_debug.batch import BatchError
from lightning_rollout_debug.callback import RolloutDebugCallback, RolloutDebugWarning
from lightning_rollout_debug.stats import GROUPS, METRIC_NAMES, MismatchStats

__all__ = [
    "GROUPS",
    "METRIC_NAMES",
    "BatchError",
    "MismatchStats",
    "RolloutDebugCallback",
    "RolloutDebugWarning",
]
__version__ = "0.1.0"
