"""RolloutDebugCallback: Lightning glue around the :class:`.RolloutDebugMonitor`.

The monitor holds the window, merges it, logs it, checks the alerts and keeps the
checkpoint state; the callback says when (the steps where the Trainer logs), how the
ranks gather (the strategy's ``all_gather``), and puts the values in
``trainer.callback_metrics``. It is a callback of both Lightning packages (:mod:`.packages`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any, Literal

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import rank_zero_only
from typing_extensions import override

from lightning_rollout_debug.checks.drift import DEFAULT_DRIFT_BASELINE
from lightning_rollout_debug.loop.arguments import (
    is_process_group,
    metric_names,
    process_group_problems,
)
from lightning_rollout_debug.loop.batch_updates import FrontDoor, RolloutDebugWarning
from lightning_rollout_debug.loop.config import InvalidSettings, RolloutDebugConfig, settings
from lightning_rollout_debug.loop.monitor import RolloutDebugMonitor
from lightning_rollout_debug.loop.packages import Callback
from lightning_rollout_debug.loop.ranks import Ranks, rank_in
from lightning_rollout_debug.metrics import caller
from lightning_rollout_debug.metrics.backends import prepare_native
from lightning_rollout_debug.metrics.settings import is_int_at_least
from lightning_rollout_debug.views.tensorboard import PROFILE_IMAGES_EVERY_N_STEPS, prepare_pictures

CALLBACK_DOOR = FrontDoor(
    "RolloutDebugCallback",
    "the output of `training_step`",
    "Pass warn_dropout=False if the recompute already runs in eval mode.",
)


class RolloutDebugCallback(Callback):
    r"""Log the mismatch between rollout-engine and trainer log-probabilities.

    On every training batch the callback reads ``rollout_log_probs`` (recorded by the
    inference engine), ``old_log_probs`` (recomputed by the trainer) and
    ``response_mask``, first from the dict ``training_step`` returned and then from the
    batch, and adds them to a window of statistics on the batch's device without
    waiting for it. On the steps where Lightning logs (or every ``log_every_n_steps``
    optimizer steps) it merges the window across processes, computes every metric of
    ``docs/metrics.md`` once, sends them to every attached logger at the step
    ``self.log`` uses, puts them in ``trainer.callback_metrics`` and starts a new window.
    Values that are undefined for a window (no tokens, a single token for a standard
    deviation) are left out rather than logged as NaN.

    Args:
        rollout_log_probs_key: key of the ``[B, T]`` log-probs the rollout engine recorded.
        old_log_probs_key: key of the ``[B, T]`` log-probs the trainer recomputed.
        response_mask_key: key of the ``[B, T]`` mask of response tokens (non-zero counts).
            Without it, ``attention_mask`` cut to the width of ``responses`` is used.
        prefix: put before every metric name.
        log_every_n_steps: log every this many optimizer steps; ``None`` follows the
            Trainer's ``log_every_n_steps``.
        strict: raise on a batch the callback cannot use instead of skipping it with a
            warning.
        is_threshold: ``C`` of the importance-ratio group (``rho > C`` is high).
        seq_ratio_bounds: ``(lo, hi)`` band of sequence geometric-mean ratios.
        token_ids_keys: batch keys of the rollout's and the trainer's token ids; turns
            on the token-id group.
        groups: metric groups to log, from ``GROUPS``; ``None`` logs all that the
            configuration allows (the token-id group needs ``token_ids_keys``).
        process_group: the process group to reduce over; ``None`` means all ranks. Pass
            the data-parallel group when several ranks hold the same tokens (tensor,
            sequence or pipeline parallelism), or they are counted several times. Either a
            group, or a picklable callable ``(trainer) -> group | None`` that every rank
            calls once in ``setup("fit")``, where it may create the group with
            ``torch.distributed.new_group`` (needed under ``ddp_spawn``, or whenever the
            group does not exist yet when the callback is built). A rank outside the group
            takes part in no collective and keeps its own window.
        histograms: with a ``TensorBoardLogger``, write histograms of the log ratio
            ``r = a - b`` and of ``abs(pa - pb)`` over the window's tokens at each logged
            step (``{prefix}rollout_log_ratio_hist``, ``{prefix}rollout_probs_diff_hist``).
        worst_tokens_k: with a ``TensorBoardLogger``, write a table of the ``k`` tokens
            with the largest ``abs(r)`` of each window (``{prefix}rollout_worst_tokens``);
            0 turns it off. The token ids come from ``token_ids_keys[0]`` or ``responses``.
        dashboard_layout: with a ``TensorBoardLogger``, write a custom-scalars layout
            grouping the charts (agreement, divergence, sequences, health, quantiles) once
            per run.
        profile_images: with a ``TensorBoardLogger``, draw where each window's mismatch
            lives in the IMAGES tab: by response position, by trainer probability, and the
            joint histogram of the two log-probs (``{prefix}rollout_profile/by_position``,
            ``.../by_probability``, ``.../joint``).
        profile_images_every_n_steps: draw the pictures at the first logged step of each
            span of this many steps (``[0, n)``, ``[n, 2n)``, ...): at every logged step
            with the Trainer's default of logging every 50 steps; 1 draws at every logged
            step.
        alert_ranges: allowed ``(low, high)`` per un-prefixed metric name (either bound
            ``None``); ``None`` uses ``DEFAULT_ALERT_RANGES`` and ``{}`` turns alerts off.
        on_alert: what a value outside its range does: ``"warn"`` (a warning once per
            crossing), ``"stop"`` (also sets ``trainer.should_stop``) or ``"raise"``
            (:class:`RolloutAlertError`). See ``docs/tensorboard.md``.
        drift_factors: drift alerts: a factor (> 1) per un-prefixed metric name; a logged
            value above factor x the metric's baseline alerts, with ``on_alert``'s action.
            ``None`` uses ``DEFAULT_DRIFT_FACTORS`` and ``{}`` turns drift alerts off;
            independent of ``alert_ranges``. For metrics that grow with the mismatch
            from a positive baseline; one that falls (a correlation) never reaches its
            factor: give it an alert range.
        drift_baseline: how many first logged (defined) values of a metric its baseline
            is the median of. The baseline is kept in the checkpoint: a resumed run goes
            on with it, a new run collects its own.
        compile: fuse the statistics and the extras into one pass: on CPUs the native
            kernel reads every batch once for both; on accelerators ``torch.compile`` takes
            every batch. ``None`` never compiles on a CPU and falls
            back to eager arithmetic where fusing does not work, ``False`` never fuses,
            ``True`` fuses every batch. The results are the same; see
            ``docs/performance.md``.
        pad_token_id: the pad token's id: the run of pad ids that ends a row's masked
            tokens (but for its first, an EOS) is counted and named in the ``padding``
            diagnosis; the ids come from ``token_ids_keys[0]`` or ``responses``.
        warn_dropout: at the start of training, warn once if the module has dropout
            active (recomputed log-probs would carry its noise); ``False`` when the
            recompute already runs in eval mode.
        tokenizer: with a ``TensorBoardLogger`` and token ids, the worst-tokens table
            shows each token's text and the text of the tokens before it in its row: a
            ``transformers`` tokenizer, a ``tokenizers.Tokenizer``, or anything with
            ``decode(ids)``, ``convert_ids_to_tokens(ids)`` or ``id_to_token(id)``.
        segment_key, max_segments, segment_names, segment_metrics, segment_alerts: the
            mismatch per segment (a turn, a data source, a task), logged as
            ``<prefix>segments/<name>/<metric>``: as the monitor's
            (:class:`~lightning_rollout_debug.RolloutDebugMonitor`); see ``docs/segments.md``.

    Every logged window is checked for the usual pipeline mistakes (misaligned
    log-probs, padding in the mask, truncated sampling, log-probs of another distribution
    than the sampled one; see ``docs/troubleshooting.md``), each warned about once (raised
    with ``strict=True``).

    It is a callback of both Lightning packages, ``pytorch_lightning`` and ``lightning``
    (``import lightning as L``; ``L.Trainer(callbacks=[RolloutDebugCallback()])``), and
    works alike with either's Trainer, loggers and ``LightningCLI``. Its engine,
    :attr:`monitor`, is a :class:`~lightning_rollout_debug.RolloutDebugMonitor`: the same
    window, merge, logs, alerts and checkpoint state serve loops without a Trainer. Its
    settings are :attr:`config` (a :class:`~lightning_rollout_debug.RolloutDebugConfig`,
    the monitor's too), with ``log_every_n_steps``, ``warn_dropout`` and
    ``process_group`` beside it.

    Example:
        >>> import pytorch_lightning as pl
        >>> from lightning_rollout_debug import RolloutDebugCallback
        >>> trainer = pl.Trainer(callbacks=[RolloutDebugCallback(log_every_n_steps=10)],
        ...                      logger=False, enable_progress_bar=False,
        ...                      enable_model_summary=False)
        >>> RolloutDebugCallback(prefix="rl/", groups=["seed", "kl"]).config.groups
        ('seed', 'kl')
    """

    def __init__(
        self,
        rollout_log_probs_key: str = "rollout_log_probs",
        old_log_probs_key: str = "old_log_probs",
        response_mask_key: str = "response_mask",
        prefix: str = "training/",
        log_every_n_steps: int | None = None,
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
        warn_dropout: bool = True,
        tokenizer: Any | None = None,
        segment_key: str = "segment_ids",
        max_segments: int = 16,
        segment_names: Sequence[str] | None = None,
        segment_metrics: Sequence[str] | None = None,
        segment_alerts: bool = False,
    ) -> None:
        given = dict(locals())  # the arguments as passed, before anything else is named
        problems = process_group_problems(process_group, trainer_callable=True)
        if log_every_n_steps is not None and not is_int_at_least(log_every_n_steps, 1):
            problems.append(
                f"`log_every_n_steps` must be None (follow the Trainer) or an int >= 1, "
                f"got {log_every_n_steps!r}."
            )
        if not isinstance(warn_dropout, bool):
            problems.append(f"`warn_dropout` must be True or False, got {warn_dropout!r}.")
        try:
            config = RolloutDebugConfig(**{field.name: given[field.name] for field in settings()})
        except InvalidSettings as error:
            problems = error.problems + problems
        if problems:
            raise InvalidSettings(type(self).__name__, problems)
        self.config = config
        """Every setting but the three below, validated and resolved."""
        self.log_every_n_steps = log_every_n_steps
        self.warn_dropout = warn_dropout
        self.process_group = process_group
        group = process_group if is_process_group(process_group) else None  # a callable: in setup
        self.monitor = RolloutDebugMonitor.from_config(config, group, door=CALLBACK_DOOR)
        """The engine: the window, its merge, the logs, the alerts and the checkpoint state."""
        self._batch_step: int | None = None  # the optimizer step of the last batch
        self._restored = False

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(prefix=self.config.prefix, groups=self.config.groups)

    # ------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.monitor.rank = trainer.global_rank
        if stage == "fit" and callable(self.process_group):
            self.monitor.process_group = self.process_group(trainer)
        if stage == "fit" and trainer.strategy.root_device.type == "cpu":
            prepare_native(self.config.compile)  # loaded before the first step
        if stage == "fit" and self.config.profile_images and trainer.is_global_zero:
            prepare_pictures()  # the pictures' fixed parts drawn before the first step
        if stage == "fit" and not trainer.loggers and trainer.is_global_zero:
            caller.warn(
                "RolloutDebugCallback: the Trainer has no logger, so the rollout metrics only "
                "reach `trainer.callback_metrics`. Pass `logger=TensorBoardLogger(...)` to see "
                "them.",
                RolloutDebugWarning,
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A window restored from a checkpoint carries on; any other starts empty.
        self.monitor.begin(keep_window=self._restored, device=pl_module.device)
        self._restored = False
        self._batch_step = None
        if self.warn_dropout:
            self.monitor.check_dropout(pl_module)

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self._batch_step = trainer.fit_loop.epoch_loop._batches_that_stepped
        self.monitor.update(outputs, batch)
        if self._should_log(trainer, pl_module):
            self._log_window(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.monitor.batches_in_window:  # the last, partial window: at its last batch's step
            self._log_window(trainer)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and callable(self.process_group):
            # The callable made the group in setup("fit"): let go of it, so that whoever
            # destroys it frees it (a gloo group's threads stop with its last reference).
            self.monitor.process_group = None

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        state = checkpoint.get("callbacks", {}).get(self.state_key)
        if state is not None and trainer.world_size > 1:
            # Every rank updates at every batch: each holds the window's batch count.
            state.update(self.monitor.window_state(self._ranks(trainer), self._own_settings()))

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        saved = checkpoint.get("callbacks", {})
        if self.state_key in saved:
            return
        present = {callback.state_key for callback in trainer.callbacks}
        kind = type(self).__qualname__  # how Lightning's state keys begin
        others = [
            key
            for key in saved
            if isinstance(key, str) and key.startswith(kind) and key not in present
        ]
        if others and rank_zero_only.rank == 0:
            caller.warn(
                f"{type(self).__name__}(prefix={self.config.prefix!r}): the checkpoint holds no "
                f"state under this callback's key, {self.state_key}, only under "
                f"{', '.join(others)}: its window, "
                "histograms, worst tokens and drift baselines start empty. The key is made of "
                "`prefix` and `groups`; resume with those the checkpoint was written with to "
                "carry them on.",
                RolloutDebugWarning,
            )

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.monitor.window_state(extra=self._own_settings())

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = self.monitor.restore(state_dict, self._own_settings())

    # --------------------------------------------------------------- helpers
    def _update(self, outputs: Any, batch: Any) -> None:
        """The work of ``on_train_batch_end`` on the window, without logging."""
        self.monitor.update(outputs, batch)

    def _should_log(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
        if pl_module.automatic_optimization and trainer.fit_loop._should_accumulate():
            return False
        if self.log_every_n_steps is None:
            return trainer._logger_connector.should_update_logs or bool(trainer.fast_dev_run)
        step = trainer.fit_loop.epoch_loop._batches_that_stepped + 1
        return step % self.log_every_n_steps == 0 or trainer.should_stop

    def _log_step(self, trainer: pl.Trainer) -> int:
        """The step ``self.log`` uses for the window's last batch.

        That of the last batch this run, the step it belongs to even where the run stopped
        before that step's optimizer step (a stop in the middle of gradient accumulation);
        for a restored window without a batch since, the last step taken.
        """
        if self._batch_step is not None:
            return self._batch_step
        return max(trainer.fit_loop.epoch_loop._batches_that_stepped - 1, 0)

    def _ranks(self, trainer: pl.Trainer) -> Ranks:
        """The Trainer's processes: they gather through the strategy, over the process group."""
        group = self.monitor.process_group
        together = trainer.world_size > 1 and rank_in(group, trainer.global_rank) >= 0
        gather = partial(trainer.strategy.all_gather, group=group) if together else None
        return Ranks(
            trainer.world_size, trainer.is_global_zero, gather, trainer.strategy.root_device
        )

    def _log_window(self, trainer: pl.Trainer) -> None:
        step = self._log_step(trainer)
        ranks = self._ranks(trainer)
        scalars, metrics = self.monitor.log_window(step, trainer.loggers, ranks)
        callback_metrics = trainer.callback_metrics
        for name in metric_names(self.config.prefix, self.config.groups) - scalars.keys():
            callback_metrics.pop(name, None)
        callback_metrics.update(
            {name: torch.tensor(value, dtype=torch.float64) for name, value in scalars.items()}
        )
        if self.monitor.check_alerts(metrics, step, warn=ranks.is_global_zero):
            trainer.should_stop = True

    def _own_settings(self) -> dict[str, Any]:
        """What a checkpoint records of the callback's own settings."""
        return {"log_every_n_steps": self.log_every_n_steps}
