"""The loss menu against hand-computed values (clip range 0.2 unless stated)."""

import math

import pytest
import torch

from example_trainer.rl.advantages import batch_advantages, group_advantages
from example_trainer.rl.loss import (BatchShape, PolicyLoss, masked_share, rollout_correction, rollout_gap_metrics,
                                     token_logprobs)


def grpo_loss(logprobs, old_logprobs, advantages, mask, clip_eps=0.2, ref_logprobs=None, beta=0.0, num_tokens=None,
              loss_type="dapo"):
    """``loss_type`` over one part holding the whole batch (``num_tokens``: the batch's, when it is a part)."""
    tokens = mask.sum().clamp(min=1.0).item() if num_tokens is None else num_tokens
    shape = BatchShape(tokens=tokens, sequences=logprobs.shape[0], parts=1, max_completion_length=4)
    return PolicyLoss(loss_type, "token", clip_eps, None, beta)(logprobs, old_logprobs, advantages, mask, shape,
                                                                  ref_logprobs=ref_logprobs)


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


def test_clip_fraction_counts_the_tokens_the_clip_takes_the_gradient_from_as_trl():
    # The table's ratios and advantages as one sequence: the clip acts on r = 1.5 with A > 0 and
    # r = 0.5 with A < 0 (no gradient); 0.5 with A > 0 and 1.5 with A < 0 are out of the range too,
    # but the min keeps their r A and its gradient: not clipped (TRL's clip_ratio counts as much).
    ratios = torch.tensor([[1.5, 0.5, 1.1, 1.5, 0.5, 1.1]])
    advantages = torch.tensor([[1.0, 1.0, 1.0, -1.0, -1.0, -1.0]])
    logprobs = torch.log(ratios).requires_grad_()
    loss, metrics = grpo_loss(logprobs, torch.zeros(1, 6), advantages, torch.ones(1, 6))
    loss.backward()
    assert (logprobs.grad == 0).tolist() == [[True, False, False, False, True, False]]
    assert metrics["train/clip_fraction"] == pytest.approx(2 / 6)


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
    base, _ = grpo_loss(lp, lp, torch.tensor([0.0]), mask, ref_logprobs=lp, beta=1.0)
    assert base.item() == pytest.approx(0.0, abs=1e-7)
    ref = torch.log(torch.tensor([[0.25, 0.25]]))
    pen, m = grpo_loss(lp, lp, torch.tensor([0.0]), mask, ref_logprobs=ref, beta=1.0)
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
    from example_trainer.rl.logprobs import sequence_logprobs

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
    from example_trainer.rl.logprobs import sequence_logprobs

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
    import example_trainer.rl.loss as loss

    seen = []
    original = loss._chunk_logprobs
    monkeypatch.setattr(loss, "_chunk_logprobs", lambda h, w, t: seen.append(h.shape[0]) or original(h, w, t))
    hidden, weight = torch.randn(4, 50, 8), torch.randn(300, 8)
    loss.chunked_token_logprobs(hidden, weight, torch.randint(0, 300, (4, 50)), chunk_tokens=64)
    assert max(seen) == 64 and sum(seen) == 4 * 49


def todays_loss(logprobs, old_logprobs, advantages, mask, clip_eps, ref_logprobs, beta, num_tokens):
    """The trainer's only loss before the menu (example_trainer/rl/loss.py at 663a23d), kept verbatim as the reference."""
    mask = mask.to(logprobs.dtype)
    adv = advantages.to(logprobs.dtype)
    adv = adv.unsqueeze(-1) if adv.dim() == 1 else adv
    ratio = torch.exp(logprobs - old_logprobs)
    per_token = -torch.minimum(ratio * adv, torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv)
    delta = ref_logprobs - logprobs
    per_token = per_token + beta * (torch.exp(delta) - delta - 1.0)
    return (per_token * mask).sum() / num_tokens


def test_dapo_is_todays_loss_bit_for_bit_in_value_and_gradient():
    torch.manual_seed(3)
    lp = (torch.randn(4, 7) * 0.3 - 1.0).requires_grad_()
    old, ref = torch.randn(4, 7) * 0.3 - 1.0, torch.randn(4, 7) * 0.3 - 1.0
    adv, mask = torch.randn(4), (torch.rand(4, 7) > 0.3).float()
    expected = todays_loss(lp, old, adv, mask, 0.2, ref, 0.05, num_tokens=40.0)
    (expected_grad,) = torch.autograd.grad(expected, lp)
    shape = BatchShape(tokens=40.0, sequences=8, parts=2, max_completion_length=512)
    got, _ = PolicyLoss("dapo", "token", 0.2, None, 0.05)(lp, old, adv, mask, shape, ref_logprobs=ref)
    (got_grad,) = torch.autograd.grad(got, lp)
    assert torch.equal(got, expected) and torch.equal(got_grad, expected_grad)


# Two sequences at ratio 1: row 0 has 2 completion tokens and A = +1, row 1 one token and A = -0.5.
# Per-token losses -1, -1 and +0.5: their sum is -1.5.
LP, MASK, ADV = torch.zeros(2, 2), torch.tensor([[1.0, 1.0], [1.0, 0.0]]), torch.tensor([1.0, -0.5])


@pytest.mark.parametrize("loss_type, parts, expected", [
    ("dapo", 1, -1.5 / 3),  # over the batch's 3 tokens
    ("grpo", 1, (-1.0 + 0.5) / 2),  # sequence means -1 and +0.5, averaged over 2 sequences
    ("dr_grpo", 1, -1.5 / (2 * 4)),  # sequences x max_completion_length 4
    ("bnpo", 1, -1.5 / 3),  # one part: its own token mean
])
def test_each_loss_type_averages_the_batch_as_its_paper_says(loss_type, parts, expected):
    shape = BatchShape(tokens=3.0, sequences=2, parts=parts, max_completion_length=4)
    loss, _ = PolicyLoss(loss_type)(LP, LP, ADV, MASK, shape)
    assert loss.item() == pytest.approx(expected, abs=1e-6)


def test_bnpo_takes_each_micro_batchs_token_mean_and_averages_the_parts():
    shape = BatchShape(tokens=3.0, sequences=2, parts=2, max_completion_length=4)
    policy = PolicyLoss("bnpo")
    parts = [policy(LP[i:i + 1], LP[i:i + 1], ADV[i:i + 1], MASK[i:i + 1], shape)[0].item() for i in (0, 1)]
    assert parts == pytest.approx([-2.0 / 2 / 2, 0.5 / 1 / 2])  # -0.25 in all, where dapo gives -0.5


def one_token(loss_type, ratio, advantage, epsilon=0.2, epsilon_high=None, logprob=math.log(0.5)):
    lp = torch.tensor([[logprob]], requires_grad=True)
    old = torch.tensor([[logprob - math.log(ratio)]])
    shape = BatchShape(tokens=1.0, sequences=1, parts=1, max_completion_length=4)
    loss, _ = PolicyLoss(loss_type, "token", epsilon, epsilon_high)(lp, old, torch.tensor([advantage]),
                                                                   torch.ones(1, 1), shape)
    loss.backward()
    return loss.item(), lp.grad.item()


def test_clip_higher_lets_a_positive_advantage_rise_further_and_leaves_the_lower_bound():
    assert one_token("dapo", 1.25, +1.0) == pytest.approx((-1.2, 0.0))  # clipped at 1 + 0.2: no gradient
    assert one_token("dapo", 1.25, +1.0, epsilon_high=0.28) == pytest.approx((-1.25, -1.25))  # d(-r)/dlp = -r
    assert one_token("dapo", 0.75, -1.0, epsilon_high=0.28) == pytest.approx((0.8, 0.0))  # 1 - 0.2 still binds


def test_cispo_caps_the_weight_but_keeps_every_tokens_gradient():
    # -sg(min(r, 5)) * A * log p at log p = log 0.5: r = 2 -> 2 ln 2, gradient -2; r = 8 -> capped at 5.
    assert one_token("cispo", 2.0, 1.0, epsilon_high=5.0) == pytest.approx((2 * math.log(2), -2.0))
    assert one_token("cispo", 8.0, 1.0, epsilon_high=5.0) == pytest.approx((5 * math.log(2), -5.0))
    assert one_token("dapo", 8.0, 1.0)[1] == 0.0  # where PPO's clip leaves none


def test_sequence_level_ratio_is_the_mean_log_ratio_of_the_sequence_gspo():
    # log ratios 0.2 and -0.1: one weight exp(0.05) = 1.05127 for both tokens, inside the clip range.
    lp = torch.zeros(1, 2, requires_grad=True)
    old = torch.tensor([[-0.2, 0.1]])
    shape = BatchShape(tokens=2.0, sequences=1, parts=1, max_completion_length=4)
    loss, metrics = PolicyLoss("dapo", "sequence")(lp, old, torch.tensor([1.0]), torch.ones(1, 2), shape)
    loss.backward()
    assert loss.item() == pytest.approx(-math.exp(0.05), abs=1e-6)
    assert lp.grad[0].tolist() == pytest.approx([-math.exp(0.05) / 2] * 2)  # loss -exp(mean): d/dlp_i = -exp(mean) / 2
    assert metrics["train/ratio_mean"] == pytest.approx(math.exp(0.05))
    token_level, _ = PolicyLoss("dapo", "token")(lp, old, torch.tensor([1.0]), torch.ones(1, 2), shape)
    assert token_level.item() == pytest.approx(-(1.2 + math.exp(-0.1)) / 2, abs=1e-6)  # exp(0.2) clipped at 1.2


# Row 0: trainer p = 0.5, 0.5 against vLLM's 0.25, 0.5 (ratios 2 and 1, sequence 2); row 1: 0.9 against 0.1 (9).
TRAINER = torch.log(torch.tensor([[0.5, 0.5], [0.9, 1.0]]))
ROLLOUT = torch.log(torch.tensor([[0.25, 0.5], [0.1, 1.0]]))
ROWS = torch.tensor([[1.0, 1.0], [1.0, 0.0]])


@pytest.mark.parametrize("mode, clip_min, expected", [
    ("token_truncate", None, [[2.0, 1.0], [3.0, 1.0]]),
    ("token_mask", None, [[2.0, 1.0], [0.0, 1.0]]),
    ("sequence_truncate", None, [[2.0], [3.0]]),
    ("sequence_mask", None, [[2.0], [0.0]]),
    ("token_truncate", 1.5, [[2.0, 1.5], [3.0, 1.5]]),
    ("token_mask", 1.5, [[2.0, 0.0], [0.0, 0.0]]),
])
def test_rollout_correction_truncates_or_masks_at_token_or_sequence_level(mode, clip_min, expected):
    weights, _ = rollout_correction(TRAINER, ROLLOUT, ROWS, mode, clip_min, 3.0)
    assert [row.tolist() for row in weights] == [pytest.approx(row, abs=1e-5) for row in expected]  # padding positions: ratio exp(0) = 1, masked later


def test_rollout_gap_metrics_are_taken_before_truncation():
    _, ratios = rollout_correction(TRAINER, ROLLOUT, ROWS, "token_truncate", None, 3.0)
    m = rollout_gap_metrics(TRAINER, ROLLOUT, ROWS, ratios)
    assert m["sampling/logp_difference/mean"] == pytest.approx((math.log(2) + 0 + math.log(9)) / 3, abs=1e-5)
    assert m["sampling/logp_difference/max"] == pytest.approx(math.log(9), abs=1e-5)
    assert (m["sampling/importance_ratio/min"], m["sampling/importance_ratio/mean"],
            m["sampling/importance_ratio/max"]) == pytest.approx((1.0, 4.0, 9.0), abs=1e-4)  # 9, not the cap 3
    _, ratios = rollout_correction(TRAINER, ROLLOUT, ROWS, "sequence_mask", None, 3.0)
    m = rollout_gap_metrics(TRAINER, ROLLOUT, ROWS, ratios)
    assert (m["sampling/importance_ratio/min"], m["sampling/importance_ratio/mean"],
            m["sampling/importance_ratio/max"]) == pytest.approx((2.0, (2 * 2 + 9) / 3, 9.0), abs=1e-4)


@pytest.mark.parametrize("mode, clip_min, expected", [
    ("sequence_mask", None, 1 / 3),  # row 1's one token (ratio 9 > 3) of the 3 completion tokens
    ("token_mask", 1.5, 2 / 3),  # row 0's second token (ratio 1 < 1.5) and row 1's
    ("token_truncate", None, 0.0),  # truncation keeps every token
])
def test_the_masked_share_counts_completion_tokens_the_correction_dropped(mode, clip_min, expected):
    weights, _ = rollout_correction(TRAINER, ROLLOUT, ROWS, mode, clip_min, 3.0)
    assert masked_share(weights, ROWS) == pytest.approx(expected)
    assert masked_share(weights, torch.zeros_like(ROWS)) == 0.0  # a part without completion tokens


def test_the_correction_weighs_each_tokens_loss():
    lp = torch.zeros(1, 2, requires_grad=True)
    shape = BatchShape(tokens=2.0, sequences=1, parts=1, max_completion_length=4)
    weights = torch.tensor([[2.0, 0.0]])
    loss, _ = PolicyLoss("dapo")(lp, lp.detach(), torch.tensor([1.0]), torch.ones(1, 2), shape, rollout_weights=weights)
    loss.backward()
    assert loss.item() == pytest.approx(-1.0) and lp.grad.tolist() == [[-1.0, 0.0]]  # (-2 * 1 + 0) / 2 tokens


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_a_group_of_equal_scores_gets_zero_advantages_whatever_its_size_and_score(scale):
    """Nine scores of 0.9 have a float32 mean 6e-8 below 0.9: divided by their std (about 0) plus
    1e-6, every completion got -0.056, a push on a group with no signal."""
    flat = [torch.full((n,), s) for n, s in ((9, 0.9), (12, 0.35), (3, 0.1), (13, 0.9), (6, 0.7))]
    for scores, advantages in zip(flat, batch_advantages([*flat, torch.tensor([0.0, 1.0])], scale)):
        assert advantages.tolist() == [0.0] * len(scores), (scores[0].item(), len(scores), advantages)
    assert group_advantages(torch.full((9,), 0.9)).tolist() == [0.0] * 9


@pytest.mark.parametrize("scale, expected", [
    ("group", [[-1.0, 1.0], [-1 / math.sqrt(3)] * 3 + [math.sqrt(3)]]),
    # every score [0, 1, 0, 0, 0, 3]: mean 2/3, population std sqrt(11/9) = 1.10554
    ("batch", [[-0.5 / 1.10554, 0.5 / 1.10554], [-0.75 / 1.10554] * 3 + [2.25 / 1.10554]]),
    ("none", [[-0.5, 0.5], [-0.75, -0.75, -0.75, 2.25]]),
])
def test_scale_rewards_divides_by_the_groups_or_the_batchs_std_or_nothing(scale, expected):
    got = batch_advantages([torch.tensor([0.0, 1.0]), torch.tensor([0.0, 0.0, 0.0, 3.0])], scale)
    assert [g.tolist() for g in got] == [pytest.approx(e, abs=1e-4) for e in expected]
