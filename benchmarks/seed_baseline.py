"""The original debug-metrics algorithm, kept as the baseline the benchmarks compare against.

It exponentiates into full copies, gathers the masked values with ``masked_select``,
stacks them for ``corrcoef`` and reads five scalars back one by one.
"""

from __future__ import annotations

import torch
from torch import Tensor


def seed_pearson_correlation_coefficient(tensor1: Tensor, tensor2: Tensor, mask: Tensor) -> float:
    selected1 = torch.masked_select(tensor1, mask)
    selected2 = torch.masked_select(tensor2, mask)
    return torch.corrcoef(torch.stack([selected1, selected2], dim=0))[0][1].detach().item()


def seed_calculate_log_prob_diff(a: Tensor, b: Tensor, mask: Tensor) -> Tensor:
    return torch.masked_select(torch.abs(a - b), mask)


def seed_calculate_debug_metrics(batch: dict[str, Tensor]) -> dict[str, float]:
    mask = batch["response_mask"].bool()
    actor_probs = torch.exp(batch["old_log_probs"])
    rollout_probs = torch.exp(batch["rollout_log_probs"])
    pearson = seed_pearson_correlation_coefficient(actor_probs, rollout_probs, mask)
    diff = seed_calculate_log_prob_diff(actor_probs, rollout_probs, mask)
    return {
        "training/rollout_probs_diff_valid": 1,
        "training/rollout_probs_diff_max": torch.max(diff).item(),
        "training/rollout_probs_diff_mean": torch.mean(diff).item(),
        "training/rollout_probs_diff_std": torch.std(diff).item(),
        "training/rollout_actor_probs_pearson_corr": pearson,
    }
