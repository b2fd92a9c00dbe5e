"""What each usual pipeline mistake looks like on the dashboard, and which diagnosis names it.

The setup of ``benchmarks/calibrate_alerts.py``'s ``realistic`` model, nothing downloaded:
a random-weight Hugging Face GPT-2 (4 layers, width 128, vocabulary 1024); its bf16 copy
samples with ``generate`` and a KV cache (the rollout engine, log-probs from its per-step
logits), the float32 model recomputes the log-probs with one forward pass (the trainer),
both through :func:`lightning_rollout_debug.response_log_probs`. Prompts are
in-distribution (the model continues two random ids, as natural text would be). A random
model almost never samples ``calibrate_alerts``' EOS id, so the EOS here is a token the
model samples now and then (the commonest one below 8% of a pilot batch): responses end
at different lengths and are padded after EOS, as an RL batch is.

Each scenario feeds the same windows (one batch of ``--batch`` sequences each) through a
fresh :class:`lightning_rollout_debug.RolloutDebugMonitor` and reports the median of each
metric over the windows (the most common ``alignment_lag``) and every diagnosis that
fired during the run:

* ``correct``: the pipeline as it should be (bf16 engine, fp32 trainer).
* ``shifted +1 (lp[:, P:])`` / ``shifted -1 (lp[:, P-2:-1])``: the per-token log-probs
  ``lp = log_softmax(logits[:, :-1]).gather(sequences[:, 1:])`` sliced one column late
  (padded with a 0 column to the response's width) or one column early.
* ``wrong token (logits[:, P:])``: the logits sliced from ``P`` and gathered at the
  response tokens themselves: each position scores the token it reads, not the next one.
  Not a shift, so the lag check cannot name it; the mismatch alerts catch it.
* ``padding, zero-filled``: the mask covers the padding after EOS, for which the engine
  wrote log-prob 0.0.
* ``padding, real log-probs``: the same mask, but the engine returned real log-probs
  for the pad steps (``generate``'s ``output_logits`` does): invisible in the mismatch
  metrics; ``+ pad_token_id`` is the same run with the monitor's ``pad_token_id``.
* ``prompt columns``: ``old_log_probs`` over the prompt and the response (``P + T``
  wide) with ``prompts`` in the batch: every batch is skipped, with the slice to take;
  ``no prompts``: the same without ``prompts`` (the skip still names the prompt as the
  likely cause); ``same width (lp[:, :T])``: the forward pass's log-probs of every token
  after the first sliced from their start to the response's width: the trainer's are
  ``P - 1`` positions late.
* ``top-k 50 engine``, ``top-k 5 engine``: the engine samples from the k most likely
  tokens and records the renormalised log-prob (``generate``'s processed ``scores``); the
  trainer the full one. This policy keeps almost all its mass in its top 50 (the KL that
  truncation causes, which k1 estimates, is tiny there); top 5 drops a few percent.
  ``full-distribution log-probs``: the top-5 engine records the log-probs of its full
  distribution (``generate``'s raw ``logits``) instead: the truncation is hidden.
* ``greedy decoding (top-k 1)``: the same engine at ``top_k=1``: it records 0.0 (the
  renormalised one-token distribution) at every step but those of tied bf16 logits
  (Hugging Face keeps the ties), where the trainer's log-prob of the argmax token is
  below -1 at the uncertain steps: the zeros the padding rule counts.
* ``raw rollout log-probs, temperature 0.7``: the engine samples at temperature 0.7 but
  records the log-probs of its raw logits (``generate``'s ``logits``, as engines that
  return log-probs before their sampling processors do); the trainer divides its logits
  by the temperature.
* ``top-k 50 in the trainer``: the engine samples from the full distribution, the
  trainer cuts its logits to their top 50 (masked to -inf) before the log-softmax: a
  sampled token outside them gets -inf.
* ``dropout 0.1``: the trainer recomputes in training mode with GPT-2's default dropout
  (``peaked``: of the peaked policy below, whose bf16 log-probs of 0.0 the noisy trainer
  doubts).
* ``stale weights (synced every 4 steps)``: the trainer's weights move along a fixed
  random direction at every step, as an optimizer's would; the engine is a bf16 copy
  refreshed at every 4th step (16 windows, one step each).
* ``correct, peaked (gain 12)``: a correct run of a more confident policy (largest
  logits ~30, like a trained LM's); shows whether healthy bf16 rounding of log p ~ 0 to
  exactly 0.0 reads as padding.

Run (about 150 s on two CPU cores with the defaults; ``--threads 1`` is the default, as
in ``calibrate_alerts.py``: these ops are too small to split)::

    python benchmarks/mistakes.py
    python benchmarks/mistakes.py --windows 16 --seed 1 --top-k 50,20,5
    python benchmarks/mistakes.py --messages

It prints a markdown table (columns: the un-prefixed metric names without ``rollout_`` /
``rollout_actor_``; ``stale_period``: its largest over the run), ready for
``docs/troubleshooting.md``; with ``--messages``, every warning each scenario gave.
"""

from __future__ import annotations

import argparse
import collections
import copy
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lightning_rollout_debug import RolloutDebugMonitor, RolloutDebugWarning, response_log_probs
from lightning_rollout_debug.checks.diagnosis import KINDS, RolloutDiagnosisWarning

sys.path.insert(0, str(Path(__file__).resolve().parent))
import calibrate_alerts

COLUMNS = {  # table column: logged metric name (un-prefixed)
    "probs_diff_mean": "rollout_probs_diff_mean",
    "pearson": "rollout_actor_probs_pearson_corr",
    "kl_k1": "rollout_actor_kl_k1",
    "kl_k3": "rollout_actor_kl_k3",
    "mult_prob_error": "rollout_actor_mult_prob_error",
    "alignment_lag": "rollout_alignment_lag",
    "zero_log_prob_tokens": "rollout_zero_log_prob_tokens",
    "actor_ppl": "actor_ppl",
    "stale_period": "rollout_stale_period",
}
PREFIX = "training/"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--windows", type=int, default=8, help="windows (batches) per scenario")
    parser.add_argument("--batch", type=int, default=16, help="sequences per window")
    parser.add_argument("--prompt-len", type=int, default=16, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=48, help="max response tokens")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and sampling")
    parser.add_argument(
        "--top-k", default="50,5", help="k of the truncated engines (a comma list: one row each)"
    )
    parser.add_argument("--dropout", type=float, default=0.1, help="p of the dropout scenario")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument(
        "--messages", action="store_true", help="print every diagnosis and skip warning"
    )
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------ rollouts
@dataclass
class Rollout:
    """One window: what the engine sampled, the trainer's logits, both sides' log-probs."""

    sequences: torch.Tensor  # [B, P + T]
    logits: torch.Tensor  # [B, P + T, V] the trainer's
    rollout: torch.Tensor  # [B, T] the engine's log-probs
    rollout_mask: torch.Tensor  # [B, T] response mask (up to the first EOS, pads out)
    old: torch.Tensor  # [B, T] the trainer's log-probs, correctly sliced


class Policy:
    """The tiny GPT-2 as rollout engine (bf16, KV cache) and trainer (fp32 forward)."""

    def __init__(self, args: argparse.Namespace, gain: float | None = None) -> None:
        self.args = args
        options = [
            *("--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens)),
            *("--seed", str(args.seed), "--batch", str(args.batch)),
            *(() if gain is None else ("--gain", str(gain))),
        ]
        config = calibrate_alerts.parse_args(options)
        torch.manual_seed(args.seed)
        windows = calibrate_alerts.HFWindows(config, "realistic")
        self.engine, self.trainer = windows.engine, windows.trainer
        self.vocab, self.pad = config.vocab, calibrate_alerts.PAD
        self.eos = calibrate_alerts.EOS
        tokens = self.sample(0, torch.Generator().manual_seed(args.seed)).sequences
        tokens = tokens[:, args.prompt_len :].flatten()
        ids, counts = tokens.unique(return_counts=True)
        counts[(ids == self.pad) | (counts > 0.08 * tokens.numel())] = 0
        self.eos = int(ids[counts.argmax()])

    @torch.no_grad()
    def sample(
        self,
        top_k: int,
        generator: torch.Generator,
        trainer: torch.nn.Module | None = None,
        temperature: float = 1.0,
        raw: bool = False,
        engine: torch.nn.Module | None = None,
    ) -> Rollout:
        """One window; ``top_k > 0``: the engine's log-probs are renormalised over the top k.

        The engine samples at ``temperature`` and records raw log-probs (its logits before
        the temperature); the trainer divides its logits by it. ``raw``: the engine records
        the log-probs of its full distribution even when it truncates. ``engine`` and
        ``trainer`` stand in for the policy's.
        """
        a = self.args
        seeds = torch.randint(2, self.vocab, (a.batch, 2), generator=generator)
        prompts = self.trainer.generate(
            seeds,
            attention_mask=torch.ones_like(seeds),
            do_sample=True,
            top_k=0,
            max_new_tokens=a.prompt_len - 2,
            min_new_tokens=a.prompt_len - 2,
            eos_token_id=self.eos,
            pad_token_id=self.pad,
        )
        out = (self.engine if engine is None else engine).generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            do_sample=True,
            top_k=top_k,
            top_p=1.0,
            temperature=temperature,
            max_new_tokens=a.new_tokens,
            output_logits=True,
            output_scores=True,
            return_dict_in_generate=True,
            eos_token_id=self.eos,
            pad_token_id=self.pad,
        )
        sequences = out.sequences
        steps = torch.stack(out.scores if top_k and not raw else out.logits, 1)  # after top-k
        ids = {"eos_token_id": self.eos, "pad_token_id": self.pad}
        rollout, mask = response_log_probs(steps, sequences, a.prompt_len, **ids)
        model = self.trainer if trainer is None else trainer
        logits = model(sequences, attention_mask=torch.ones_like(sequences)).logits
        old, _ = response_log_probs(logits / temperature, sequences, a.prompt_len, **ids)
        return Rollout(sequences, logits, rollout, mask, old)


# ------------------------------------------------------------------------------ mistakes
Batch = dict[str, torch.Tensor]


def shifted(r: Rollout, prompt: int, shift: int) -> torch.Tensor:
    """``lp[:, P:]`` padded with a 0 column (+1), or ``lp[:, P - 2 : -1]`` (-1)."""
    log_p = r.logits[:, :-1].float().log_softmax(-1)
    lp = log_p.gather(-1, r.sequences[:, 1:].unsqueeze(-1)).squeeze(-1)
    if shift == 1:
        return torch.nn.functional.pad(lp[:, prompt:], (0, 1))
    return lp[:, prompt - 2 : -1]


def wrong_token(r: Rollout, prompt: int) -> torch.Tensor:
    """``log_softmax(logits[:, P:])`` gathered at the response tokens themselves."""
    log_p = r.logits[:, prompt:].float().log_softmax(-1)
    return log_p.gather(-1, r.sequences[:, prompt:].unsqueeze(-1)).squeeze(-1)


def trainer_top_k(r: Rollout, prompt: int, k: int) -> torch.Tensor:
    """The trainer's log-probs with its logits cut to their top ``k`` (masked to -inf)."""
    logits = r.logits.float()
    cut = logits.masked_fill(logits < logits.topk(k, -1).values[..., -1:], -float("inf"))
    return response_log_probs(cut, r.sequences, prompt)[0]


def with_prompt(r: Rollout) -> torch.Tensor:
    """The log-prob of every token of the sequence (0 for the first): ``P + T`` wide."""
    log_p = r.logits[:, :-1].float().log_softmax(-1)
    lp = log_p.gather(-1, r.sequences[:, 1:].unsqueeze(-1)).squeeze(-1)
    return torch.nn.functional.pad(lp, (1, 0))


def prompt_sliced(r: Rollout, prompt: int) -> torch.Tensor:
    """The log-probs of every token after the first sliced from their start, ``lp[:, :T]``."""
    log_p = r.logits[:, :-1].float().log_softmax(-1)
    lp = log_p.gather(-1, r.sequences[:, 1:].unsqueeze(-1)).squeeze(-1)
    return lp[:, : r.rollout.shape[1]]


@dataclass
class Scenario:
    name: str
    batch: Callable[[Rollout, int], Batch]
    """The window's batch from a rollout and the prompt width."""
    top_k: int = 0
    temperature: float = 1.0
    dropout: float = 0.0
    gain: float | None = None
    monitor: dict[str, object] = field(default_factory=dict)
    raw: bool = False
    """The engine records the log-probs of its full distribution (raw logits)."""
    sync_every: int = 0
    """Stale weights: the trainer moves at every step, the engine is synced every this many."""


def plain(r: Rollout, prompt: int, old: torch.Tensor | None = None, **extra: torch.Tensor) -> Batch:
    return {
        "rollout_log_probs": r.rollout,
        "old_log_probs": r.old if old is None else old,
        "response_mask": r.rollout_mask,
        "responses": r.sequences[:, prompt:],
        **extra,
    }


def padding(r: Rollout, prompt: int, *, zero_filled: bool) -> Batch:
    """The mask left all ones: the padding after EOS (and sampled pad ids) count."""
    rollout = r.rollout.masked_fill(~r.rollout_mask, 0.0) if zero_filled else r.rollout
    batch = plain(r, prompt)
    batch.update(rollout_log_probs=rollout, response_mask=torch.ones_like(r.rollout_mask))
    return batch


def scenarios(args: argparse.Namespace) -> list[Scenario]:
    return [
        Scenario("correct", plain),
        Scenario("shifted +1 (`lp[:, P:]`)", lambda r, p: plain(r, p, shifted(r, p, 1))),
        Scenario("shifted -1 (`lp[:, P-2:-1]`)", lambda r, p: plain(r, p, shifted(r, p, -1))),
        Scenario("wrong token (`logits[:, P:]`)", lambda r, p: plain(r, p, wrong_token(r, p))),
        Scenario("padding, zero-filled", lambda r, p: padding(r, p, zero_filled=True)),
        Scenario("padding, real log-probs", lambda r, p: padding(r, p, zero_filled=False)),
        Scenario(
            "padding, real log-probs + `pad_token_id`",
            lambda r, p: padding(r, p, zero_filled=False),
            monitor={"pad_token_id": calibrate_alerts.PAD},
        ),
        Scenario(
            "prompt columns",
            lambda r, p: plain(r, p, with_prompt(r), prompts=r.sequences[:, :p]),
        ),
        Scenario("prompt columns, no prompts", lambda r, p: plain(r, p, with_prompt(r))),
        Scenario(
            "prompt columns, same width (`lp[:, :T]`)",
            lambda r, p: plain(r, p, prompt_sliced(r, p)),
        ),
        *(Scenario(f"top-k {k} engine", plain, top_k=int(k)) for k in args.top_k.split(",")),
        Scenario("top-k 5 engine, full-distribution log-probs", plain, top_k=5, raw=True),
        Scenario("greedy decoding (top-k 1)", plain, top_k=1),
        Scenario("raw rollout log-probs, temperature 0.7", plain, temperature=0.7),
        Scenario("top-k 50 in the trainer", lambda r, p: plain(r, p, trainer_top_k(r, p, 50))),
        Scenario(f"dropout {args.dropout:g}", plain, dropout=args.dropout),
        Scenario(f"dropout {args.dropout:g}, peaked", plain, dropout=args.dropout, gain=12.0),
        Scenario("stale weights (synced every 4 steps)", plain, sync_every=4),
        Scenario("correct, peaked (gain 12)", plain, gain=12.0),
    ]


# ------------------------------------------------------------------------------ runs
def with_dropout(model: torch.nn.Module, p: float) -> torch.nn.Module:
    """A copy of ``model`` with every dropout at ``p``, in training mode."""
    model = copy.deepcopy(model).train()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = p
    return model


def run(args: argparse.Namespace, scenario: Scenario, policy: Policy) -> dict[str, str]:
    monitor = RolloutDebugMonitor(
        histograms=False, worst_tokens_k=0, alert_ranges={}, **scenario.monitor
    )
    trainer = with_dropout(policy.trainer, scenario.dropout) if scenario.dropout else None
    drift = Drift(policy, scenario.sync_every, args.seed) if scenario.sync_every else None
    generator = torch.Generator().manual_seed(args.seed + 1)
    torch.manual_seed(args.seed + 1)  # generate() samples from the global generator
    values: dict[str, list[float]] = collections.defaultdict(list)
    windows = max(args.windows, 4 * scenario.sync_every)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if trainer is not None:
            monitor.check_dropout(trainer)
        for step in range(windows):
            engine = None
            if drift is not None:
                trainer, engine = drift.step(step)
            rollout = policy.sample(
                scenario.top_k, generator, trainer, scenario.temperature, scenario.raw, engine
            )
            monitor.update(scenario.batch(rollout, args.prompt_len))
            logged = monitor.log(step)
            for column, name in COLUMNS.items():
                if f"{PREFIX}{name}" in logged:
                    values[column].append(logged[f"{PREFIX}{name}"])
    fired = [kind for kind in KINDS if kind in monitor.diagnosed]
    messages = [str(w.message) for w in caught if w.category is RolloutDebugWarning]
    if any("includes the prompt" in message for message in messages):
        fired.append("prompt (batches skipped)")
    assert len([w for w in caught if w.category is RolloutDiagnosisWarning]) == len(
        monitor.diagnosed
    ), "one warning per kind"
    row = {"scenario": scenario.name}
    for column in COLUMNS:
        row[column] = summary(column, values[column])
    row["diagnoses"] = ", ".join(fired) or "none"
    said = [w for w in caught if w.category in (RolloutDebugWarning, RolloutDiagnosisWarning)]
    row["messages"] = "\n".join(dict.fromkeys(f"  - {w.message}" for w in said))
    return row


class Drift:
    """A trainer whose weights move along a fixed random direction at every step, and a
    bf16 engine synced with it every ``sync_every`` steps: stale weights in between."""

    def __init__(self, policy: Policy, sync_every: int, seed: int, size: float = 5e-4) -> None:
        self.trainer = copy.deepcopy(policy.trainer)
        generator = torch.Generator().manual_seed(seed + 7)
        self.direction = [
            size * torch.randn(p.shape, generator=generator) for p in self.trainer.parameters()
        ]
        self.engine = copy.deepcopy(policy.engine)
        self.sync_every = sync_every

    @torch.no_grad()
    def step(self, step: int) -> tuple[torch.nn.Module, torch.nn.Module]:
        """The trainer and the engine of ``step`` (the trainer moved, the engine synced)."""
        if step:
            for parameter, direction in zip(self.trainer.parameters(), self.direction, strict=True):
                parameter.add_(direction)
        if step % self.sync_every == 0:
            self.engine.load_state_dict(self.trainer.state_dict())
        return self.trainer, self.engine


def summary(column: str, values: list[float]) -> str:
    if not values:
        return "-"
    if column == "alignment_lag":
        return f"{collections.Counter(values).most_common(1)[0][0]:+.0f}"
    if column == "zero_log_prob_tokens":
        return f"{statistics.median(values):.0f}"
    if column == "stale_period":  # the run's series: named once it holds three periods
        return f"{max(values):.0f}"
    return f"{statistics.median(values):.4g}"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers.utils import logging

    logging.set_verbosity_error()
    start = time.perf_counter()
    policies: dict[float | None, Policy] = {}
    rows = []
    for scenario in scenarios(args):
        if scenario.gain not in policies:
            policies[scenario.gain] = Policy(args, scenario.gain)
        rows.append(run(args, scenario, policies[scenario.gain]))
    header = ["scenario", *COLUMNS, "diagnoses"]
    print(
        f"Tiny random GPT-2, bf16 `generate` engine vs fp32 trainer; {args.windows} windows of "
        f"{args.batch} sequences (prompt {args.prompt_len}, up to {args.new_tokens} new "
        f"tokens), seed {args.seed}; medians over the windows.\n"
    )
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for row in rows:
        print("| " + " | ".join(row[column] for column in header) + " |")
    print(f"\n({time.perf_counter() - start:.0f} s)")
    if args.messages:
        for row in rows:
            print(f"\n{row['scenario']}:\n{row['messages'] or '  (none)'}")


if __name__ == "__main__":
    main()
