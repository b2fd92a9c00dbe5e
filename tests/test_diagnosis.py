"""The usual pipeline mistakes, each fed through a real Trainer, and the correct run.

Each mistake (log-probs shifted by one position, padding left in the mask, the prompt's
columns kept, truncated sampling in the engine, dropout in the recompute) must produce
its own :class:`~lightning_rollout_debug.checks.diagnosis.RolloutDiagnosisWarning` (once per
run and kind; :class:`~lightning_rollout_debug.checks.diagnosis.RolloutDiagnosisError` with
``strict=True``), and a correct run none. The realistic data come from a tiny random
GPT-2 (``benchmarks/calibrate_alerts.py``'s ``realistic`` model): a bf16 copy samples
with ``generate`` and its KV cache (the rollout engine), the float32 model recomputes the
log-probs with one forward pass (the trainer), both through
:func:`~lightning_rollout_debug.response_log_probs`; the mistakes are the real slicing
errors on those logits. The statistics behind the lag check are compared with the
float64 NumPy reference (``tests/reference.py``) and merged across simulated ranks.
"""

from __future__ import annotations

import contextlib
import math
import re
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from lightning_helpers import FEATURES, TRAINER_DEFAULTS, MemoryLogger, RolloutModule
from reference import reference_metrics
from torch import Tensor, nn

from lightning_rollout_debug import (
    MismatchStats,
    RolloutDebugCallback,
    RolloutDebugMonitor,
    RolloutDebugWarning,
    response_log_probs,
)
from lightning_rollout_debug.checks.diagnosis import (
    RolloutDiagnosisError,
    RolloutDiagnosisWarning,
    active_dropout,
    diagnose,
    lag_spreads,
)
from lightning_rollout_debug.metrics.formulas import Window, lag_correlations
from lightning_rollout_debug.metrics.layout import STATE, merge_states
from lightning_rollout_debug.metrics.shifts import LAGS, ShiftSample, lag_sums

pytestmark = [
    pytest.mark.filterwarnings("ignore:The '.*dataloader' does not have many workers"),
    pytest.mark.filterwarnings("ignore:The number of training batches .* is smaller than"),
    pytest.mark.filterwarnings("ignore:`isinstance.treespec, LeafSpec.` is deprecated"),
    pytest.mark.filterwarnings("ignore:Found .* module.* in eval mode at the start of training"),
    # Threshold alerts on mistaken data: what these tests check is the diagnosis.
    pytest.mark.filterwarnings("ignore:RolloutDebugCallback at step .* is outside"),
]

PREFIX = "training/"
LAG = f"{PREFIX}rollout_alignment_lag"
ZEROS = f"{PREFIX}rollout_zero_log_prob_tokens"
K1, K3 = f"{PREFIX}rollout_actor_kl_k1", f"{PREFIX}rollout_actor_kl_k3"
PROMPT, NEW_TOKENS, ROWS = 8, 24, 8
"""The GPT-2 rollouts: prompt width, response width, sequences per batch."""


# ---------------------------------------------------------------------- the tiny GPT-2
@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run the tiny model on one CPU thread: its ops are too small to split, and on a busy
    machine two threads ran the fixture 20x slower (as ``calibrate_alerts.py`` found)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@dataclass
class Rollout:
    """One batch of a tiny GPT-2: what the engine sampled and both sides' log-probs."""

    sequences: Tensor
    """``[B, P + T]`` prompt then response ids."""
    logits: Tensor
    """``[B, P + T, V]`` the float32 trainer's logits over ``sequences``."""
    rollout: Tensor
    """``[B, T]`` the bf16 engine's log-probs (``generate``'s per-step logits)."""
    old: Tensor
    """``[B, T]`` the trainer's log-probs, correctly sliced."""
    mask: Tensor
    """``[B, T]`` the response mask: up to the first EOS, pads out."""


class TinyGPT2:
    """The ``realistic`` model of ``benchmarks/calibrate_alerts.py``: bf16 engine, fp32 trainer."""

    def __init__(self, seed: int = 0) -> None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
        import calibrate_alerts

        self.eos, self.pad = calibrate_alerts.EOS, calibrate_alerts.PAD
        args = calibrate_alerts.parse_args(
            ["--prompt-len", str(PROMPT), "--new-tokens", str(NEW_TOKENS), "--seed", str(seed)]
        )
        self.vocab = args.vocab
        torch.manual_seed(seed)
        windows = calibrate_alerts.HFWindows(args, "realistic")
        self.engine, self.trainer = windows.engine, windows.trainer
        self.generator = torch.Generator().manual_seed(seed)
        # A random model almost never samples calibrate_alerts' EOS (1 of 1,024 ids): end
        # the responses at a token it samples now and then (the commonest one below 8% of
        # a pilot batch), so that rows end early and the masks are prefixes of every length.
        tokens = self.rollout().sequences[:, PROMPT:].flatten()
        ids, counts = tokens.unique(return_counts=True)
        counts[(ids == self.pad) | (counts > 0.08 * tokens.numel())] = 0
        self.eos = int(ids[counts.argmax()])

    def prompts(self) -> Tensor:
        """In-distribution prompts (as natural text is): the model continues two random ids."""
        seeds = torch.randint(2, self.vocab, (ROWS, 2), generator=self.generator)
        return self.trainer.generate(
            seeds,
            attention_mask=torch.ones_like(seeds),
            do_sample=True,
            top_k=0,
            max_new_tokens=PROMPT - 2,
            min_new_tokens=PROMPT - 2,
            eos_token_id=self.eos,
            pad_token_id=self.pad,
        )

    @torch.no_grad()
    @one_thread()
    def rollout(self) -> Rollout:
        prompts = self.prompts()
        out = self.engine.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            do_sample=True,
            top_k=0,
            top_p=1.0,
            max_new_tokens=NEW_TOKENS,
            output_logits=True,
            return_dict_in_generate=True,
            eos_token_id=self.eos,
            pad_token_id=self.pad,
        )
        sequences = out.sequences
        ids = {"eos_token_id": self.eos, "pad_token_id": self.pad}
        rollout, mask = response_log_probs(torch.stack(out.logits, 1), sequences, PROMPT, **ids)
        logits = self.trainer(sequences, attention_mask=torch.ones_like(sequences)).logits
        old, trainer_mask = response_log_probs(logits, sequences, PROMPT, **ids)
        assert torch.equal(mask, trainer_mask)
        return Rollout(sequences, logits, rollout, old, mask)

    @torch.no_grad()
    @one_thread()
    def one_token_rollout(self, engine: str) -> Rollout:
        """A batch of an engine that keeps one token per step and renormalises over it.

        ``"greedy"``: ``generate`` decodes greedily (the argmax of the bf16 logits) and
        the engine records the log-prob of that one-token distribution: 0.0 everywhere.
        ``"top-k 1"``: it samples with ``top_k=1`` and records ``generate``'s processed
        ``scores`` (Hugging Face keeps the tokens tied with the k-th logit, so a step of
        tied bf16 logits keeps two or three). The trainer scores the full distribution.
        """
        prompts = self.prompts()
        sampling = {"do_sample": False} if engine == "greedy" else {"do_sample": True, "top_k": 1}
        out = self.engine.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            top_p=1.0,
            max_new_tokens=NEW_TOKENS,
            output_logits=True,
            output_scores=True,
            return_dict_in_generate=True,
            eos_token_id=self.eos,
            pad_token_id=self.pad,
            **sampling,
        )
        sequences = out.sequences
        steps = torch.stack(out.scores if engine == "top-k 1" else out.logits, 1).float()
        if engine == "greedy":  # the one-token distribution: the argmax alone
            argmax = steps.argmax(-1, keepdim=True)
            steps = torch.full_like(steps, -math.inf).scatter(-1, argmax, 0.0)
        ids = {"eos_token_id": self.eos, "pad_token_id": self.pad}
        rollout, mask = response_log_probs(steps, sequences, PROMPT, **ids)
        logits = self.trainer(sequences, attention_mask=torch.ones_like(sequences)).logits
        old, _ = response_log_probs(logits, sequences, PROMPT, **ids)
        return Rollout(sequences, logits, rollout, old, mask)

    @torch.no_grad()
    @one_thread()
    def forward_log_probs(self, sequences: Tensor) -> tuple[Tensor, Tensor]:
        """``(engine, trainer)`` log-probs of the response of ``sequences``, full forwards."""
        sides = []
        for model in (self.engine, self.trainer):
            logits = model(sequences, attention_mask=torch.ones_like(sequences)).logits
            sides.append(response_log_probs(logits, sequences, PROMPT)[0])
        return sides[0], sides[1]


@pytest.fixture(scope="module")
def gpt2() -> TinyGPT2:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    with one_thread():
        return TinyGPT2()


@pytest.fixture(scope="module")
def rollouts(gpt2: TinyGPT2) -> list[Rollout]:
    """Four batches of the tiny GPT-2, shared by the tests of this module."""
    return [gpt2.rollout() for _ in range(4)]


def shifted_old(rollout: Rollout, shift: int) -> Tensor:
    """The trainer's log-probs sliced one position off: the real mistake, on real logits.

    ``lp = log_softmax(logits[:, :-1]).gather(sequences[:, 1:])`` holds in column ``j``
    the log-prob of token ``j + 1``, so the response's are ``lp[:, P - 1 :]``. ``+1``:
    ``lp[:, P:]``, padded with a 0 column to the response's width: ``old[t]`` is the
    log-prob of response token ``t + 1`` (the trainer's are one token early). ``-1``:
    ``lp[:, P - 2 : -1]``: ``old[t]`` is that of token ``t - 1`` (one token late).
    """
    log_p = rollout.logits[:, :-1].float().log_softmax(-1)
    lp = log_p.gather(-1, rollout.sequences[:, 1:].unsqueeze(-1)).squeeze(-1)
    if shift == 1:
        return torch.nn.functional.pad(lp[:, PROMPT:], (0, 1))
    return lp[:, PROMPT - 2 : -1]


def batch_of(
    rollout: Tensor, old: Tensor, mask: Tensor, seed: int = 0, **extra: Tensor
) -> dict[str, Tensor]:
    """A training batch of :class:`RolloutModule`: the rollout tensors and the model input."""
    rows = rollout.shape[0]
    x = torch.randn(rows, FEATURES, generator=torch.Generator().manual_seed(seed))
    return {
        "rollout_log_probs": rollout,
        "old_log_probs": old,
        "response_mask": mask,
        "x": x,
        **extra,
    }


def gpt2_batches(rollouts: Sequence[Rollout], shift: int = 0) -> list[dict[str, Tensor]]:
    return [
        batch_of(
            r.rollout,
            r.old if shift == 0 else shifted_old(r, shift),
            r.mask,
            seed=i,
            responses=r.sequences[:, PROMPT:],
        )
        for i, r in enumerate(rollouts)
    ]


# ---------------------------------------------------------------------- synthetic data
def sampled_batch(
    seed: int, *, top_k: int | None = None, rows: int = 16, width: int = 32, vocab: int = 32
) -> dict[str, Tensor]:
    """Real softmax distributions over a small vocabulary; the engine samples from them.

    With ``top_k`` the engine samples from the ``top_k`` most likely tokens renormalised
    and records that log-prob (truncated sampling); the trainer records the log-prob of
    the full distribution. Otherwise both record the full one. The engine's value carries
    bf16-like rounding noise; the mask is a prefix of random length per row.
    """
    generator = torch.Generator().manual_seed(seed)
    log_p = (2.5 * torch.randn(rows, width, vocab, generator=generator)).log_softmax(-1)
    k = vocab if top_k is None else top_k
    top = log_p.topk(k, -1).values
    choice = torch.multinomial(top.exp().reshape(-1, k), 1, generator=generator)
    old = top.gather(-1, choice.reshape(rows, width, 1)).squeeze(-1)
    rollout = old - top.logsumexp(-1) if top_k is not None else old.clone()
    rollout = rollout + 2e-3 * torch.randn(rows, width, generator=generator) * rollout.abs()
    rollout = rollout.clamp(max=0.0)
    lengths = torch.randint(width // 2, width + 1, (rows, 1), generator=generator)
    mask = torch.arange(width)[None, :] < lengths
    return batch_of(rollout, old, mask, seed)


# ---------------------------------------------------------------------- Trainer runs
class DropoutModule(RolloutModule):
    """:class:`RolloutModule` with a dropout layer in front (``p``, in eval mode if asked)."""

    def __init__(self, batches: Sequence[Any], p: float, *, eval_mode: bool = False) -> None:
        super().__init__(batches)
        self.dropout = nn.Dropout(p)
        if eval_mode:
            self.dropout.eval()

    def _loss(self, data: Mapping[str, Any]) -> Tensor:
        return self.layer(self.dropout(data["x"].float())).pow(2).mean()


class GPT2Module(RolloutModule):
    """:class:`RolloutModule` holding a GPT-2 with its default dropout (0.1), in training mode."""

    def __init__(self, batches: Sequence[Any]) -> None:
        super().__init__(batches)
        import transformers

        config = transformers.GPT2Config(
            vocab_size=64, n_positions=32, n_embd=16, n_layer=1, n_head=2
        )
        self.policy = transformers.GPT2LMHeadModel(config)


@dataclass
class Run:
    callback: RolloutDebugCallback
    logger: Any
    caught: list[warnings.WarningMessage]

    def diagnoses(self) -> list[str]:
        """The messages of the diagnosis warnings, in order."""
        return [
            str(w.message) for w in self.caught if issubclass(w.category, RolloutDiagnosisWarning)
        ]

    def skips(self) -> list[str]:
        """The warnings of skipped batches (not that of a window they all were)."""
        said = [str(w.message) for w in self.caught if w.category is RolloutDebugWarning]
        return [message for message in said if "of the window logged at step" not in message]

    def logged(self, name: str) -> list[float]:
        """The values of ``name`` at every logged step, in order."""
        steps = self.logger.steps
        return [steps[step][name] for step in sorted(steps) if name in steps[step]]


def fit(
    batches: Sequence[Mapping[str, Tensor]] = (),
    *,
    module: Any = None,
    log_every_n_steps: int = 100,
    **callback_kwargs: Any,
) -> Run:
    """One epoch of ``module`` (a :class:`RolloutModule` over ``batches`` by default)."""
    callback = RolloutDebugCallback(
        log_every_n_steps=log_every_n_steps,
        histograms=False,
        worst_tokens_k=0,
        **callback_kwargs,
    )
    logger = MemoryLogger()
    trainer = pl_trainer(callback, logger)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module if module is not None else RolloutModule(batches))
    return Run(callback, logger, caught)


def pl_trainer(callback: RolloutDebugCallback, logger: Any) -> Any:
    import pytorch_lightning as pl

    return pl.Trainer(logger=logger, callbacks=[callback], max_epochs=1, **TRAINER_DEFAULTS)


def one_with(messages: Sequence[str], keyword: str) -> str:
    """The one message containing ``keyword`` (the test fails if not exactly one)."""
    found = [message for message in messages if keyword in message]
    assert len(found) == 1, (keyword, messages)
    return found[0]


# ---------------------------------------------------------------------- the correct run
def test_the_tiny_gpt2_rollouts_are_realistic(rollouts: list[Rollout]) -> None:
    """bf16 engine vs fp32 trainer: close but not equal, peaked, a few EOS-ended rows."""
    old = torch.cat([r.old[r.mask] for r in rollouts])
    rollout = torch.cat([r.rollout[r.mask] for r in rollouts])
    assert old.numel() > 500
    assert 0 < (old - rollout).abs().mean() < 0.1
    assert 0.3 < old.exp().mean() < 0.95  # a peaked policy, not the uniform random one
    lengths = torch.cat([r.mask.sum(1) for r in rollouts])
    assert (lengths < NEW_TOKENS).sum() >= 4 and (lengths == NEW_TOKENS).sum() >= 4


@pytest.mark.parametrize("strict", [False, True], ids=["warn", "strict"])
def test_a_correct_gpt2_run_is_diagnosed_with_nothing(
    rollouts: list[Rollout], gpt2: TinyGPT2, strict: bool
) -> None:
    run = fit(
        gpt2_batches(rollouts),
        log_every_n_steps=2,
        strict=strict,
        pad_token_id=gpt2.pad,
        warn_dropout=True,
    )
    assert run.diagnoses() == []
    assert run.callback.monitor.diagnosed == set()
    assert run.logged(LAG) == [0.0, 0.0]
    assert run.logged(ZEROS) == [0.0, 0.0]


@pytest.mark.parametrize("strict", [False, True], ids=["warn", "strict"])
def test_a_correct_synthetic_run_is_diagnosed_with_nothing(strict: bool) -> None:
    """Full-distribution sampling with rounding noise and prefix masks (no transformers)."""
    run = fit([sampled_batch(seed) for seed in range(4)], log_every_n_steps=2, strict=strict)
    assert run.diagnoses() == []
    assert run.logged(LAG) == [0.0, 0.0]


@pytest.mark.parametrize(
    "trainer",
    [-3.814697265625e-06, -1e-4, -5e-3],
    ids=["fp32-rounding", "shifted-confident-token", "dropout-noise"],
)
def test_confident_tokens_rounded_to_zero_by_the_engine_are_not_padding(trainer: float) -> None:
    """The engine's log-prob of a token with p > 1 - 1e-5 rounds to 0.0 exactly.

    The fp32 trainer's is one float32 step below (-3.8e-6 beside logits near 30): seen on
    correct runs of the tiny GPT-2 (``calibrate_alerts.py`` ``realistic``: 1 token in
    7,680; gain 8: 4; gain 12: 12), and more often with a trained, peaked LM. With another
    mistake (a shift, dropout), the trainer's value there is another confident token's or
    a noisy one (-1e-4, -5e-3 in ``benchmarks/mistakes.py``). Padding's trainer log-probs
    are far from 0 (-7 to -28 there): only a trainer's log-prob below -1 counts.
    """
    batch = sampled_batch(0)
    confident = torch.zeros_like(batch["response_mask"])
    confident[:, 0] = True
    batch["rollout_log_probs"] = torch.where(confident, 0.0, batch["rollout_log_probs"])
    batch["old_log_probs"] = torch.where(confident, trainer, batch["old_log_probs"])
    run = fit([batch])
    assert run.diagnoses() == []


def test_confident_tokens_the_trainer_doubts_are_not_padding() -> None:
    """A bf16 engine records 0.0 for the tokens it is sure of; after an expert-routing flip
    or stale weights the trainer scores some of them below -1. They sit alone inside the
    rows, where padding never does: ``rollout_zero_log_prob_tokens`` counts them, but the
    padding rule does not name them."""
    batches, flipped = [], 0
    for seed in range(2):
        batch = sampled_batch(seed, width=64)
        mask = batch["response_mask"]
        followed = torch.nn.functional.pad(mask[:, 1:], (0, 1))  # not a row's last token
        spaced = (torch.arange(64) % 4 == 1)[None, :]  # no two side by side
        draw = torch.rand(mask.shape, generator=torch.Generator().manual_seed(10 + seed))
        chosen = mask & followed & spaced & (draw < 0.1)
        batch["rollout_log_probs"] = batch["rollout_log_probs"].masked_fill(chosen, 0.0)
        batch["old_log_probs"] = batch["old_log_probs"].masked_fill(chosen, -2.0)
        flipped += int(chosen.sum())
        batches.append(batch)
    assert flipped >= 25
    run = fit(batches)
    assert run.logged(ZEROS) == [float(flipped)]
    assert run.diagnoses() == []


def test_a_mask_one_token_too_long_over_zero_filled_padding_is_named() -> None:
    """The mask keeps one position past each response (a shifted attention mask): one
    zero-filled pad per ended row, the last token of its row, where padding puts it."""
    batch = sampled_batch(3, width=32)
    lengths = batch["response_mask"].sum(1, keepdim=True)
    columns = torch.arange(32)[None, :]
    pad = columns >= lengths
    batch["rollout_log_probs"] = batch["rollout_log_probs"].masked_fill(pad, 0.0)
    batch["old_log_probs"] = batch["old_log_probs"].masked_fill(pad, -9.0)
    batch["response_mask"] = columns < lengths + 1
    ended = int((lengths < 32).sum())
    assert ended >= 4
    run = fit([batch])
    message = one_with(run.diagnoses(), "padding")
    assert f"{ended} masked-in tokens whose rollout log-prob is exactly 0.0" in message
    assert f"{ended} of them right after another or last in their row" in message
    assert run.logged(ZEROS) == [float(ended)]


# ---------------------------------------------------------------------- misaligned
def rows_of(rollouts: Sequence[Rollout], ended: bool) -> list[Rollout]:
    """The rows of ``rollouts`` that end with EOS (``ended``) or run to the full width."""
    keep = torch.cat([r.mask.all(1) != ended for r in rollouts])

    def rows(name: str) -> Tensor:
        return torch.cat([getattr(r, name) for r in rollouts])[keep]

    return [Rollout(*(rows(name) for name in ("sequences", "logits", "rollout", "old", "mask")))]


@pytest.mark.parametrize(
    ("shift", "rows"),
    [
        (1, "eos-ended"),
        (1, "full"),
        (-1, "eos-ended"),
        (-1, "full"),
    ],
)
def test_log_probs_shifted_by_one_are_misaligned(
    rollouts: list[Rollout], shift: int, rows: str
) -> None:
    """``lp[:, P:]`` (+1) and ``lp[:, P - 2 : -1]`` (-1) on the tiny GPT-2's rows that end
    with EOS (as RL responses mostly do), or on those that ran to the full width."""
    data = rows_of(rollouts, ended=rows == "eos-ended")
    assert data[0].mask.shape[0] >= 4
    run = fit(gpt2_batches(data, shift))
    message = one_with(run.diagnoses(), "misaligned")
    assert f"shifted by {shift:+d}" in message
    assert f"one token {'early' if shift > 0 else 'late'}" in message
    assert "logits[:, P - 1 : -1]" in message
    # Pairs (a_t, b_(t+L)), a the trainer's: old[t] = rollout[t + 1] peaks at L = +1.
    assert set(run.logged(LAG)) == {float(shift)}
    assert run.callback.monitor.diagnosed == {"misaligned"}


def test_a_shift_in_a_window_of_confident_and_uncertain_responses_is_named() -> None:
    """Confident responses (log-probs near 0) beside uncertain ones (near -3): every lag
    correlates well through the spread between them, so the correlations alone miss the
    shift; the pairs' mean squared differences (NumPy, below) name it."""
    generator = torch.Generator().manual_seed(5)
    rows, width = 16, 48
    spread = torch.randn(rows, width, generator=generator).abs()
    confident = torch.arange(rows)[:, None] < 10
    rollout = torch.where(confident, -0.02 * spread, -3.0 - 0.6 * spread)
    trainer = rollout + 1e-3 * torch.randn(rows, width, generator=generator)
    old = torch.nn.functional.pad(trainer[:, 1:], (0, 1))  # lp[:, P:]: one token early
    mask = torch.ones(rows, width, dtype=torch.bool)
    mask[:, -1] = False  # the padded column
    stats = MismatchStats()
    stats.update(rollout, old, mask)
    window = Window(stats.state.tolist())
    correlations = lag_correlations(window)
    assert correlations[1] - correlations[0] < 0.25, correlations  # the correlations' margin
    a, b = old.double().numpy(), rollout.double().numpy()
    pair = (mask[:, :-1] & mask[:, 1:]).numpy()
    shifted = np.mean((a[:, :-1] - b[:, 1:])[pair] ** 2)
    unshifted = np.mean((a - b)[mask.numpy()] ** 2)
    spreads = lag_spreads(window)
    assert spreads[1] == pytest.approx(shifted, rel=1e-9)
    assert spreads[0] == pytest.approx(unshifted, rel=1e-9)
    (found,) = diagnose(window, stats.compute())
    assert found.kind == "misaligned" and "shifted by +1" in found.message
    assert f"differ by {shifted:.3g} (mean square)" in found.message
    assert f"against {unshifted:.3g} (the trainer's are one token early)" in found.message


def test_a_shift_over_certain_tokens_is_not_also_called_padding() -> None:
    """An engine writes 0.0 for the tokens it was certain of; shifted by one, the trainer's
    log-probs beside them are their neighbours', often below -1: what the padding rule
    counts. Under a shift the log-probs belong to other tokens, so only the shift is named."""
    generator = torch.Generator().manual_seed(6)
    rows, width = 16, 64
    certain = torch.rand(rows, width, generator=generator) < 0.6
    spread = torch.randn(rows, width, generator=generator).abs()
    rollout = torch.where(certain, 0.0, -2.0 - spread)
    trainer = rollout - 1e-4 * torch.rand(rows, width, generator=generator)
    mask = torch.ones(rows, width, dtype=torch.bool)
    mask[:, -1] = False  # the padded column
    found = {}
    for name, old in (
        ("aligned", trainer),
        ("shifted", torch.nn.functional.pad(trainer[:, 1:], (0, 1))),
    ):
        stats = MismatchStats()
        stats.update(rollout, old, mask)
        window = Window(stats.state.tolist())
        found[name] = ([d.kind for d in diagnose(window, stats.compute())], window)
    assert found["aligned"][0] == []
    kinds, window = found["shifted"]
    assert window["zero_rollout_log_prob"] > 100  # what the padding rule alone would name
    assert kinds == ["misaligned"]


@pytest.mark.parametrize("shift", [1, -1])
def test_the_shifted_log_probs_correlate_at_their_lag(rollouts: list[Rollout], shift: int) -> None:
    """What the rule reads: a correlation (within [-1, 1]) near 1 at the shift, small at 0.

    The pairs themselves correlate 0.9996 (NumPy over the pairs, below)."""
    stats = MismatchStats()
    pairs = []
    for r in rows_of(rollouts, ended=True):
        old = shifted_old(r, shift)
        stats.update(r.rollout, old, r.mask)
        both = r.mask[:, :-1] & r.mask[:, 1:]
        first, second = (
            (old[:, :-1], r.rollout[:, 1:]) if shift > 0 else (old[:, 1:], r.rollout[:, :-1])
        )
        pairs.append(torch.stack([first[both], second[both]]).double())
    assert np.corrcoef(torch.cat(pairs, 1).numpy())[0, 1] > 0.99
    correlations = lag_correlations(Window(stats.state.tolist()))
    assert all(-1.0 <= c <= 1.0 for c in correlations.values()), correlations
    assert correlations[shift] > 0.9, correlations
    assert correlations[0] < 0.5 and correlations[-shift] < 0.5, correlations


# ---------------------------------------------------------------------- padding
def padded(gpt2: TinyGPT2, rollout: Rollout, seed: int) -> tuple[Tensor, Tensor]:
    """``rollout``'s sequences ended early: pad ids after a random length per row."""
    generator = torch.Generator().manual_seed(seed)
    width = rollout.mask.shape[1]
    lengths = torch.randint(width // 3, width - 2, (ROWS, 1), generator=generator)
    after = torch.arange(width)[None, :] > lengths  # the response ends at `lengths`
    sequences = rollout.sequences.clone()
    sequences[:, PROMPT:][after] = gpt2.pad
    return sequences, after


def padding_of(ids: Tensor, mask: Tensor, pad: int) -> int:
    """The padding of ``docs/troubleshooting.md``, counted one row at a time: the masked pad
    ids after the row's last masked id of another token, each right after a pad id (the
    first of the run is an EOS)."""
    count = 0
    for row, kept in zip(ids.tolist(), mask.tolist(), strict=True):
        masked = [t for t, keep in enumerate(kept) if keep]
        last_other = max((t for t in masked if row[t] != pad), default=-1)
        count += sum(1 for t in masked if t > last_other and t > 0 and row[t - 1] == pad)
    return count


def test_zero_filled_padding_in_the_mask_is_named(gpt2: TinyGPT2, rollouts: list[Rollout]) -> None:
    """The engine wrote 0.0 for the pad positions, the trainer real log-probs; all masked in."""
    batches, padding = [], 0
    for i, r in enumerate(rollouts[:2]):
        sequences, after = padded(gpt2, r, seed=i)
        rollout, old = gpt2.forward_log_probs(sequences)
        rollout = rollout.masked_fill(after, 0.0)
        # Counted where the trainer's log-prob is below -1 (pads mostly are: -5 to -28).
        padding += int((after & (old < -1.0)).sum())
        mask = torch.ones_like(after)
        batches.append(batch_of(rollout, old, mask, seed=i, responses=sequences[:, PROMPT:]))
    assert padding > 0
    run = fit(batches)
    message = one_with(run.diagnoses(), "padding")
    assert f"{padding} masked-in tokens whose rollout log-prob is exactly 0.0" in message
    assert "Mask out every position after the first EOS" in message
    assert run.logged(ZEROS) == [float(padding)]
    assert run.callback.monitor.diagnosed == {"padding"}


@pytest.mark.parametrize("pad_token_id", [None, "pad"], ids=["no-pad-id", "pad-id"])
def test_pad_ids_in_the_mask_are_named_with_pad_token_id(
    gpt2: TinyGPT2, rollouts: list[Rollout], pad_token_id: str | None
) -> None:
    """The engine returned real log-probs for the pads (HF ``output_logits`` does): only
    ``pad_token_id`` can see them."""
    batches, pads = [], 0
    for i, r in enumerate(rollouts[:2]):
        sequences, after = padded(gpt2, r, seed=i)
        rollout, old = gpt2.forward_log_probs(sequences)
        mask = torch.ones_like(after)
        pads += padding_of(sequences[:, PROMPT:], mask, gpt2.pad)
        batches.append(batch_of(rollout, old, mask, seed=i, responses=sequences[:, PROMPT:]))
    run = fit(batches, pad_token_id=None if pad_token_id is None else gpt2.pad)
    assert run.logged(ZEROS) == [0.0]
    if pad_token_id is None:
        assert run.diagnoses() == []
        return
    message = one_with(run.diagnoses(), "padding")
    assert f"{pads} pad tokens inside the response mask" in message
    assert "exactly 0.0" not in message


@pytest.mark.parametrize("extra", [0, 1, 3], ids=["correct-mask", "one-more", "three-more"])
def test_a_pad_id_that_is_also_the_eos_counts_once_per_row(extra: int) -> None:
    """Tokenizers that pad with their EOS id (Llama, Qwen, GPT-2): the mask that keeps the
    first EOS is correct; each masked position after it is padding."""
    eos = 7
    generator = torch.Generator().manual_seed(3)
    lengths = torch.arange(8) * 4 + 20  # each response ends with its EOS at lengths - 1
    ids = torch.randint(8, 50, (8, 64), generator=generator)
    columns = torch.arange(64)[None, :]
    ids[columns >= lengths[:, None] - 1] = eos
    mask = columns < lengths[:, None] + extra
    rollout = torch.log(torch.rand(8, 64, generator=generator) * 0.9 + 0.05)
    old = rollout + 1e-3 * torch.randn(8, 64, generator=generator)
    logger = MemoryLogger()
    monitor = RolloutDebugMonitor(pad_token_id=eos, alert_ranges={}, drift_factors={})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor.update(
            {"rollout_log_probs": rollout, "old_log_probs": old},
            {"response_mask": mask, "responses": ids},
        )
        monitor.log(0, logger)
    named = [str(w.message) for w in caught if issubclass(w.category, RolloutDiagnosisWarning)]
    if extra == 0:
        assert named == [] and monitor.diagnosed == set()
    else:
        (message,) = named
        assert f"{8 * extra} pad tokens inside the response mask" in message


@pytest.mark.parametrize("padding", [0, 2], ids=["correct-mask", "two-more"])
def test_packed_rows_that_end_each_sequence_with_the_pad_id_are_not_padding(
    padding: int,
) -> None:
    """Three sequences back to back in each row (or three turns of a conversation), each
    ending with the EOS id the tokenizer also pads with: an EOS inside the mask is no
    padding. Only pad ids right after one are: those a mask keeps past the last EOS."""
    eos = 7
    generator = torch.Generator().manual_seed(4)
    ids = torch.randint(8, 50, (6, 64), generator=generator)
    ends = torch.tensor([11, 27, 40])  # the three sequences' EOS positions
    ids[:, ends] = eos
    ids[:, 41:] = eos  # the padding after the last sequence
    mask = torch.arange(64)[None, :].expand(6, 64) < 41 + padding
    rollout = torch.log(torch.rand(6, 64, generator=generator) * 0.9 + 0.05)
    old = rollout + 1e-3 * torch.randn(6, 64, generator=generator)
    monitor = RolloutDebugMonitor(pad_token_id=eos, alert_ranges={}, drift_factors={})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor.update(
            {"rollout_log_probs": rollout, "old_log_probs": old},
            {"response_mask": mask, "responses": ids},
        )
        monitor.log(0, MemoryLogger())
    named = [str(w.message) for w in caught if issubclass(w.category, RolloutDiagnosisWarning)]
    if padding == 0:
        assert named == [] and monitor.diagnosed == set()
    else:
        (message,) = named
        assert f"{6 * padding} pad tokens inside the response mask" in message


@pytest.mark.parametrize("extra", [0, 2], ids=["correct-mask", "two-more"])
@pytest.mark.parametrize(
    ("compile", "dtype"),
    [(None, torch.float32), (False, torch.float32), (True, torch.float64)],
    ids=["kernel", "eager", "compiled"],
)
def test_pad_ids_the_model_sampled_mid_response_are_not_padding(
    extra: int, compile: bool | None, dtype: torch.dtype
) -> None:
    """``pad_token_id`` set, as the docs advise, and a model that sampled the pad id as an
    ordinary token before its response ended (once, and three times in a row): no padding.
    Only the run of pad ids that ends a row's masked tokens is, counted exactly on every
    road (the kernel's float32, torch eager, torch compiled on float64)."""
    eos = 7
    generator = torch.Generator().manual_seed(5)
    lengths = torch.arange(6) * 5 + 30  # each response ends with its EOS at lengths - 1
    ids = torch.randint(8, 50, (6, 64), generator=generator)
    ids[:, 4] = eos  # sampled alone
    ids[:, 10:13] = eos  # sampled three times in a row: pad ids right after a pad id
    columns = torch.arange(64)[None, :]
    ids[columns >= lengths[:, None] - 1] = eos
    mask = columns < lengths[:, None] + extra
    uniform = torch.rand(6, 64, generator=generator, dtype=torch.float64)
    rollout = torch.log(uniform * 0.9 + 0.05)
    old = rollout + 1e-3 * torch.randn(6, 64, generator=generator, dtype=torch.float64)
    assert padding_of(ids, mask, eos) == 6 * extra  # the old rule counted 12 more
    monitor = RolloutDebugMonitor(
        pad_token_id=eos,
        groups=["seed", "health"],
        histograms=False,
        worst_tokens_k=0,
        profile_images=False,
        compile=compile,
        alert_ranges={},
        drift_factors={},
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor.update(
            {"rollout_log_probs": rollout.to(dtype), "old_log_probs": old.to(dtype)},
            {"response_mask": mask, "responses": ids},
        )
        assert monitor.state_dict()["window"][STATE.at["pad_in_mask"]].item() == 6 * extra
        monitor.log(0, MemoryLogger())
    named = [str(w.message) for w in caught if issubclass(w.category, RolloutDiagnosisWarning)]
    if extra == 0:
        assert named == [] and monitor.diagnosed == set()
    else:
        (message,) = named
        assert f"{6 * extra} pad tokens inside the response mask" in message


# ---------------------------------------------------------------------- prompt columns
@pytest.mark.parametrize("columns", ["all", "after-the-first"])
@pytest.mark.parametrize("source", ["prompts", "attention_mask", "prompt_attention_mask", None])
def test_log_probs_with_the_prompt_columns_are_skipped_with_the_slice(
    rollouts: list[Rollout], source: str | None, columns: str
) -> None:
    r = rollouts[0]
    log_p = r.logits.float().log_softmax(-1)[:, :-1]
    every = log_p.gather(-1, r.sequences[:, 1:].unsqueeze(-1)).squeeze(-1)  # [B, P + T - 1]
    # [B, P + T]: a column for the first token too; or the forward pass's log-probs as they are.
    whole = torch.nn.functional.pad(every, (1, 0)) if columns == "all" else every
    width = r.mask.shape[1]
    extra = {}
    if source == "prompts":
        extra["prompts"] = r.sequences[:, :PROMPT]
    elif source == "attention_mask":
        extra["attention_mask"] = torch.ones_like(r.sequences)
    elif source == "prompt_attention_mask":  # the prompt's own mask, as its tokenizer gave it
        extra["attention_mask"] = torch.ones_like(r.sequences[:, :PROMPT])
    run = fit([batch_of(r.rollout, whole, r.mask, **extra)])
    skipped = [message for message in run.skips() if "old_log_probs" in message]
    assert len(skipped) == 1, run.skips()
    assert f"`old_log_probs[:, -{width}:]`" in skipped[0]
    assert "The batch is skipped" in skipped[0]
    assert run.diagnoses() == []
    # The slice it names is the correct run's log-probs.
    torch.testing.assert_close(whole[:, -width:], r.old)
    if source is None:  # no width to confirm it: the prompt is the likely cause
        more = whole.shape[1] - width
        assert (
            f"`old_log_probs` has {more} more columns than `rollout_log_probs`: it likely "
            "includes the prompt's (log-probs of the whole sequence, prompt and response)"
        ) in skipped[0]
        return
    assert "`old_log_probs` looks like it includes the prompt" in skipped[0]
    if columns == "all":
        assert f"{PROMPT} columns wider, the prompt's width." in skipped[0]
    else:
        assert f"{PROMPT - 1} columns wider, the prompt's width less one" in skipped[0]


def whole_log_probs(rollout: Rollout, first: bool) -> Tensor:
    """The log-probs of every token of the sequence after the first (``[B, P + T - 1]``), as
    a forward pass gives them; with ``first``, a 0 column for the first token too."""
    log_p = rollout.logits[:, :-1].float().log_softmax(-1)
    every = log_p.gather(-1, rollout.sequences[:, 1:].unsqueeze(-1)).squeeze(-1)
    return torch.nn.functional.pad(every, (1, 0)) if first else every


@pytest.mark.parametrize("first", [False, True], ids=["every-token-after-the-first", "all"])
def test_prompt_columns_of_the_responses_width_are_named(
    rollouts: list[Rollout], first: bool
) -> None:
    """``lp[:, :T]``: the right width, the prompt's columns kept and the response's last
    dropped. The trainer's log-probs are ``P - 1`` (``P``) positions late: the window's
    sample names it, the slice to take with it, and nothing else."""
    width = rollouts[0].mask.shape[1]
    batches = [
        batch_of(r.rollout, whole_log_probs(r, first)[:, :width], r.mask, seed=i)
        for i, r in enumerate(rollouts[:2])
    ]
    run = fit(batches)
    late = PROMPT if first else PROMPT - 1
    assert run.callback.monitor.diagnosed == {"prompt"}, run.diagnoses()
    message = one_with(run.diagnoses(), "positions late")
    assert f"The trainer's log-probs look {late} positions late" in message
    assert f"rollout_log_probs[:, t - {late}]" in message
    assert "Take the response's columns: lp[:, -T:]" in message
    torch.testing.assert_close(whole_log_probs(rollouts[0], first)[:, -width:], rollouts[0].old)


def test_log_probs_early_by_several_positions_are_misaligned(rollouts: list[Rollout]) -> None:
    """``lp[:, P + 2 :]``: three positions early, padded to the response's width."""
    width = rollouts[0].mask.shape[1]
    batches = []
    for i, r in enumerate(rollouts[:2]):
        early = whole_log_probs(r, first=False)[:, PROMPT + 2 :]
        early = torch.nn.functional.pad(early, (0, width - early.shape[1]))
        batches.append(batch_of(r.rollout, early, r.mask, seed=i))
    run = fit(batches)
    assert run.callback.monitor.diagnosed == {"misaligned"}, run.diagnoses()
    message = one_with(run.diagnoses(), "positions early")
    assert "The trainer's log-probs look 3 positions early" in message


def reference_lag_sums(batch: Mapping[str, Tensor], lag: int) -> tuple[float, ...]:
    """The sums over the pairs ``(a_t, b_(t+lag))`` of one row that both count, in float64."""
    a = np.maximum(batch["old_log_probs"].double().numpy(), -20.0)
    b = np.maximum(batch["rollout_log_probs"].double().numpy(), -20.0)
    counts = (batch["response_mask"].numpy() != 0) & np.isfinite(a) & np.isfinite(b)
    pairs = [
        (a[row, t], b[row, t + lag])
        for row in range(min(a.shape[0], 8))
        for t in range(a.shape[1])
        if 0 <= t + lag < a.shape[1] and counts[row, t] and counts[row, t + lag]
    ]
    x = np.array([p[0] for p in pairs]).reshape(-1)
    y = np.array([p[1] for p in pairs]).reshape(-1)
    return (len(pairs), x.sum(), y.sum(), (x * x).sum(), (y * y).sum(), (x * y).sum())


def test_the_samples_lag_sums_are_the_references_and_merge_over_ranks() -> None:
    """Every lag up to half the sample's width, from the window's first batch alone; two
    ranks' samples add up."""
    batches = [sampled_batch(seed, width=40) for seed in range(3)]
    batches[0]["old_log_probs"][1, 3] = -math.inf  # floored at -20
    batches[0]["rollout_log_probs"][2, 5] = math.nan  # does not count
    monitors = [RolloutDebugMonitor(alert_ranges={}, drift_factors={}) for _ in range(2)]
    for monitor in monitors:
        for batch in batches:  # the later batches add nothing to the sample
            monitor.update(batch)
    vectors = [monitor._shifts.window_values(torch.device("cpu")) for monitor in monitors]
    sums = lag_sums(vectors[0].tolist())
    for lag in range(-LAGS, LAGS + 1):
        want = reference_lag_sums(batches[0], lag) if abs(lag) <= 20 else (0,) * 6
        np.testing.assert_allclose(sums[lag], want, rtol=1e-9, atol=1e-9, err_msg=str(lag))
    merged = lag_sums(ShiftSample.merge_states(torch.stack(vectors)).tolist())
    np.testing.assert_allclose(merged[-3], 2 * np.array(sums[-3]), rtol=1e-12)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RolloutDiagnosisWarning)  # the -inf: masked logits
        monitors[0].log(0)  # a new window: a new sample, from its first batch
    monitors[0].update(batches[2])
    again = lag_sums(monitors[0]._shifts.window_values(torch.device("cpu")).tolist())
    np.testing.assert_allclose(again[2], reference_lag_sums(batches[2], 2), rtol=1e-9)


# ---------------------------------------------------------------------- truncated sampling
def test_renormalised_top_k_log_probs_are_named_truncated() -> None:
    run = fit([sampled_batch(seed, top_k=8) for seed in range(2)])
    message = one_with(run.diagnoses(), "truncat")
    assert "top-k / top-p" in message and "Sample without truncation" in message
    assert "correct with the importance ratio" in message and "k1 KL penalty" in message
    assert "Log-probs of the full distribution would hide the truncation" in message
    (k1,), (k3,) = run.logged(K1), run.logged(K3)
    assert k1 > 0.05 and k1 > 5 * k3
    assert run.callback.monitor.diagnosed == {"truncated"}


@pytest.mark.parametrize("top_k", [2, 3, 4])
def test_strong_truncation_is_named_with_the_mass_it_keeps(top_k: int) -> None:
    """An engine that keeps little of the mass makes k3 large too (k1 / k3 under 8): the
    mean importance ratio, clearly below 1, still names it, and the message gives it."""
    batches = [sampled_batch(seed, top_k=top_k) for seed in range(2)]
    ratios = np.concatenate(
        [
            np.exp(b["old_log_probs"].double().numpy() - b["rollout_log_probs"].double().numpy())[
                b["response_mask"].numpy() != 0
            ]
            for b in batches
        ]
    )
    run = fit(batches)
    message = one_with(run.diagnoses(), "truncat")
    assert f"The importance ratios average {ratios.mean():.4g}, clearly below 1" in message
    (k1,), (k3,) = run.logged(K1), run.logged(K3)
    assert k1 < 8 * k3  # beyond what the k1-against-k3 rule sees


@pytest.mark.parametrize("engine", ["greedy", "top-k 1"])
def test_a_greedy_engine_is_named_truncated_not_padding(gpt2: TinyGPT2, engine: str) -> None:
    """An engine that keeps one token per step records 0.0 (probability 1) where the
    trainer's log-prob is that of the argmax, below -1 at the uncertain steps: the zeros
    the padding rule counts. They are truncated sampling, not padding in the mask."""
    rollouts = [gpt2.one_token_rollout(engine) for _ in range(4)]
    rollout = torch.cat([r.rollout[r.mask] for r in rollouts])
    old = torch.cat([r.old[r.mask] for r in rollouts])
    zeros = int(((rollout == 0) & (old < -1.0)).sum())
    assert zeros > 0  # what the padding rule counted
    if engine == "greedy":
        assert torch.equal(rollout, torch.zeros_like(rollout))
    else:  # tied bf16 logits: a few steps kept more than one token
        assert 0 < int((rollout < 0).sum()) < 0.2 * rollout.numel()
    batches = [
        batch_of(r.rollout, r.old, r.mask, seed=i, responses=r.sequences[:, PROMPT:])
        for i, r in enumerate(rollouts)
    ]
    run = fit(batches, pad_token_id=gpt2.pad)
    assert run.logged(ZEROS) == [float(zeros)]
    assert run.callback.monitor.diagnosed == {"truncated"}, run.diagnoses()
    message = one_with(run.diagnoses(), "truncat")
    assert "greedy" in message and "top-k 1" in message
    assert "not padding" in message
    if engine == "greedy":
        assert "Every rollout log-prob is exactly 0.0" in message


def test_a_greedy_engine_of_confident_steps_names_no_padding() -> None:
    """Every rollout log-prob 0.0, every trainer's above -1: no zero the padding rule counts,
    and the message says nothing of padding."""
    generator = torch.Generator().manual_seed(5)
    old = -torch.rand(16, 32, generator=generator) * 0.9  # the argmax of confident steps
    stats = MismatchStats()
    stats.update(torch.zeros_like(old), old, torch.ones_like(old))
    found = diagnose(Window(stats.state.tolist()), stats.compute())
    assert [diagnosis.kind for diagnosis in found] == ["truncated"]
    assert "Every rollout log-prob is exactly 0.0" in found[0].message
    assert "padding" not in found[0].message


def tempered_batch(seed: int, *, rollout_side: str, trainer_side: str) -> dict[str, Tensor]:
    """The engine samples at temperature 0.7; each side reports the ``"raw"`` or the
    ``"tempered"`` log-prob of the sampled token (a prefix mask of random length)."""
    rows, width, vocab = 16, 32, 32
    generator = torch.Generator().manual_seed(seed)
    raw = (2.5 * torch.randn(rows, width, vocab, generator=generator)).log_softmax(-1)
    sides = {"raw": raw, "tempered": (raw / 0.7).log_softmax(-1)}
    choice = torch.multinomial(sides["tempered"].exp().reshape(-1, vocab), 1, generator=generator)
    picked = {k: v.gather(-1, choice.reshape(rows, width, 1)).squeeze(-1) for k, v in sides.items()}
    lengths = torch.randint(width // 2, width + 1, (rows, 1), generator=generator)
    mask = torch.arange(width)[None, :] < lengths
    return batch_of(picked[rollout_side], picked[trainer_side], mask, seed)


@pytest.mark.parametrize(
    ("rollout_side", "trainer_side", "named"),
    [("raw", "tempered", True), ("tempered", "raw", False), ("tempered", "tempered", False)],
    ids=["raw-engine", "raw-trainer", "both-tempered"],
)
def test_rollout_log_probs_of_another_distribution_are_named_one_sided(
    rollout_side: str, trainer_side: str, named: bool
) -> None:
    """An engine that samples with a temperature but records raw log-probs (the trainer
    applying the temperature) gives a k1 below 0, which no mismatch gives; the reverse
    is a real difference of distributions (k1 above 0), and is not named."""
    batches = [
        tempered_batch(s, rollout_side=rollout_side, trainer_side=trainer_side) for s in (0, 1)
    ]
    k1 = np.mean(
        np.concatenate(
            [
                (b["rollout_log_probs"].double() - b["old_log_probs"].double())[
                    b["response_mask"]
                ].numpy()
                for b in batches
            ]
        )
    )
    run = fit(batches)
    assert run.logged(K1) == [pytest.approx(k1, rel=1e-6, abs=1e-9)]
    if not named:
        assert "one_sided" not in run.callback.monitor.diagnosed, run.diagnoses()
        return
    assert k1 < -0.05
    message = one_with(run.diagnoses(), "clearly below 0")
    assert f"KL k1 = {k1:.4g} is clearly below 0" in message
    assert "records its log-probs before them" in message
    assert run.callback.monitor.diagnosed == {"one_sided"}


# ---------------------------------------------------------------------- masked logits
@pytest.mark.parametrize("top_k", [3, 8])
def test_a_trainer_that_masks_logits_the_engine_sampled_is_named(
    gpt2: TinyGPT2, rollouts: list[Rollout], top_k: int
) -> None:
    """The trainer applies top-k to its logits in the recompute; the engine sampled from
    the full distribution. Each sampled token outside the trainer's top k gets -inf."""
    batches, masked = [], 0
    for i, r in enumerate(rollouts[:2]):
        logits = r.logits.float()
        kth = logits.topk(top_k, -1).values[..., -1:]
        cut = logits.masked_fill(logits < kth, -math.inf)
        old, _ = response_log_probs(cut, r.sequences, PROMPT)
        masked += int((r.mask & (old == -math.inf)).sum())
        batches.append(batch_of(r.rollout, old, r.mask, seed=i, responses=r.sequences[:, PROMPT:]))
    assert masked >= 3
    run = fit(batches)
    message = one_with(run.diagnoses(), "log-prob of -inf")
    assert message.startswith(f"RolloutDebugCallback: {masked} sampled tokens have")
    assert "top-k / top-p / min-p applied in the recompute" in message
    assert "masked_logits" in run.callback.monitor.diagnosed


def test_zero_filled_padding_the_trainer_masks_is_padding_not_masked_logits() -> None:
    """A trainer that gives the pad id -inf, beside an engine's dummy 0.0: padding only."""
    batch = sampled_batch(4, width=32)
    lengths = batch["response_mask"].sum(1, keepdim=True)
    pad = torch.arange(32)[None, :] >= lengths
    assert pad.sum() >= 8
    batch["rollout_log_probs"] = batch["rollout_log_probs"].masked_fill(pad, 0.0)
    batch["old_log_probs"] = batch["old_log_probs"].masked_fill(pad, -math.inf)
    batch["response_mask"] = torch.ones_like(pad)
    run = fit([batch])
    assert run.callback.monitor.diagnosed == {"padding"}, run.diagnoses()


# ---------------------------------------------------------------------- dropout
def test_active_dropout_is_named_once_at_train_start() -> None:
    batches = [sampled_batch(seed) for seed in range(3)]
    run = fit(module=DropoutModule(batches, 0.1), log_every_n_steps=1)
    message = one_with(run.diagnoses(), "dropout")
    assert "1 dropout module(s)" in message and "(dropout)" in message
    assert "eval mode" in message and "warn_dropout=False" in message
    assert len(run.diagnoses()) == 1
    assert run.callback.monitor.diagnosed == {"dropout"}


def test_the_monitors_dropout_check_names_its_own_way_out() -> None:
    """The monitor has no ``warn_dropout``: its message says to leave the call out."""
    monitor = RolloutDebugMonitor()
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1))
    with pytest.warns(RolloutDiagnosisWarning) as caught:
        monitor.check_dropout(model)
    (message,) = [str(w.message) for w in caught]
    assert message.startswith("RolloutDebugMonitor: 1 dropout module(s)")
    assert "Leave out the check_dropout call" in message and "warn_dropout" not in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RolloutDebugMonitor().check_dropout(model.eval())  # in eval mode: nothing to say


@pytest.mark.parametrize("p", [0.3, 0.0])
def test_dropout_inside_attention_is_named(p: float) -> None:
    """Attention that drops its weights inside the call, without a dropout module."""
    model = nn.MultiheadAttention(16, 2, dropout=p)
    names = ["MultiheadAttention"] if p else []
    assert active_dropout(model) == names
    assert active_dropout(model.eval()) == []


def assert_it_drops(model: nn.Module) -> None:
    """Two forwards of a causal LM in training mode differ: its dropout does drop."""
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        noisy = [model(ids).logits for _ in range(2)]
    assert not torch.equal(*noisy)


def test_a_llama_with_attention_dropout_is_named() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        attention_dropout=0.3,
    )
    model = transformers.LlamaForCausalLM(config).train()
    assert_it_drops(model)
    names = active_dropout(model)
    assert names == [f"model.layers.{i}.self_attn" for i in range(2)], names
    assert active_dropout(model.eval()) == []


def test_a_falcon_with_hidden_dropout_is_named() -> None:
    """Falcon's layers drop their residual activations with a float attribute and a function
    (``dropout_add``), no dropout module: the attribute names them."""
    transformers = pytest.importorskip("transformers")
    config = transformers.FalconConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        hidden_dropout=0.1,
        attention_dropout=0.0,
    )
    model = transformers.FalconForCausalLM(config).train()
    assert_it_drops(model)
    names = active_dropout(model)
    # Each layer, and its submodules that keep the same setting.
    assert {f"transformer.h.{i}" for i in range(2)} <= set(names), names
    assert all(name.startswith("transformer.h.") for name in names), names
    assert active_dropout(model.eval()) == []


def test_a_gpt2_with_its_default_dropout_is_named() -> None:
    pytest.importorskip("transformers")
    run = fit(module=GPT2Module([sampled_batch(0)]))
    message = one_with(run.diagnoses(), "dropout")
    assert "4 dropout module(s)" in message  # embeddings; attention, residual, MLP of 1 layer


@pytest.mark.parametrize(
    ("p", "eval_mode", "warn_dropout"),
    [(0.1, False, False), (0.0, False, True), (0.1, True, True)],
    ids=["warn_dropout=False", "p=0", "eval-mode"],
)
def test_no_dropout_warning(p: float, eval_mode: bool, warn_dropout: bool) -> None:
    batches = [sampled_batch(seed) for seed in range(2)]
    module = DropoutModule(batches, p, eval_mode=eval_mode)
    run = fit(module=module, warn_dropout=warn_dropout, strict=True)
    assert run.diagnoses() == []


# ---------------------------------------------------------------------- strict
def zero_padded_batch(seed: int = 0) -> dict[str, Tensor]:
    """A synthetic batch whose last 5 columns are zero-filled padding, masked in (the
    trainer scores the pad tokens there: -12 nats)."""
    batch = sampled_batch(seed)
    batch["response_mask"] = torch.ones_like(batch["response_mask"])
    batch["rollout_log_probs"][:, -5:] = 0.0
    batch["old_log_probs"][:, -5:] = -12.0
    return batch


@pytest.mark.parametrize("kind", ["misaligned", "padding", "truncated", "dropout"])
def test_strict_raises_each_mistake_out_of_fit(request: pytest.FixtureRequest, kind: str) -> None:
    module: Any
    if kind == "misaligned":
        rollouts = request.getfixturevalue("rollouts")
        module = RolloutModule(gpt2_batches(rollouts[:2], shift=-1))
    elif kind == "padding":
        module = RolloutModule([zero_padded_batch()])
    elif kind == "truncated":
        module = RolloutModule([sampled_batch(0, top_k=8)])
    else:
        module = DropoutModule([sampled_batch(0)], 0.1)
    with pytest.raises(RolloutDiagnosisError, match=kind[:7]):
        fit(module=module, strict=True)


def test_strict_logs_the_window_before_it_raises() -> None:
    """The window a mistake is named from reaches the loggers first: its evidence stays."""
    logger = MemoryLogger()
    monitor = RolloutDebugMonitor(strict=True, alert_ranges={}, drift_factors={})
    monitor.update(zero_padded_batch())
    with pytest.raises(RolloutDiagnosisError, match="padding"):
        monitor.log(7, logger)
    assert logger.steps[7][ZEROS] == 5.0 * 16


# ---------------------------------------------------------------------- once per run
@pytest.mark.parametrize("kind", ["misaligned", "padding", "truncated"])
def test_each_kind_is_warned_once_per_run(request: pytest.FixtureRequest, kind: str) -> None:
    """Every window shows the mistake (one window per batch): one warning."""
    if kind == "misaligned":
        batches = gpt2_batches(request.getfixturevalue("rollouts"), shift=-1)
    elif kind == "padding":
        batches = [zero_padded_batch(seed) for seed in range(3)]
    else:
        batches = [sampled_batch(seed, top_k=8) for seed in range(3)]
    run = fit(batches, log_every_n_steps=1)
    assert len(run.logged(LAG)) == len(batches)
    if kind == "misaligned":
        assert run.logged(LAG) == [-1.0] * len(batches)
    if kind == "padding":
        assert run.logged(ZEROS) == [5.0 * 16] * len(batches)
    assert len(run.diagnoses()) == 1, run.diagnoses()
    assert run.callback.monitor.diagnosed == {kind}


# ---------------------------------------------------------------------- lag statistics
def lag_batches(seed: int) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """Batches of different widths, dtypes and masks whose log-probs correlate along t."""
    rng = np.random.default_rng(seed)
    rollouts, olds, masks = [], [], []
    for rows, width, kind in ((5, 17, "prefix"), (3, 1, "ones"), (7, 40, "random"), (2, 9, "none")):
        walk = np.cumsum(rng.normal(0.0, 0.7, (rows, width + 1)), axis=1)
        log_p = -np.abs(walk) - rng.exponential(0.5, (rows, width + 1))
        old = log_p[:, 1:] + rng.normal(0.0, 0.05, (rows, width))
        rollout = log_p[:, :-1] if kind == "random" else log_p[:, 1:]  # one batch shifted
        if kind == "prefix":
            mask = np.arange(width)[None, :] < rng.integers(0, width + 1, (rows, 1))
        elif kind == "random":
            mask = rng.random((rows, width)) < 0.8
        else:
            mask = np.full((rows, width), kind == "ones")
        rollouts.append(torch.from_numpy(rollout).to(torch.bfloat16))
        olds.append(torch.from_numpy(old).float())
        masks.append(torch.from_numpy(mask))
    return rollouts, olds, masks


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lag_correlations_equal_the_float64_reference(seed: int) -> None:
    rollouts, olds, masks = lag_batches(seed)
    stats = MismatchStats()
    for batch in zip(rollouts, olds, masks, strict=True):
        stats.update(*batch)
    got = lag_correlations(Window(stats.state.tolist()))
    want = reference_metrics(rollouts, olds, masks)
    assert set(got) == set(want.lags) == {-1, 0, 1}
    for lag, value in want.lags.items():
        assert not math.isnan(value)
        # Mixed dtypes take the torch arithmetic: its row sums are float32.
        assert got[lag] == pytest.approx(value, abs=1e-6), (lag, got, want.lags)
    assert stats.compute()["rollout_alignment_lag"] == want["rollout_alignment_lag"]


def test_lag_correlations_are_exact_across_ranks() -> None:
    """Per-batch windows (and rows of one batch split over two ranks) merge to one window."""
    rollouts, olds, masks = lag_batches(3)
    whole = MismatchStats()
    parts = []
    for batch in zip(rollouts, olds, masks, strict=True):
        whole.update(*batch)
        for rows in (slice(0, 1), slice(1, None)):  # rank 0 one row, rank 1 the rest
            part = MismatchStats()
            part.update(*(tensor[rows] for tensor in batch))
            parts.append(part.state)
    merged = Window(merge_states(torch.stack(parts)).tolist())
    single = Window(whole.state.tolist())
    for slot in ("neighbour_pairs", "sum_actor_x_next_rollout", "sum_next_actor_x_rollout"):
        assert merged[slot] == pytest.approx(single[slot], rel=1e-12, abs=1e-12)
    got, want = lag_correlations(merged), lag_correlations(single)
    assert got == pytest.approx(want, abs=1e-12)
    assert got == pytest.approx(reference_metrics(rollouts, olds, masks).lags, abs=1e-6)


def test_a_misaligned_rank_is_diagnosed_after_the_merge(rollouts: list[Rollout]) -> None:
    """The lag rule reads the merged window: two ranks of shifted GPT-2 batches."""
    states = []
    for r in rollouts[:2]:
        stats = MismatchStats()
        stats.update(r.rollout, shifted_old(r, -1), r.mask)
        states.append(stats.state)
    merged = MismatchStats.from_state(merge_states(torch.stack(states)))
    found = diagnose(Window(merged.state.tolist()), merged.compute())
    assert [d.kind for d in found] == ["misaligned"]
    assert merged.compute()["rollout_alignment_lag"] == -1.0


@pytest.mark.parametrize(
    ("responses", "why"),
    [
        (None, "the batch holds no token ids (`responses` or `token_ids_keys[0]`)"),
        (
            torch.zeros(4, 6, dtype=torch.long),
            "the batch's `responses` has shape (4, 6), not the mask's",
        ),
        (
            torch.zeros(4, 5),
            "the batch's `responses` has dtype torch.float32, not an integer dtype",
        ),
        ([[0] * 5] * 4, "the batch's `responses` is a list, not a tensor"),
    ],
    ids=["absent", "wrong-shape", "float", "list"],
)
def test_pad_token_id_without_usable_token_ids_says_why(responses: Any, why: str) -> None:
    generator = torch.Generator().manual_seed(5)
    rollout = torch.log(torch.rand(4, 5, generator=generator) * 0.9 + 0.05)
    extra = {} if responses is None else {"responses": responses}
    monitor = RolloutDebugMonitor(pad_token_id=0, alert_ranges={}, drift_factors={})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor.update({"rollout_log_probs": rollout, "old_log_probs": rollout - 1e-3}, extra)
        monitor.update({"rollout_log_probs": rollout, "old_log_probs": rollout - 1e-3}, extra)
    (message,) = [str(w.message) for w in caught if "pad_token_id" in str(w.message)]
    assert f"`pad_token_id=0` is set but {why}" in message and "not counted" in message
    assert monitor._stats.compute()["rollout_tokens"] == 40


# ---------------------------------------------------------------------- arguments
@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"pad_token_id": "0"}, "`pad_token_id` must be None or an int token id, got '0'"),
        ({"pad_token_id": True}, "`pad_token_id` must be None or an int token id, got True"),
        ({"warn_dropout": "yes"}, "`warn_dropout` must be True or False, got 'yes'"),
    ],
)
def test_diagnosis_arguments_are_validated(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        RolloutDebugCallback(**arguments)
