"""The GRPO run of ``grpo_mismatch.py`` in a Lightning Fabric loop, watched by RolloutDebugMonitor.

The same task, policy, rollout engine, reward and PPO loss as ``examples/grpo_mismatch.py``
(imported from it), trained with a loop of its own instead of a Trainer: the loop hands
each batch's ``rollout_log_probs``, ``old_log_probs`` and ``response_mask`` to a
:class:`~lightning_rollout_debug.RolloutDebugMonitor` and calls ``monitor.log(step,
fabric=fabric)`` every ``--log-every`` steps. The monitor merges the window of every
process, logs the ``training/*`` scalars to the Fabric's TensorBoard logger, writes the
histograms, the worst tokens and the dashboard layout there, and checks the alerts (here
they warn; built with ``RolloutDebugMonitor(on_alert="stop")`` the loop would also stop
when a metric leaves its range).

Run it, then open TensorBoard::

    python examples/grpo_mismatch_fabric.py --logdir runs
    python examples/grpo_mismatch_fabric.py --weight-sync-every 4 --logdir runs
    python examples/grpo_mismatch_fabric.py --devices 2 --logdir runs  # two CPU processes
    tensorboard --logdir runs

The default run (30 steps) takes well under a minute on two CPU cores.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

ROLLOUT_DTYPES = ("float32", "bfloat16", "float16")


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
        help="Send the trained weights to the rollout engine every N optimizer steps.",
    )
    parser.add_argument("--max-steps", type=int, default=30, help="Number of optimizer steps.")
    parser.add_argument("--log-every", type=int, default=1, help="Log every this many steps.")
    parser.add_argument(
        "--devices", type=int, default=1, help="CPU processes (DDP with gloo when above 1)."
    )
    parser.add_argument(
        "--logdir", default="runs", help="Directory the TensorBoard logs are written under."
    )
    parser.add_argument("--seed", type=int, default=0, help="Random seed.")
    args = parser.parse_args(argv)
    for flag in ("weight_sync_every", "max_steps", "log_every", "devices"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    return args


if __name__ == "__main__":
    parse_args()  # --help and wrong flags exit here, before the slow imports below

import torch  # noqa: E402
from grpo_mismatch import (  # noqa: E402
    GROUP_SIZE,
    LEARNING_RATE,
    PPO_CLIP,
    PROMPT_LEN,
    PROMPTS_PER_STEP,
    SEP,
    PromptDataset,
    RolloutEngine,
    TinyCausalLM,
    group_advantages,
    ppo_clip_loss,
    reversal_reward,
    token_log_probs,
)
from torch import Tensor  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

try:  # the unified package where installed, else the one pytorch-lightning ships
    from lightning.fabric import Fabric
    from lightning.fabric.loggers import TensorBoardLogger
except ImportError:
    from lightning_fabric import Fabric
    from lightning_fabric.loggers import TensorBoardLogger

from lightning_rollout_debug import RolloutDebugMonitor  # noqa: E402


def grpo_step(
    policy: torch.nn.Module, engine: RolloutEngine, digits: Tensor
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """One GRPO step's forward: (loss, mean reward, the tensors the monitor reads)."""
    digits = digits.repeat_interleave(GROUP_SIZE, dim=0)
    prompts = torch.cat([digits, torch.full_like(digits[:, :1], SEP)], dim=1)
    rollout = engine.generate(prompts)
    sequences = torch.cat([prompts, rollout.responses], dim=1)
    new_log_probs = token_log_probs(policy(sequences)[:, PROMPT_LEN - 1 : -1], rollout.responses)
    old_log_probs = new_log_probs.detach()  # one PPO update per batch: old = new
    rewards = reversal_reward(digits, rollout.responses)
    advantages = group_advantages(rewards, GROUP_SIZE)
    loss = ppo_clip_loss(new_log_probs, old_log_probs, advantages, rollout.mask, PPO_CLIP)
    tensors = {
        "rollout_log_probs": rollout.log_probs,
        "old_log_probs": old_log_probs,
        "response_mask": rollout.mask,
        "responses": rollout.responses,
    }
    return loss, rewards.mean(), tensors


def train(fabric: Fabric, args: argparse.Namespace) -> None:
    """The training loop, on every process."""
    fabric.seed_everything(args.seed)
    policy = TinyCausalLM()
    dtype = getattr(torch, args.rollout_dtype)
    engine = RolloutEngine(policy, dtype, seed=args.seed + fabric.global_rank)
    optimizer = torch.optim.Adam(policy.parameters(), lr=LEARNING_RATE)
    model, optimizer = fabric.setup(policy, optimizer)
    prompts = PromptDataset(args.max_steps * PROMPTS_PER_STEP * fabric.world_size, args.seed)
    loader = fabric.setup_dataloaders(DataLoader(prompts, batch_size=PROMPTS_PER_STEP))
    monitor = RolloutDebugMonitor()

    step = -1
    for step, digits in enumerate(loader):  # max_steps batches on each process
        if step % args.weight_sync_every == 0:
            engine.load_weights(policy)  # the engine gets fresh weights only now
        loss, reward, tensors = grpo_step(model, engine, digits)
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()

        monitor.update(tensors)  # on the batch's device, without waiting for it
        fabric.log("train/reward", reward, step=step)
        if (step + 1) % args.log_every == 0:
            monitor.log(step, fabric=fabric)  # every process, at the same steps
        if monitor.should_stop:  # on_alert="stop": the same on every process
            break
    if monitor.batches_in_window:
        monitor.log(step, fabric=fabric)
    if torch.distributed.is_initialized():  # gloo: destroyed before the process exits
        torch.distributed.destroy_process_group()


def main(argv: list[str] | None = None) -> Path:
    """Train, log to TensorBoard, and return the run's log directory."""
    args = parse_args(argv)
    # The prompts are generated in memory; worker processes would only add start-up time.
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    logger = TensorBoardLogger(
        args.logdir, name=f"grpo_fabric_{args.rollout_dtype}_sync{args.weight_sync_every}"
    )
    fabric = Fabric(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        loggers=[logger],
    )
    fabric.launch(train, args)
    fabric.logger.finalize("success")
    log_dir = Path(logger.log_dir)
    if fabric.is_global_zero:
        print(f"\nTensorBoard logs written to {log_dir}")
        print(f"View them with:  tensorboard --logdir {args.logdir}")
    return log_dir


if __name__ == "__main__":
    main()
