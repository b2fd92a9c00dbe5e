"""A monitor's window: the statistics and extras of the batches since the last log.

:class:`DeviceWindow` holds them on the batches' device with the number of updates they
count, and answers the three questions a logged step or a checkpoint asks of them: the
window merged over the ranks (one collective of one float64 vector, the same length on
every rank, once the ranks have been found to lay it out alike: :mod:`.agreement`), that
merged window on the host (one copy), and its checkpoint state.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_rollout_debug.checks.drift import DriftMonitor
from lightning_rollout_debug.loop.agreement import check_agreement, shaping_settings
from lightning_rollout_debug.loop.checkpoint import saved_state
from lightning_rollout_debug.loop.ranks import Ranks
from lightning_rollout_debug.metrics.extras import ExtrasSummary, TokenExtras
from lightning_rollout_debug.metrics.layout import merge_states
from lightning_rollout_debug.metrics.stats import MismatchStats


class DeviceWindow:
    """The statistics and extras of a window on the device, and the updates it counts.

    Args:
        stats: the window's statistics.
        extras: its histograms, worst tokens and profile (``None``: none kept).
        owner: the front door its errors name.

    Example:
        >>> import torch
        >>> from lightning_rollout_debug.loop.ranks import Ranks
        >>> from lightning_rollout_debug.metrics.stats import MismatchStats
        >>> from lightning_rollout_debug.loop.window import DeviceWindow
        >>> window = DeviceWindow(MismatchStats(groups=["seed"]), None)
        >>> window.stats.update(torch.zeros(1, 3), torch.zeros(1, 3), torch.ones(1, 3))
        >>> stats, summary = window.on_host(Ranks())
        >>> stats.compute()["rollout_probs_diff_max"], summary
        (0.0, None)
    """

    def __init__(
        self, stats: MismatchStats, extras: TokenExtras | None, owner: str = "RolloutDebugMonitor"
    ) -> None:
        self.stats = stats
        self.extras = extras
        self.owner = owner
        self.agreed = False
        """Whether the ranks were found to lay the window out alike (checked once)."""
        self.batches = 0
        """The updates since the window began, skipped batches too."""
        self.partial_profile = False
        """Restored from a checkpoint without its extras: its profile misses tokens."""

    def empty(self) -> None:
        """Start a new, empty window."""
        self.stats.reset()
        if self.extras is not None:
            self.extras.reset()
        self.batches = 0
        self.partial_profile = False

    def move_to(self, device: torch.device) -> None:
        """Keep the window's states on ``device`` (a restored window, on the model's)."""
        self.stats.load_state(self.stats.state.to(device))
        if self.extras is not None:
            self.extras.load_state(self.extras.state.to(device))

    def merged(self, ranks: Ranks) -> tuple[MismatchStats, Tensor | None]:
        """The window merged over ``ranks``: one collective of one float64 vector.

        The packed statistics and the packed extras (histogram bins, worst-token
        candidates) travel together, the same length on every rank, empty window or not.
        Before the first merge the ranks compare the settings that lay it out, in a
        collective of its own: where they differ, every rank raises
        :class:`~.config.InvalidSettings` (:func:`~.agreement.check_agreement`). Returns
        the merged statistics and the merged extras state (``None`` without extras), both
        on the device.
        """
        extras = None if self.extras is None else self.extras.state
        if ranks.gather is None:
            return self.stats, extras
        device = ranks.device or self.stats.device or torch.device("cpu")
        if not self.agreed:
            settings = shaping_settings(self.stats, self.extras)
            check_agreement(ranks.gather, settings, self.owner, device)
            self.agreed = True
        parts = [self.stats.state.to(device)]
        if extras is not None:
            parts.append(extras.to(device))
        width = parts[0].numel()
        local = torch.cat(parts)
        gathered = ranks.gather(local).reshape(-1, local.numel()).to(torch.float64)
        stats = copy.copy(self.stats)
        stats.load_state(merge_states(gathered[:, :width]))
        if self.extras is not None:
            extras = self.extras.merge_states(gathered[:, width:])
        return stats, extras

    def on_host(self, ranks: Ranks) -> tuple[MismatchStats, ExtrasSummary | None]:
        """The merged window, copied to the host in one transfer: statistics and extras."""
        stats, extras = self.merged(ranks)
        state = stats.state
        host = torch.cat([state] if extras is None else [state, extras.to(state.device)]).cpu()
        on_host = copy.copy(stats)
        on_host.load_state(host[: state.numel()])
        if extras is None or self.extras is None:
            return on_host, None
        return on_host, self.extras.summary(host[state.numel() :])

    def saved(
        self,
        stats: MismatchStats,
        extras: Tensor | None,
        config: Mapping[str, Any],
        drift: DriftMonitor,
        batches: int | None = None,
    ) -> dict[str, Any]:
        """A checkpoint state of the window ``stats`` and ``extras``.

        ``batches``: the window's updates (by default this process's).
        """
        settings = None if self.extras is None else self.extras.settings()
        batches = self.batches if batches is None else batches
        return saved_state(stats, extras, batches, config, drift, settings)

    def saved_over(
        self, ranks: Ranks, config: Mapping[str, Any], drift: DriftMonitor
    ) -> dict[str, Any]:
        """A checkpoint state of the window merged over ``ranks``; every rank must call it.

        Its batch count is the most updates of any rank's window, in a second collective:
        in a loop where a rank fed none since the last log (a pipeline stage without the
        log-probs), that rank would otherwise save a window of tokens and no batch, which
        reads as damaged.
        """
        stats, extras = self.merged(ranks)
        batches = self.batches
        if ranks.gather is not None:
            device = ranks.device or self.stats.device or torch.device("cpu")
            count = torch.tensor([float(batches)], dtype=torch.float64, device=device)
            batches = int(ranks.gather(count).max().item())
        return self.saved(stats, extras, config, drift, batches)
