"""GRPO loss against hand-computed values (clip range 0.2 unless stated)."""

import math

import pytest
import torch

from example_trainer.loss import group_advantages, grpo_loss, token_logprobs


def one_token_loss(ratio: float, advantage: float, clip_eps: float = 0.2):
    logprobs = torch.tensor([[math.log(ratio)]], requires_grad=True)
    loss, _ = grpo_loss(logprobs, torch.zeros(1, 1), torch.tensor([advantage]), torch.ones(1, 1), clip_eps=clip_eps)
    loss.backward()
    return loss.item(), logprobs.grad.item()


@pytest.mark.parametrize(
    "ratio, advantage, expected_loss, has_gradient",
    [
        (1.5, +1.0, -1.2, False),  # A > 0, above the range: clipped at 1.2, no gradient
        (0.5, +1.0, -0.5, True),  # A > 0, below the range: unclipped (min picks r*A)
        (1.1, +1.0, -1.1, True),  # A > 0, inside
        (1.5, -1.0, 1.5, True),  # A < 0, above the range: unclipped r*A = -1.5 is the min
        (0.5, -1.0, 0.8, False),  # A < 0, below the range: clipped at 0.8 (max(...) would give 0.5)
        (1.1, -1.0, 1.1, True),  # A < 0, inside
        (0.9, -2.0, 1.8, True),
    ],
)
def test_clipped_loss_matches_hand_computed_value_for_both_signs(ratio, advantage, expected_loss, has_gradient):
    loss, grad = one_token_loss(ratio, advantage)
    assert loss == pytest.approx(expected_loss, abs=1e-6)
    assert (abs(grad) > 1e-8) == has_gradient


def test_loss_is_mean_over_completion_tokens_only():
    # two sequences of 3 positions; mask keeps 2 + 1 tokens
    logprobs = torch.log(torch.tensor([[1.0, 1.1, 0.9], [1.0, 1.0, 1.15]]))
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 1.0]])
    adv = torch.tensor([1.0, -1.0])
    loss, _ = grpo_loss(logprobs, torch.zeros(2, 3), adv, mask)
    expected = (-1.1 - 0.9 + 1.15) / 3
    assert loss.item() == pytest.approx(expected, abs=1e-6)


def test_prompt_positions_do_not_change_the_loss():
    logprobs = torch.log(torch.tensor([[0.5, 1.1, 0.9]]))
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    old_a = torch.tensor([[0.0, 0.0, 0.0]])
    old_b = torch.tensor([[-5.0, 0.0, 0.0]])  # differs only at the masked prompt position
    a, _ = grpo_loss(logprobs, old_a, torch.tensor([1.0]), mask)
    b, _ = grpo_loss(logprobs, old_b, torch.tensor([1.0]), mask)
    assert a.item() == pytest.approx(b.item())


def test_num_tokens_normaliser_makes_micro_batches_sum_to_the_full_batch():
    torch.manual_seed(0)
    lp, old, mask = torch.randn(4, 5) * 0.1, torch.randn(4, 5) * 0.1, (torch.rand(4, 5) > 0.3).float()
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    full, _ = grpo_loss(lp, old, adv, mask)
    n = mask.sum().item()
    parts = sum(grpo_loss(lp[i:i + 2], old[i:i + 2], adv[i:i + 2], mask[i:i + 2], num_tokens=n)[0] for i in (0, 2))
    assert parts.item() == pytest.approx(full.item(), abs=1e-6)


def test_kl_penalty_is_zero_at_reference_and_positive_elsewhere():
    lp = torch.log(torch.tensor([[0.5, 0.25]]))
    mask = torch.ones(1, 2)
    base, _ = grpo_loss(lp, lp, torch.tensor([0.0]), mask, ref_logprobs=lp, kl_coef=1.0)
    assert base.item() == pytest.approx(0.0, abs=1e-7)
    ref = torch.log(torch.tensor([[0.25, 0.25]]))
    pen, m = grpo_loss(lp, lp, torch.tensor([0.0]), mask, ref_logprobs=ref, kl_coef=1.0)
    # k3 at token 0: exp(log .5) - log .5 - 1 = 0.5 + 0.6931 - 1 = 0.1931; token 1: 0
    assert pen.item() == pytest.approx(0.19315 / 2, abs=1e-4)
    assert m["train/kl"] == pytest.approx(0.19315 / 2, abs=1e-4)


@pytest.mark.parametrize(
    "scores, expected",
    [
        ([0.0, 1.0], [-1.0, 1.0]),
        ([0.0, 0.0, 1.0, 1.0], [-1.0, -1.0, 1.0, 1.0]),
        ([1.0, 1.0, 1.0], [0.0, 0.0, 0.0]),
        ([0.0, 0.0, 0.0, 1.0], [-1 / math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3), math.sqrt(3)]),
    ],
)
def test_group_advantages_are_score_minus_mean_over_std(scores, expected):
    got = group_advantages(torch.tensor(scores))
    assert got.tolist() == pytest.approx(expected, abs=1e-4)


def test_token_logprobs_are_shifted_by_one():
    logits = torch.zeros(1, 3, 4)
    logits[0, 0, 2] = 10.0  # position 0 predicts token 2
    logits[0, 1, 1] = 10.0  # position 1 predicts token 1
    lp = token_logprobs(logits, torch.tensor([[0, 2, 1]]))
    assert lp.shape == (1, 2)
    assert lp[0].tolist() == pytest.approx([0.0, 0.0], abs=1e-3)


def test_per_token_advantages_weigh_each_token():
    logprobs = torch.log(torch.tensor([[1.0, 1.1, 0.9]]))
    mask = torch.ones(1, 3)
    per_sequence, _ = grpo_loss(logprobs, torch.zeros(1, 3), torch.tensor([1.0]), mask, clip_eps=0.2)
    broadcast, _ = grpo_loss(logprobs, torch.zeros(1, 3), torch.ones(1, 3), mask, clip_eps=0.2)
    assert broadcast.item() == pytest.approx(per_sequence.item())
    only_last, _ = grpo_loss(logprobs, torch.zeros(1, 3), torch.tensor([[0.0, 0.0, 1.0]]), mask, clip_eps=0.2)
    assert only_last.item() == pytest.approx(-0.9 / 3)  # ratio 0.9 inside the clip range, A = 1 on one token


def tiny_llama(dtype=torch.float32, tied=True):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def grads_of(model, loss) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("tied", [True, False])
def test_chunked_logprobs_equal_the_full_ones_in_value_and_gradient(tied):
    from example_trainer.logprobs import sequence_logprobs

    model = tiny_llama(tied=tied)
    tokens = torch.randint(0, 97, (3, 12))
    mask = torch.ones_like(tokens)
    mask[2, 9:] = 0  # a padded row
    inputs = {"input_ids": tokens, "attention_mask": mask}
    weights = torch.rand(3, 11)  # any loss that uses every position
    full = sequence_logprobs(model, inputs, chunk_tokens=0)
    chunked = sequence_logprobs(model, inputs, chunk_tokens=5)  # 33 positions: 6 chunks of 5 and one of 3
    assert torch.allclose(chunked, full, atol=1e-5, rtol=0)
    assert torch.allclose(full, token_logprobs(model(**inputs).logits, tokens))
    for a, b in zip(grads_of(model, (chunked * weights).sum()), grads_of(model, (full * weights).sum())):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


def test_chunked_logprobs_with_substituted_weights_use_those_weights():
    """The CPU path computes with the fp32 masters in place of the model's bf16 parameters."""
    from example_trainer.logprobs import sequence_logprobs

    model = tiny_llama(dtype=torch.bfloat16)
    masters = {name: p.detach().float().requires_grad_() for name, p in model.named_parameters()}
    reference = tiny_llama(dtype=torch.float32)
    reference.load_state_dict({k: v.detach() for k, v in masters.items()}, strict=False)
    tokens = torch.randint(0, 97, (2, 10))
    inputs = {"input_ids": tokens, "attention_mask": torch.ones_like(tokens)}
    chunked = sequence_logprobs(model, inputs, chunk_tokens=4, weights=masters)
    assert chunked.dtype == torch.float32
    assert torch.allclose(chunked, sequence_logprobs(reference, inputs, chunk_tokens=0), atol=1e-5, rtol=0)
    chunked.sum().backward()
    assert all(m.grad is not None for m in masters.values())  # gradients land on the masters


def test_chunk_projection_never_sees_more_than_chunk_tokens_positions(monkeypatch):
    import example_trainer.loss as loss

    seen = []
    original = loss._chunk_logprobs
    monkeypatch.setattr(loss, "_chunk_logprobs", lambda h, w, t: seen.append(h.shape[0]) or original(h, w, t))
    hidden, weight = torch.randn(4, 50, 8), torch.randn(300, 8)
    loss.chunked_token_logprobs(hidden, weight, torch.randint(0, 300, (4, 50)), chunk_tokens=64)
    assert max(seen) == 64 and sum(seen) == 4 * 49
