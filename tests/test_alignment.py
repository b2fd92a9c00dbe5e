"""``response_log_probs``: hand-computed values, and a real causal LM with random weights."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_rollout_debug import response_log_probs


def test_a_forward_pass_scores_each_token_from_the_position_before() -> None:
    vocab, prompt = 4, 3
    sequences = torch.tensor([[1, 2, 3, 0, 2, 1, 1]])  # prompt [1 2 3], response [0 2 1 1]
    logits = torch.randn(1, sequences.shape[1], vocab, generator=torch.Generator().manual_seed(0))
    log_probs, mask = response_log_probs(logits, sequences, prompt)
    want = [
        logits[0, t - 1].log_softmax(-1)[sequences[0, t]].item()
        for t in range(prompt, sequences.shape[1])
    ]
    assert log_probs[0].tolist() == pytest.approx(want, abs=1e-6)
    assert mask.tolist() == [[True] * 4]


def test_eos_ends_the_response_and_pads_are_masked_out() -> None:
    eos, pad = 3, 0
    sequences = torch.tensor(
        [
            [5, 1, 2, 3, 0, 0],  # ends at EOS, then padding
            [5, 1, 2, 2, 2, 2],  # no EOS
            [5, 3, 0, 3, 3, 0],  # EOS first: only it counts
        ]
    )
    logits = torch.zeros(3, 6, 6)
    _, mask = response_log_probs(logits, sequences, 1, eos_token_id=eos, pad_token_id=pad)
    assert mask.int().tolist() == [[1, 1, 1, 0, 0], [1] * 5, [1, 0, 0, 0, 0]]
    # Pad and EOS one id (as many tokenizers have it): the first EOS still counts.
    _, mask = response_log_probs(logits, sequences, 1, eos_token_id=eos, pad_token_id=eos)
    assert mask.int().tolist() == [[1, 1, 1, 0, 0], [1] * 5, [1, 0, 0, 0, 0]]


def test_temperature_divides_the_logits() -> None:
    sequences = torch.tensor([[0, 1]])
    logits = torch.tensor([[[0.0, 2.0], [0.0, 0.0]]])
    log_probs, _ = response_log_probs(logits, sequences, 1, temperature=2.0)
    assert log_probs.item() == pytest.approx(1.0 - math.log(1.0 + math.e))


@pytest.mark.parametrize(
    ("logits_shape", "sequences_shape", "prompt", "message"),
    [
        ((2, 5, 3), (3, 5), 2, "same B"),
        ((2, 5, 3), (2, 5), 0, "prompt_width"),
        ((2, 5, 3), (2, 5), 5, "prompt_width"),
        ((2, 4, 3), (2, 5), 2, "expected 5"),
    ],
)
def test_shapes_that_do_not_fit_are_named(
    logits_shape: tuple[int, ...], sequences_shape: tuple[int, ...], prompt: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        response_log_probs(torch.zeros(logits_shape), torch.zeros(sequences_shape).long(), prompt)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"prompt_width": True}, "`prompt_width` must be an int between 1 and the width of "
         "`sequences` minus 1 (4); got True."),
        ({"prompt_width": 2.5}, "`prompt_width` must be an int between 1 and the width of "
         "`sequences` minus 1 (4); got 2.5."),
        ({"temperature": math.inf}, "`temperature` must be a finite positive number, got inf."),
        ({"temperature": 0.0}, "`temperature` must be a finite positive number, got 0.0."),
        ({"temperature": "1"}, "`temperature` must be a finite positive number, got '1'."),
        ({"pad_token_id": "0"}, "`pad_token_id` must be None or an int token id, got '0'."),
        ({"eos_token_id": "0"}, "`eos_token_id` must be None or an int token id, got '0'."),
        ({"eos_token_id": 2.0}, "`eos_token_id` must be None or an int token id, got 2.0."),
        ({"sequences": torch.zeros(2, 5)}, "`sequences` must be an integer tensor of token ids, "
         "got torch.float32."),
        ({"sequences": [[0] * 5] * 2}, "`sequences` must be a torch.Tensor, got a list."),
        ({"logits": torch.zeros(2, 5, 3).numpy()}, "`logits` must be a torch.Tensor, got a "
         "ndarray."),
        ({"logits": torch.zeros(2, 5, 3).long()}, "`logits` must be a floating-point tensor, got "
         "torch.int64."),
    ],
)  # fmt: skip
def test_arguments_that_are_not_numbers_of_the_kind_are_named(
    arguments: dict[str, object], message: str
) -> None:
    call = {"logits": torch.zeros(2, 5, 3), "sequences": torch.zeros(2, 5).long()}
    call = {**call, "prompt_width": 2, **arguments}
    with pytest.raises(ValueError) as raised:
        response_log_probs(**call)  # type: ignore[arg-type]
    assert str(raised.value) == message


@pytest.mark.parametrize("dtype", [torch.int16, torch.int32, torch.uint8])
def test_token_ids_of_any_integer_dtype_give_the_same_log_probs(dtype: torch.dtype) -> None:
    sequences = torch.tensor([[1, 2, 0, 2, 1], [1, 2, 2, 1, 0]])
    logits = torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(2))
    want = response_log_probs(logits, sequences, 2, eos_token_id=0, pad_token_id=1)
    got = response_log_probs(logits, sequences.to(dtype), 2, eos_token_id=0, pad_token_id=1)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_an_id_outside_the_vocabulary_has_no_log_prob() -> None:
    """-100 (the labels' ignore index) where the response is padded: its log-prob is NaN,
    outside the mask; inside it, the callback counts it among the non-finite tokens."""
    sequences = torch.tensor([[1, 2, 0, -100, -100], [1, 2, 7, 1, 0]])
    logits = torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(1))
    log_probs, mask = response_log_probs(logits, sequences, 2, pad_token_id=-100)
    assert mask.tolist() == [[True, False, False], [True, True, True]]
    want = logits[:, 1:-1].log_softmax(-1)
    assert log_probs[0, 0].item() == pytest.approx(want[0, 0, 0].item(), abs=1e-6)
    others = [want[1, 1, 1].item(), want[1, 2, 0].item()]
    assert log_probs[1, 1:].tolist() == pytest.approx(others, abs=1e-6)
    assert log_probs.isnan().tolist() == [[False, True, True], [True, False, False]]


def test_a_real_causal_lm_gives_the_same_log_probs_by_forward_pass_and_by_generate() -> None:
    """A small GPT-2 with random weights: the full forward pass and `generate`'s per-step
    logits give the same response log-probs; slicing the logits from the prompt width
    (the usual off-by-one) does not."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=1,
        eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    prompts = torch.randint(3, 64, (4, 6))
    generated = model.generate(
        prompts,
        attention_mask=torch.ones_like(prompts),
        do_sample=True,
        max_new_tokens=12,
        output_logits=True,
        return_dict_in_generate=True,
    )
    sequences = generated.sequences
    options = {"eos_token_id": 2, "pad_token_id": 0}
    rollout, rollout_mask = response_log_probs(
        torch.stack(generated.logits, 1), sequences, 6, **options
    )
    with torch.no_grad():
        full = model(sequences).logits
    old, old_mask = response_log_probs(full, sequences, 6, **options)
    assert torch.equal(rollout_mask, old_mask)
    assert torch.allclose(old[old_mask], rollout[old_mask], atol=1e-4)
    shifted = full[:, 6:].float().log_softmax(-1).gather(-1, sequences[:, 6:].unsqueeze(-1))
    assert not torch.allclose(shifted.squeeze(-1)[:, :-1], rollout[:, :-1], atol=1e-2)
