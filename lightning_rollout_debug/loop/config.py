"""Every setting of a monitor, in one frozen object checked at once.

:class:`RolloutDebugConfig` holds what :class:`~lightning_rollout_debug.RolloutDebugMonitor`
and :class:`~lightning_rollout_debug.RolloutDebugCallback` are configured with (their
constructors take these arguments and build it; the callback adds how often to log, the
dropout check and the process group), validated at once: one ``ValueError`` lists every
problem. What the settings leave open is resolved here: the groups that will be logged,
the alert ranges and drift factors of those groups. The ``tokenizer`` only shows the worst
tokens' text: it takes no part in comparing two configurations, nor in a checkpoint's
(:meth:`RolloutDebugConfig.checkpoint_identity`), nor in the window's state.

Example:
    >>> config = RolloutDebugConfig(groups=["seed", "kl"], worst_tokens_k=3)
    >>> config.groups, config.worst_tokens_k, config.prefix
    (('seed', 'kl'), 3, 'training/')
    >>> RolloutDebugConfig(prefix=1, worst_tokens_k=-1)
    Traceback (most recent call last):
    ...
    lightning_rollout_debug.loop.config.InvalidSettings: Invalid RolloutDebugConfig arguments:
    - `prefix` must be a string such as 'training/', got 1.
    - `worst_tokens_k` must be an int from 0 (the table off) to 1000, got -1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from lightning_rollout_debug.checks.alerts import resolve_alert_ranges
from lightning_rollout_debug.checks.drift import DEFAULT_DRIFT_BASELINE, resolve_drift_factors
from lightning_rollout_debug.loop.arguments import enabled_groups, monitor_problems, once
from lightning_rollout_debug.metrics.catalog import GROUPS
from lightning_rollout_debug.metrics.segments import default_segment_metrics
from lightning_rollout_debug.views.tensorboard import PROFILE_IMAGES_EVERY_N_STEPS


class InvalidSettings(ValueError):
    """Settings that do not hold: :attr:`problems` lists each, one line apiece."""

    def __init__(self, owner: str, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__(f"Invalid {owner} arguments:\n- " + "\n- ".join(self.problems))


@dataclass(frozen=True)
class RolloutDebugConfig:
    """The settings of a monitor, each as :class:`~.RolloutDebugMonitor` describes it.

    Built from the arguments as given, it keeps them resolved: ``groups`` the tuple of
    groups that will be logged (in :data:`~lightning_rollout_debug.GROUPS` order),
    ``token_ids_keys`` a tuple or ``None``, ``alert_ranges`` and ``drift_factors`` those of
    the logged groups, the counts ints.

    Raises:
        InvalidSettings: a ``ValueError`` naming every setting that does not hold.
    """

    rollout_log_probs_key: str = "rollout_log_probs"
    old_log_probs_key: str = "old_log_probs"
    response_mask_key: str = "response_mask"
    prefix: str = "training/"
    strict: bool = False
    is_threshold: float = 2.0
    seq_ratio_bounds: tuple[float, float] = (0.99, 1.01)
    token_ids_keys: tuple[str, str] | None = None
    groups: Sequence[str] | None = None
    histograms: bool = True
    worst_tokens_k: int = 10
    dashboard_layout: bool = True
    profile_images: bool = True
    profile_images_every_n_steps: int = PROFILE_IMAGES_EVERY_N_STEPS
    alert_ranges: Mapping[str, tuple[float | None, float | None]] | None = None
    on_alert: Literal["warn", "stop", "raise"] = "warn"
    drift_factors: Mapping[str, float] | None = None
    drift_baseline: int = DEFAULT_DRIFT_BASELINE
    compile: bool | None = None
    pad_token_id: int | None = None
    tokenizer: Any | None = field(default=None, compare=False)
    segment_key: str = "segment_ids"
    max_segments: int = 16
    segment_names: Sequence[str] | None = None
    segment_metrics: Sequence[str] | None = None
    segment_alerts: bool = False

    def __post_init__(self) -> None:
        given = {field.name: once(getattr(self, field.name)) for field in settings()}
        problems = monitor_problems(**given)
        if problems:
            raise InvalidSettings(type(self).__name__, problems)
        keys = given["token_ids_keys"]
        enabled = enabled_groups(given["groups"], keys)
        groups = tuple(group for group in GROUPS if group in enabled)
        resolved = {
            "token_ids_keys": None if keys is None else tuple(keys),
            "groups": groups,
            "seq_ratio_bounds": tuple(given["seq_ratio_bounds"]),
            "worst_tokens_k": int(given["worst_tokens_k"]),
            "profile_images_every_n_steps": int(given["profile_images_every_n_steps"]),
            "alert_ranges": resolve_alert_ranges(given["alert_ranges"], groups),
            "drift_factors": resolve_drift_factors(given["drift_factors"], groups),
            "drift_baseline": int(given["drift_baseline"]),
            "pad_token_id": None if given["pad_token_id"] is None else int(given["pad_token_id"]),
            "max_segments": int(given["max_segments"]),
            "segment_names": None
            if given["segment_names"] is None
            else tuple(given["segment_names"]),
            "segment_metrics": default_segment_metrics(groups)
            if given["segment_metrics"] is None
            else tuple(given["segment_metrics"]),
        }
        for name, value in resolved.items():
            object.__setattr__(self, name, value)

    def checkpoint_identity(self) -> dict[str, Any]:
        """The settings a checkpoint's window must have been made with to be carried on."""
        names = ("rollout_log_probs_key", "old_log_probs_key", "response_mask_key", "prefix")
        return {
            **{name: getattr(self, name) for name in names},
            "is_threshold": self.is_threshold,
            "seq_ratio_bounds": self.seq_ratio_bounds,
            "token_ids_keys": self.token_ids_keys,
            "groups": self.groups,
            "pad_token_id": self.pad_token_id,
            "max_segments": self.max_segments,
        }


def _tuple_or_none(values: Any) -> tuple[Any, ...] | None:
    return None if values is None else tuple(values)


def settings() -> tuple[dataclasses.Field[Any], ...]:
    """The fields of :class:`RolloutDebugConfig`: the settings, in the constructors' order."""
    return dataclasses.fields(RolloutDebugConfig)
