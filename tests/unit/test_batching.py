"""Groups from the API are parsed into typed groups (a malformed one stops the trainer, naming
the field) and become padded tensors with prompts masked and per-group advantages."""

import pytest
import torch

from api.models import ScoredData
from example_trainer.data.api_client import DropWatch, MalformedBatch, TrajectoryClient, parse_batch
from example_trainer.data.batching import build_batch


def group_fields(prompt, completions, scores, logprob=-0.5, **fields) -> dict:
    """A group as JSON fields: each completion after the same prompt, rollout logprobs on every token."""
    tokens = [prompt + c for c in completions]
    masks = [[-100] * len(prompt) + c for c in completions]
    lps = [[1.0] * len(prompt) + [logprob] * len(c) for c in completions]
    return {"tokens": tokens, "masks": masks, "scores": scores, "inference_logprobs": lps, **fields}


def group(prompt, completions, scores, logprob=-0.5, **fields) -> ScoredData:
    return ScoredData(**group_fields(prompt, completions, scores, logprob, **fields))


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
    # One advantage per token; the prompt's are masked anyway.
    g = group([5, 6], [[7, 8, 9]], [1.0], advantages=[[0.0, 0.0, 0.1, 0.2, 0.3]])
    batch = build_batch([g], seq_len=8)
    assert batch.advantages[0].tolist() == pytest.approx([0.0, 0.1, 0.2, 0.3])  # of tokens 1..4


def test_a_batch_mixing_groups_with_and_without_rollout_logprobs_keeps_each_rows_own(caplog):
    without = group([1], [[2, 3]], [1.0], inference_logprobs=None)
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


@pytest.mark.parametrize("rows, parts", [(6, 4), (5, 2), (3, 3), (7, 1), (2, 3), (4, 8), (1, 2)])
def test_split_never_drops_a_row(rows, parts):
    # 6 rows in 4 micro-batches once trained 4 of them: two rows' tokens counted in the loss's
    # normaliser but never took part in it.
    batch = build_batch([group([1], [[2 + i] for i in range(rows)], [float(i % 2) for i in range(rows)])], seq_len=8)
    split = batch.split(parts)
    assert len(split) == parts
    assert torch.equal(torch.cat([p.tokens for p in split]), batch.tokens)
    assert torch.equal(torch.cat([p.completion_mask for p in split]), batch.completion_mask)
    assert sum((p.scores for p in split), []) == batch.scores
    assert max(len(p.scores) for p in split) - min(len(p.scores) for p in split) <= 1


def test_a_short_batch_splits_into_more_parts_than_rows_with_the_extra_parts_empty():
    # The group filter serves fewer rows than --batch-size when it cannot fill a batch: 4 rows
    # into 8 micro-batches stopped the run ("cannot split 4 rows into 8 micro-batches").
    batch = build_batch([group([1], [[2], [3]], [1.0, 0.0])], seq_len=8)
    parts = batch.split(3)
    assert [len(p.scores) for p in parts] == [1, 1, 0] and parts[2].tokens.shape == (0, 2)
    with pytest.raises(ValueError, match="into 0 micro-batches"):
        batch.split(0)



def test_a_served_batch_parses_into_typed_groups_that_build_a_batch():
    served = {"batch": [group_fields([5, 6], [[7], [8]], [1.0, 0.0], logprob=-0.25, group_uuid="g1")]}
    (parsed,) = parse_batch(served)
    assert isinstance(parsed, ScoredData)
    assert parsed.inference_logprobs == [[1.0, 1.0, -0.25]] * 2 and parsed.group_uuid == "g1"
    assert build_batch([parsed], seq_len=8).old_logprobs[:, 1].tolist() == [-0.25, -0.25]


def test_no_batch_yet_parses_to_none():
    assert parse_batch({"batch": None}) is None


MALFORMED = {
    "token_not_int": ({"tokens": [[5, "x"]]}, "batch[1].tokens[0][1]"),
    "scores_missing": ({"scores": None}, "batch[1].scores"),
    "logprob_row_short": ({"inference_logprobs": [[1.0, -0.5]]}, "batch[1].inference_logprobs[0]"),
    "masks_count": ({"masks": [[-100, 1, 1], [-100, 1, 1]]}, "batch[1].masks"),
    "distill_logprobs_missing": ({"distill_token_ids": [[[1], [2], [3]]]}, "batch[1].distill_logprobs"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_group_stops_the_trainer_naming_group_and_field(case):
    change, where = MALFORMED[case]
    bad = {**group_fields([5], [[6, 7]], [1.0]), **change}
    with pytest.raises(MalformedBatch) as raised:
        parse_batch({"batch": [group_fields([5], [[6, 7]], [1.0]), bad]})
    assert f"served a malformed batch, {where}: " in str(raised.value)
    assert "Nothing of it was trained on" in str(raised.value)


def test_get_batch_raises_on_a_malformed_batch_instead_of_returning_it(monkeypatch):
    client = TrajectoryClient("http://api.invalid")
    bad = group_fields([5], [[6, 7]], [1.0], masks=[[-100, 7]])
    monkeypatch.setattr(client, "_call", lambda method, path, **kwargs: {"batch": [bad]})
    with pytest.raises(MalformedBatch, match=r"GET http://api.invalid/batch served a malformed batch, "
                                             r"batch\[0\]\.masks\[0\]: has 2 entries but tokens\[0\] has 3"):
        client.get_batch(timeout=5)


def test_truncated_completions_leave_the_loss_and_finished_ones_stay():
    from example_trainer.data.batching import build_batch

    batch = build_batch([group([1], [[5, 2], [5, 6]], [1.0, 0.0])], seq_len=8, end_tokens={2})  # 2 = end of sequence
    assert batch.truncated.tolist() == [False, True]
    assert batch.completion_mask.tolist() == [[1.0, 1.0], [0.0, 0.0]]
    assert build_batch([group([1], [[5, 2], [5, 6]], [1.0, 0.0])], seq_len=8).truncated.tolist() == [False, False]


def test_scale_rewards_reaches_the_batchs_advantages():
    groups = [group([1], [[2], [3]], [0.0, 1.0]), group([1], [[2], [3], [4], [5]], [0.0, 0.0, 0.0, 3.0])]
    assert build_batch(groups, seq_len=8, scale_rewards="none").advantages[:, 0].tolist() == \
        pytest.approx([-0.5, 0.5, -0.75, -0.75, -0.75, 2.25])


@pytest.mark.parametrize("params", [{"top_p": 0.9}, {"top_k": 20}, {"min_p": 0.05}])
def test_the_rollout_correction_refuses_groups_sampled_from_a_truncated_distribution(params):
    from example_trainer.data.batching import refuse_truncated_sampling

    sampled = group([1], [[2], [3]], [0.0, 1.0], generation_params={"temperature": 0.7, "top_p": 1.0, **params})
    with pytest.raises(ValueError, match=str(params)[1:-1].replace("'", ".")):
        refuse_truncated_sampling([sampled])
    refuse_truncated_sampling([group([1], [[2]], [0.0], generation_params={"temperature": 0.7, "top_p": 1.0,
                                                                           "top_k": -1})])


def test_token_versions_are_shifted_like_the_targets_and_measure_how_far_behind_the_batch_is():
    from example_trainer.data.batching import off_policy_metrics

    sent = group([1, 1], [[5, 6, 7], [8, 9]], [1.0, 0.0], weight_versions=[[-1, -1, 3, 4, 4], [-1, -1, 6, 6]])
    batch = build_batch([sent], seq_len=8)
    assert batch.versions.tolist() == [[-1, 3, 4, 4], [-1, 6, 6, -1]]
    # at version 6: tokens 3, 4, 4 are 3, 2, 2 behind, tokens 6, 6 none
    metrics = off_policy_metrics(batch, 6)
    assert metrics.pop("off_policy/tokens_by_lag") == [2, 0, 2, 1]  # two at 0, none at 1, two at 2, one at 3
    assert metrics == pytest.approx({"off_policy/mean": 7 / 5, "off_policy/max": 3.0})
    assert off_policy_metrics(batch, None) == {}
    assert off_policy_metrics(build_batch([group([1], [[2]], [0.0])], seq_len=8), 6) == {}


def test_the_trainers_wait_warning_gives_each_drop_reasons_cause_and_flag():
    """A run whose prompts were all too long warned only "a group was longer than the environment's
    --env.max_token_length": not that it was the prompt, nor what to change."""
    watch = DropWatch(TrajectoryClient("http://api.invalid"))
    watch.latest = {"dropped_equal_scores": 2, "skipped_too_long": 3}
    summary = watch.summary()
    assert "2 dropped_equal_scores (" in summary and "--env.ensure_scores_are_not_same false" in summary
    too_long = summary.split("3 skipped_too_long (")[1]
    assert "prompt" in too_long and "raise --env.max_token_length" in too_long and "--env.shots" in too_long
