"""Calibrate the default alert ranges against healthy bf16-rollout / fp32-trainer mismatch.

What it measures: for each window (one batch of sampled sequences), the mismatch between a
bfloat16 rollout engine and a float32 trainer holding *the same weights* -- the mismatch a
correctly wired RL pipeline always has -- and, for every metric with a default alert range
(:data:`lightning_rollout_debug.DEFAULT_ALERT_RANGES`), its distribution over the windows
and how often the default range would fire.

The setup, nothing downloaded:

* the policy is a random-weight Hugging Face ``GPT2LMHeadModel`` built from a tiny config
  (dropout off, eval mode);
* rollout engine: a copy cast with ``.to(torch.bfloat16)`` samples with
  ``generate(do_sample=True, top_k=0, output_logits=True, ...)`` and its KV cache, at
  temperature 1; its per-step logits (bf16 values) give ``rollout_log_probs``;
* trainer: the float32 model recomputes ``old_log_probs`` with one full forward pass over
  the finished sequences;
* both go through :func:`lightning_rollout_debug.response_log_probs` (EOS counts, padding
  after it is masked) and :func:`lightning_rollout_debug.functional.mismatch_metrics`.

Model configs (``--configs``), vocabulary 1024 (``--vocab``); the logit gain multiplies the
final layer-norm weight, which scales every logit (GPT-2's LM head is tied and bias-free):

* ``flat``: GPT-2's default init (std 0.02), 2 layers, width 64, gain 1. Logits ~0.2 over
  the vocab, every token has probability ~1/V (entropy ~log V = 6.9 nats). Unrealistic:
  probabilities this small make ``probs_diff_mean`` and the Pearson correlation
  meaningless, and logits this small hide bf16 rounding, whose absolute error grows with
  the logit. Kept as the "random model" baseline the issue asked about.
* ``peaked``: ``flat`` with gain 16: largest logit ~14, entropy ~0.5 nat, 80% of sampled
  tokens with p > 0.9. But with std 0.02 the layers barely change the residual stream (it
  stays ~ the token embedding), so bf16 error does not build up with depth: a floor.
* ``realistic`` (the reference): init std 0.1 (~1/sqrt(width)), so every layer changes the
  residual stream by O(1) as in a trained network, 4 layers, width 128, gain 5: mean
  entropy 0.6-1.2 nats (by seed), mean sampled-token probability 0.5-0.75, largest logit
  ~20 (a trained LM's are ~20-40), and a multiplicative error of 1.016-1.03, inside the
  1.01-1.04 that NeMo-RL's model-validation guide lists for healthy HF/Megatron-vs-vLLM
  comparisons. (Random Gaussian logits are only peaked when large: ``--gain`` 8-12 gives
  entropy 0.3-0.5 nat with largest logits ~30-50; 20 gives ~80, beyond a real LM's.)
* ``deep``: ``realistic`` with 8 layers and gain 6: more bf16 rounding steps, mult
  error 1.03-1.04 (the top of NeMo-RL's healthy list; the issue's "median 1.04").
* ``bf16_trainer``: ``realistic`` with the trainer in bf16 too (an FSDP trainer whose LM
  head runs in bf16): both sides round the weights alike, so the mismatch is *smaller*
  (only the KV-cache decode vs. one full pass differ).
* ``fp32``: ``realistic`` with a float32 engine: the floor (KV cache vs. one full pass).
* ``example``: the untrained ``TinyCausalLM`` and bf16 ``RolloutEngine`` of
  ``examples/grpo_mismatch.py`` (vocabulary 16, no KV cache), if it imports.

Run (the default, flat + peaked + realistic at 100 windows, takes about 70 s on two CPU
cores; ``deep`` about 50 s more. ``--threads 1`` is the default: these ops are too small
to split, and two threads on a busy machine ran 20x slower)::

    python benchmarks/calibrate_alerts.py
    python benchmarks/calibrate_alerts.py --windows 200 --seed 1 --configs realistic,deep

Printed per config and alerted metric: the default range, the healthy median and the
p90 / p99 / worst window on the side the range guards (p10 / p1 / min for a lower bound),
the fraction of windows where the default fires, the longest run of consecutive firing
windows, and the fraction of windows that would fire under a "K consecutive windows" rule.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from pathlib import Path

import torch

from lightning_rollout_debug import DEFAULT_ALERT_RANGES, response_log_probs
from lightning_rollout_debug.functional import mismatch_metrics

CONFIGS = ("flat", "peaked", "realistic", "deep", "bf16_trainer", "fp32", "example")
EOS, PAD = 1, 0
Window = tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]
"""``(rollout_log_probs, old_log_probs, response_mask, trainer profile)`` of one window."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--windows", type=int, default=100, help="windows (batches) per config")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights, prompts, sampling")
    parser.add_argument(
        "--configs", default="flat,peaked,realistic", help=f"comma list of {CONFIGS}"
    )
    parser.add_argument("--batch", type=int, default=16, help="sequences per window")
    parser.add_argument("--new-tokens", type=int, default=48, help="max response tokens")
    parser.add_argument("--prompt-len", type=int, default=16, help="prompt tokens")
    parser.add_argument("--vocab", type=int, default=1024, help="vocabulary size")
    parser.add_argument(
        "--gain", type=float, default=None, help="override the configs' logit gain (sweeps)"
    )
    parser.add_argument("--consecutive", type=int, default=3, help="K of the K-windows rule")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (tiny ops: 1 is fastest)"
    )
    args = parser.parse_args(argv)
    unknown = set(args.configs.split(",")) - set(CONFIGS)
    if unknown:
        parser.error(f"unknown configs {sorted(unknown)}; choose from {CONFIGS}")
    return args


# ------------------------------------------------------------------------------ engines


MODELS = {  # name: (init std, layers, width, heads, logit gain)
    "flat": (0.02, 2, 64, 2, 1.0),
    "peaked": (0.02, 2, 64, 2, 16.0),
    "realistic": (0.1, 4, 128, 4, 5.0),
    "deep": (0.1, 8, 128, 4, 6.0),
    "bf16_trainer": (0.1, 4, 128, 4, 5.0),
    "fp32": (0.1, 4, 128, 4, 5.0),
}


def build_gpt2(args: argparse.Namespace, name: str) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    # generate() feeds PAD after EOS with an all-ones mask (as the trainer does); hush the
    # one-time "input_ids may be padded" notice this triggers.
    logging.set_verbosity_error()
    std, layers, width, heads, gain = MODELS[name]
    gain = gain if args.gain is None else args.gain
    config = GPT2Config(
        vocab_size=args.vocab,
        n_positions=args.prompt_len + args.new_tokens,
        n_embd=width,
        n_layer=layers,
        n_head=heads,
        initializer_range=std,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=EOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    model = GPT2LMHeadModel(config).eval().requires_grad_(False)
    model.transformer.ln_f.weight.mul_(gain)  # every logit times `gain` (tied, bias-free head)
    return model


class HFWindows:
    """bf16 (or fp32) ``generate`` with a KV cache vs. an fp32 full forward pass."""

    def __init__(self, args: argparse.Namespace, name: str) -> None:
        self.args = args
        self.trainer = build_gpt2(args, name)
        dtype = torch.float32 if name == "fp32" else torch.bfloat16
        self.engine = copy.deepcopy(self.trainer).to(dtype)
        if name == "bf16_trainer":
            self.trainer.to(torch.bfloat16)

    @torch.no_grad()
    def window(self) -> Window:
        a = self.args
        prompts = torch.randint(2, a.vocab, (a.batch, a.prompt_len))
        out = self.engine.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            do_sample=True,
            top_k=0,
            top_p=1.0,
            temperature=1.0,
            max_new_tokens=a.new_tokens,
            output_logits=True,
            return_dict_in_generate=True,
            eos_token_id=EOS,
            pad_token_id=PAD,
        )
        sequences = out.sequences
        if sequences.shape[1] == a.prompt_len + 1:  # keep T >= 2 for the alignment below
            sequences = torch.cat([sequences, torch.full_like(sequences[:, :1], PAD)], 1)
        step_logits = torch.stack(out.logits, 1)
        step_logits = torch.nn.functional.pad(
            step_logits, (0, 0, 0, sequences.shape[1] - a.prompt_len - step_logits.shape[1])
        )
        ids = dict(eos_token_id=EOS, pad_token_id=PAD)
        rollout, mask = response_log_probs(step_logits, sequences, a.prompt_len, **ids)
        logits = self.trainer(sequences, attention_mask=torch.ones_like(sequences)).logits
        old, trainer_mask = response_log_probs(logits, sequences, a.prompt_len, **ids)
        assert torch.equal(mask, trainer_mask)
        return rollout, old, mask, profile(logits[:, a.prompt_len - 1 : -1])


class ExampleWindows:
    """The untrained policy and bf16 RolloutEngine of ``examples/grpo_mismatch.py``."""

    def __init__(self, args: argparse.Namespace) -> None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
        import grpo_mismatch as ex

        self.ex = ex
        self.batch = args.batch
        self.policy = ex.TinyCausalLM().eval().requires_grad_(False)
        self.engine = ex.RolloutEngine(self.policy, torch.bfloat16, args.seed)

    @torch.no_grad()
    def window(self) -> Window:
        ex = self.ex
        digits = torch.randint(0, ex.NUM_DIGITS, (self.batch, ex.PROMPT_DIGITS))
        prompts = torch.cat([digits, torch.full_like(digits[:, :1], ex.SEP)], 1)
        rollout = self.engine.generate(prompts)
        sequences = torch.cat([prompts, rollout.responses], 1)
        logits = self.policy(sequences)[:, ex.PROMPT_LEN - 1 : -1]
        old = ex.token_log_probs(logits, rollout.responses)
        return rollout.log_probs, old, rollout.mask.bool(), profile(logits)


def profile(logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """[B, T] entropy and largest logit of the trainer's distribution at each response step."""
    log_p = logits.float().log_softmax(-1)
    return {"entropy": -(log_p.exp() * log_p).sum(-1), "top_logit": logits.float().amax(-1)}


# ------------------------------------------------------------------------------ report


def quantile(values: list[float], q: float) -> float:
    return torch.quantile(torch.tensor(values, dtype=torch.float64), q).item()


def longest_run(flags: list[bool]) -> int:
    best = run = 0
    for flag in flags:
        run = run + 1 if flag else 0
        best = max(best, run)
    return best


def fires_after(flags: list[bool], k: int) -> float:
    """Fraction of windows at which the metric has been out of range for >= k windows."""
    run, hits = 0, 0
    for flag in flags:
        run = run + 1 if flag else 0
        hits += run >= k
    return hits / len(flags)


def run_config(args: argparse.Namespace, name: str) -> None:
    torch.manual_seed(args.seed)
    source = ExampleWindows(args) if name == "example" else HFWindows(args, name)
    names = list(DEFAULT_ALERT_RANGES)
    values: dict[str, list[float]] = {n: [] for n in names}
    extra: dict[str, list[float]] = {
        "1-pearson": [],
        "log_diff_mean": [],
        "k3/(mpe-1)^2": [],
        "tokens": [],
    }
    profiles: dict[str, list[float]] = {"entropy": [], "top_logit": [], "p": [], "p>0.9": []}
    start = time.perf_counter()
    for _ in range(args.windows):
        rollout, old, mask, scores = source.window()
        metrics = mismatch_metrics(rollout, old, mask, prefix="")
        for n in names:
            values[n].append(metrics[n])
        extra["1-pearson"].append(metrics["rollout_actor_probs_one_minus_pearson_corr"])
        extra["log_diff_mean"].append(metrics["rollout_log_probs_diff_mean"])
        extra["tokens"].append(metrics["rollout_tokens"])
        m1 = metrics["rollout_actor_mult_prob_error_minus_one"]
        extra["k3/(mpe-1)^2"].append(metrics["rollout_actor_kl_k3"] / m1**2 if m1 > 0 else math.nan)
        scores.update(p=old.exp(), **{"p>0.9": (old.exp() > 0.9).float()})
        for key, tensor in scores.items():
            profiles[key].append(tensor[mask].mean().item())
    seconds = time.perf_counter() - start
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    print(
        f"\n== {name}: {args.windows} windows x {args.batch} seqs, "
        f"{mean(extra['tokens']):.0f} tokens/window, {seconds:.0f}s\n   trainer's distribution: "
        f"entropy {mean(profiles['entropy']):.2f} nats, largest logit "
        f"{mean(profiles['top_logit']):.1f}, sampled-token p {mean(profiles['p']):.3f} "
        f"(p > 0.9 for {mean(profiles['p>0.9']):.0%} of tokens)"
    )
    k = args.consecutive
    header = (
        f"{'metric':34} {'default':>12} {'median':>9} {'p90*':>9} {'p99*':>9} {'worst':>9} "
        f"{'fires':>6} {'run':>4} {f'>={k}run':>6}"
    )
    print(header)
    for n in names:
        low, high = DEFAULT_ALERT_RANGES[n]
        xs = [x for x in values[n] if not math.isnan(x)]
        if not xs:
            print(f"{n:34} (undefined in every window)")
            continue
        lower = low is not None and high is None  # tail on the low side
        qs = (0.1, 0.01, 0.0) if lower else (0.9, 0.99, 1.0)
        flags = [
            (low is not None and x < low) or (high is not None and x > high) for x in values[n]
        ]
        rng = f"[{'-inf' if low is None else f'{low:g}'},{'inf' if high is None else f'{high:g}'}]"
        print(
            f"{n:34} {rng:>12} {quantile(xs, 0.5):9.4g} "
            + " ".join(f"{quantile(xs, q):9.4g}" for q in qs)
            + f" {mean(flags):6.0%} {longest_run(flags):4d} {fires_after(flags, k):6.0%}"
        )
    for n in ("1-pearson", "log_diff_mean", "k3/(mpe-1)^2"):
        xs = [x for x in extra[n] if not math.isnan(x)]
        if xs:
            print(
                f"{'  (' + n + ')':34} {'':>12} {quantile(xs, 0.5):9.4g} "
                + " ".join(f"{quantile(xs, q):9.4g}" for q in (0.9, 0.99, 1.0))
            )
    nan = {n: sum(math.isnan(x) for x in v) for n, v in values.items() if any(map(math.isnan, v))}
    if nan:
        print(f"  undefined (NaN) windows: {nan}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    print(
        "p90*/p99*/worst: on the side the default range guards "
        "(p10/p1/min for a lower bound such as the Pearson correlation)"
    )
    for name in args.configs.split(","):
        try:
            run_config(args, name)
        except ImportError as error:  # the example needs pytorch_lightning
            print(f"\n== {name}: skipped ({error})")


if __name__ == "__main__":
    main()
