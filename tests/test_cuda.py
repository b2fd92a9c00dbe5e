"""On a GPU: exact statistics, updates that never wait, one host copy per logged step, and
a handful of kernel launches per update.

``torch.cuda.set_sync_debug_mode("error")`` raises on any operation that waits for the
device (a ``.item()``, a boolean-mask gather, a device-to-host copy). Non-logged training
steps run the whole callback hook under it; logged steps run under ``"warn"`` and must
warn exactly once: the single copy of the packed window.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from lightning_helpers import TRAINER_DEFAULTS, RolloutModule, make_batches
from reference import assert_metrics_close, reference_metrics
from test_fusion import _batch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from lightning_rollout_debug import MismatchStats, RolloutDebugCallback, RolloutDebugMonitor

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_statistics_match_the_reference(compile: bool, dtype: torch.dtype) -> None:
    tensors = _batch(dtype)
    stats = MismatchStats(compile=compile)
    stats.update(*(t.cuda() for t in tensors))
    assert stats.device is not None and stats.device.type == "cuda"
    want = reference_metrics(
        [tensors[0]],
        [tensors[1]],
        [tensors[2]],
        rollout_ids=[tensors[3]],
        trainer_ids=[tensors[4]],
    )
    assert_metrics_close(stats.compute(), want)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_cuda_update_never_waits_for_the_device(compile: bool) -> None:
    tensors = [t.cuda() for t in _batch(torch.bfloat16)]
    stats = MismatchStats(compile=compile)
    stats.update(*tensors)  # warm-up: CUDA context, kernels, compilation
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            stats.update(*tensors)
        merged = MismatchStats().merge(stats).merge(stats)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert merged.compute()["rollout_tokens"] == 2 * stats.compute()["rollout_tokens"] > 0


class SyncCountingCallback(RolloutDebugCallback):
    """Runs each hook under CUDA's sync debug mode and records the synchronisations."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.records: list[tuple[bool, int]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        logs = self._should_log(trainer, trainer.lightning_module)
        warm = trainer.global_step > 2  # the first steps compile and build the kernels
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn" if logs or not warm else "error")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                super().on_train_batch_end(trainer, *args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        syncs = sum("synchronizing" in str(warning.message) for warning in caught)
        if warm:
            self.records.append((logs, syncs))


@pytest.mark.parametrize("extras", [True, False], ids=["with-extras", "scalars-only"])
def test_cuda_training_copies_to_the_host_once_per_logged_step(extras: bool) -> None:
    callback = SyncCountingCallback(
        strict=True,  # a synchronisation must fail the run, not become a warning
        log_every_n_steps=3,
        histograms=extras,
        worst_tokens_k=5 if extras else 0,
        dashboard_layout=extras,
        alert_ranges={},
    )
    # 64 x 2048 tokens: a training batch.
    batches = make_batches(9, batch_size=64, width=2048, mask="random")
    trainer = pl.Trainer(
        **{**TRAINER_DEFAULTS, "accelerator": "gpu"},
        max_steps=9,
        logger=False,
        callbacks=[callback],
    )
    trainer.fit(RolloutModule(batches, log_loss=False))
    assert callback.records, "no warm step was recorded"
    for logs, syncs in callback.records:
        assert syncs == (1 if logs else 0), callback.records
    assert [logs for logs, _ in callback.records].count(True) >= 2


UPDATE_LAUNCH_BUDGET = 8
"""Kernel launches one whole update may cost on a GPU, extras included."""


def _launches_per_update(monitor: RolloutDebugMonitor, batch: dict[str, torch.Tensor]) -> int:
    """Kernels (and copies, fills) one ``monitor.update`` puts on the GPU, after warm-up."""
    for _ in range(3):  # the CUDA context, compilation, the window's first state
        monitor.update(batch)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        monitor.update(batch)
        torch.cuda.synchronize()
    return sum(1 for event in prof.events() if event.device_type == DeviceType.CUDA)


@pytest.mark.parametrize(
    "options",
    [{"histograms": False, "worst_tokens_k": 0, "groups": ["seed"]}, {}],
    ids=["seed-group", "defaults"],
)
def test_cuda_update_launches_a_handful_of_kernels(options: dict[str, Any]) -> None:
    # 64 x 2048 tokens: a training batch.
    (batch,) = make_batches(1, batch_size=64, width=2048, mask="random")
    batch = {key: value.cuda() for key, value in batch.items()}
    launches = _launches_per_update(RolloutDebugMonitor(alert_ranges={}, **options), batch)
    assert 0 < launches <= UPDATE_LAUNCH_BUDGET, f"{launches} launches for one update"
