"""RolloutDebugMonitor: the window of a training loop, its merge across ranks, and its logs.

The engine behind every front door that follows a training loop. It finds the tensors of
each batch (:mod:`~lightning_rollout_debug.metrics.batch`), adds them to a window of
statistics and extras on the batch's device (:mod:`~lightning_rollout_debug.metrics.stats`,
:mod:`~lightning_rollout_debug.metrics.extras`, held by :mod:`.window`), and at a logged
step merges the window of every rank with one collective, copies it to the host once,
logs the scalars and writes the TensorBoard extras (:mod:`.logs`), checks the alerts
(:mod:`~lightning_rollout_debug.checks.alerts`) and starts a new window;
:mod:`.checkpoint` writes the window's checkpoint state and reads it back. The road of an
update is :class:`~.batch_updates.BatchUpdates`', that of a logged step
:class:`~.logged_step.LoggedStep`'s; the monitor holds the state both read and the calls
of a loop. :class:`~lightning_rollout_debug.RolloutDebugCallback` is this engine with a
Lightning Trainer deciding when to log and how ranks gather.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch

from lightning_rollout_debug.checks.alerts import AlertMonitor
from lightning_rollout_debug.checks.drift import DEFAULT_DRIFT_BASELINE, DriftMonitor
from lightning_rollout_debug.loop.arguments import (
    checked_loggers,
    checked_step,
    process_group_problems,
)
from lightning_rollout_debug.loop.batch_updates import (
    BatchUpdates,
    FrontDoor,
    RolloutDebugWarning,
    SkippedBatches,
)
from lightning_rollout_debug.loop.checkpoint import StateReader
from lightning_rollout_debug.loop.config import InvalidSettings, RolloutDebugConfig, settings
from lightning_rollout_debug.loop.logged_step import LoggedStep
from lightning_rollout_debug.loop.logs import WindowLogs
from lightning_rollout_debug.loop.ranks import Ranks, loop_ranks
from lightning_rollout_debug.loop.window import DeviceWindow
from lightning_rollout_debug.metrics.profile import Profile
from lightning_rollout_debug.metrics.segments import for_each_segment, segment_name
from lightning_rollout_debug.views.tensorboard import PROFILE_IMAGES_EVERY_N_STEPS
from lightning_rollout_debug.views.token_text import TokenText

MONITOR_DOOR = FrontDoor(
    "RolloutDebugMonitor",
    "what was given before it",
    "Leave out the check_dropout call if the recompute already runs in eval mode.",
)


class RolloutDebugMonitor(BatchUpdates, LoggedStep):
    r"""Measure the mismatch between rollout-engine and trainer log-probabilities in any loop.

    The front door for loops that are not a Lightning Trainer: Lightning Fabric, or plain
    PyTorch. :meth:`update` finds ``rollout_log_probs`` (recorded by the inference engine),
    ``old_log_probs`` (recomputed by the trainer) and ``response_mask`` in the mappings or
    objects it is given, first to last, and adds them to a window of statistics on the
    batch's device without waiting for it. :meth:`log` merges the window across processes,
    computes every metric of ``docs/metrics.md`` once, sends the scalars to the loggers,
    writes the histograms, the worst tokens and the dashboard layout to TensorBoard
    loggers, checks the alerts and starts a new window. :meth:`state_dict` and
    :meth:`load_state_dict` carry a window over a restart. The
    :class:`~lightning_rollout_debug.RolloutDebugCallback` is this monitor driven by a
    Trainer.

    Args:
        rollout_log_probs_key: key of the ``[B, T]`` log-probs the rollout engine recorded.
        old_log_probs_key: key of the ``[B, T]`` log-probs the trainer recomputed.
        response_mask_key: key of the ``[B, T]`` mask of response tokens (non-zero counts).
            Without it, ``attention_mask`` cut to the width of ``responses`` is used.
        prefix: put before every metric name.
        strict: raise on a batch the monitor cannot use instead of skipping it with a
            warning (and on a checkpoint state it cannot restore).
        is_threshold: ``C`` of the importance-ratio group (``rho > C`` is high).
        seq_ratio_bounds: ``(lo, hi)`` band of sequence geometric-mean ratios.
        token_ids_keys: keys of the rollout's and the trainer's token ids; turns on the
            token-id group.
        groups: metric groups to log, from ``GROUPS``; ``None`` logs all that the
            configuration allows (the token-id group needs ``token_ids_keys``).
        process_group: the ``torch.distributed`` process group to merge over; ``None``
            means all ranks. Pass the data-parallel group when several ranks hold the same
            tokens (tensor, sequence or pipeline parallelism). A rank outside the group
            keeps its own window.
        histograms: with a TensorBoard logger, write histograms of the log ratio
            ``r = a - b`` and of ``abs(pa - pb)`` over the window's tokens.
        worst_tokens_k: with a TensorBoard logger, write a table of the ``k`` tokens with
            the largest ``abs(r)`` of each window; 0 turns it off. The token ids come from
            ``token_ids_keys[0]`` or ``responses``.
        dashboard_layout: with a TensorBoard logger, write a custom-scalars layout grouping
            the charts once per log directory.
        profile_images: with a TensorBoard logger, draw where the window's mismatch lives
            (IMAGES tab): by response position, by trainer probability, and the joint
            histogram of the two log-probs. :attr:`profile` holds the numbers of the last
            logged window (with the pictures or the quantiles group on).
        profile_images_every_n_steps: draw the pictures at the first logged step of each
            span of this many steps (``[0, n)``, ``[n, 2n)``, ...): at every logged step
            when logging every ``n`` steps or less often; 1 draws at every logged step.
        alert_ranges: allowed ``(low, high)`` per un-prefixed metric name (either bound
            ``None``); ``None`` uses ``DEFAULT_ALERT_RANGES`` and ``{}`` turns alerts off.
        on_alert: what a value outside its range does: ``"warn"`` (a warning once per
            crossing), ``"stop"`` (also sets :attr:`should_stop`, for the loop to read) or
            ``"raise"`` (:class:`~lightning_rollout_debug.RolloutAlertError`).
        drift_factors: drift alerts: a factor (> 1) per un-prefixed metric name; a logged
            value above factor x the metric's baseline alerts, with ``on_alert``'s action.
            ``None`` uses ``DEFAULT_DRIFT_FACTORS`` and ``{}`` turns drift alerts off.
            For metrics that grow with the mismatch from a positive baseline; one that
            falls (a correlation) never reaches its factor: give it an alert range.
        drift_baseline: how many first logged (defined) values of a metric its baseline
            is the median of. The baseline is kept in :meth:`state_dict`.
        compile: fuse the statistics and the extras of a batch into one pass, as the
            callback's ``compile`` does (the kernel on CPUs, ``torch.compile`` on
            accelerators, every batch); see ``docs/performance.md``.
        pad_token_id: the pad token's id: the run of pad ids that ends a row's masked
            tokens (but for its first, an EOS) is counted and named in the ``padding``
            diagnosis. The ids come from ``token_ids_keys[0]`` or ``responses``.
        tokenizer: with a TensorBoard logger and token ids, the worst-tokens table shows
            each token's text and the text of the tokens before it in its row: a
            ``transformers`` tokenizer, a ``tokenizers.Tokenizer``, or anything with
            ``decode(ids)``, ``convert_ids_to_tokens(ids)`` or ``id_to_token(id)``.
        segment_key: key of the segment labels, integer ``[B]`` (a data source or task a
            sequence) or ``[B, T]`` (a turn a token); a batch without it has none. Each
            segment's metrics are logged as ``<prefix>segments/<name>/<metric>``.
        max_segments: labels ``0`` to ``max_segments - 1`` (at most 256) name segments;
            the tokens of every other label count in one more, ``other`` (warned once).
        segment_names: a name for each label, in tags (default the number).
        segment_metrics: the metrics logged per segment, of ``SEGMENT_METRIC_CHOICES``
            (default ``DEFAULT_SEGMENT_METRICS``, those of the groups that are on).
        segment_alerts: check each segment's values against the alert ranges and drift
            factors too, naming the segment.

    Every logged window is also checked for the usual pipeline mistakes
    (:mod:`~lightning_rollout_debug.checks.diagnosis`: misaligned log-probs, padding in the mask,
    truncated sampling, log-probs of another distribution than the sampled one), each
    warned about once (raised with ``strict=True``);
    :meth:`check_dropout` checks a model.

    Attributes:
        config: every setting above but ``process_group``, validated and resolved
            (:class:`~lightning_rollout_debug.RolloutDebugConfig`).
        should_stop: set when a window was out of range with ``on_alert="stop"``.
        batches_in_window: the updates since the window began, skipped batches too.

    Example:
        >>> import torch
        >>> from lightning_rollout_debug import RolloutDebugMonitor
        >>> monitor = RolloutDebugMonitor(groups=["seed", "health"])
        >>> rollout = torch.log(torch.tensor([[0.5, 0.25, 0.9]]))
        >>> batch = {"rollout_log_probs": rollout, "response_mask": torch.tensor([[1, 1, 0]])}
        >>> outputs = {"old_log_probs": rollout - 0.001}
        >>> monitor.update(outputs, batch)
        >>> logged = monitor.log(step=0)
        >>> logged["training/rollout_tokens"], logged["training/rollout_probs_diff_valid"]
        (2.0, 1.0)
        >>> monitor.batches_in_window
        0
    """

    _door = MONITOR_DOOR

    def __init__(
        self,
        rollout_log_probs_key: str = "rollout_log_probs",
        old_log_probs_key: str = "old_log_probs",
        response_mask_key: str = "response_mask",
        prefix: str = "training/",
        strict: bool = False,
        is_threshold: float = 2.0,
        seq_ratio_bounds: tuple[float, float] = (0.99, 1.01),
        token_ids_keys: tuple[str, str] | None = None,
        groups: Sequence[str] | None = None,
        process_group: Any | None = None,
        histograms: bool = True,
        worst_tokens_k: int = 10,
        dashboard_layout: bool = True,
        profile_images: bool = True,
        profile_images_every_n_steps: int = PROFILE_IMAGES_EVERY_N_STEPS,
        alert_ranges: Mapping[str, tuple[float | None, float | None]] | None = None,
        on_alert: Literal["warn", "stop", "raise"] = "warn",
        drift_factors: Mapping[str, float] | None = None,
        drift_baseline: int = DEFAULT_DRIFT_BASELINE,
        compile: bool | None = None,
        pad_token_id: int | None = None,
        tokenizer: Any | None = None,
        segment_key: str = "segment_ids",
        max_segments: int = 16,
        segment_names: Sequence[str] | None = None,
        segment_metrics: Sequence[str] | None = None,
        segment_alerts: bool = False,
    ) -> None:
        given = dict(locals())  # the arguments as passed, before anything else is named
        problems = process_group_problems(process_group)
        try:
            self.config = RolloutDebugConfig(**{f.name: given[f.name] for f in settings()})
            """Every setting, validated and resolved (:class:`RolloutDebugConfig`)."""
        except InvalidSettings as error:
            problems = error.problems + problems
        if problems:
            raise InvalidSettings(type(self).__name__, problems)
        self._set_up(self.config, process_group)

    @classmethod
    def from_config(
        cls, config: RolloutDebugConfig, process_group: Any | None = None, *, door: FrontDoor
    ) -> RolloutDebugMonitor:
        """A monitor of ``config``, the front door ``door`` naming it in its messages.

        Example:
            >>> monitor = RolloutDebugMonitor.from_config(
            ...     RolloutDebugConfig(groups=["seed"]), door=MONITOR_DOOR)
            >>> monitor.config.groups
            ('seed',)
        """
        monitor = cls.__new__(cls)
        monitor._door = door
        monitor.config = config
        monitor._set_up(config, process_group)
        return monitor

    def _set_up(self, config: RolloutDebugConfig, process_group: Any | None) -> None:
        """The window, the logs and the alerts of ``config``."""
        self.process_group = process_group
        self.should_stop = False
        self._window = DeviceWindow.of_config(config, owner=self._door.name)
        window = self._window
        self._stats, self._extras, self._series = window.stats, window.extras, window.series
        self._shifts, self._segments = window.shifts, window.segments
        self.profile: Profile | None = None
        """The :class:`~lightning_rollout_debug.metrics.profile.Profile` of the last logged window
        (quantiles, by position, by probability, joint counts), if it is kept."""
        self._logs = WindowLogs(
            prefix=config.prefix,
            groups=config.groups,
            dashboard_layout=config.dashboard_layout,
            profile_images=config.profile_images,
            profile_images_every_n_steps=config.profile_images_every_n_steps,
            strict=config.strict,
            warn_once=self._warn_once,
            token_text=None if config.tokenizer is None else TokenText(config.tokenizer),
            segment_metrics=config.segment_metrics,
            segment_names=tuple(
                segment_name(segment, config.max_segments, config.segment_names)
                for segment in range(config.max_segments + 1)
            ),
        )
        ranges, factors = dict(config.alert_ranges), dict(config.drift_factors)
        if config.segment_alerts:  # each segment's values alert as the window's do
            every = (config.segment_metrics, config.max_segments, config.segment_names)
            ranges |= for_each_segment(config.alert_ranges, *every)
            factors |= for_each_segment(config.drift_factors, *every)
        self._alerts = AlertMonitor(ranges)
        self._drift = DriftMonitor(factors, config.drift_baseline)
        self.rank: int | None = None
        """The rank shown in the worst-tokens table (``None``: asked of torch.distributed)."""
        self._warned: set[str] = set()
        self.skips = SkippedBatches()
        """The batches of the window that were skipped (a window of nothing but skips warns)."""
        self.diagnosed: set[str] = set()
        """The kinds of mistake warned about so far (each once per run)."""
        self.causes: set[str] = set()
        """The causes found outside the windows (``"dropout"``), which explain their symptoms."""

    @property
    def batches_in_window(self) -> int:
        """The updates since the window began, skipped batches too."""
        return self._window.batches

    @batches_in_window.setter
    def batches_in_window(self, batches: int) -> None:
        self._window.batches = batches

    # ------------------------------------------------------------------ the loop's calls
    def update(self, *sources: Any) -> None:
        """Add one batch to the window, on its device, without waiting for it.

        Args:
            *sources: mappings of tensors, TensorDicts, or objects whose ``.batch`` is
                one (verl's ``DataProto``): each tensor is taken from the first source that
                holds its key, so put what the training step computed before the batch.

        A batch the monitor cannot use is skipped with one warning per kind of problem, or
        raised with ``strict=True``.
        """
        if not sources:
            raise TypeError(
                "update() takes the batch: one or more mappings of tensors, TensorDicts or "
                "objects whose `.batch` is one."
            )
        self.batches_in_window += 1
        self._update(sources, self.batches_in_window - 1)

    def log(
        self, step: int, loggers: Any | None = None, *, fabric: Any | None = None
    ) -> dict[str, float]:
        """Log the window at ``step``, start a new one, and return what was logged.

        Every process must call it at the same steps: the window of every rank is merged
        with one collective, through ``fabric.all_gather`` when given a Fabric, over
        ``process_group`` when ``torch.distributed`` is initialised, else not at all (before
        the first, the settings that lay it out are compared: where the ranks' differ, each
        raises :class:`~.config.InvalidSettings`, as a constructor does). Rank
        0 sends the scalars to the loggers and writes the histograms, worst tokens,
        profile pictures and dashboard layout to the TensorBoard ones; every rank checks
        the alerts.

        Args:
            step: the step the values are logged at (an int >= 0).
            loggers: a logger or a list of them, of either Lightning package or of Fabric
                (anything with ``log_metrics(metrics, step)``); by default the Fabric's own
                loggers, or none.
            fabric: the ``lightning.fabric.Fabric`` running the loop, if any.

        Returns:
            The logged scalars by prefixed name; undefined values (no tokens, a single
            token for a standard deviation) are left out.
        """
        step = checked_step(step)
        if fabric is not None and not hasattr(fabric, "loggers"):
            raise TypeError(
                "`fabric` must be the lightning Fabric running the loop (it has `.loggers`), "
                f"got a {type(fabric).__name__}."
            )
        if loggers is None:
            loggers = [] if fabric is None else list(fabric.loggers)
        ranks = loop_ranks(fabric, self.process_group)
        scalars, metrics = self.log_window(step, checked_loggers(loggers), ranks)
        self.check_alerts(metrics, step, warn=ranks.is_global_zero)
        return scalars

    def reset(self) -> None:
        """Start over: an empty window, no open alert episodes, ``should_stop`` cleared.

        Warnings about the batches are given again, once per kind, the pictures are drawn
        at the next logged step, and the drift baselines are collected again from the next
        logged window.
        """
        self.begin()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The window (statistics and extras), its batch count and configuration, on the CPU.

        When ``torch.distributed`` is initialised the window is merged over the process
        group first, so every rank must call it, as ``fabric.save`` does; its batch count
        is then the most batches any rank's window holds.
        """
        ranks = loop_ranks(None, self.process_group)
        return self._window.saved_over(ranks, self.config.checkpoint_identity(), self._drift)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue the window of :meth:`state_dict`.

        The saved window holds every rank's tokens: the first rank of the process group
        carries it on, the others start empty. A damaged state starts an empty window with
        a warning (an error with ``strict=True``); another configuration warns, and a
        window whose groups the statistics now count otherwise (other groups, another
        ``is_threshold`` or ``seq_ratio_bounds``, or a state that records no configuration)
        starts empty.
        """
        self.restore(state_dict)

    # ------------------------------------------------------------------ windows
    def begin(self, *, keep_window: bool = False, device: torch.device | None = None) -> None:
        """Start a run: the window emptied, or kept on ``device``.

        No alert episode is open, and no warning or picture counts as given yet. A kept
        window (restored from a checkpoint) keeps its drift baselines too; otherwise they
        are collected again.
        """
        self._alerts.reset()
        self._drift.reset()
        self.should_stop = False
        self._warned.clear()
        self._logs.restart()
        if not keep_window:
            self.skips.empty()
            self._window.empty()
            self._drift.restart()
            self.diagnosed.clear()
            if self._series is not None:
                self._series.reset()
        elif device is not None:
            self._window.move_to(device)

    # ------------------------------------------------------------------ state
    def window_state(
        self, ranks: Ranks | None = None, extra: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """A checkpoint state of the window: this process's updates, or merged over ``ranks``.

        ``extra``: settings of the caller's that the state records beside the monitor's
        (the callback's ``log_every_n_steps``).
        """
        config = {**self.config.checkpoint_identity(), **(extra or {})}
        if ranks is None:
            extras = None if self._extras is None else self._extras.state
            return self._window.saved(self._stats, extras, config, self._drift)
        stats, merged, series, _, segments = self._window.merged(ranks)
        return self._window.saved(
            stats, merged, config, self._drift, series=series, segments=segments
        )

    def restore(self, state_dict: Any, extra: Mapping[str, Any] | None = None) -> bool:
        """Restore a saved window (see :meth:`load_state_dict`); whether it was.

        ``extra``: as for :meth:`window_state`, compared with what the state recorded.
        """
        return self._load(state_dict, {**self.config.checkpoint_identity(), **(extra or {})})

    def _load(self, state_dict: Any, config: Mapping[str, Any]) -> bool:
        """Restore a saved window (see :meth:`load_state_dict`); whether it was."""
        self._window.empty()
        self._drift.restart()
        if self._series is not None:
            self._series.reset()
        restored = self._state_reader().read(state_dict, config)
        if restored is None:
            return False
        self._window.batches, self._window.partial_profile = restored
        return True

    def _state_reader(self) -> StateReader:
        """What restores a checkpoint state into this monitor's window, as it is now set up."""
        return StateReader(
            name=self._door.name,
            prefix=self.config.prefix,
            strict=self.config.strict,
            drift_baseline=self.config.drift_baseline,
            stats=self._stats,
            extras=self._extras,
            drift=self._drift,
            process_group=self.process_group,
            category=RolloutDebugWarning,
            series=self._series,
            segments=self._segments,
        )
