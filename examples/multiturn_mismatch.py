"""A small multi-turn agent whose rollout engine drifts more turn after turn, watched per turn.

An agent's rollout is a conversation: the policy writes a turn, a tool answers, the policy
writes the next turn, and so on. The tool's tokens are context, not actions: the response
mask leaves them out. An inference engine does not recompute the conversation when a tool
answers: it keeps the state it built (its KV cache) and goes on from there, so whatever
that state lost to rounding, every later turn inherits. A window mean over all the turns
hides it; ``RolloutDebugCallback`` given the turn of every token (``segment_ids``) logs
each turn's mismatch of its own (``training/segments/turn_1/rollout_actor_kl_k3``, ...).

This script is a small GRPO run on a CPU that shows it:

* the policy is a 2-layer causal transformer with linear attention (written with
  ``torch.nn``, nothing downloaded). Linear attention keeps its KV cache in a fixed
  size: one running sum of ``phi(k) v^T`` per head and layer, which every token adds to;
* the task: the prompt is four random digits; in each of ``--turns`` turns the agent
  writes the last four digits it was shown (the prompt's, then each tool answer's), then
  the same digits reversed; after every turn but the last, a tool answers (a stand-in
  for a search result: twelve words of text, then four new digits). The reward is the
  fraction of answer tokens right;
* the rollout engine is a copy of the policy that samples token by token (temperature 1),
  computes in float32 but stores its cache in ``--cache-dtype``, and reuses it across the
  turns: the tool's tokens are added to the same cache. In bfloat16 each addition to the
  running sum rounds it to 8 significant bits, and a sum that grows with every token
  rounds in ever larger steps: the cache's error accumulates along the conversation;
* the trainer recomputes the log-probabilities in float32 from the whole conversation at
  once (the attention matrix, no cache), normalises the rewards within each group of
  samples of the same prompt (GRPO) and optimises the PPO clipped objective. Its batches
  hold ``rollout_log_probs``, ``old_log_probs``, ``response_mask`` (1 on the agent's
  tokens, 0 on the tool's) and ``segment_ids``: the turn of every token, the tool's
  answer labelled with the turn that called it.

What it shows: with the default bfloat16 cache, the first turn reads a cache of a dozen
tokens at most, the fourth one of more than eighty, and the fourth turn's mismatch is
above the first's at every logged step. At the end the script prints each turn's
``rollout_probs_diff_mean`` and ``rollout_actor_kl_k3`` over the whole run (from
``lightning_rollout_debug.functional.segment_metrics``), and the multiple of the first
turn's; with the defaults::

    turn      tokens  probs_diff_mean             kl_k3
    turn_1     20480        1.243e-05   1.0x  8.991e-09    1.0x
    turn_2     20480        1.932e-05   1.6x  2.287e-08    2.5x
    turn_3     20480        2.795e-05   2.2x  4.470e-08    5.0x
    turn_4     20480        3.305e-05   2.7x  6.153e-08    6.8x

Each turn's mismatch is above the one before: the KL estimate of the fourth turn is about
7 times the first's and the probability difference about 2.7 times, while the
window-wide values of the ``training/rollout_*`` charts sit in between and name no turn.
The digits move a little with the CPU's arithmetic. The mismatch is small, since the
engine computes everything but its cache in float32: it is the cache's rounding alone.
With ``--cache-dtype float32`` there is none: every turn's probability difference is
about 3e-8 (float32 rounding) and none is above the first's. The reward rises slowly in
so short a run (from about 0.06 to about 0.1: the agent learns to answer with digits
first); the run is there for its mismatch.

Run it, then open TensorBoard (the ``segments`` section of the Custom Scalars page, or
the ``training/segments/turn_*`` charts of the Scalars page)::

    python examples/multiturn_mismatch.py --logdir runs
    python examples/multiturn_mismatch.py --cache-dtype float32 --logdir runs
    tensorboard --logdir runs

The default run takes well under a minute on two CPU cores.
"""

from __future__ import annotations

import argparse
import copy
import warnings
from pathlib import Path
from typing import NamedTuple

# Vocabulary: the digits 0-9, two special tokens and four words.
NUM_DIGITS = 10
SEP = 10  # ends the prompt, and each tool answer
TOOL = 11  # starts a tool answer
FIRST_WORD = 12  # the words of a tool answer's text: ids 12 to 15
VOCAB_SIZE = 16

DIGITS = 4  # digits in the prompt and in each tool answer
WORDS = 12  # words of text in each tool answer, before its digits
PROMPT_LEN = DIGITS + 1  # the digits, then SEP
ANSWER_LEN = 2 * DIGITS  # a turn: the digits shown last, then the same reversed
TOOL_LEN = 1 + WORDS + DIGITS + 1  # TOOL, the words, the digits, SEP
MAX_TURNS = 16  # the callback's default max_segments

# GRPO hyperparameters.
PROMPTS_PER_STEP = 8
GROUP_SIZE = 8  # responses sampled per prompt; advantages are normalised within the group
LEARNING_RATE = 3e-3
PPO_CLIP = 0.2

CACHE_DTYPES = ("float32", "bfloat16", "float16")


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
        "--cache-dtype",
        choices=CACHE_DTYPES,
        default="bfloat16",
        help="Precision the rollout engine stores its attention cache in; it computes in "
        "float32, and so does the trainer.",
    )
    parser.add_argument(
        "--turns",
        type=int,
        default=4,
        help=f"Agent turns per conversation (1 to {MAX_TURNS}); a tool answers between two.",
    )
    parser.add_argument(
        "--max-steps",
        type=int,
        default=40,
        help=f"Number of optimizer steps; each samples {GROUP_SIZE} conversations for each "
        f"of {PROMPTS_PER_STEP} prompts.",
    )
    parser.add_argument(
        "--logdir", default="runs", help="Directory the TensorBoard logs are written under."
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="Random seed for the weights, the prompts, the tool's answers and the sampling.",
    )
    args = parser.parse_args(argv)
    if not 1 <= args.turns <= MAX_TURNS:
        parser.error(f"--turns must be from 1 to {MAX_TURNS}")
    if args.max_steps < 1:
        parser.error("--max-steps must be at least 1")
    return args


if __name__ == "__main__":
    parse_args()  # --help and wrong flags exit here, before the slow imports below

import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
from pytorch_lightning.loggers import TensorBoardLogger  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from lightning_rollout_debug import RolloutDebugCallback  # noqa: E402
from lightning_rollout_debug.functional import segment_metrics  # noqa: E402

DTYPES = {name: getattr(torch, name) for name in CACHE_DTYPES}


def response_len(turns: int) -> int:
    """Tokens after the prompt: every turn's answer, and a tool answer between two turns."""
    return turns * ANSWER_LEN + (turns - 1) * TOOL_LEN


# --------------------------------------------------------------------------------------------
# The policy: a small causal transformer with linear attention.
# --------------------------------------------------------------------------------------------


def feature_map(x: Tensor) -> Tensor:
    """The positive feature map of linear attention, ``elu(x) + 1``."""
    return F.elu(x) + 1.0


class CausalLinearAttention(nn.Module):
    """Linear attention: ``norm(phi(q_t) . sum_s phi(k_s) v_s^T)`` over ``s <= t``, per head.

    Each head's output is normalised (a layer norm without weights) rather than divided by
    ``phi(q_t) . sum_s phi(k_s)``, as several linear-attention models do. Its cache is one
    sum, ``sum_s phi(k_s) v_s^T``, of a fixed size however long the context.
    :meth:`forward` computes a whole sequence at once, as a trainer does; :meth:`step` one
    token from the cache of the tokens before it, as an engine does.
    """

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def _heads(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``phi(q)``, ``phi(k)`` and ``v`` of ``x`` ``[..., d_model]``, ``[..., heads, dim]``."""
        q, k, v = self.qkv(x).unflatten(-1, (3, self.n_heads, -1)).unbind(-3)
        return feature_map(q), feature_map(k), v

    def _out(self, heads: Tensor) -> Tensor:
        """The output projection of the normalised heads ``[..., heads, dim]``."""
        return self.proj(F.layer_norm(heads, heads.shape[-1:]).flatten(-2))

    def forward(self, x: Tensor) -> Tensor:
        """Attend over ``x`` of shape ``[B, L, d_model]``, in float32, without a cache."""
        q, k, v = (t.transpose(1, 2) for t in self._heads(x))  # each [B, heads, L, dim]
        weights = (q @ k.transpose(-2, -1)).tril()  # [B, heads, L, L], 0 on the future
        return self._out((weights @ v).transpose(1, 2))

    def step(self, x: Tensor, cache: Tensor) -> tuple[Tensor, Tensor]:
        """One token ``x`` ``[B, d_model]``: its output, and the cache with the token added.

        The token's ``phi(k) v^T`` is added to the cache in float32 and the sum stored back
        in the cache's dtype: in bfloat16, every addition rounds the whole sum to 8
        significant bits, in steps that grow as the sum does.
        """
        q, k, v = self._heads(x)  # each [B, heads, dim]
        cache = (cache.float() + k.unsqueeze(-1) * v.unsqueeze(-2)).to(cache.dtype)
        return self._out((q.unsqueeze(-2) @ cache.float()).squeeze(-2)), cache


class Block(nn.Module):
    """A pre-norm transformer block: attention then MLP, each with a residual connection."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalLinearAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: Tensor) -> Tensor:
        """Apply the block to ``x`` of shape ``[B, L, d_model]``."""
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))

    def step(self, x: Tensor, cache: Tensor) -> tuple[Tensor, Tensor]:
        """Apply the block to one token ``x`` ``[B, d_model]`` with its layer's cache."""
        attended, cache = self.attn.step(self.ln1(x), cache)
        x = x + attended
        return x + self.mlp(self.ln2(x)), cache


class TinyLinearLM(nn.Module):
    """A GPT-style language model with linear attention: embeddings, blocks, output head."""

    def __init__(
        self, max_len: int, d_model: int = 64, n_heads: int = 4, n_layers: int = 2
    ) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.tok_emb = nn.Embedding(VOCAB_SIZE, d_model)
        self.pos_emb = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB_SIZE)

    def forward(self, tokens: Tensor) -> Tensor:
        """Map token ids ``[B, L]`` to next-token logits ``[B, L, vocab]``."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def empty_cache(self, batch: int, dtype: torch.dtype) -> list[Tensor]:
        """A cache per layer, of no tokens yet."""
        head_dim = self.tok_emb.embedding_dim // self.n_heads
        shape = (batch, self.n_heads, head_dim, head_dim)
        return [torch.zeros(shape, dtype=dtype) for _ in self.blocks]

    def step(self, token: Tensor, position: int, caches: list[Tensor]) -> tuple[Tensor, list]:
        """Next-token logits ``[B, vocab]`` after ``token`` ``[B]`` at ``position``."""
        x = self.tok_emb(token) + self.pos_emb.weight[position]
        new_caches = []
        for block, cache in zip(self.blocks, caches, strict=True):
            x, cache = block.step(x, cache)
            new_caches.append(cache)
        return self.head(self.ln_f(x)), new_caches


def token_log_probs(logits: Tensor, tokens: Tensor) -> Tensor:
    """Log-probability (float32) of each of ``tokens`` ``[...]`` under ``logits`` ``[..., V]``."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    return log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


# --------------------------------------------------------------------------------------------
# The conversation: the agent's turns and the tool's answers.
# --------------------------------------------------------------------------------------------


class Rollout(NamedTuple):
    """What the rollout engine hands to the trainer; every tensor is ``[B, response length]``."""

    responses: Tensor  # the tokens after the prompt: the agent's turns and the tool's answers
    log_probs: Tensor  # log-prob the engine gave each sampled token (float32), 0 on the tool's
    mask: Tensor  # 1.0 for the agent's tokens, 0.0 for the tool's
    turns: Tensor  # the turn of each token (long): a tool answer has its calling turn's


def conversation_layout(turns: int) -> tuple[list[bool], Tensor]:
    """Which response positions the agent writes, and each position's turn (``[T]``, long)."""
    agent, turn_of = [], []
    for turn in range(turns):
        agent += [True] * ANSWER_LEN
        turn_of += [turn] * ANSWER_LEN
        if turn < turns - 1:
            agent += [False] * TOOL_LEN
            turn_of += [turn] * TOOL_LEN
    return agent, torch.tensor(turn_of)


def tool_answer(words: Tensor, digits: Tensor) -> Tensor:
    """The tokens of tool answers of ``words`` and ``digits`` ``[..., n]``: TOOL, the words,
    the digits, SEP."""
    tool = torch.full_like(digits[..., :1], TOOL)
    sep = torch.full_like(digits[..., :1], SEP)
    return torch.cat([tool, words, digits, sep], dim=-1)


def answer_targets(prompt_digits: Tensor, tool_digits: Tensor) -> Tensor:
    """The answer every turn should write, ``[B, turns, ANSWER_LEN]``.

    A turn writes the digits shown last (the prompt's, then the tool's), then them reversed.
    """
    shown = torch.cat([prompt_digits.unsqueeze(1), tool_digits], dim=1)  # [B, turns, DIGITS]
    return torch.cat([shown, shown.flip(-1)], dim=-1)


class RolloutEngine:
    """Stands in for an inference server (vLLM, SGLang, ...) that runs the agent's rollouts.

    It holds its own copy of the policy and samples token by token, adding every token to
    its attention cache, which it stores in ``cache_dtype`` and keeps for the whole
    conversation: the tool's answers are added to it too, as a prefix-caching engine
    does, rather than the conversation being recomputed at each turn. It is deliberately
    not an ``nn.Module`` attribute of the LightningModule, so Lightning neither trains it
    nor moves it around.
    """

    def __init__(self, policy: TinyLinearLM, cache_dtype: torch.dtype, seed: int) -> None:
        self.cache_dtype = cache_dtype
        self.model = copy.deepcopy(policy).eval().requires_grad_(False)
        self.generator = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def load_weights(self, policy: nn.Module) -> None:
        """Copy the trainer's current weights in (a weight sync)."""
        self.model.load_state_dict(policy.state_dict())

    @torch.no_grad()
    def generate(self, prompts: Tensor, tool_answers: Tensor) -> Rollout:
        """Run one conversation per prompt ``[B, PROMPT_LEN]``, the tool answering with
        ``tool_answers`` ``[B, turns - 1, TOOL_LEN]``, in order."""
        batch, turns = prompts.shape[0], tool_answers.shape[1] + 1
        agent, turn_of = conversation_layout(turns)
        # The response with the tool's answers in place; the agent's tokens are sampled in.
        responses = torch.zeros(batch, len(agent), dtype=torch.long)
        responses[:, ~torch.tensor(agent)] = tool_answers.flatten(1)
        log_probs = torch.zeros(batch, len(agent))
        caches = self.model.empty_cache(batch, self.cache_dtype)
        for position in range(PROMPT_LEN - 1):  # the prompt but its last token
            _, caches = self.model.step(prompts[:, position], position, caches)
        token = prompts[:, -1]
        for t, sampled in enumerate(agent):
            logits, caches = self.model.step(token, PROMPT_LEN - 1 + t, caches)
            if sampled:
                probs = torch.softmax(logits, dim=-1)
                responses[:, t] = torch.multinomial(probs, 1, generator=self.generator)[:, 0]
                log_probs[:, t] = token_log_probs(logits, responses[:, t])
            token = responses[:, t]  # a tool's token is read into the cache, not sampled
        mask = torch.tensor(agent, dtype=torch.float32).expand(batch, -1).clone()
        return Rollout(responses, log_probs, mask, turn_of.expand(batch, -1).clone())


# --------------------------------------------------------------------------------------------
# Task, reward and GRPO.
# --------------------------------------------------------------------------------------------


class PromptDataset(Dataset[Tensor]):
    """``num_prompts`` random prompts of ``DIGITS`` digits (the SEP is added later)."""

    def __init__(self, num_prompts: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.digits = torch.randint(0, NUM_DIGITS, (num_prompts, DIGITS), generator=generator)

    def __len__(self) -> int:
        return len(self.digits)

    def __getitem__(self, index: int) -> Tensor:
        return self.digits[index]


def answer_reward(rollout: Rollout, targets: Tensor) -> Tensor:
    """Fraction of the answer tokens of every turn the conversation gets right, per row."""
    batch = targets.shape[0]
    written = rollout.responses[rollout.mask.bool()].view(batch, -1)
    return (written == targets.flatten(1)).float().mean(dim=1)


def group_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """GRPO advantages: each reward normalised by the mean and std of its prompt's group."""
    groups = rewards.view(-1, group_size)
    mean = groups.mean(dim=1, keepdim=True)
    std = groups.std(dim=1, keepdim=True)
    return ((groups - mean) / (std + 1e-4)).view(-1)


def ppo_clip_loss(
    new_log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor, clip: float
) -> Tensor:
    """PPO clipped policy loss, averaged over the agent's tokens (where ``mask`` is 1)."""
    ratio = torch.exp(new_log_probs - old_log_probs.detach())
    advantages = advantages.unsqueeze(-1)  # one advantage per conversation
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip, 1.0 + clip)
    return (torch.maximum(unclipped, clipped) * mask).sum() / mask.sum()


class MultiTurnGRPO(pl.LightningModule):
    """GRPO on the multi-turn answering task, with rollouts from a :class:`RolloutEngine`."""

    def __init__(
        self,
        turns: int = 4,
        cache_dtype: torch.dtype = torch.bfloat16,
        seed: int = 0,
        group_size: int = GROUP_SIZE,
        lr: float = LEARNING_RATE,
        clip: float = PPO_CLIP,
    ) -> None:
        super().__init__()
        self.turns = turns
        self.group_size = group_size
        self.lr = lr
        self.clip = clip
        self.policy = TinyLinearLM(max_len=PROMPT_LEN + response_len(turns))
        self.rollout_engine = RolloutEngine(self.policy, cache_dtype, seed)
        self.tool = torch.Generator().manual_seed(seed + 1)  # the tool's answers
        self.history: list[dict[str, Tensor]] = []  # every step's rollouts, for the summary

    def training_step(self, batch: Tensor, batch_idx: int) -> dict[str, Tensor]:
        """Run a group of conversations per prompt, score them, take one PPO step."""
        digits = batch.repeat_interleave(self.group_size, dim=0)  # [B, DIGITS]
        prompts = torch.cat([digits, torch.full_like(digits[:, :1], SEP)], dim=1)
        shape = (len(digits), self.turns - 1)
        words = torch.randint(FIRST_WORD, VOCAB_SIZE, (*shape, WORDS), generator=self.tool)
        tool_digits = torch.randint(0, NUM_DIGITS, (*shape, DIGITS), generator=self.tool)

        self.rollout_engine.load_weights(self.policy)  # in sync at every step
        rollout = self.rollout_engine.generate(prompts, tool_answer(words, tool_digits))

        # The trainer recomputes the log-probs of the conversation in float32, in one pass
        # over all of it. With one PPO update per batch the "old" policy is the current one.
        sequences = torch.cat([prompts, rollout.responses], dim=1)
        logits = self.policy(sequences)[:, PROMPT_LEN - 1 : -1]
        new_log_probs = token_log_probs(logits, rollout.responses)
        old_log_probs = new_log_probs.detach()

        rewards = answer_reward(rollout, answer_targets(digits, tool_digits))
        advantages = group_advantages(rewards, self.group_size)
        loss = ppo_clip_loss(new_log_probs, old_log_probs, advantages, rollout.mask, self.clip)

        self.log("train/reward", rewards.mean(), prog_bar=True)
        self.log("train/loss", loss)
        measured = {
            "rollout_log_probs": rollout.log_probs,
            "old_log_probs": old_log_probs,
            "response_mask": rollout.mask,
            "segment_ids": rollout.turns,  # [B, T]: the turn of every token
        }
        self.history.append(measured)
        return {"loss": loss, "responses": rollout.responses, **measured}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """Adam on the policy."""
        return torch.optim.Adam(self.policy.parameters(), lr=self.lr)


# --------------------------------------------------------------------------------------------
# Training, and the summary per turn.
# --------------------------------------------------------------------------------------------


def turn_names(turns: int) -> list[str]:
    """The turns' names in the tags: ``turn_1``, ``turn_2``, ..."""
    return [f"turn_{turn + 1}" for turn in range(turns)]


def summary(history: list[dict[str, Tensor]], turns: int) -> dict[str, dict[str, float]]:
    """Each turn's mismatch over all the run's rollouts, by the turn's name."""
    run = {key: torch.cat([step[key] for step in history]) for key in history[0]}
    per_turn = segment_metrics(
        run["rollout_log_probs"],
        run["old_log_probs"],
        run["response_mask"],
        run["segment_ids"],
        num_segments=turns,
    )
    return {name: per_turn[turn] for turn, name in enumerate(turn_names(turns))}


def print_summary(per_turn: dict[str, dict[str, float]]) -> None:
    """A table of each turn's mismatch and its multiple of the first turn's."""
    first = next(iter(per_turn.values()))
    print(f"\n{'turn':<8}{'tokens':>8}{'probs_diff_mean':>17}{'':>7}{'kl_k3':>11}{'':>8}")
    for name, metrics in per_turn.items():
        probs = metrics["rollout_probs_diff_mean"]
        k3 = metrics["rollout_actor_kl_k3"]
        print(
            f"{name:<8}{metrics['rollout_tokens']:>8.0f}{probs:>17.3e}"
            f"{probs / first['rollout_probs_diff_mean']:>6.1f}x"
            f"{k3:>11.3e}{k3 / first['rollout_actor_kl_k3']:>7.1f}x"
        )


def main(argv: list[str] | None = None) -> Path:
    """Train, log to TensorBoard, print the summary per turn, and return the log directory."""
    args = parse_args(argv)
    pl.seed_everything(args.seed, verbose=False)
    # The prompts are generated in memory; worker processes would only add start-up time.
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    # Lightning's own use of a torch API that newer torch deprecates: nothing to act on.
    warnings.filterwarnings("ignore", r".*isinstance\(treespec, LeafSpec\)` is deprecated")

    module = MultiTurnGRPO(turns=args.turns, cache_dtype=DTYPES[args.cache_dtype], seed=args.seed)
    prompts = PromptDataset(args.max_steps * PROMPTS_PER_STEP, seed=args.seed)
    loader = DataLoader(prompts, batch_size=PROMPTS_PER_STEP, num_workers=0)

    tb_logger = TensorBoardLogger(
        save_dir=args.logdir, name=f"multiturn_{args.cache_dtype}_{args.turns}turns"
    )
    callback = RolloutDebugCallback(
        segment_names=turn_names(args.turns),  # training/segments/turn_1/..., turn_2, ...
        profile_images_every_n_steps=10,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=args.max_steps,
        log_every_n_steps=1,
        enable_checkpointing=False,
        logger=tb_logger,
        callbacks=[callback],
    )
    trainer.fit(module, train_dataloaders=loader)

    print_summary(summary(module.history, args.turns))
    log_dir = Path(tb_logger.log_dir)
    print(f"\nTensorBoard logs written to {log_dir}")
    print(f"View them with:  tensorboard --logdir {args.logdir}")
    return log_dir


if __name__ == "__main__":
    main()
