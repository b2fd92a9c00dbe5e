"""The settings that shape a merged window, compared over the ranks before their first merge.

The ranks merge their windows in one collective of one float64 vector
(:class:`~.window.DeviceWindow`), whose length and meaning their settings give: the groups
(and the ``is_threshold`` and ``seq_ratio_bounds`` their sums are counted with) and the
layout of the extras (``histograms``, ``worst_tokens_k``, the profile) and of the segments
(``max_segments``). Ranks built with
other settings would send vectors of other lengths, which gloo answers by aborting a
rank, or of other meanings, merged into wrong metrics. So before the first merge every
rank sends the same few float64 values that encode those settings (:func:`encoded`), in
one collective whose size no setting changes, and where they differ every rank raises the
same :class:`~.config.InvalidSettings`, naming each setting and each rank's value.

Example:
    >>> import torch
    >>> from lightning_rollout_debug.metrics.stats import MismatchStats
    >>> mine = shaping_settings(MismatchStats(groups=["seed"]), None)
    >>> rows = torch.stack([encoded(mine), encoded({**mine, "is_threshold": 3.0})])
    >>> (line,) = disagreements(rows)
    >>> found, expected = line.split("; ")
    >>> found
    '`is_threshold` differs between the ranks: 2.0 on rank 0, 3.0 on rank 1'
    >>> expected
    'expected the same on every rank (it shapes the window the ranks merge).'
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_rollout_debug.loop.config import InvalidSettings
from lightning_rollout_debug.metrics.catalog import GROUPS
from lightning_rollout_debug.metrics.extras import TokenExtras
from lightning_rollout_debug.metrics.layout import STATE
from lightning_rollout_debug.metrics.stats import MismatchStats

SHAPING = (
    "groups",
    "is_threshold",
    "seq_ratio_bounds",
    "histograms",
    "worst_tokens_k",
    "profile",
    "max_segments",
    "state_size",
)
"""The settings that shape a window's packed state, in the order they are encoded."""

WIDTH = len(SHAPING) + 1
"""The float64 values a rank sends: one per setting, two for ``seq_ratio_bounds``."""

_NAMED = {
    "profile": "the profile (`profile_images`, or the `quantiles` group)",
    "state_size": "the length of the packed window (another version of the package?)",
}
"""How a message names the settings that are no constructor argument."""


def shaping_settings(
    stats: MismatchStats, extras: TokenExtras | None, *beside: Any | None
) -> dict[str, Any]:
    """The settings that shape the packed window of ``stats`` and ``extras``, by name.

    ``beside``: what else travels in the window's vector (each with its ``size``, or
    ``None``): the run's series, the shift sample, the segments (with their ``segments``).
    """
    return {
        "groups": tuple(group for group in GROUPS if group in stats.groups),
        "is_threshold": float(stats.is_threshold),
        "seq_ratio_bounds": tuple(float(bound) for bound in stats.seq_ratio_bounds),
        "histograms": extras is not None and bool(extras.histograms),
        "worst_tokens_k": 0 if extras is None else int(extras.worst_tokens_k),
        "profile": extras is not None and bool(extras.profile),
        "max_segments": max((getattr(part, "segments", 0) for part in beside), default=0),
        "state_size": STATE.size
        + (0 if extras is None else extras.size)
        + sum(part.size for part in beside if part is not None),
    }


def encoded(settings: Mapping[str, Any], device: torch.device | None = None) -> Tensor:
    """``settings`` as :data:`WIDTH` float64 values, each exact (the groups as bits)."""
    groups = sum(1 << GROUPS.index(group) for group in settings["groups"])
    low, high = settings["seq_ratio_bounds"]
    values = [groups, settings["is_threshold"], low, high]
    values += [float(settings[name]) for name in SHAPING[3:]]
    return torch.tensor(values, dtype=torch.float64, device=device)


def decoded(row: Sequence[float]) -> dict[str, Any]:
    """The settings of one rank's :func:`encoded` values."""
    groups = tuple(group for bit, group in enumerate(GROUPS) if int(row[0]) >> bit & 1)
    return {
        "groups": groups,
        "is_threshold": row[1],
        "seq_ratio_bounds": (row[2], row[3]),
        "histograms": bool(row[4]),
        "worst_tokens_k": int(row[5]),
        "profile": bool(row[6]),
        "max_segments": int(row[7]),
        "state_size": int(row[8]),
    }


def disagreements(rows: Tensor) -> list[str]:
    """One line per setting that differs between the ranks' rows ``[n, WIDTH]`` (or ``[]``).

    The length of the window is named only where no setting explains it.
    """
    settings = [decoded(row) for row in rows.tolist()]
    lines: list[str] = []
    for name in SHAPING:
        if name == "state_size" and lines:  # the settings above explain it
            break
        values: dict[Any, list[int]] = {}
        for rank, each in enumerate(settings):
            values.setdefault(each[name], []).append(rank)
        if len(values) > 1:
            found = ", ".join(f"{value!r} on {_ranks(ranks)}" for value, ranks in values.items())
            lines.append(
                f"{_NAMED.get(name, f'`{name}`')} differs between the ranks: {found}; expected "
                "the same on every rank (it shapes the window the ranks merge)."
            )
    return lines


def check_agreement(
    gather: Callable[[Tensor], Tensor],
    settings: Mapping[str, Any],
    owner: str,
    device: torch.device | None = None,
) -> None:
    """Raise :class:`~.config.InvalidSettings` on every rank if the ranks' ``settings`` differ.

    One collective (``gather``, as the merge's) of :data:`WIDTH` values, the same on every
    rank whatever the settings, and one copy to the host. ``owner`` names the front door.
    """
    local = encoded(settings, device)
    rows = gather(local).reshape(-1, WIDTH).to(torch.float64).cpu()
    if not bool((rows == local.cpu()).all()):
        raise InvalidSettings(owner, disagreements(rows))


def _ranks(ranks: Sequence[int]) -> str:
    """``ranks`` for a message: ``rank 1``, ``ranks 0 and 2``, ``ranks 0-31``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if len(ranks) > 2 and list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return f"ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}"
