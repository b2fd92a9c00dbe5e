"""RolloutDebugCallback: Lightning glue around the statistics of ``stats.py``."""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.utilities import rank_zero_warn
from typing_extensions import override

from lightning_rollout_debug.batch import BatchError, extract_inputs, tensor_sources
from lightning_rollout_debug.stats import (
    GROUPS,
    METRIC_NAMES,
    MismatchStats,
    validate_groups,
    validate_is_threshold,
    validate_seq_ratio_bounds,
)


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
        process_group: the process group to reduce over (for example the
            data-parallel group under tensor parallelism); ``None`` means all ranks.

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
        if problems:
            raise ValueError("Invalid RolloutDebugCallback arguments:\n- " + "\n- ".join(problems))

        self.rollout_log_probs_key = rollout_log_probs_key
        self.old_log_probs_key = old_log_probs_key
        self.response_mask_key = response_mask_key
        self.prefix = prefix
        self.log_every_n_steps = log_every_n_steps
        self.strict = strict
        self.token_ids_keys = None if token_ids_keys is None else tuple(token_ids_keys)
        self.groups = tuple(
            group
            for group in GROUPS
            if (group in groups if groups is not None else True)
            and (group != "token_ids" or token_ids_keys is not None)
        )
        self.process_group = process_group
        self._stats = MismatchStats(
            is_threshold=is_threshold, seq_ratio_bounds=seq_ratio_bounds, groups=self.groups
        )
        self._batches_in_window = 0
        self._warned: set[str] = set()
        self._restored_window: torch.Tensor | None = None

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(prefix=self.prefix, groups=self.groups)

    # ------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
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
        if self._restored_window is not None and trainer.global_rank == 0:
            # The checkpoint holds the window of all ranks merged: rank 0 alone carries it on.
            self._stats.load_state(self._restored_window.to(pl_module.device))
        self._restored_window = None

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
        if self._batches_in_window:
            self._log_window(trainer)

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        state = checkpoint.get("callbacks", {}).get(self.state_key)
        if state is not None and trainer.world_size > 1:
            state["window"] = self._all_ranks(trainer).state.cpu()

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "window": self._stats.state.detach().cpu().clone(),
            "batches_in_window": self._batches_in_window,
            "config": self._config(),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("config", {})
        if saved and saved != self._config():
            rank_zero_warn(
                f"RolloutDebugCallback: the checkpoint was written with {saved}; continuing "
                f"with the constructor's {self._config()}.",
                category=RolloutDebugWarning,
            )
        self._restored_window = state_dict["window"]
        self._batches_in_window = int(state_dict.get("batches_in_window", 0))

    # --------------------------------------------------------------- helpers
    def _update(self, outputs: Any, batch: Any) -> None:
        try:
            inputs, fallback = extract_inputs(
                tensor_sources(outputs, batch),
                rollout_log_probs_key=self.rollout_log_probs_key,
                old_log_probs_key=self.old_log_probs_key,
                response_mask_key=self.response_mask_key,
                token_ids_keys=self.token_ids_keys,
            )
            if fallback is not None:
                self._warn_once("mask-fallback", fallback)
            self._stats.update(
                inputs.rollout_log_probs,
                inputs.old_log_probs,
                inputs.mask,
                inputs.rollout_token_ids,
                inputs.trainer_token_ids,
            )
        except BatchError as error:
            if self.strict:
                raise
            self._warn_once(error.kind, f"{error} The batch is skipped.")
        except Exception as error:
            if self.strict:
                raise
            self._warn_once(
                type(error).__name__, f"Could not update the statistics ({error!r}); skipped."
            )

    def _should_log(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
        if pl_module.automatic_optimization and trainer.fit_loop._should_accumulate():
            return False
        if self.log_every_n_steps is None:
            return trainer._logger_connector.should_update_logs or bool(trainer.fast_dev_run)
        step = trainer.fit_loop.epoch_loop._batches_that_stepped + 1
        return step % self.log_every_n_steps == 0 or trainer.should_stop

    def _all_ranks(self, trainer: pl.Trainer) -> MismatchStats:
        """The window merged over every rank of the process group: one collective."""
        if trainer.world_size == 1:
            return self._stats
        return self._stats.synced(
            lambda state: trainer.strategy.all_gather(state, group=self.process_group),
            device=trainer.strategy.root_device,
        )

    def _log_window(self, trainer: pl.Trainer) -> None:
        metrics = self._all_ranks(trainer).compute()
        self._stats.reset()
        self._batches_in_window = 0
        scalars = {
            f"{self.prefix}{name}": value
            for name, value in metrics.items()
            if not math.isnan(value)
        }
        self._publish(trainer, scalars)

    def _publish(self, trainer: pl.Trainer, scalars: Mapping[str, float]) -> None:
        names = {f"{self.prefix}{name}" for group in self.groups for name in METRIC_NAMES[group]}
        callback_metrics = trainer.callback_metrics
        for name in names - scalars.keys():
            callback_metrics.pop(name, None)
        callback_metrics.update(
            {name: torch.tensor(value, dtype=torch.float64) for name, value in scalars.items()}
        )
        if trainer.is_global_zero and scalars:
            step = trainer.fit_loop.epoch_loop._batches_that_stepped
            for logger in trainer.loggers:
                logger.log_metrics(dict(scalars), step=step)

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
