"""RolloutDebugCallback: Lightning glue around the statistics and the TensorBoard extras."""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.loggers import TensorBoardLogger
from pytorch_lightning.utilities import rank_zero_warn
from typing_extensions import override

from lightning_rollout_debug.alerts import (
    AlertMonitor,
    RolloutAlertError,
    RolloutAlertWarning,
    alert_problems,
    enabled_metric_names,
    resolve_alert_ranges,
)
from lightning_rollout_debug.backends import compile_problems
from lightning_rollout_debug.batch import (
    RESPONSES_KEY,
    BatchError,
    MismatchInputs,
    batch_type_error,
    extract_inputs,
    lookup,
    tensor_sources,
)
from lightning_rollout_debug.catalog import GROUPS, METRIC_NAMES
from lightning_rollout_debug.extras import (
    ExtrasSummary,
    TokenExtras,
    extras_problems,
    token_ids_for,
    update_together,
)
from lightning_rollout_debug.layout import merge_states, state_problems
from lightning_rollout_debug.stats import (
    MismatchStats,
    validate_groups,
    validate_is_threshold,
    validate_seq_ratio_bounds,
)
from lightning_rollout_debug.tensorboard import dashboard_layout, write_extras

POSITIVE_LOG_PROB_TOLERANCE = 1e-3
"""Log-probs above this (nats) are reported: no log-probability is above 0."""


class RolloutDebugWarning(UserWarning):
    """A batch the callback skipped, or a setting it cannot honour."""


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
            grouping the charts (agreement, divergence, sequences, health) once per run.
        alert_ranges: allowed ``(low, high)`` per un-prefixed metric name (either bound
            ``None``); ``None`` uses ``DEFAULT_ALERT_RANGES`` and ``{}`` turns alerts off.
        on_alert: what a value outside its range does: ``"warn"`` (a warning once per
            crossing), ``"stop"`` (also sets ``trainer.should_stop``) or ``"raise"``
            (:class:`RolloutAlertError`). See ``docs/tensorboard.md``.
        compile: fuse the statistics and the extras of large batches (65,536 tokens or
            more) into one pass: on CPUs the native kernel reads the batch once for both,
            on accelerators ``torch.compile``. ``None`` never compiles on a CPU and falls
            back to eager arithmetic where fusing does not work, ``False`` never fuses,
            ``True`` fuses every batch. The results are the same; see
            ``docs/performance.md``.

    Example:
        >>> import pytorch_lightning as pl
        >>> from lightning_rollout_debug import RolloutDebugCallback
        >>> trainer = pl.Trainer(callbacks=[RolloutDebugCallback(log_every_n_steps=10)],
        ...                      logger=False, enable_progress_bar=False,
        ...                      enable_model_summary=False)
        >>> RolloutDebugCallback(prefix="rl/", groups=["seed", "kl"]).groups
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
        alert_ranges: Mapping[str, tuple[float | None, float | None]] | None = None,
        on_alert: Literal["warn", "stop", "raise"] = "warn",
        compile: bool | None = None,
    ) -> None:
        problems = _argument_problems(
            rollout_log_probs_key=rollout_log_probs_key,
            old_log_probs_key=old_log_probs_key,
            response_mask_key=response_mask_key,
            prefix=prefix,
            log_every_n_steps=log_every_n_steps,
            strict=strict,
            token_ids_keys=token_ids_keys,
        )
        for validate, value in (
            (validate_is_threshold, is_threshold),
            (validate_seq_ratio_bounds, seq_ratio_bounds),
            (validate_groups, groups),
        ):
            try:
                validate(value)
            except ValueError as error:
                problems.append(str(error))
        if groups is not None and "token_ids" in groups and token_ids_keys is None:
            problems.append(
                "The `token_ids` group needs `token_ids_keys=(rollout_key, trainer_key)`."
            )
        problems += extras_problems(
            histograms=histograms, worst_tokens_k=worst_tokens_k, dashboard_layout=dashboard_layout
        )
        problems += alert_problems(alert_ranges, on_alert, _enabled_groups(groups, token_ids_keys))
        problems += compile_problems(compile)
        if problems:
            raise ValueError("Invalid RolloutDebugCallback arguments:\n- " + "\n- ".join(problems))

        self.rollout_log_probs_key = rollout_log_probs_key
        self.old_log_probs_key = old_log_probs_key
        self.response_mask_key = response_mask_key
        self.prefix = prefix
        self.log_every_n_steps = log_every_n_steps
        self.strict = strict
        self.token_ids_keys = None if token_ids_keys is None else tuple(token_ids_keys)
        enabled = _enabled_groups(groups, token_ids_keys)
        self.groups = tuple(group for group in GROUPS if group in enabled)
        self.process_group = process_group
        self._group = None if callable(process_group) else process_group  # resolved in setup
        self._stats = MismatchStats(
            is_threshold=is_threshold,
            seq_ratio_bounds=seq_ratio_bounds,
            groups=self.groups,
            compile=compile,
        )
        self._batches_in_window = 0
        self._ended = False
        self._warned: set[str] = set()
        self._restored_window: torch.Tensor | None = None
        self.histograms = histograms
        self.worst_tokens_k = worst_tokens_k
        self.dashboard_layout = dashboard_layout
        self.on_alert = on_alert
        self.alert_ranges = resolve_alert_ranges(alert_ranges, self.groups)
        self._alerts = AlertMonitor(self.alert_ranges)
        self._extras = (
            TokenExtras(histograms=histograms, worst_tokens_k=worst_tokens_k, compile=compile)
            if histograms or worst_tokens_k
            else None
        )
        self._restored_extras: torch.Tensor | None = None
        self._layouts_written: set[str] = set()
        self._rank = 0

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(prefix=self.prefix, groups=self.groups)

    # ------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._rank = trainer.global_rank
        if stage == "fit" and callable(self.process_group):
            self._group = self.process_group(trainer)
        if stage == "fit" and not trainer.loggers:
            rank_zero_warn(
                "RolloutDebugCallback: the Trainer has no logger, so the rollout metrics only "
                "reach `trainer.callback_metrics`. Pass `logger=TensorBoardLogger(...)` to see "
                "them.",
                category=RolloutDebugWarning,
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stats.reset()
        if self._extras is not None:
            self._extras.reset()
        self._alerts.reset()
        if self._restored_window is not None and _rank_in(self._group, trainer) == 0:
            # The checkpoint holds the window of all ranks (of the process group) merged: the
            # first rank (of each group: they hold the same tokens) alone carries it on.
            self._stats.load_state(self._restored_window.to(pl_module.device))
            if self._extras is not None and self._restored_extras is not None:
                self._extras.load_state(self._restored_extras.to(pl_module.device))
        self._restored_window = None
        self._restored_extras = None

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self._batches_in_window += 1
        self._update(outputs, batch)
        if self._should_log(trainer, pl_module):
            self._log_window(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._batches_in_window:  # the last, partial window: at the step of its last batch
            self._ended = True
            try:
                self._log_window(trainer)
            finally:
                self._ended = False

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and callable(self.process_group):
            # The callable made the group in setup("fit"): let go of it, so that whoever
            # destroys it frees it (a gloo group's threads stop with its last reference).
            self._group = None

    def _log_step(self, trainer: pl.Trainer) -> int:
        """The step ``self.log`` uses for the batch that just ended."""
        step = trainer.fit_loop.epoch_loop._batches_that_stepped
        return max(step - 1, 0) if self._ended else step

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        state = checkpoint.get("callbacks", {}).get(self.state_key)
        if state is not None and trainer.world_size > 1:
            stats, extras = self._all_ranks(trainer)
            state["window"] = stats.state.cpu()
            if extras is not None:
                state["extras_window"] = extras.cpu()

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "window": self._stats.state.detach().cpu().clone(),
            "batches_in_window": self._batches_in_window,
            "extras_window": None
            if self._extras is None
            else self._extras.state.detach().cpu().clone(),
            "config": self._config(),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored_window = self._restored_extras = None
        self._batches_in_window = 0
        problems = _checkpoint_problems(state_dict)
        if not problems:
            problems = state_problems(state_dict["window"])
        if problems:
            self._reject_checkpoint(problems, "the window starts empty")
            return
        saved = state_dict.get("config", {})
        if saved and saved != self._config():
            rank_zero_warn(
                f"RolloutDebugCallback: the checkpoint was written with {saved}; continuing "
                f"with the constructor's {self._config()}.",
                category=RolloutDebugWarning,
            )
        self._restored_window = state_dict["window"]
        self._batches_in_window = state_dict.get("batches_in_window", 0)
        extras = state_dict.get("extras_window")
        if self._extras is not None and extras is not None:
            problems = self._extras.state_problems(extras)
            if (
                problems
                and isinstance(extras, torch.Tensor)
                and extras.shape != (self._extras.size,)
            ):
                return  # saved with other histograms or another k: those start empty
            if problems:
                self._reject_checkpoint(problems, "the histograms and worst tokens start empty")
                return
            self._restored_extras = extras

    def _reject_checkpoint(self, problems: Sequence[str], consequence: str) -> None:
        message = (
            f"RolloutDebugCallback(prefix={self.prefix!r}): the checkpoint's state cannot be "
            f"restored: {'; '.join(problems)}."
        )
        if self.strict:
            raise ValueError(message)
        rank_zero_warn(f"{message} Training goes on; {consequence}.", category=RolloutDebugWarning)

    # --------------------------------------------------------------- helpers
    def _update(self, outputs: Any, batch: Any) -> None:
        try:
            sources = tensor_sources(outputs, batch)
            inputs, fallback = extract_inputs(
                sources,
                rollout_log_probs_key=self.rollout_log_probs_key,
                old_log_probs_key=self.old_log_probs_key,
                response_mask_key=self.response_mask_key,
                token_ids_keys=self.token_ids_keys,
            )
            if fallback is not None:
                self._warn_once("mask-fallback", fallback)
            together = self._extras is not None and update_together(
                self._stats,
                self._extras,
                inputs,
                _token_ids(sources, inputs),
                batch_index=self._batches_in_window - 1,
                rank=self._rank,
            )
            if not together:
                self._stats.update(
                    inputs.rollout_log_probs,
                    inputs.old_log_probs,
                    inputs.mask,
                    inputs.rollout_token_ids,
                    inputs.trainer_token_ids,
                )
        except BatchError as error:
            # A list or tuple batch: say so. No local may hold the error (its traceback holds
            # this frame, and with it the batch and any autograd graph, until a gc cycle).
            self._skip_batch(batch_type_error(batch, error))
            return
        except Exception as error:
            if self.strict:
                raise
            self._warn_once(
                type(error).__name__, f"Could not update the statistics ({error!r}); skipped."
            )
            return
        if self._extras is not None and not together:
            self._update_extras(self._extras, sources, inputs)

    def _update_extras(
        self, extras: TokenExtras, sources: Sequence[Any], inputs: MismatchInputs
    ) -> None:
        """Add the batch to the histograms and worst tokens (its statistics are counted)."""
        try:
            extras.update(
                inputs.rollout_log_probs,
                inputs.old_log_probs,
                inputs.mask,
                _token_ids(sources, inputs),
                batch_index=self._batches_in_window - 1,
                rank=self._rank,
            )
        except Exception as error:
            if self.strict:
                raise
            self._warn_once(
                f"extras:{type(error).__name__}",
                f"Could not add a batch to the histograms and worst tokens ({error!r}); they "
                "miss it, the statistics count it.",
            )

    def _should_log(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
        if pl_module.automatic_optimization and trainer.fit_loop._should_accumulate():
            return False
        if self.log_every_n_steps is None:
            return trainer._logger_connector.should_update_logs or bool(trainer.fast_dev_run)
        step = trainer.fit_loop.epoch_loop._batches_that_stepped + 1
        return step % self.log_every_n_steps == 0 or trainer.should_stop

    def _all_ranks(self, trainer: pl.Trainer) -> tuple[MismatchStats, torch.Tensor | None]:
        """The window merged over every rank of the process group: one collective.

        The packed statistics and the packed TensorBoard extras (histogram bins, worst-token
        candidates) travel as one float64 vector, the same length on every rank, empty
        window or not. Returns the merged statistics and the merged extras state (``None``
        without extras), both on the device.
        """
        extras = None if self._extras is None else self._extras.state
        if trainer.world_size == 1 or _rank_in(self._group, trainer) < 0:
            return self._stats, extras
        device = trainer.strategy.root_device
        parts = [self._stats.state.to(device)]
        if extras is not None:
            parts.append(extras.to(device))
        width = parts[0].numel()
        local = torch.cat(parts)
        gathered = trainer.strategy.all_gather(local, group=self._group)
        gathered = gathered.reshape(-1, local.numel()).to(torch.float64)
        stats = copy.copy(self._stats)
        stats.load_state(merge_states(gathered[:, :width]))
        if self._extras is not None:
            extras = self._extras.merge_states(gathered[:, width:])
        return stats, extras

    def _host_window(self, trainer: pl.Trainer) -> tuple[MismatchStats, ExtrasSummary | None]:
        """The merged window, copied to the host in one transfer: statistics and extras."""
        stats, extras = self._all_ranks(trainer)
        state = stats.state
        host = torch.cat([state] if extras is None else [state, extras.to(state.device)]).cpu()
        on_host = copy.copy(stats)
        on_host.load_state(host[: state.numel()])
        if extras is None or self._extras is None:
            return on_host, None
        return on_host, self._extras.summary(host[state.numel() :])

    def _log_window(self, trainer: pl.Trainer) -> None:
        stats, extras = self._host_window(trainer)
        self._stats.reset()
        if self._extras is not None:
            self._extras.reset()
        self._batches_in_window = 0
        self._check_log_prob_signs(trainer, stats)
        metrics = stats.compute()
        scalars = {
            f"{self.prefix}{name}": value
            for name, value in metrics.items()
            if not math.isnan(value)
        }
        self._publish(trainer, scalars)
        self._write_tensorboard(trainer, extras)
        self._check_alerts(trainer, metrics)

    def _check_log_prob_signs(self, trainer: pl.Trainer, stats: MismatchStats) -> None:
        """Warn once per key when the window holds log-probs above 0 (read off the host copy)."""
        keys = (self.old_log_probs_key, self.rollout_log_probs_key)
        for key, largest in zip(keys, stats.largest_log_probs(), strict=True):
            if largest > POSITIVE_LOG_PROB_TOLERANCE:
                self._warn_once(
                    f"positive:{key}",
                    f"`{key}` holds values up to {largest:.6g} in the window ending at step "
                    f"{self._log_step(trainer)}; log-probabilities are at most 0 (logits, or "
                    "negative log-likelihoods?). Its tokens are counted as they are: "
                    "probabilities above 1, perplexities below 1.",
                )

    def _publish(self, trainer: pl.Trainer, scalars: Mapping[str, float]) -> None:
        names = {f"{self.prefix}{name}" for group in self.groups for name in METRIC_NAMES[group]}
        callback_metrics = trainer.callback_metrics
        for name in names - scalars.keys():
            callback_metrics.pop(name, None)
        callback_metrics.update(
            {name: torch.tensor(value, dtype=torch.float64) for name, value in scalars.items()}
        )
        if trainer.is_global_zero and scalars:
            step = self._log_step(trainer)
            for logger in trainer.loggers:
                logger.log_metrics(dict(scalars), step=step)

    def _write_tensorboard(self, trainer: pl.Trainer, extras: ExtrasSummary | None) -> None:
        """Histograms, worst tokens and (once per run) the layout, to TensorBoard loggers."""
        if not trainer.is_global_zero:
            return
        step = self._log_step(trainer)
        for logger in trainer.loggers:
            if not isinstance(logger, TensorBoardLogger):
                continue
            writer = logger.experiment
            if self.dashboard_layout and logger.log_dir not in self._layouts_written:
                self._layouts_written.add(logger.log_dir)
                names = enabled_metric_names(self.groups)
                writer.add_custom_scalars(dashboard_layout(self.prefix, names))
            if extras is not None:
                write_extras(writer, self.prefix, extras, step, show_rank=trainer.world_size > 1)

    def _check_alerts(self, trainer: pl.Trainer, metrics: Mapping[str, float]) -> None:
        """Act on the metrics outside their allowed range (the same on every rank)."""
        result = self._alerts.check(metrics)
        if not result.outside:
            return
        step = self._log_step(trainer)
        if self.on_alert == "raise":
            found = "; ".join(alert.describe(self.prefix) for alert in result.outside)
            raise RolloutAlertError(f"RolloutDebugCallback at step {step}: {found}.")
        stop = self.on_alert == "stop"
        if stop:
            trainer.should_stop = True
        for alert in result.new:
            then = (
                "stopping the training (on_alert='stop')"
                if stop
                else "warning again only after it is back in range"
            )
            rank_zero_warn(
                f"RolloutDebugCallback at step {step}: {alert.describe(self.prefix)}; {then}.",
                category=RolloutAlertWarning,
            )

    def _skip_batch(self, error: BatchError) -> None:
        if self.strict:
            raise error
        self._warn_once(error.kind, f"{error} The batch is skipped.")

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(f"RolloutDebugCallback: {message}", RolloutDebugWarning, stacklevel=2)

    def _config(self) -> dict[str, Any]:
        return {
            "rollout_log_probs_key": self.rollout_log_probs_key,
            "old_log_probs_key": self.old_log_probs_key,
            "response_mask_key": self.response_mask_key,
            "prefix": self.prefix,
            "log_every_n_steps": self.log_every_n_steps,
            "is_threshold": self._stats.is_threshold,
            "seq_ratio_bounds": tuple(self._stats.seq_ratio_bounds),
            "token_ids_keys": self.token_ids_keys,
            "groups": self.groups,
        }


def _checkpoint_problems(state_dict: Any) -> list[str]:
    """What is wrong with the keys and plain values of the callback's checkpoint state."""
    if not isinstance(state_dict, Mapping):
        return [f"its state is a {type(state_dict).__name__}, not a dict"]
    problems = []
    if "window" not in state_dict:
        problems.append(f"it has no `window` (keys: {sorted(map(str, state_dict))})")
    batches = state_dict.get("batches_in_window", 0)
    if isinstance(batches, bool) or not isinstance(batches, int) or batches < 0:
        problems.append(f"`batches_in_window` is {batches!r}; expected an int >= 0")
    if not isinstance(state_dict.get("config", {}), Mapping):
        problems.append(f"`config` is a {type(state_dict['config']).__name__}, not a dict")
    return problems


def _rank_in(group: Any, trainer: pl.Trainer) -> int:
    """This process's rank in ``group`` (``None``: all ranks); -1 when outside it."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if group is None or not distributed:
        return trainer.global_rank
    return torch.distributed.get_rank(group)


def _enabled_groups(groups: Any, token_ids_keys: Any) -> frozenset[str]:
    """The groups the callback will log (all of them if ``groups`` is invalid)."""
    try:
        chosen = validate_groups(groups)
    except (TypeError, ValueError):
        chosen = frozenset(GROUPS)
    return chosen if token_ids_keys is not None else chosen - {"token_ids"}


def _token_ids(sources: Sequence[Any], inputs: MismatchInputs) -> torch.Tensor | None:
    """Ids of the sampled tokens for the worst-tokens table: rollout ids, else ``responses``."""
    if inputs.rollout_token_ids is not None:
        return inputs.rollout_token_ids
    return token_ids_for(lookup(sources, RESPONSES_KEY), inputs.mask)


def _argument_problems(
    *,
    rollout_log_probs_key: Any,
    old_log_probs_key: Any,
    response_mask_key: Any,
    prefix: Any,
    log_every_n_steps: Any,
    strict: Any,
    token_ids_keys: Any,
) -> list[str]:
    problems = []
    for name, value in (
        ("rollout_log_probs_key", rollout_log_probs_key),
        ("old_log_probs_key", old_log_probs_key),
        ("response_mask_key", response_mask_key),
    ):
        if not isinstance(value, str) or not value:
            problems.append(f"`{name}` must be a non-empty string, got {value!r}.")
    if not isinstance(prefix, str):
        problems.append(f"`prefix` must be a string such as 'training/', got {prefix!r}.")
    if log_every_n_steps is not None and (
        isinstance(log_every_n_steps, bool)
        or not isinstance(log_every_n_steps, int)
        or log_every_n_steps < 1
    ):
        problems.append(
            f"`log_every_n_steps` must be None (follow the Trainer) or an int >= 1, "
            f"got {log_every_n_steps!r}."
        )
    if not isinstance(strict, bool):
        problems.append(f"`strict` must be True or False, got {strict!r}.")
    if token_ids_keys is not None and (
        isinstance(token_ids_keys, str)
        or len(token_ids_keys) != 2
        or not all(isinstance(key, str) and key for key in token_ids_keys)
    ):
        problems.append(
            "`token_ids_keys` must be None or a pair of batch keys "
            f"(rollout_ids_key, trainer_ids_key), got {token_ids_keys!r}."
        )
    return problems
