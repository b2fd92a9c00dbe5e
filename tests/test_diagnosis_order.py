"""One root cause at a time: a cause of the pipeline is named before the symptoms it explains.

The causes (misaligned or shifted log-probs, padding, masked logits, dropout, stale
weights) are mistakes of the pipeline itself; the symptoms (truncated and one-sided
sampling) are what the KL estimates show, and every cause moves them. Each test feeds a
window that shows a cause and the symptom it brings, through a real Trainer (or a
monitor), and checks that only the cause is named, with the symptom said as its
consequence; and that the same symptom alone is still named.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_diagnosis import DropoutModule, fit, one_with, sampled_batch, zero_padded_batch
from torch import Tensor

from lightning_rollout_debug.checks.findings import CAUSES, SYMPTOMS, Diagnosis, in_order

pytestmark = [
    pytest.mark.filterwarnings("ignore:The '.*dataloader' does not have many workers"),
    pytest.mark.filterwarnings("ignore:The number of training batches .* is smaller than"),
    pytest.mark.filterwarnings("ignore:`isinstance.treespec, LeafSpec.` is deprecated"),
    pytest.mark.filterwarnings("ignore:RolloutDebugCallback at step .* is outside"),
]

PAD = 3
"""The pad id of the padded batches."""


def test_causes_come_first_and_silence_their_symptoms() -> None:
    found = [Diagnosis(kind, kind) for kind in ("truncated", "stale", "padding", "one_sided")]
    ordered = in_order(found)
    assert [d.kind for d in ordered] == ["padding", "stale"]
    assert ordered[0].message == (
        "padding The KL estimates of this window also read like truncated and one-sided "
        "sampling: a consequence of it, not a cause of its own."
    )
    assert ordered[1].message == "stale"
    assert in_order(found[:1]) == found[:1]  # a symptom alone is named
    assert in_order(found[:1], known={"dropout"}) == []  # a cause known from elsewhere
    assert set(CAUSES).isdisjoint(SYMPTOMS)


def padded_with_real_log_probs(seed: int) -> dict[str, Tensor]:
    """A batch sampled from the full distribution whose rows end early, the pads after
    them masked in: the engine recorded its log-prob of each forced pad (about -6), the
    trainer scores it higher (about -4). Tokens the engine did not sample: k1 below 0."""
    batch = sampled_batch(seed)
    generator = torch.Generator().manual_seed(100 + seed)
    rows, width = batch["response_mask"].shape
    after = ~batch["response_mask"].bool()
    ids = torch.randint(8, 32, (rows, width), generator=generator).masked_fill(after, PAD)
    engine = -6.0 + 0.3 * torch.randn(rows, width, generator=generator)
    trainer = engine + 2.0 + 0.3 * torch.randn(rows, width, generator=generator)
    batch["rollout_log_probs"] = torch.where(after, engine, batch["rollout_log_probs"])
    batch["old_log_probs"] = torch.where(after, trainer, batch["old_log_probs"])
    batch["response_mask"] = torch.ones_like(after)
    batch["responses"] = ids
    return batch


@pytest.mark.parametrize("pad_token_id", [PAD, None], ids=["pad-id", "no-pad-id"])
def test_padding_is_named_before_the_one_sided_reading_it_explains(
    pad_token_id: int | None,
) -> None:
    batches = [padded_with_real_log_probs(seed) for seed in range(2)]
    r = torch.cat([(b["rollout_log_probs"] - b["old_log_probs"]).flatten() for b in batches])
    assert r.double().mean() < -0.1  # k1: the one-sided reading
    run = fit(batches, pad_token_id=pad_token_id)
    if pad_token_id is None:  # nothing shows the padding: the reading is named, padding with it
        assert run.callback.monitor.diagnosed == {"one_sided"}, run.diagnoses()
        message = one_with(run.diagnoses(), "clearly below 0")
        assert "the mask holds tokens the engine did not sample" in message
        assert "pass pad_token_id" in message
        return
    assert run.callback.monitor.diagnosed == {"padding"}, run.diagnoses()
    message = one_with(run.diagnoses(), "padding")
    assert "pad tokens inside the response mask" in message
    assert message.endswith(
        "The KL estimates of this window also read like one-sided sampling: a consequence "
        "of it, not a cause of its own."
    )


@pytest.mark.parametrize("dropout", [0.1, 0.0], ids=["dropout", "no-dropout"])
def test_a_run_with_dropout_names_dropout_alone(dropout: float) -> None:
    """Windows that read as truncated sampling and as zero-filled padding, recomputed by a
    module with dropout active: its noise can read as either, so neither is named after
    it. Without dropout the same windows name both."""
    batches = [sampled_batch(0, top_k=8), zero_padded_batch(1), sampled_batch(2, top_k=8)]
    run = fit(module=DropoutModule(batches, dropout), log_every_n_steps=1)
    if not dropout:
        assert run.callback.monitor.diagnosed == {"truncated", "padding"}, run.diagnoses()
        return
    (message,) = run.diagnoses()
    assert "dropout module(s)" in message
    assert "can read as misaligned log-probs, padding or truncated sampling" in message
    assert run.callback.monitor.diagnosed == {"dropout"}
    assert run.callback.monitor.causes == {"dropout"}


def test_pad_ids_and_masked_logits_are_named_with_dropout_known() -> None:
    """What dropout's noise cannot give (pad ids, a trainer's log-prob of -inf) is still
    named after it."""
    batch = padded_with_real_log_probs(0)
    batch["old_log_probs"][0, 0] = -math.inf
    run = fit(module=DropoutModule([batch], 0.1), pad_token_id=PAD)
    assert run.callback.monitor.diagnosed == {"dropout", "padding", "masked_logits"}
