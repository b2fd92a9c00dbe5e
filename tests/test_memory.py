"""Long runs keep nothing: thousands of updates and logged windows, constant memory.

Two runs, each measured after a warm-up and again at the end:

- 5,000 ``MismatchStats.update`` calls on a pool of varied batches (B = 0 included,
  special values, requires-grad inputs), a ``compute`` and ``reset`` every 50 updates
  and a ``merge`` of another window every 500;
- a CPU ``Trainer`` run of 2,000 tiny steps with the callback logging every 5 steps, a
  few bad batches (skipped with a warning) and ``training_step`` outputs attached to the
  model's autograd graph.

What must not grow: the number of live tensors (``gc.get_objects``), the resident set
size, the Python heap (``tracemalloc``), every container the callback and its helpers
hold, and no autograd graph may outlive the step that built it.
"""

from __future__ import annotations

import gc
import os
import tracemalloc
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from conftest import make_batch as random_batch
from lightning_helpers import TRAINER_DEFAULTS, RolloutModule, make_batch
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.loggers import Logger
from pytorch_lightning.utilities import rank_zero_only
from reference import assert_metrics_close, reference_metrics
from torch.utils.data import DataLoader, Dataset

from lightning_rollout_debug import RolloutDebugCallback, RolloutDebugWarning
from lightning_rollout_debug.metrics.layout import STATE_SIZE
from lightning_rollout_debug.metrics.stats import MismatchStats

pytestmark = [
    pytest.mark.filterwarnings("ignore:The '.*dataloader' does not have many workers"),
    pytest.mark.filterwarnings("ignore:RolloutDebugCallback at step .* is outside"),
]

MiB = 1 << 20


def live_tensors() -> int:
    """Tensors the garbage collector knows of (``type()``: no lazy attribute is touched)."""
    gc.collect()
    return sum(1 for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor))


def resident_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def container_sizes(obj: Any, depth: int = 2, path: str = "") -> dict[str, int]:
    """``{attribute path: len}`` of every list, dict, set or tuple held by ``obj``'s attributes.

    Follows plain objects (not tensors, modules or the Trainer) ``depth`` levels down.
    """
    sizes: dict[str, int] = {}
    for name, value in vars(obj).items():
        key = f"{path}{name}"
        if isinstance(value, (list, tuple, dict, set, frozenset)):
            sizes[key] = len(value)
        elif isinstance(value, torch.Tensor):
            sizes[key] = value.numel()
        elif depth > 0 and hasattr(value, "__dict__") and not isinstance(value, type):
            sizes.update(container_sizes(value, depth - 1, f"{key}."))
    return sizes


# ---------------------------------------------------------------------- statistics
@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
def test_five_thousand_updates_keep_constant_memory() -> None:
    rng = np.random.default_rng(7)
    pool = []
    for i in range(40):
        shape = (int(rng.integers(0, 7)), int(rng.integers(0, 48)))
        batch = random_batch(
            rng, shape, special_rate=0.05, mask_kind="counts", mask_dtype=torch.float32
        )
        if i % 4 == 0:  # requires-grad inputs, one of them with a graph behind it
            batch.rollout = batch.rollout.clone().requires_grad_()
            batch.old = batch.old.clone().requires_grad_() * 1.0
        pool.append(batch)
    graph_refs = [weakref.ref(batch.old) for batch in pool if batch.old.grad_fn is not None]
    stats = MismatchStats()
    other = MismatchStats()
    other.update(pool[1].rollout, pool[1].old, pool[1].mask)

    def run(updates: range) -> None:
        for i in updates:
            batch = pool[i % len(pool)]
            stats.update(batch.rollout, batch.old, batch.mask)
            if i % 500 == 499:
                stats.merge(other)
            if i % 50 == 49:
                stats.compute()
                stats.reset()

    run(range(0, 1000))  # warm-up: caches, allocator pools, lazy imports
    tensors, rss, attributes = live_tensors(), resident_bytes(), container_sizes(stats)
    run(range(1000, 3000))
    tracemalloc.start()  # the last 2,000 under tracemalloc (it slows Python down 2x)
    try:
        run(range(3000, 5000))
        gc.collect()
        heap, heap_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert live_tensors() == tensors
    assert resident_bytes() - rss < 16 * MiB
    assert heap < 256 * 1024, heap  # what the 2,000 traced updates left on the Python heap
    assert heap_peak < 8 * MiB, heap_peak
    assert container_sizes(stats) == attributes  # no attribute added, no container grown
    assert stats.state.shape == (STATE_SIZE,) and stats.state.grad_fn is None
    # The pool still holds its graphs; the statistics hold no part of them.
    pool.clear()
    gc.collect()
    assert graph_refs and all(ref() is None for ref in graph_refs)
    # And the window after all that is still right.
    check = random_batch(rng, (4, 9))
    stats.reset()
    stats.update(*check.args()[:3])
    assert_metrics_close(stats.compute(), reference_metrics(check.rollout, check.old, check.mask))


# ---------------------------------------------------------------------- Trainer
STEPS = 2000
WARM = 300
EVERY = 5


class CycleDataset(Dataset):
    """``length`` items cycling through a small pool (no per-step allocation in the data)."""

    def __init__(self, pool: list[Any], length: int) -> None:
        self.pool, self.length = pool, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Any:
        return self.pool[index % len(self.pool)]


class LongRunModule(RolloutModule):
    """Returns ``old_log_probs`` attached to the model's graph; remembers weak references."""

    def __init__(self, pool: list[Any]) -> None:
        super().__init__(log_loss=True)
        self.pool = pool
        self.output_refs: list[weakref.ref[torch.Tensor]] = []

    def train_dataloader(self) -> DataLoader:
        return DataLoader(CycleDataset(self.pool, STEPS), batch_size=None, collate_fn=lambda b: b)

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        loss = self.layer(batch["x"]).pow(2).mean()
        self.log("loss", loss)
        output: dict[str, Any] = {"loss": loss}
        if "old_log_probs" in batch:
            old = batch["old_log_probs"] + 0.0 * self.layer.weight.sum()
            self.output_refs.append(weakref.ref(old))
            output["old_log_probs"] = old
        return output

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        pass


class CountingLogger(Logger):
    """Counts ``log_metrics`` calls and keeps only the last values (grows with nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.last: dict[str, float] = {}

    @property
    def name(self) -> str:
        return "counting"

    @property
    def version(self) -> int:
        return 0

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        if any(name.startswith("training/") for name in metrics):
            self.calls += 1
            self.last = dict(metrics)

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


class Probe(Callback):
    """Measures at the warm-up step and at the last one; checks graphs die every step."""

    def __init__(self, callback: RolloutDebugCallback) -> None:
        self.callback = callback
        self.measured: dict[str, dict[str, Any]] = {}
        self.graphs_alive = 0

    def _measure(self, trainer: pl.Trainer, module: LongRunModule) -> dict[str, Any]:
        return {
            "tensors": live_tensors(),
            "rss": resident_bytes(),
            "callback": container_sizes(self.callback),
            "callback_metrics": len(trainer.callback_metrics),
        }

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        refs = pl_module.output_refs
        # The step before last is over: nothing may keep its graph (the last one is
        # still referenced by Lightning's `outputs` of this hook).
        if len(refs) >= 3 and refs[-3]() is not None:
            self.graphs_alive += 1
        step = batch_idx + 1
        if step in (WARM, STEPS):
            self.measured["warm" if step == WARM else "end"] = self._measure(trainer, pl_module)


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
def test_two_thousand_trainer_steps_keep_constant_memory() -> None:
    pool: list[Any] = [make_batch(2, 3 + i % 4, seed=300 + i, index=i) for i in range(16)]
    pool[5] = {k: v for k, v in pool[5].items() if k != "old_log_probs"}  # bad: missing key
    pool[11] = {**pool[11], "response_mask": pool[11]["response_mask"].tolist()}  # bad: list
    module = LongRunModule(pool)
    callback = RolloutDebugCallback(log_every_n_steps=EVERY)
    probe, logger = Probe(callback), CountingLogger()
    trainer = pl.Trainer(
        logger=logger,
        callbacks=[callback, probe],
        max_epochs=1,
        log_every_n_steps=50,
        **TRAINER_DEFAULTS,
    )
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(module)

    assert trainer.global_step == STEPS
    assert logger.calls == STEPS // EVERY
    skipped = [str(w.message) for w in record if issubclass(w.category, RolloutDebugWarning)]
    assert len(skipped) == 2, skipped  # one per kind, however often the kind recurs
    assert callback.monitor._warned == {"missing:old_log_probs", "type:response_mask"}
    assert probe.graphs_alive == 0
    warm, end = probe.measured["warm"], probe.measured["end"]
    assert end["tensors"] == warm["tensors"], (warm["tensors"], end["tensors"])
    # The open alert episodes follow the data (at most one per alerted metric); nothing else
    # the callback holds (list, set, dict or state) may change size.
    active = "monitor._alerts._active"
    for sizes in (warm["callback"], end["callback"]):
        assert sizes.pop(active) <= len(callback.config.alert_ranges)
    assert end["callback"] == warm["callback"]
    assert end["callback_metrics"] == warm["callback_metrics"]
    assert end["rss"] - warm["rss"] < 32 * MiB, (end["rss"] - warm["rss"]) / MiB
    assert callback.monitor.batches_in_window == 0  # the last window was logged at step 2000
    refs = module.output_refs
    del trainer, module
    gc.collect()
    assert refs and all(ref() is None for ref in refs)
