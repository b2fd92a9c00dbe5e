"""Where a logged window goes: its scalars to every logger, its extras to TensorBoard.

:class:`WindowLogs` writes one logged window on rank zero: the scalars to every logger
(through its ``log_metrics``), and to each TensorBoard logger the histograms, the
worst tokens, the profile's pictures at the first logged step of each span of steps, and
the dashboard layout once per log directory (once more, with the segments' charts, at the
first window that logs segments); with a tokenizer the table shows the tokens' text. A
logger that fails warns once per kind of error (raises in strict mode) and the other
loggers still get theirs: a monitor's own logs never stop a training run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_rollout_debug.checks.alerts import enabled_metric_names
from lightning_rollout_debug.loop.packages import TENSORBOARD_LOGGERS
from lightning_rollout_debug.metrics.extras import ExtrasSummary
from lightning_rollout_debug.metrics.profile import Profile
from lightning_rollout_debug.views.tensorboard import (
    SEGMENTS_CATEGORY,
    dashboard_layout,
    log_scalars,
    logger_prefix,
    write_extras,
    write_layout,
    write_profile,
)
from lightning_rollout_debug.views.token_text import TokenText


@dataclass
class WindowLogs:
    """The writes of a monitor's logged windows, and what they remember between windows.

    Args:
        prefix: put before every metric name (after a logger's own prefix).
        groups: the logged metric groups, for the dashboard layout.
        dashboard_layout: write the custom-scalars layout once per log directory.
        profile_images: draw the profile's pictures.
        profile_images_every_n_steps: the span of steps the pictures are drawn once in.
        strict: raise what a logger raises instead of warning.
        warn_once: ``warn_once(kind, message)``, the monitor's warning once per kind.
        token_text: the tokenizer's text of the worst tokens, or ``None`` (ids only).
        segment_metrics: the metrics charted per segment once segments are logged.
        segment_names: the name of each segment by index (``other`` last), for the
            worst-tokens table; a segment without one shows its number.

    Example:
        >>> from lightning_rollout_debug.loop.logs import WindowLogs
        >>> class Broken:
        ...     def log_metrics(self, metrics, step):
        ...         raise OSError("disk full")
        >>> logs = WindowLogs(
        ...     prefix="training/", groups=("seed",), dashboard_layout=True,
        ...     profile_images=True, profile_images_every_n_steps=50, strict=False,
        ...     warn_once=lambda kind, message: print(kind),
        ... )
        >>> logs.write([Broken()], {"training/rollout_tokens": 2.0}, None, None, step=0)
        logger:Broken:OSError
    """

    prefix: str
    groups: tuple[str, ...]
    dashboard_layout: bool
    profile_images: bool
    profile_images_every_n_steps: int
    strict: bool
    warn_once: Callable[[str, str], None]
    token_text: TokenText | None = None
    segment_metrics: Sequence[str] = ()
    segment_names: Sequence[str] = ()
    _layouts_written: dict[str, bool] = field(default_factory=dict)  # with segments' charts
    _pictures_span: int | None = None  # the span of steps last drawn in

    def restart(self) -> None:
        """Draw the pictures at the next logged step with a profile, whatever its span."""
        self._pictures_span = None

    def write(
        self,
        loggers: Sequence[Any],
        scalars: Mapping[str, float],
        extras: ExtrasSummary | None,
        profile: Profile | None,
        step: int,
        *,
        show_rank: bool = False,
    ) -> None:
        """Write one logged window at ``step``: its scalars, then its TensorBoard extras.

        ``profile``: the window's profile, drawn if its pictures are due (an empty window
        draws nothing and leaves its span to the next logged step); ``show_rank``: name
        each worst token's rank.
        """
        if scalars:
            for logger in loggers:
                self._log_scalars_to(logger, scalars, step)
        pictures = profile is not None and profile.tokens > 0 and self._pictures_due(step)
        segments = f"{self.prefix}{SEGMENTS_CATEGORY}/"
        segmented = any(name.startswith(segments) for name in scalars)
        for logger in loggers:
            if not isinstance(logger, TENSORBOARD_LOGGERS):
                continue
            try:
                if self.dashboard_layout:
                    self._write_layout_to(logger, segmented)
                self._write_extras_to(
                    logger, extras, profile if pictures else None, step, show_rank=show_rank
                )
            except Exception as error:
                if self.strict:
                    raise
                self.warn_once(
                    f"tensorboard:{type(error).__name__}",
                    f"could not write the TensorBoard extras (histograms, worst tokens, "
                    f"pictures, layout) at step {step} ({error!r}); the scalars are logged "
                    "and training goes on. profile_images=False, histograms=False, "
                    "worst_tokens_k=0 or dashboard_layout=False turns a part off.",
                )

    def _log_scalars_to(self, logger: Any, scalars: Mapping[str, float], step: int) -> None:
        """Log the scalars to one logger; one that fails warns once per kind of error."""
        try:
            log_scalars(logger, scalars, step)
        except Exception as error:
            if self.strict:
                raise
            self.warn_once(
                f"logger:{type(logger).__name__}:{type(error).__name__}",
                f"could not log the scalars to {type(logger).__name__} at step {step} "
                f"({error!r}); the other loggers have them, and training goes on.",
            )

    def _write_extras_to(
        self,
        logger: Any,
        extras: ExtrasSummary | None,
        pictures: Profile | None,
        step: int,
        *,
        show_rank: bool,
    ) -> None:
        """The extras of one logged step, written to one TensorBoard logger.

        Under the logger's own prefix too, as its scalars are: the charts find them.
        """
        writer = logger.experiment
        prefix = logger_prefix(logger) + self.prefix
        if extras is not None:
            text = self.token_text
            write_extras(
                writer,
                prefix,
                extras,
                step,
                show_rank=show_rank,
                token_text=text,
                segment_names=self.segment_names,
            )
            if text is not None and text.failure is not None:
                self.warn_once(
                    "tokenizer",
                    f"the tokenizer failed on worst-token ids ({text.failure}); the table "
                    "shows those tokens as their ids.",
                )
                text.failure = None
        if pictures is not None:
            write_profile(writer, prefix, pictures, step)

    def _write_layout_to(self, logger: Any, segmented: bool) -> None:
        """Write the dashboard layout to a logger's run, if it is due.

        Once per log directory, and once more, with the segments' charts, at the first
        window that logs segments: TensorBoard shows the last layout a run wrote.
        """
        written = self._layouts_written.get(logger.log_dir)
        if written or (written is not None and not segmented):
            return
        self._layouts_written[logger.log_dir] = segmented
        metrics = self.segment_metrics if segmented else ()
        layout = dashboard_layout(
            logger_prefix(logger) + self.prefix, enabled_metric_names(self.groups), metrics
        )
        write_layout(logger.experiment, layout)

    def _pictures_due(self, step: int) -> bool:
        """Whether ``step`` is the first logged step of its span of steps to draw in."""
        if not self.profile_images:
            return False
        span = step // self.profile_images_every_n_steps
        if span == self._pictures_span:
            return False
        self._pictures_span = span
        return True
