"""The arguments of the monitor and the callback, checked at once, and of their calls.

Every problem is reported in one message: :func:`monitor_problems` lists what is wrong
with a constructor's arguments, :func:`checked_step` and :func:`checked_loggers` check a
``log`` call before anything is merged, :func:`checkpoint_problems` a checkpoint state.

Example:
    >>> monitor_problems(
    ...     rollout_log_probs_key="rollout_log_probs", old_log_probs_key="old_log_probs",
    ...     response_mask_key="", prefix="training/", strict=False, is_threshold=2.0,
    ...     seq_ratio_bounds=(0.99, 1.01), token_ids_keys=None, groups=None, histograms=True,
    ...     worst_tokens_k=10, dashboard_layout=True, alert_ranges=None, on_alert="warn",
    ...     compile=None,
    ... )
    ["`response_mask_key` must be a non-empty string, got ''."]
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from lightning_rollout_debug.checks.alerts import alert_problems
from lightning_rollout_debug.checks.drift import DEFAULT_DRIFT_BASELINE, drift_problems
from lightning_rollout_debug.metrics.backends import compile_problems
from lightning_rollout_debug.metrics.catalog import GROUPS, METRIC_NAMES
from lightning_rollout_debug.metrics.extras import extras_problems
from lightning_rollout_debug.metrics.segments import segment_problems
from lightning_rollout_debug.metrics.settings import (
    is_int_at_least,
    is_token_id,
    prefix_problems,
    validate_groups,
    validate_is_threshold,
    validate_seq_ratio_bounds,
)
from lightning_rollout_debug.views.tensorboard import PROFILE_IMAGES_EVERY_N_STEPS
from lightning_rollout_debug.views.token_text import tokenizer_problems


def monitor_problems(
    *,
    rollout_log_probs_key: Any,
    old_log_probs_key: Any,
    response_mask_key: Any,
    prefix: Any,
    strict: Any,
    is_threshold: Any,
    seq_ratio_bounds: Any,
    token_ids_keys: Any,
    groups: Any,
    histograms: Any,
    worst_tokens_k: Any,
    dashboard_layout: Any,
    alert_ranges: Any,
    on_alert: Any,
    compile: Any,
    drift_factors: Any = None,
    drift_baseline: Any = DEFAULT_DRIFT_BASELINE,
    pad_token_id: Any = None,
    profile_images: Any = True,
    profile_images_every_n_steps: Any = PROFILE_IMAGES_EVERY_N_STEPS,
    tokenizer: Any = None,
    **segments: Any,
) -> list[str]:
    """What is wrong with the monitor's arguments, one line per problem (empty if nothing).

    ``segments``: the settings of the segments (``segment_key``, ``max_segments``, ...).
    """
    problems = _key_problems(
        rollout_log_probs_key, old_log_probs_key, response_mask_key, token_ids_keys
    )
    problems += prefix_problems(prefix)
    if not isinstance(strict, bool):
        problems.append(f"`strict` must be True or False, got {strict!r}.")
    for validate, value in (
        (validate_is_threshold, is_threshold),
        (validate_seq_ratio_bounds, seq_ratio_bounds),
    ):
        try:
            validate(value)
        except ValueError as error:
            problems.append(str(error))
    problems += _group_problems(groups, token_ids_keys)
    problems += extras_problems(
        histograms=histograms, worst_tokens_k=worst_tokens_k, dashboard_layout=dashboard_layout
    )
    if not isinstance(profile_images, bool):
        problems.append(f"`profile_images` must be True or False, got {profile_images!r}.")
    if not is_int_at_least(profile_images_every_n_steps, 1):
        problems.append(
            "`profile_images_every_n_steps` must be an int >= 1 (1: at every logged step), "
            f"got {profile_images_every_n_steps!r}."
        )
    enabled = enabled_groups(groups, token_ids_keys)
    problems += alert_problems(alert_ranges, on_alert, enabled)
    problems += drift_problems(drift_factors, drift_baseline, enabled)
    problems += compile_problems(compile)
    problems += segment_problems(**segments, groups=enabled)
    return problems + _pad_token_id_problems(pad_token_id) + tokenizer_problems(tokenizer)


def _pad_token_id_problems(pad_token_id: Any) -> list[str]:
    """What is wrong with ``pad_token_id`` (empty if nothing)."""
    if pad_token_id is None or is_token_id(pad_token_id):
        return []
    integral = isinstance(pad_token_id, numbers.Integral) and type(pad_token_id) is not bool
    beyond = " (beyond int64, the token ids' dtype)" if integral else ""
    return [f"`pad_token_id` must be None or an int token id, got {pad_token_id!r}{beyond}."]


def _group_problems(groups: Any, token_ids_keys: Any) -> list[str]:
    """What is wrong with ``groups`` (empty if nothing)."""
    try:
        chosen = validate_groups(groups)
    except ValueError as error:
        return [str(error)]
    if not chosen:
        return [
            f"`groups` is empty, so nothing would be logged; choose from {list(GROUPS)}, "
            "or pass None for all of them."
        ]
    if groups is not None and "token_ids" in chosen and token_ids_keys is None:
        return ["The `token_ids` group needs `token_ids_keys=(rollout_key, trainer_key)`."]
    return []


def _key_problems(
    rollout_log_probs_key: Any, old_log_probs_key: Any, response_mask_key: Any, token_ids: Any
) -> list[str]:
    """What is wrong with the batch keys (empty if nothing)."""
    problems = []
    for name, value in (
        ("rollout_log_probs_key", rollout_log_probs_key),
        ("old_log_probs_key", old_log_probs_key),
        ("response_mask_key", response_mask_key),
    ):
        if not isinstance(value, str) or not value:
            problems.append(f"`{name}` must be a non-empty string, got {value!r}.")
    problems += _shared_key_problems(
        rollout_log_probs_key, old_log_probs_key, response_mask_key, token_ids
    )
    if token_ids is not None and (
        not isinstance(token_ids, Sequence)
        or isinstance(token_ids, str)
        or len(token_ids) != 2
        or not all(isinstance(key, str) and key for key in token_ids)
    ):
        problems.append(
            "`token_ids_keys` must be None or a pair of batch keys "
            f"(rollout_ids_key, trainer_ids_key), got {token_ids!r}."
        )
    return problems


def once(value: Any) -> Any:
    """``value``, or the tuple of its items if it is an iterator, which reads only once.

    Example:
        >>> once(group for group in ("seed", "health")), once(["seed"]), once(None)
        (('seed', 'health'), ['seed'], None)
    """
    return tuple(value) if isinstance(value, Iterator) else value


def _shared_key_problems(
    rollout_log_probs_key: Any, old_log_probs_key: Any, response_mask_key: Any, token_ids_keys: Any
) -> list[str]:
    """Batch keys named twice: log-probs compared with themselves show no mismatch at all.

    The two token-id keys may be one (ids of one tensor, for the worst tokens' table).
    """
    named = {
        "rollout_log_probs_key": rollout_log_probs_key,
        "old_log_probs_key": old_log_probs_key,
        "response_mask_key": response_mask_key,
    }
    if isinstance(token_ids_keys, (tuple, list)) and len(token_ids_keys) == 2:
        first, second = token_ids_keys
        if first == second:
            named["token_ids_keys"] = first
        else:
            named["token_ids_keys[0]"], named["token_ids_keys[1]"] = first, second
    seen: dict[str, list[str]] = {}
    for name, key in named.items():
        if isinstance(key, str) and key:
            seen.setdefault(key, []).append(f"`{name}`")
    return [
        f"{' and '.join(names)} name the same batch key {key!r}; each must name its own tensor."
        for key, names in seen.items()
        if len(names) > 1
    ]


def is_process_group(value: Any) -> bool:
    """Whether ``value`` is a ``torch.distributed`` process group.

    Or the marker ``torch.distributed.new_group`` returns to the ranks outside the group
    it makes (every rank must call it): such a rank keeps its own window.
    """
    distributed = torch.distributed
    return distributed.is_available() and (
        isinstance(value, distributed.ProcessGroup)
        or value is distributed.GroupMember.NON_GROUP_MEMBER
    )


def process_group_problems(group: Any, *, trainer_callable: bool = False) -> list[str]:
    """What is wrong with a ``process_group`` argument (nothing: ``[]``).

    With ``trainer_callable`` (the callback's), a callable that makes the group from the
    Trainer is valid too.
    """
    if group is None or is_process_group(group) or (trainer_callable and callable(group)):
        return []
    if callable(group):
        return [
            "`process_group` must be a torch.distributed process group or None, got a "
            "callable; create the group first and pass it."
        ]
    also = ", or a callable that makes one from the Trainer" if trainer_callable else ""
    return [
        f"`process_group` must be None (every rank) or a torch.distributed process group{also}, "
        f"got {group!r}."
    ]


def enabled_groups(groups: Any, token_ids_keys: Any) -> frozenset[str]:
    """The groups that will be logged (all of them if ``groups`` is invalid)."""
    try:
        chosen = validate_groups(groups)
    except (TypeError, ValueError):
        chosen = frozenset(GROUPS)
    return chosen if token_ids_keys is not None else chosen - {"token_ids"}


def metric_names(prefix: str, groups: Iterable[str]) -> set[str]:
    """The prefixed names of every metric of ``groups``."""
    return {f"{prefix}{name}" for group in groups for name in METRIC_NAMES[group]}


def checked_step(step: Any) -> int:
    """``step`` as an int, or a ``ValueError`` if it is not an int >= 0."""
    if not is_int_at_least(step, 0):
        raise ValueError(f"`step` must be an int >= 0, got {step!r}.")
    return int(step)


def checked_loggers(loggers: Any) -> list[Any]:
    """``loggers`` as a list, every one with ``log_metrics``; checked before any collective."""
    single = hasattr(loggers, "log_metrics") or isinstance(loggers, str | bytes)
    listed = [loggers] if single or not isinstance(loggers, Iterable) else list(loggers)
    wrong = [repr(logger) for logger in listed if not callable(getattr(logger, "log_metrics", 0))]
    if wrong:
        raise TypeError(
            "`loggers` must be a logger or a list of loggers with `log_metrics(metrics, step)` "
            "(those of lightning.pytorch.loggers, pytorch_lightning.loggers or "
            f"lightning.fabric.loggers); got {', '.join(wrong)}."
        )
    return listed


def checkpoint_problems(state_dict: Any) -> list[str]:
    """What is wrong with the keys and plain values of a checkpoint state."""
    if not isinstance(state_dict, Mapping):
        return [f"its state is a {type(state_dict).__name__}, not a dict"]
    problems = []
    if "window" not in state_dict:
        problems.append(f"it has no `window` (keys: {sorted(map(str, state_dict))})")
    batches = state_dict.get("batches_in_window", 0)
    if not is_int_at_least(batches, 0):
        problems.append(f"`batches_in_window` is {batches!r}; expected an int >= 0")
    if not isinstance(state_dict.get("config", {}), Mapping):
        problems.append(f"`config` is a {type(state_dict['config']).__name__}, not a dict")
    return problems
