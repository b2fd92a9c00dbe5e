"""A tiny GRPO run whose rollout engine disagrees with the trainer, watched by RolloutDebugCallback.

In RL fine-tuning of language models the responses are sampled by a separate inference
("rollout") engine, which records the log-probability of every token it samples. The trainer
then recomputes those log-probabilities with the policy it is optimising. Ideally the two agree;
in practice they drift apart because the engine runs in lower precision, or because it is
serving weights older than the trainer's. ``RolloutDebugCallback`` measures that drift and logs
it to TensorBoard (``training/rollout_probs_diff_mean``, ``training/rollout_actor_kl_k3``, ...).

This script is a real, small GRPO training run on CPU that makes both effects visible:

* the policy is a 2-layer causal transformer (written with ``torch.nn``, nothing downloaded);
* the task: the prompt is four random digits, the response should be the same digits reversed
  followed by an end-of-sequence token; the reward is the fraction of those five positions the
  response gets right, so it rises within a few dozen steps;
* the rollout engine is a copy of the policy that samples responses token by token
  (temperature 1, no gradient) and computes in ``--rollout-dtype``; it receives the trained
  weights only every ``--weight-sync-every`` optimizer steps;
* the trainer recomputes the log-probabilities in float32, normalises the rewards within each
  group of samples of the same prompt (GRPO) and optimises the PPO clipped objective.

What it shows:

* ``--rollout-dtype float32 --weight-sync-every 1``: the engine and the trainer run the same
  float32 computation on the same batch layout, so the mismatch is zero;
* ``--rollout-dtype bfloat16`` (the default): bfloat16 rounding in the engine gives a small but
  clearly non-zero mismatch (token probabilities differ by roughly 5e-4 on average). It is
  not constant: ``rollout_probs_diff_mean`` weighs each token's log-prob error by its
  probability, and the sampled tokens' probabilities rise as the policy leaves its uniform
  start, so it grows from about 3.7e-4 over the first ten steps to 6e-4 to 1.2e-3 from
  step 23 to step 63 (above twice that start in 37 of those 41 steps), while the log-space
  error (``rollout_log_probs_diff_mean``) stays between 2e-3 and 3.5e-3; then both fall as
  the policy turns almost deterministic. The rise stays inside
  every fixed alert range but passes twice the run's own start, so from about step 23
  the drift alert warns about it (and later about ``rollout_actor_kl_k3``, whose tail
  grows). A policy fine-tuned from a trained model starts confident, without that
  climb; here the log-space metrics tell the policy's change from the engine's;
* ``--weight-sync-every 4``: the engine samples with weights up to three optimizer steps old,
  and the KL (k1, k3) and importance-ratio metrics are much larger again (large enough for
  the callback to warn about them);
* ``--sync-stops-at 20``: the weight sync silently stops working at step 20, so the engine
  falls further behind the trainer at every step. The mismatch jumps about 50-fold at
  step 20 and keeps rising as the engine falls behind; the fixed ranges and the drift
  alert both name it at that step.

Besides the scalars, TensorBoard's IMAGES tab shows, every 10 steps, where the
mismatch lives: along the response (``rollout_profile/by_position``), by the trainer's
token probability (``rollout_profile/by_probability``), and the joint histogram of the
two log-probs (``rollout_profile/joint``); the quantile charts (p50 ... p99.9) are in
the ``quantiles`` section of the Custom Scalars tab.

Run it, then open TensorBoard::

    python examples/grpo_mismatch.py --rollout-dtype float32 --logdir runs
    python examples/grpo_mismatch.py --logdir runs
    python examples/grpo_mismatch.py --weight-sync-every 4 --logdir runs
    python examples/grpo_mismatch.py --sync-stops-at 20 --logdir runs
    tensorboard --logdir runs

The default run takes well under two minutes on two CPU cores.
"""

from __future__ import annotations

import argparse
import copy
import math
import warnings
from pathlib import Path
from typing import NamedTuple

# Vocabulary: the digits 0-9 plus three special tokens (and a few unused ids).
NUM_DIGITS = 10
SEP = 10  # ends the prompt
EOS = 11  # ends the response
PAD = 12  # fills the response after EOS
VOCAB_SIZE = 16

PROMPT_DIGITS = 4
PROMPT_LEN = PROMPT_DIGITS + 1  # the digits, then SEP
MAX_RESPONSE_LEN = PROMPT_DIGITS + 2  # room for the answer, EOS and one token too many
SEQ_LEN = PROMPT_LEN + MAX_RESPONSE_LEN

# GRPO hyperparameters.
PROMPTS_PER_STEP = 16
GROUP_SIZE = 8  # responses sampled per prompt; advantages are normalised within the group
LEARNING_RATE = 3e-3
PPO_CLIP = 0.2

ROLLOUT_DTYPES = ("float32", "bfloat16", "float16")


# --------------------------------------------------------------------------------------------
# Command line, read before torch and Lightning are imported: `--help` answers at once.
# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command-line flags."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--rollout-dtype",
        choices=ROLLOUT_DTYPES,
        default="bfloat16",
        help="Precision the rollout engine computes in; the trainer always uses float32.",
    )
    parser.add_argument(
        "--weight-sync-every",
        type=int,
        default=1,
        metavar="N",
        help="Send the trained weights to the rollout engine every N optimizer steps "
        "(N > 1 simulates a stale-weights bug).",
    )
    parser.add_argument(
        "--sync-stops-at",
        type=int,
        default=None,
        metavar="STEP",
        help="From this optimizer step on the weight sync silently fails and the engine keeps "
        "its last weights (a faulty-sync bug whose mismatch creeps up).",
    )
    parser.add_argument(
        "--max-steps",
        type=int,
        default=100,
        help=f"Number of optimizer steps; each samples {GROUP_SIZE} responses to each of "
        f"{PROMPTS_PER_STEP} prompts.",
    )
    parser.add_argument(
        "--logdir", default="runs", help="Directory the TensorBoard logs are written under."
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="Random seed for the weights, the prompts and the sampling.",
    )
    args = parser.parse_args(argv)
    if args.weight_sync_every < 1:
        parser.error("--weight-sync-every must be at least 1")
    if args.sync_stops_at is not None and args.sync_stops_at < 1:
        parser.error("--sync-stops-at must be at least 1")
    return args


if __name__ == "__main__":
    parse_args()  # --help and wrong flags exit here, before the slow imports below

import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
from pytorch_lightning.loggers import TensorBoardLogger  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from lightning_rollout_debug import RolloutDebugCallback  # noqa: E402

DTYPES = {name: getattr(torch, name) for name in ROLLOUT_DTYPES}


# --------------------------------------------------------------------------------------------
# The policy: a small causal transformer.
# --------------------------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position only attends to itself and the past."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        """Attend over ``x`` of shape ``[B, L, d_model]``."""
        batch, length, d_model = x.shape
        head_dim = d_model // self.n_heads
        qkv = self.qkv(x).view(batch, length, 3, self.n_heads, head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [B, heads, L, head_dim]
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(head_dim)
        future = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1)
        weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        out = (weights @ v).transpose(1, 2).reshape(batch, length, d_model)
        return self.proj(out)


class Block(nn.Module):
    """A pre-norm transformer block: attention then MLP, each with a residual connection."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: Tensor) -> Tensor:
        """Apply the block to ``x`` of shape ``[B, L, d_model]``."""
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyCausalLM(nn.Module):
    """A GPT-style language model: token + position embeddings, blocks, output head."""

    def __init__(self, d_model: int = 64, n_heads: int = 4, n_layers: int = 2) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB_SIZE, d_model)
        self.pos_emb = nn.Embedding(SEQ_LEN, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB_SIZE)

    def forward(self, tokens: Tensor) -> Tensor:
        """Map token ids ``[B, L]`` to next-token logits ``[B, L, vocab]``, in the params' dtype."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def token_log_probs(logits: Tensor, tokens: Tensor) -> Tensor:
    """Log-probability (float32) of each of ``tokens`` ``[...]`` under ``logits`` ``[..., V]``."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    return log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


# --------------------------------------------------------------------------------------------
# The rollout engine: a copy of the policy that samples, in its own dtype, with its own weights.
# --------------------------------------------------------------------------------------------


class Rollout(NamedTuple):
    """What the rollout engine hands to the trainer; every tensor is ``[B, MAX_RESPONSE_LEN]``."""

    responses: Tensor  # sampled token ids (long), PAD after EOS
    log_probs: Tensor  # log-prob the engine gave each sampled token (float32), 0 on padding
    mask: Tensor  # 1.0 for sampled tokens (EOS included), 0.0 for padding


class RolloutEngine:
    """Stands in for an inference server (vLLM, SGLang, ...) that generates the rollouts.

    It holds its own copy of the policy, cast to ``dtype`` so that its whole forward pass runs
    in that precision, and only sees new weights when :meth:`load_weights` is called. Like
    vLLM, it turns its (low-precision) logits into probabilities in float32. It is deliberately
    not an ``nn.Module`` attribute of the LightningModule, so Lightning neither trains it nor
    moves it around.
    """

    def __init__(self, policy: nn.Module, dtype: torch.dtype, seed: int) -> None:
        self.dtype = dtype
        self.model = copy.deepcopy(policy).to(dtype).eval().requires_grad_(False)
        self.generator = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def load_weights(self, policy: nn.Module) -> None:
        """Copy the trainer's current weights in, cast to the engine's dtype (a weight sync)."""
        self.model.load_state_dict(policy.state_dict())

    @torch.no_grad()
    def generate(self, prompts: Tensor) -> Rollout:
        """Sample one response per prompt, token by token, at temperature 1.

        There is no KV cache: each step runs the model on the whole fixed-length window
        (prompt, tokens so far, padding; the causal mask hides the padding). That is slow for a
        real model but means that, in float32, the engine computes exactly what the trainer's
        single forward pass over the finished sequences computes.
        """
        batch = prompts.shape[0]
        window = torch.full((batch, SEQ_LEN), PAD, dtype=torch.long)
        window[:, :PROMPT_LEN] = prompts
        log_probs = torch.zeros(batch, MAX_RESPONSE_LEN)
        mask = torch.zeros(batch, MAX_RESPONSE_LEN)
        finished = torch.zeros(batch, dtype=torch.bool)
        for t in range(MAX_RESPONSE_LEN):
            position = PROMPT_LEN + t
            logits = self.model(window)[:, position - 1]  # predicts the token at `position`
            probs = torch.softmax(logits.float(), dim=-1)
            token = torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)
            token = token.masked_fill(finished, PAD)
            window[:, position] = token
            log_probs[:, t] = token_log_probs(logits, token).masked_fill(finished, 0.0)
            mask[:, t] = (~finished).float()
            finished |= token == EOS
        return Rollout(window[:, PROMPT_LEN:], log_probs, mask)


# --------------------------------------------------------------------------------------------
# Task, reward and GRPO.
# --------------------------------------------------------------------------------------------


class PromptDataset(Dataset[Tensor]):
    """``num_prompts`` random prompts of ``PROMPT_DIGITS`` digits (the SEP is added later)."""

    def __init__(self, num_prompts: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        shape = (num_prompts, PROMPT_DIGITS)
        self.digits = torch.randint(0, NUM_DIGITS, shape, generator=generator)

    def __len__(self) -> int:
        return len(self.digits)

    def __getitem__(self, index: int) -> Tensor:
        return self.digits[index]


def reversal_reward(digits: Tensor, responses: Tensor) -> Tensor:
    """Fraction of the target (the digits reversed, then EOS) the response matches, per row."""
    eos = torch.full_like(digits[:, :1], EOS)
    target = torch.cat([digits.flip(1), eos], dim=1)
    return (responses[:, : target.shape[1]] == target).float().mean(dim=1)


def group_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """GRPO advantages: each reward normalised by the mean and std of its prompt's group."""
    groups = rewards.view(-1, group_size)
    mean = groups.mean(dim=1, keepdim=True)
    std = groups.std(dim=1, keepdim=True)
    return ((groups - mean) / (std + 1e-4)).view(-1)


def ppo_clip_loss(
    new_log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor, clip: float
) -> Tensor:
    """PPO clipped policy loss, averaged over the response tokens where ``mask`` is 1."""
    ratio = torch.exp(new_log_probs - old_log_probs.detach())
    advantages = advantages.unsqueeze(-1)  # one advantage per sequence, shared by its tokens
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip, 1.0 + clip)
    return (torch.maximum(unclipped, clipped) * mask).sum() / mask.sum()


class GRPOModule(pl.LightningModule):
    """GRPO on the digit-reversal task, sampling its rollouts with a :class:`RolloutEngine`."""

    def __init__(
        self,
        rollout_dtype: torch.dtype = torch.bfloat16,
        weight_sync_every: int = 1,
        seed: int = 0,
        group_size: int = GROUP_SIZE,
        sync_stops_at: int | None = None,
        lr: float = LEARNING_RATE,
        clip: float = PPO_CLIP,
    ) -> None:
        super().__init__()
        self.weight_sync_every = weight_sync_every
        self.sync_stops_at = sync_stops_at
        self.group_size = group_size
        self.lr = lr
        self.clip = clip
        self.policy = TinyCausalLM()
        self.rollout_engine = RolloutEngine(self.policy, rollout_dtype, seed)

    def training_step(self, batch: Tensor, batch_idx: int) -> dict[str, Tensor]:
        """Sample a group of responses per prompt, score them, take one PPO step."""
        digits = batch.repeat_interleave(self.group_size, dim=0)  # [B, PROMPT_DIGITS]
        sep = torch.full_like(digits[:, :1], SEP)
        prompts = torch.cat([digits, sep], dim=1)

        # The engine gets fresh weights only every `weight_sync_every` optimizer steps, and
        # none from `sync_stops_at` on.
        syncing = self.sync_stops_at is None or self.global_step < self.sync_stops_at
        if syncing and self.global_step % self.weight_sync_every == 0:
            self.rollout_engine.load_weights(self.policy)
        rollout = self.rollout_engine.generate(prompts)

        # The trainer recomputes the log-probs of the sampled tokens in float32. With one PPO
        # update per batch the "old" policy is the current one, so old = new, detached (the
        # ratio starts at 1; the clip only bites in further updates on the same batch).
        sequences = torch.cat([prompts, rollout.responses], dim=1)
        logits = self.policy(sequences)[:, PROMPT_LEN - 1 : -1]
        new_log_probs = token_log_probs(logits, rollout.responses)
        old_log_probs = new_log_probs.detach()

        rewards = reversal_reward(digits, rollout.responses)
        advantages = group_advantages(rewards, self.group_size)
        loss = ppo_clip_loss(new_log_probs, old_log_probs, advantages, rollout.mask, self.clip)

        self.log("train/reward", rewards.mean(), prog_bar=True)
        self.log("train/loss", loss)
        return {
            "loss": loss,
            "rollout_log_probs": rollout.log_probs,
            "old_log_probs": old_log_probs,
            "response_mask": rollout.mask,
            "responses": rollout.responses,
        }

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """Adam on the policy."""
        return torch.optim.Adam(self.policy.parameters(), lr=self.lr)


# --------------------------------------------------------------------------------------------
# Training.
# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> Path:
    """Train, log to TensorBoard, and return the run's log directory."""
    args = parse_args(argv)
    pl.seed_everything(args.seed, verbose=False)
    # The prompts are generated in memory; worker processes would only add start-up time.
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    # Lightning's own use of a torch API that newer torch deprecates: nothing to act on.
    warnings.filterwarnings("ignore", r".*isinstance\(treespec, LeafSpec\)` is deprecated")

    module = GRPOModule(
        rollout_dtype=DTYPES[args.rollout_dtype],
        weight_sync_every=args.weight_sync_every,
        seed=args.seed,
        sync_stops_at=args.sync_stops_at,
    )
    prompts = PromptDataset(args.max_steps * PROMPTS_PER_STEP, seed=args.seed)
    loader = DataLoader(prompts, batch_size=PROMPTS_PER_STEP, num_workers=0)

    name = f"grpo_{args.rollout_dtype}_sync{args.weight_sync_every}"
    if args.sync_stops_at is not None:
        name += f"_stops{args.sync_stops_at}"
    tb_logger = TensorBoardLogger(save_dir=args.logdir, name=name)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=args.max_steps,
        log_every_n_steps=1,
        enable_checkpointing=False,
        logger=tb_logger,
        # Every step is logged; the profile pictures every 10 steps: over the default 100
        # steps, the 10 sets TensorBoard shows per tag.
        callbacks=[RolloutDebugCallback(profile_images_every_n_steps=10)],
    )
    trainer.fit(module, train_dataloaders=loader)

    log_dir = Path(tb_logger.log_dir)
    print(f"\nTensorBoard logs written to {log_dir}")
    print(f"View them with:  tensorboard --logdir {args.logdir}")
    return log_dir


if __name__ == "__main__":
    main()
