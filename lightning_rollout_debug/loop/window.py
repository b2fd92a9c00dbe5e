"""A monitor's window: the statistics and extras of the batches since the last log.

:class:`DeviceWindow` holds them on the batches' device with the number of updates they
count, and the run's per-batch series beside them, and answers the three questions a
logged step or a checkpoint asks of them: the window merged over the ranks (one
collective of one float64 vector, the same length on every rank, once the ranks have
been found to lay it out alike: :mod:`.agreement`), that merged window on the host (one
copy), and its checkpoint state.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor

from lightning_rollout_debug.checks.drift import DriftMonitor
from lightning_rollout_debug.loop.agreement import check_agreement, shaping_settings
from lightning_rollout_debug.loop.checkpoint import saved_state
from lightning_rollout_debug.loop.config import RolloutDebugConfig
from lightning_rollout_debug.loop.ranks import Ranks
from lightning_rollout_debug.metrics.extras import ExtrasSummary, TokenExtras
from lightning_rollout_debug.metrics.segments import SEGMENT_GROUPS, SegmentWindow
from lightning_rollout_debug.metrics.series import MismatchSeries
from lightning_rollout_debug.metrics.shifts import ShiftSample
from lightning_rollout_debug.metrics.stats import MismatchStats


class Merged(NamedTuple):
    """A window merged over the ranks, on the device (``None``: not kept)."""

    stats: MismatchStats
    extras: Tensor | None
    """The packed extras."""
    series: Tensor | None
    """The window's per-batch series (:meth:`.MismatchSeries.window_values`)."""
    shifts: Tensor | None
    """The sample's sums at every lag (:meth:`.ShiftSample.window_values`)."""
    segments: Tensor | None = None
    """The packed segments (:class:`~.segments.SegmentWindow`)."""


class OnHost(NamedTuple):
    """A merged window on the host (``None``: not kept)."""

    stats: MismatchStats
    extras: ExtrasSummary | None
    series: list[float] | None
    shifts: list[float] | None
    segments: Tensor | None = None
    """The packed segments, on the host."""


class DeviceWindow:
    """The statistics and extras of a window on the device, and the updates it counts.

    Args:
        stats: the window's statistics.
        extras: its histograms, worst tokens and profile (``None``: none kept).
        series: the run's per-batch series (``None``: none kept).
        shifts: the sample the window's shifts are searched on (``None``: none kept).
        owner: the front door its errors name.
        segments: the statistics of each segment (``None``: none kept).

    Example:
        >>> import torch
        >>> from lightning_rollout_debug.loop.ranks import Ranks
        >>> from lightning_rollout_debug.metrics.stats import MismatchStats
        >>> from lightning_rollout_debug.loop.window import DeviceWindow
        >>> window = DeviceWindow(MismatchStats(groups=["seed"]), None)
        >>> window.stats.update(torch.zeros(1, 3), torch.zeros(1, 3), torch.ones(1, 3))
        >>> stats, summary, series, shifts, segments = window.on_host(Ranks())
        >>> stats.compute()["rollout_probs_diff_max"], summary, series, shifts
        (0.0, None, None, None)
    """

    def __init__(
        self,
        stats: MismatchStats,
        extras: TokenExtras | None,
        series: MismatchSeries | None = None,
        shifts: ShiftSample | None = None,
        owner: str = "RolloutDebugMonitor",
        segments: SegmentWindow | None = None,
    ) -> None:
        self.stats = stats
        self.extras = extras
        self.series = series
        self.shifts = shifts
        self.segments = segments
        self.owner = owner
        self.agreed = False
        """Whether the ranks were found to lay the window out alike (checked once)."""
        self.batches = 0
        """The updates since the window began, skipped batches too."""
        self.partial_profile = False
        """Restored from a checkpoint without its extras: its profile misses tokens."""

    @classmethod
    def of_config(cls, config: RolloutDebugConfig, owner: str) -> DeviceWindow:
        """The window of a monitor's ``config``: what it keeps follows from its settings."""
        stats = MismatchStats(
            is_threshold=config.is_threshold,
            seq_ratio_bounds=config.seq_ratio_bounds,
            groups=config.groups,
            compile=config.compile,
        )
        # The profile gives the quantiles and the pictures.
        profile = config.profile_images or "quantiles" in config.groups
        extras = None
        if config.histograms or config.worst_tokens_k or profile:
            extras = TokenExtras(
                histograms=config.histograms,
                worst_tokens_k=config.worst_tokens_k,
                profile=profile,
                compile=config.compile,
            )
        # The per-batch mean |r| the kernel writes with the log-space group; the sample of
        # the shifts beside the health group's lag sums.
        series = MismatchSeries() if "log_space" in config.groups else None
        shifts = ShiftSample() if "health" in config.groups else None
        segments = SegmentWindow(
            config.max_segments,
            groups=set(config.groups) & set(SEGMENT_GROUPS),
            metrics=config.segment_metrics,
            is_threshold=config.is_threshold,
            compile=config.compile,
        )
        return cls(stats, extras, series, shifts, owner, segments)

    def empty(self) -> None:
        """Start a new, empty window."""
        self.stats.reset()
        if self.extras is not None:
            self.extras.reset()
        if self.series is not None:
            self.series.clear_window()
        if self.shifts is not None:
            self.shifts.clear()
        if self.segments is not None:
            self.segments.reset()
        self.batches = 0
        self.partial_profile = False

    def move_to(self, device: torch.device) -> None:
        """Keep the window's states on ``device`` (a restored window, on the model's)."""
        self.stats.load_state(self.stats.state.to(device))
        for window in (self.extras, self.segments):
            if window is not None:
                window.load_state(window.state.to(device))

    def merged(self, ranks: Ranks) -> Merged:
        """The window merged over ``ranks``: one collective of one float64 vector.

        The packed statistics, the packed extras (histogram bins, worst-token candidates),
        the window's per-batch series and its sample's sums at every lag travel together,
        the same length on every rank, empty window or not, each merged by its owner.
        Before the first merge the ranks compare the settings that lay it out, in a
        collective of its own: where they differ, every rank raises
        :class:`~.config.InvalidSettings` (:func:`~.agreement.check_agreement`).
        """
        device = ranks.device or self.stats.device or torch.device("cpu")
        owners = (self.stats, self.extras, self.series, self.shifts, self.segments)
        local = self.parts(device)
        if ranks.gather is None:
            return Merged(self.stats, *local[1:])
        if not self.agreed:
            beside = (self.series, self.shifts, self.segments)
            settings = shaping_settings(self.stats, self.extras, *beside)
            check_agreement(ranks.gather, settings, self.owner, device)
            self.agreed = True
        kept = [(i, part.to(device)) for i, part in enumerate(local) if part is not None]
        vector = torch.cat([part for _, part in kept])
        gathered = ranks.gather(vector).reshape(-1, vector.numel()).to(torch.float64)
        blocks = gathered.split([part.numel() for _, part in kept], dim=1)
        merged: list[Tensor | None] = [None] * len(owners)
        for (i, _), block in zip(kept, blocks, strict=True):
            merged[i] = owners[i].merge_states(block)  # type: ignore[union-attr]
        stats = copy.copy(self.stats)
        stats.load_state(merged[0])  # type: ignore[arg-type]
        return Merged(stats, *merged[1:])

    def parts(self, device: torch.device) -> list[Tensor | None]:
        """This process's parts of the merged vector, in order (``None``: not kept).

        The statistics, the extras, the series, the shift sample's sums, the segments.
        """
        return [
            self.stats.state,
            None if self.extras is None else self.extras.state,
            None if self.series is None else self.series.window_values(device),
            None if self.shifts is None else self.shifts.window_values(device),
            None if self.segments is None else self.segments.state,
        ]

    def on_host(self, ranks: Ranks) -> OnHost:
        """The merged window, copied to the host in one transfer.

        The statistics, the extras' summary, the window's per-batch series
        (:meth:`.MismatchSeries.window_values`) and its sample's sums at every lag
        (:meth:`.ShiftSample.window_values`), as plain floats (``None``: not kept).
        """
        merged = self.merged(ranks)
        state = merged.stats.state
        parts = [state, *(p.to(state.device) for p in merged[1:] if p is not None)]
        host = torch.cat(parts).cpu()
        pieces = iter(host.split([part.numel() for part in parts]))
        stats = copy.copy(merged.stats)
        stats.load_state(next(pieces))
        extras, series, shifts, segments = (None if p is None else next(pieces) for p in merged[1:])
        summary = None
        if extras is not None and self.extras is not None:
            summary = self.extras.summary(extras)
        return OnHost(
            stats,
            summary,
            None if series is None else series.tolist(),
            None if shifts is None else shifts.tolist(),
            segments,
        )

    def saved(
        self,
        stats: MismatchStats,
        extras: Tensor | None,
        config: Mapping[str, Any],
        drift: DriftMonitor,
        batches: int | None = None,
        series: Tensor | None = None,
        segments: Tensor | None = None,
    ) -> dict[str, Any]:
        """A checkpoint state of the window ``stats``, ``extras`` and ``segments``.

        ``batches``: the window's updates (by default this process's). ``series``: the
        window's per-batch vector, kept after the run's series.
        """
        settings = None if self.extras is None else self.extras.settings()
        batches = self.batches if batches is None else batches
        kept = None
        if self.series is not None:
            kept = self.series.state([] if series is None else series.tolist())
        saved = saved_state(stats, extras, batches, config, drift, settings, kept)
        if self.segments is not None:
            if segments is None:
                segments = self.segments.state
            saved["segments_window"] = segments.detach().cpu().clone()
            saved["segments_settings"] = self.segments.settings()
        return saved

    def saved_over(
        self, ranks: Ranks, config: Mapping[str, Any], drift: DriftMonitor
    ) -> dict[str, Any]:
        """A checkpoint state of the window merged over ``ranks``; every rank must call it.

        Its batch count is the most updates of any rank's window, in a second collective:
        in a loop where a rank fed none since the last log (a pipeline stage without the
        log-probs), that rank would otherwise save a window of tokens and no batch, which
        reads as damaged.
        """
        stats, extras, series, _, segments = self.merged(ranks)
        batches = self.batches
        if ranks.gather is not None:
            device = ranks.device or self.stats.device or torch.device("cpu")
            count = torch.tensor([float(batches)], dtype=torch.float64, device=device)
            batches = int(ranks.gather(count).max().item())
        return self.saved(stats, extras, config, drift, batches, series, segments)
