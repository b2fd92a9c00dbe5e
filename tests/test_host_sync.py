"""The callback waits for the device only on logged steps, and then once.

Every ``on_train_batch_end`` of a real Trainer run is recorded with a dispatch mode that
sees every aten op (``tests/test_stats.py``'s recorder) while ``Tensor.cpu``,
``Tensor.tolist`` and ``Tensor.item`` are counted. On a GPU a device-to-host copy is one
of these calls; on the CPU they copy nothing, but the counts are the same, so the test
proves the number of transfers the code would make on an accelerator.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from lightning_helpers import RolloutModule, make_batches
from test_stats import OpRecorder, host_syncs

from lightning_rollout_debug import RolloutDebugCallback, RolloutDebugMonitor

TRANSFERS = ("cpu", "tolist", "item")


class RecordingCallback(RolloutDebugCallback):
    """Records, per batch, whether the step logged and what waited for the device."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.records: list[dict[str, Any]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        logs = self._should_log(trainer, trainer.lightning_module)
        counts = dict.fromkeys(TRANSFERS, 0)
        originals: dict[str, Callable[..., Any]] = {}

        def counting(name: str) -> Callable[..., Any]:
            def call(tensor: torch.Tensor, *call_args: Any, **call_kwargs: Any) -> Any:
                counts[name] += 1
                return originals[name](tensor, *call_args, **call_kwargs)

            return call

        for name in TRANSFERS:
            originals[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, counting(name))
        try:
            with OpRecorder() as recorder:
                super().on_train_batch_end(trainer, *args)
        finally:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)
        self.records.append({"logs": logs, "syncs": host_syncs(recorder.calls), **counts})


@pytest.mark.parametrize(
    ("extras", "segments"),
    [(True, False), (False, False), (True, True)],
    ids=["with-extras", "scalars-only", "segments"],
)
def test_only_logged_steps_copy_to_the_host_once(extras: bool, segments: bool) -> None:
    """No update waits for the device and a logged step copies to the host once: with the
    extras, with the statistics alone, and with segment labels (a label a token, some
    outside the segments)."""
    callback = RecordingCallback(
        log_every_n_steps=3,
        histograms=extras,
        worst_tokens_k=5 if extras else 0,
        dashboard_layout=extras,
        alert_ranges={},
    )
    batches = make_batches(9, batch_size=[3, 2, 4] * 3, width=[5, 7, 3] * 3, mask="random")
    for i, batch in enumerate(batches if segments else []):
        labels = torch.randint(
            -1, 18, batch["response_mask"].shape, generator=torch.Generator().manual_seed(i)
        )
        batch["segment_ids"] = labels
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=9,
        logger=False,
        callbacks=[callback],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    # On the CPU the native kernel checks, once per process as it loads, what its library
    # computes (on host tensors); an accelerator never loads it. Load it before counting.
    options = {"histograms": extras, "worst_tokens_k": 5 if extras else 0, "alert_ranges": {}}
    RolloutDebugMonitor(**options).update(batches[0])
    trainer.fit(RolloutModule(batches, log_loss=False))
    assert [record["logs"] for record in callback.records] == [False, False, True] * 3
    for record in callback.records:
        assert record["syncs"] == [], record
        assert record["item"] == 0, record
        if not record["logs"]:
            assert record["cpu"] == record["tolist"] == 0, record
        else:
            # The statistics (and the extras) travel together in one copy; the host then
            # reads that copy (tolist of a host tensor moves nothing).
            assert record["cpu"] == 1, record
