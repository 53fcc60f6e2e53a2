"""Groups from the API become padded tensors with prompts masked and per-group advantages."""

import pytest
import torch

from example_trainer.batching import build_batch


def group(prompt, completions, scores, logprob=-0.5):
    tokens = [prompt + c for c in completions]
    masks = [[-100] * len(prompt) + c for c in completions]
    lps = [[1.0] * len(prompt) + [logprob] * len(c) for c in completions]
    return {"tokens": tokens, "masks": masks, "scores": scores, "inference_logprobs": lps}


def test_prompt_tokens_are_masked_and_targets_shifted():
    batch = build_batch([group([5, 6, 7], [[8, 9], [10]], [1.0, 0.0])], seq_len=16)
    # sequence 0: tokens 5 6 7 8 9 → targets 6 7 8 9; completion targets are 8, 9
    assert batch.completion_mask[0].tolist() == [0.0, 0.0, 1.0, 1.0]
    assert batch.completion_mask[1].tolist() == [0.0, 0.0, 1.0, 0.0]  # padded position stays 0
    assert batch.old_logprobs[0, 2:].tolist() == [-0.5, -0.5]
    assert batch.attention_mask[1].tolist() == [1, 1, 1, 1, 0]


def test_advantages_are_normalised_within_each_group():
    batch = build_batch([group([1], [[2], [3]], [1.0, 0.0]), group([1], [[2], [3]], [5.0, 5.0])], seq_len=8)
    assert batch.advantages[:, 0].tolist() == pytest.approx([1.0, -1.0, 0.0, 0.0], abs=1e-4)


def test_per_token_advantages_are_used_as_sent():
    g = group([5, 6], [[7, 8, 9]], [1.0])
    g["advantages"] = [[0.0, 0.0, 0.1, 0.2, 0.3]]  # one per token; the prompt's are masked anyway
    batch = build_batch([g], seq_len=8)
    assert batch.advantages[0].tolist() == pytest.approx([0.0, 0.1, 0.2, 0.3])  # of tokens 1..4


def test_a_batch_mixing_groups_with_and_without_rollout_logprobs_keeps_each_rows_own(caplog):
    without = group([1], [[2, 3]], [1.0, 0.0][:1])
    del without["inference_logprobs"]
    batch = build_batch([group([1], [[2, 3]], [1.0], logprob=-0.7), without], seq_len=8)
    assert batch.has_old_logprobs.tolist() == [True, False]
    assert batch.old_logprobs[0].tolist() == pytest.approx([-0.7, -0.7])
    assert "1 of 2 sequences came without inference logprobs" in caplog.text


def test_sequence_longer_than_seq_len_is_an_error():
    with pytest.raises(ValueError, match="seq-len"):
        build_batch([group([1, 2, 3], [[4, 5, 6]], [1.0])], seq_len=4)


def test_split_keeps_rows_together():
    batch = build_batch([group([1], [[2], [3], [4], [5]], [1.0, 0.0, 1.0, 0.0])], seq_len=8)
    parts = batch.split(2)
    assert [p.tokens.shape[0] for p in parts] == [2, 2]
    assert torch.equal(torch.cat([p.tokens for p in parts]), batch.tokens)

