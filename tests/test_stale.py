"""Stale weights: an engine synced every ``k`` steps while the policy trains is named, with ``k``.

A tiny GRPO-like loop in a real Trainer: a bigram policy trains with REINFORCE on the
tokens its rollout engine samples; the engine is a bf16 copy of the policy refreshed
every ``k`` optimizer steps (every step: a healthy on-policy loop). The engine's
log-probs of the tokens it sampled are ``rollout_log_probs``, the policy's (float32) are
``old_log_probs``. The per-batch mean ``|a - b|`` then rises at every step since a sync
and drops back at each: ``stale`` must be named with the period ``k`` within three periods,
whatever ``log_every_n_steps`` is, and ``rollout_stale_period`` logged; a loop synced
every step must log 0 and be named nothing. The series itself is checked against a float64
NumPy reference on both roads, merged across simulated ranks, and carried through a
checkpoint.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
import torch
from conftest import NEEDS_CXX
from lightning_helpers import TRAINER_DEFAULTS, MemoryLogger
from reference import stale_period
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_rollout_debug import MismatchStats, RolloutDebugCallback, RolloutDebugMonitor
from lightning_rollout_debug.checks.diagnosis import RolloutDiagnosisWarning
from lightning_rollout_debug.metrics import native
from lightning_rollout_debug.metrics.backends import add_batch
from lightning_rollout_debug.metrics.inputs import check_inputs
from lightning_rollout_debug.metrics.sawtooth import PERIODS, Series, _fitted, sawtooth
from lightning_rollout_debug.metrics.series import SERIES_LENGTH, MismatchSeries

pytestmark = [
    pytest.mark.filterwarnings("ignore:The '.*dataloader' does not have many workers"),
    pytest.mark.filterwarnings("ignore:`isinstance.treespec, LeafSpec.` is deprecated"),
    pytest.mark.filterwarnings("ignore:RolloutDebugCallback at step .* is outside"),
]

VOCAB, ROWS, WIDTH = 16, 16, 24
PERIOD = "training/rollout_stale_period"


def _pl() -> Any:
    import pytorch_lightning as pl

    return pl


class StaleLoop(_pl().LightningModule):
    """A bigram policy trained with REINFORCE on what a bf16 copy of it samples.

    The copy (the engine) is refreshed from the policy at every ``sync_every``-th optimizer
    step; the reward is the share of the target token in a response.
    """

    def __init__(self, steps: int, sync_every: int, seed: int = 0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.policy = nn.Parameter(2.0 * torch.randn(VOCAB, VOCAB, generator=generator))
        self.register_buffer("engine", self.policy.detach().to(torch.bfloat16))
        self.steps, self.sync_every, self.seed = steps, sync_every, seed

    def train_dataloader(self) -> DataLoader:
        return DataLoader([{"index": torch.tensor(i)} for i in range(self.steps)], batch_size=None)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam([self.policy], lr=0.05)

    def training_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> dict[str, Tensor]:
        if self.global_step % self.sync_every == 0:  # the weight sync
            self.engine.copy_(self.policy.detach())
        generator = torch.Generator().manual_seed(self.seed * 1000 + batch_idx)
        tokens = torch.zeros(ROWS, WIDTH + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, VOCAB, (ROWS,), generator=generator)
        with torch.no_grad():  # the engine samples in bf16 and records its log-probs
            for t in range(WIDTH):
                probs = self.engine[tokens[:, t]].float().softmax(-1)
                tokens[:, t + 1] = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
            rollout = _log_probs(self.engine.float(), tokens)
        log_p = _log_probs(self.policy, tokens)
        reward = (tokens[:, 1:] == 3).float().mean(1)
        loss = -((reward - reward.mean())[:, None] * log_p).mean()
        return {
            "loss": loss,
            "old_log_probs": log_p.detach(),
            "rollout_log_probs": rollout,
            "response_mask": torch.ones_like(rollout, dtype=torch.bool),
        }


def _log_probs(logits: Tensor, tokens: Tensor) -> Tensor:
    """The log-prob of each next token under the bigram ``logits``."""
    return logits[tokens[:, :-1]].log_softmax(-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)


def fit_loop(steps: int, sync_every: int, log_every_n_steps: int, seed: int = 0) -> Any:
    callback = RolloutDebugCallback(
        log_every_n_steps=log_every_n_steps, histograms=False, worst_tokens_k=0
    )
    logger = MemoryLogger()
    trainer = _pl().Trainer(
        logger=logger, callbacks=[callback], max_steps=steps, max_epochs=1, **TRAINER_DEFAULTS
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(StaleLoop(steps, sync_every, seed))
    named = [str(w.message) for w in caught if issubclass(w.category, RolloutDiagnosisWarning)]
    periods = {step: values[PERIOD] for step, values in logger.steps.items() if PERIOD in values}
    return callback, named, periods


@pytest.mark.parametrize("log_every_n_steps", [1, 4, 32])
@pytest.mark.parametrize("sync_every", [2, 5])
def test_an_engine_synced_every_k_steps_is_named_stale(
    sync_every: int, log_every_n_steps: int
) -> None:
    callback, named, periods = fit_loop(40, sync_every, log_every_n_steps)
    assert callback.monitor.diagnosed == {"stale"}, named
    (message,) = named
    assert message.startswith(f"RolloutDebugCallback: The mismatch rises for {sync_every} batches")
    assert f"rollout_stale_period = {sync_every})" in message
    assert "Check the weight sync and its timing" in message
    # Named at the first logged step whose series holds three periods, and logged after it.
    three = 3 * sync_every - 1  # the step of the batch that completes the third period
    first = min(step for step in periods if step >= three)
    assert all(value == 0.0 for step, value in periods.items() if step < three), periods
    assert all(value == sync_every for step, value in periods.items() if step >= first), periods


def test_a_loop_synced_every_step_is_not_stale() -> None:
    callback, named, periods = fit_loop(48, 1, 1)
    assert named == [] and callback.monitor.diagnosed == set()
    assert len(periods) == 48 and set(periods.values()) == {0.0}
    means = callback.monitor._series.read().means
    assert len(means) == 48 and 0 < max(means) < 0.01  # bf16 rounding alone


# ---------------------------------------------------------------------- the series
def offset_batch(offset: float, seed: int, rows: int = 8, width: int = 32) -> dict[str, Tensor]:
    """Log-probs and the trainer's ``offset`` nats above or below, by turns (k1 = 0): a mean
    ``|a - b|`` of ``offset``."""
    generator = torch.Generator().manual_seed(seed)
    rollout = torch.log(torch.rand(rows, width, generator=generator) * 0.5 + 0.05)
    signs = 1.0 - 2.0 * ((torch.arange(rows)[:, None] + torch.arange(width)) % 2)
    return {
        "rollout_log_probs": rollout,
        "old_log_probs": rollout + offset * signs,
        "response_mask": torch.ones(rows, width, dtype=torch.bool),
    }


SAW = [0.01, 0.02, 0.03, 0.04]
"""An engine synced every 4 steps: the mismatch of each batch since the sync."""


def feed(monitor: RolloutDebugMonitor, offsets: list[float], first: int = 0) -> list[str]:
    """One logged window per batch; the diagnosis warnings they gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, offset in enumerate(offsets):
            monitor.update(offset_batch(offset, first + i))
            monitor.log(first + i)
    return [str(w.message) for w in caught if issubclass(w.category, RolloutDiagnosisWarning)]


def test_the_series_survives_a_checkpoint() -> None:
    """Two periods before the checkpoint, one after: named at the third, as without one."""
    options: dict[str, Any] = {"alert_ranges": {}, "drift_factors": {}}
    before = RolloutDebugMonitor(**options)
    assert feed(before, SAW * 2) == []
    saved = before.state_dict()
    assert saved["series"].shape == (SERIES_LENGTH * 4,)
    resumed = RolloutDebugMonitor(**options)
    resumed.load_state_dict(saved)
    (message,) = feed(resumed, SAW, first=8)
    assert "rises for 4 batches and drops back, 2 times in the last 12 batches" in message
    fresh = RolloutDebugMonitor(**options)
    assert feed(fresh, SAW, first=8) == []  # one period alone: nothing to name
    damaged = dict(saved, series=saved["series"] * -1.0)
    with pytest.warns(UserWarning, match="the stale-weights series starts empty"):
        RolloutDebugMonitor(**options).load_state_dict(damaged)


def reference_sums(batch: Mapping[str, Tensor]) -> tuple[float, float, float]:
    """The float64 sums of ``|a - b|`` and ``(a - b)^2`` over a batch's counting tokens,
    and their number, in the series' order."""
    a = np.maximum(batch["old_log_probs"].double().numpy(), -20.0)
    b = np.maximum(batch["rollout_log_probs"].double().numpy(), -20.0)
    mask = batch["response_mask"].numpy().astype(bool)
    counting = mask & np.isfinite(a) & np.isfinite(b)
    r = (a - b)[counting]
    return float(np.abs(r).sum()), float(counting.sum()), float((r * r).sum())


@pytest.mark.parametrize(
    "compile",
    [None, False, pytest.param(True, marks=NEEDS_CXX)],
    ids=["kernel", "torch", "torch-compiled"],
)
def test_each_batch_is_kept_as_its_sums(
    compile: bool | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each road's batch as the series reads it: the kernel's packed state, a torch pass's
    row sums (eager: squares about each row's mean; compiled: plain squares, rows in lists)."""
    if compile:  # on a CPU, torch.compile where the kernel does not take the batch
        monkeypatch.setattr(native.passes, "_pass", lambda *args, **kwargs: None)
    batches = [offset_batch(0.01 * (i + 1), i, rows=3 + i, width=17) for i in range(5)]
    batches[2]["old_log_probs"][0, :4] = -50.0  # floored at -20
    batches[3]["rollout_log_probs"][1, 2] = math.nan  # does not count
    batches[4]["response_mask"][:, 9:] = False
    monitor = RolloutDebugMonitor(compile=compile, alert_ranges={}, drift_factors={})
    for batch in batches[:2]:
        monitor.update(batch)
    monitor.log(0)
    for batch in batches[2:]:
        monitor.update(batch)
    monitor.log(1)
    got = np.array(monitor._series.history)
    want = np.array([reference_sums(batch) for batch in batches])
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_a_batch_read_in_passes_is_one_entry() -> None:
    stats, series = MismatchStats(compile=False, chunk_tokens=64), MismatchSeries()
    batch = offset_batch(0.25, 0, rows=10, width=32)  # 320 tokens: 5 passes of 2 rows
    inputs = check_inputs(
        batch["rollout_log_probs"], batch["old_log_probs"], batch["response_mask"]
    )
    add_batch(inputs, None, stats=stats, extras=None, series=series)
    values = series.window_values(torch.device("cpu"))
    read = series.extend(values.tolist())
    assert read.means == pytest.approx([0.25], rel=1e-6)
    assert read.errors == pytest.approx([0.0], abs=1e-6)  # |r| = 0.25 on every token
    np.testing.assert_allclose(series.history, [reference_sums(batch)], rtol=1e-6)


def test_the_ranks_series_merge_to_the_whole_batches() -> None:
    """Each rank holds half the rows of every batch: merged, each batch's sums are whole."""
    batches = [offset_batch(0.01 * (i + 1), i, rows=6) for i in range(3)]
    ranks = []
    for rows in (slice(0, 2), slice(2, None)):
        monitor = RolloutDebugMonitor(alert_ranges={}, drift_factors={})
        for batch in batches:
            monitor.update({key: value[rows] for key, value in batch.items()})
        ranks.append(monitor._series.window_values(torch.device("cpu")))
    merged = MismatchSeries.merge_states(torch.stack(ranks))
    series = MismatchSeries()
    read = series.extend(merged.tolist())
    want = [reference_sums(b) for b in batches]
    np.testing.assert_allclose(series.history, want, rtol=1e-6)
    assert read.means == pytest.approx([0.01, 0.02, 0.03], rel=1e-5)


def test_the_series_keeps_its_last_batches() -> None:
    series = MismatchSeries()
    for window in range(3):  # three windows of 30 batches: the last 64 stay
        rows = [[float(window * 30 + i), 1.0, 0.0, 1.0] for i in range(30)]
        padding = [[0.0, 0.0, 0.0, 0.0]] * (SERIES_LENGTH - 30)
        read = series.extend([v for row in padding + rows for v in row])
    assert read.means == [float(i) for i in range(90 - SERIES_LENGTH, 90)]


@pytest.mark.parametrize(
    "means",
    [
        [0.01] * 30,
        [0.01, 0.011, 0.0105, 0.0102] * 6,  # a rise of 10%: noise
        [0.01 * (1 + 0.05 * i) for i in range(40)],  # mismatch that grows over training
        [0.01] * 20 + [0.05] * 20,  # a jump that stays
        [0.04, 0.03, 0.02, 0.01] * 5,  # a drop and a slow recovery
    ],
    ids=["flat", "small", "trend", "jump", "falling"],
)
def test_no_rise_and_drop_is_no_stale_weights(means: list[float]) -> None:
    assert sawtooth(Series(means)) is None


def test_a_rise_and_drop_is_found_at_three_periods_and_not_before() -> None:
    saw = [0.008, 0.017, 0.026, 0.035, 0.044] * 3
    assert sawtooth(Series(saw[:-1])) is None
    found = sawtooth(Series(saw))
    assert (found.period, found.drops, found.batches) == (5, 2, 15)
    assert found.trough == pytest.approx(0.008) and found.peak == pytest.approx(0.044)
    late = sawtooth(Series((saw * 2)[2:17]))  # starting mid-period
    assert late is not None and (late.period, late.drops) == (5, 3)
    holes = list(saw)
    holes[7] = math.nan  # a batch without tokens
    assert sawtooth(Series(holes)).period == 5


def test_a_rise_within_the_batches_noise_is_not_stale() -> None:
    """Batches whose mean a few far-off tokens carry (masked logits at the -20 floor): the
    same means rise and drop, but by less than four standard errors of each step."""
    means = [0.0228, 0.0839, 0.0217, 0.0489, 0.0222, 0.0428, 0.024]
    assert sawtooth(Series(means)).period == 2  # the means alone
    errors = [0.0016, 0.0398, 0.0014, 0.0211, 0.0013, 0.0208, 0.0014]
    assert sawtooth(Series(means, errors)) is None
    assert stale_period(means, errors) == 0.0


def test_the_period_is_the_references() -> None:
    """The float64 NumPy reference of docs/metrics.md, on rises and drops and on noise."""
    rng = np.random.default_rng(0)
    cases = []
    for period in (2, 3, 5, 8, 16):
        k = (np.arange(64) + rng.integers(period)) % period
        for rise, spread in ((4.0, 0.05), (1.0, 0.1), (0.6, 0.3)):
            noise = np.exp(spread * rng.standard_normal(64))
            cases.append(list(0.01 * (1 + rise * k / (period - 1)) * noise))
    cases += [list(0.01 * np.exp(0.3 * rng.standard_normal(40))) for _ in range(20)]
    periods = []
    for means in cases:
        errors = list(rng.uniform(0.0, 0.002, len(means)))
        for length in (6, 15, 24, 48, 64):
            found = sawtooth(Series(means[:length], errors[:length]))
            periods.append(0.0 if found is None else float(found.period))
            got = stale_period(means[:length], errors[:length])
            assert periods[-1] == got, (means[:length], found)
    assert 0 < sum(p > 0 for p in periods) < len(periods)


def test_the_phases_left_out_are_those_that_cannot_fit() -> None:
    """The search fits only the phases whose steps all rise and drop: on rises and drops,
    noise, trends and holes it finds what fitting every phase of every period finds."""
    rng = np.random.default_rng(5)
    found = 0
    for case in range(300):
        n, period = int(rng.integers(6, 65)), int(rng.integers(2, 17))
        k = (np.arange(n) + rng.integers(period)) % period
        rise = (0.0, 0.3, 1.0, 4.0)[case % 4]
        means = 0.01 * (1 + rise * k / (period - 1)) * np.exp(0.05 * rng.standard_normal(n))
        means[rng.random(n) < 0.05] = math.nan
        series = Series(list(means), list(rng.uniform(0.0, 0.0005, n)))
        every = [
            fit
            for p in PERIODS
            if n >= 3 * p
            for phase in range(p)
            if (fit := _fitted(series, p, phase)) is not None
        ]
        best = max(every, key=lambda fit: fit.fit, default=None)
        assert sawtooth(series) == best
        found += best is not None
    assert 0 < found < 300


def test_a_monitor_with_its_series_and_sample_pickles() -> None:
    """A spawned process gets the callback pickled: the series and the sample with it."""
    import pickle

    monitor = RolloutDebugMonitor(alert_ranges={}, drift_factors={})
    for i, offset in enumerate(SAW):
        monitor.update(offset_batch(offset, i))
    copied = pickle.loads(pickle.dumps(monitor))
    assert copied.log(0) == monitor.log(0)
    assert copied._series.history == monitor._series.history
