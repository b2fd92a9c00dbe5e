"""The checks of a setting's value that the statistics and the one-shot functions share.

The groups, ``is_threshold`` and ``seq_ratio_bounds`` the statistics are counted with
(each ``validate_*`` returns the value resolved, or raises a ``ValueError`` naming it),
and the plain values a setting takes: an int of at least some bound, a token id, a
metric-name prefix. The constructors of the loop list every problem at once from these.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from lightning_rollout_debug.metrics.catalog import GROUPS


def is_int_at_least(value: Any, low: int) -> bool:
    """Whether ``value`` is an int (not a bool) of at least ``low``.

    Example:
        >>> is_int_at_least(3, 1), is_int_at_least(True, 1), is_int_at_least(2.0, 1)
        (True, False, False)
    """
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= low


def is_token_id(value: Any) -> bool:
    """Whether ``value`` is an int (not a bool) that an int64 token-id tensor can hold.

    Example:
        >>> is_token_id(50256), is_token_id(-100), is_token_id(2**63), is_token_id(True)
        (True, True, False, False)
    """
    return is_int_at_least(value, -(2**63)) and value < 2**63


def prefix_problems(prefix: Any) -> list[str]:
    """What is wrong with a metric-name prefix (empty if nothing)."""
    if isinstance(prefix, str):
        return []
    return [f"`prefix` must be a string such as 'training/', got {prefix!r}."]


def validate_is_threshold(value: float) -> float:
    """Return ``value`` as a float if it is a finite number greater than 1."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not (1.0 < float(value) < math.inf)
    ):
        raise ValueError(f"`is_threshold` must be a finite number greater than 1, got {value!r}.")
    return float(value)


def validate_seq_ratio_bounds(value: Sequence[float]) -> tuple[float, float]:
    """Return ``(lo, hi)`` if ``0 < lo <= 1 <= hi < inf``."""
    try:
        lo, hi = (float(bound) for bound in value)
    except (TypeError, ValueError):
        lo = hi = math.nan
    if not (0.0 < lo <= 1.0 <= hi < math.inf):
        raise ValueError(
            f"`seq_ratio_bounds` must be (lo, hi) with 0 < lo <= 1 <= hi, got {value!r}."
        )
    return lo, hi


def validate_groups(groups: Iterable[str] | None) -> frozenset[str]:
    """Return the chosen groups as a set, or all of :data:`GROUPS` for ``None``."""
    if groups is None:
        return frozenset(GROUPS)
    if isinstance(groups, str):
        groups = [groups]
    if not isinstance(groups, Iterable) or isinstance(groups, (bytes, Mapping)):
        raise ValueError(
            f"`groups` must be None (all of them) or a list of group names from {list(GROUPS)}, "
            f"got {groups!r}."
        )
    listed = list(groups)
    unknown = sorted(
        (group for group in listed if not isinstance(group, str) or group not in GROUPS), key=repr
    )
    if unknown:
        raise ValueError(f"Unknown metric groups {unknown}; valid groups are {list(GROUPS)}.")
    return frozenset(listed)
