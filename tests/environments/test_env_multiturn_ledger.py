"""EpisodeLedger and episodes_group: row layout over turns, closing rows, baselines over episodes."""

import numpy as np
import pytest
import torch

from environments.multiturn.ledger import (Episode, EpisodeLedger, PromptMismatch, Row, episode_advantages,
                                           episodes_group)
from example_trainer.rl.advantages import batch_advantages

PROMPT = [1, 2, 3]


def three_turns() -> tuple[EpisodeLedger, list[list[int]]]:
    """Prompt, then 3 sampled turns with 2 tool results between them; returns the prompts sent."""
    ledger = EpisodeLedger(PROMPT)
    sent = []
    for turn, (sampled, context) in enumerate([([10, 11], [20, 21, 22]), ([12], [23]), ([13, 14, 15], None)]):
        sent.append(ledger.prompt_ids)
        ledger.check_echo(sent[-1])
        ledger.add_sampled(sampled, [-0.1 * (turn + 1)] * len(sampled), [turn] * len(sampled))
        if context:
            ledger.add_context(context)
    return ledger, sent


def test_ledger_lines_up_masks_logprobs_and_versions_over_three_turns():
    ledger, sent = three_turns()
    (row,) = ledger.finish()
    assert row.tokens == [1, 2, 3, 10, 11, 20, 21, 22, 12, 23, 13, 14, 15]
    assert row.masks == [-100, -100, -100, 10, 11, -100, -100, -100, 12, -100, 13, 14, 15]
    assert row.logprobs == pytest.approx([1.0] * 3 + [-0.1] * 2 + [1.0] * 3 + [-0.2] + [1.0] + [-0.3] * 3)
    assert row.versions == [-1, -1, -1, 0, 0, -1, -1, -1, 1, -1, 2, 2, 2]


def test_each_turns_prompt_is_the_row_so_far():
    ledger, sent = three_turns()
    (row,) = ledger.finish()
    assert [len(p) for p in sent] == [3, 8, 10]
    for prompt in sent:
        assert row.tokens[: len(prompt)] == prompt
        assert row.masks[len(prompt) - 1] == -100 and row.masks[len(prompt)] != -100  # sampling starts here


def test_check_echo_names_the_first_difference():
    ledger = EpisodeLedger(PROMPT)
    ledger.check_echo([1, 2, 3])
    expected = r"first difference at position 0 \(sent \[1, 2, 3\], echoed \[0, 1, 2, 3\]\)"
    with pytest.raises(PromptMismatch, match=expected):
        ledger.check_echo([0, 1, 2, 3])  # a server that added a BOS


def test_history_that_does_not_extend_the_row_closes_it_and_no_token_is_in_two_rows():
    ledger = EpisodeLedger(PROMPT)
    ledger.add_sampled([10, 11, 12], [-0.5] * 3)
    assert ledger.continue_with([1, 2, 3, 10, 11, 12, 20])  # extends: same row
    ledger.add_sampled([13], [-0.5])
    # The template now drops 10, 11 (earlier thinking): not an extension.
    assert not ledger.continue_with([1, 2, 3, 12, 20, 13, 21])
    ledger.add_sampled([14, 15], [-0.5] * 2)
    first, second = ledger.finish()
    assert first.tokens == [1, 2, 3, 10, 11, 12, 20, 13]
    assert second.tokens == [1, 2, 3, 12, 20, 13, 21, 14, 15]
    assert second.masks == [-100] * 7 + [14, 15]  # 12 and 13 are context here, trained in the first row
    trained = [t for row in (first, second) for t, m in zip(row.tokens, row.masks) if m != -100]
    assert trained == [10, 11, 12, 13, 14, 15]  # each sampled token once, none lost
    assert ledger.restarts == 1


def test_a_closed_row_ends_at_its_last_sampled_token():
    ledger = EpisodeLedger(PROMPT)
    ledger.add_sampled([10], [-0.5])
    ledger.add_context([20, 21])  # a tool result whose next turn never came
    (row,) = ledger.finish()
    assert row.tokens == [1, 2, 3, 10] and row.masks[-1] == 10


def test_a_turn_without_versions_leaves_the_row_without_versions():
    ledger = EpisodeLedger(PROMPT)
    ledger.add_sampled([10], [-0.5], [4])
    ledger.add_context([20])
    ledger.add_sampled([11], [-0.5], None)
    (row,) = ledger.finish()
    assert row.versions is None
    assert episodes_group([Episode([row], 1.0), Episode([row], 0.0)]).weight_versions is None


def row(*sampled: int) -> Row:
    ledger = EpisodeLedger(PROMPT)
    ledger.add_sampled(list(sampled), [-0.5] * len(sampled), [0] * len(sampled))
    return ledger.finish()[0]


def test_one_row_per_episode_is_a_plain_grpo_group():
    group = episodes_group([Episode([row(10)], 1.0), Episode([row(11, 12)], 0.0)])
    assert group.scores == [1.0, 0.0] and group.advantages is None
    assert group.weight_versions == [[-1, -1, -1, 0], [-1, -1, -1, 0, 0]]


def test_split_episode_rows_share_its_advantage_taken_over_episodes():
    # Episode A (score 1) spans two rows; B (score 0) one. A score-only group would take the mean
    # over 3 rows (2/3); over episodes it is 1/2, and A's rows get +1, B's -1 (group std 0.5).
    group = episodes_group([Episode([row(10), row(11)], 1.0), Episode([row(12)], 0.0)])
    assert group.scores == [1.0, 1.0, 0.0]
    expected = batch_advantages([torch.tensor([1.0, 0.0])], "group")[0].tolist()  # the trainer's, per episode
    assert [a[0] for a in group.advantages] == pytest.approx([expected[0], expected[0], expected[1]])
    assert all(len(a) == len(t) and len(set(a)) == 1 for a, t in zip(group.advantages, group.tokens))


def test_episode_advantages_match_the_trainer_and_are_zero_when_scores_are_equal():
    scores = [0.9, 0.2, 0.2, 0.5]
    for scale in ("group", "none"):
        trainer = batch_advantages([torch.tensor(scores)], scale)[0].tolist()
        assert episode_advantages(scores, scale) == pytest.approx(trainer, abs=1e-6)
    assert episode_advantages([0.9] * 9) == [0.0] * 9
    with pytest.raises(ValueError, match="valid: group, none"):
        episode_advantages(scores, "batch")


def test_episodes_without_rows_are_left_out_and_none_at_all_gives_no_group():
    assert episodes_group([Episode([], 1.0)]) is None
    group = episodes_group([Episode([], 1.0), Episode([row(10)], 0.5)])
    assert group.scores == [0.5]


def test_trainer_takes_a_split_episode_group_with_the_episode_advantage_on_every_trained_token():
    from api.models import ScoredData
    from api.validation import check_shape
    from example_trainer.data.batching import build_batch

    ledger = EpisodeLedger(PROMPT)
    ledger.add_sampled([10, 11], [-0.5] * 2, [0, 0])
    ledger.continue_with([1, 2, 10, 11, 20])  # not an extension: a second row
    ledger.add_sampled([12], [-0.5], [1])
    group = episodes_group([Episode(ledger.finish(), 1.0), Episode([row(13, 14)], 0.0), Episode([row(15)], 0.0)],
                           scale="none")
    data = ScoredData.model_validate(group.model_dump(exclude_none=True))
    check_shape(data)
    batch = build_batch([data], seq_len=64, scale_rewards="group")  # sent advantages win over --scale-rewards
    trained = batch.completion_mask.bool()  # (B, T-1)
    assert trained.sum().item() == 2 + 1 + 2 + 1  # every sampled token once
    per_row = [batch.advantages[b][trained[b]].unique().tolist() for b in range(4)]
    assert per_row == [[pytest.approx(2 / 3)], [pytest.approx(2 / 3)], [pytest.approx(-1 / 3)], [pytest.approx(-1 / 3)]]


def test_an_episode_scored_none_leaves_the_baseline_of_a_split_group():
    # A (1.0, two rows), B (0.0), C (None). Counted as 0, C would move the mean to 1/3 and give B
    # a negative advantage smaller in size; left out, the baseline is over A and B only.
    group = episodes_group([Episode([row(10), row(11)], 1.0), Episode([row(12)], 0.0), Episode([row(13)], None)])
    assert group.scores == [1.0, 1.0, 0.0] and len(group.tokens) == 3
    expected = batch_advantages([torch.tensor([1.0, 0.0])], "group")[0].tolist()
    assert [a[0] for a in group.advantages] == pytest.approx([expected[0], expected[0], expected[1]])
    assert episodes_group([Episode([row(10)], None)]) is None


def call_routes(positions: int, expert: int, layers: int = 2, top_k: int = 2):
    """What a call returns with --enable-return-routed-experts: every position routed to `expert`."""
    from environments.multiturn.routes import encode_routes

    return encode_routes(np.full((positions, layers, top_k), expert, dtype=np.uint16))


def experts(routes) -> list[int]:
    """The expert of each position of `routes` (all of a position's layers and slots agree here)."""
    from environments.multiturn.routes import decode_routes

    array = decode_routes(routes)
    assert (array == array[:, :1, :1]).all()
    return array[:, 0, 0].tolist()


def test_each_position_keeps_the_routes_of_the_call_that_sampled_its_turn():
    """Every call returns routes for its whole prompt (the row so far) too; a call that computed the
    prefix again (the cache evicted, the weights moved) may route it otherwise. Call k routes every
    position to expert k here: the row takes the prefix from the call that first fed it forward."""
    ledger, prompts = EpisodeLedger(PROMPT), []
    for call, (sampled, context) in enumerate([([10, 11], [20, 21, 22]), ([12], [23]), ([13, 14, 15], None)], 1):
        prompts.append(len(ledger.prompt_ids))
        ledger.add_sampled(sampled, [-0.5] * len(sampled), None, call_routes(prompts[-1] + len(sampled) - 1, call))
        if context:
            ledger.add_context(context)
    (row,) = ledger.finish()
    # tokens: 1 2 3 | 10 11 | 20 21 22 | 12 | 23 | 13 14 15. Position t's routes produced token t + 1.
    # Token 12 (the second turn's last) was first fed forward by the third call.
    assert experts(row.routed_experts()) == [1] * 4 + [2] * 4 + [3] * 4
    for call, start in enumerate(prompts, 1):  # each turn's sampled tokens came from its own call's routes
        assert experts(row.routed_experts())[start - 1] == call


def test_a_closed_row_keeps_its_own_calls_routes_and_a_new_row_takes_all_from_its_first_call():
    ledger = EpisodeLedger(PROMPT)
    ledger.add_sampled([10, 11], [-0.5] * 2, None, call_routes(4, 1))
    ledger.add_context([20])  # a tool result whose next turn comes after a re-rendered history
    assert not ledger.continue_with([1, 2, 11, 20])
    ledger.add_sampled([12], [-0.5], None, call_routes(4, 2))
    first, second = ledger.finish()
    assert first.tokens == [1, 2, 3, 10, 11] and experts(first.routed_experts()) == [1] * 4
    assert second.tokens == [1, 2, 11, 20, 12] and experts(second.routed_experts()) == [2] * 4
    group = episodes_group([Episode([first, second], 1.0), Episode([row(13)], 0.0)])
    assert group.routed_experts is None  # row() has no routes: the group goes without, as with versions


def test_routes_of_the_wrong_length_or_shape_are_refused_and_a_turn_without_routes_drops_them():
    ledger = EpisodeLedger(PROMPT)
    with pytest.raises(ValueError, match="routes of 5 positions for a prompt \\+ completion of 5 tokens: expected 4"):
        ledger.add_sampled([10, 11], [-0.5] * 2, None, call_routes(5, 1))
    ledger = EpisodeLedger(PROMPT)
    ledger.add_sampled([10], [-0.5], None, call_routes(3, 1))
    with pytest.raises(ValueError, match="routes of 1 layers x top_k 2 after 2 x 2"):
        ledger.add_sampled([11], [-0.5], None, call_routes(4, 1, layers=1))
    ledger = EpisodeLedger(PROMPT)
    ledger.add_sampled([10], [-0.5], None, call_routes(3, 1))
    ledger.add_sampled([11], [-0.5], None, None)  # a server that stopped returning routes
    assert ledger.finish()[0].routed_experts() is None


def test_routes_past_255_experts_widen_the_whole_row():
    ledger = EpisodeLedger(PROMPT)
    ledger.add_sampled([10], [-0.5], None, call_routes(3, 7))  # sent as uint8
    ledger.add_sampled([11], [-0.5], None, call_routes(4, 300))  # uint16
    routes = ledger.finish()[0].routed_experts()
    assert routes.dtype == "uint16" and experts(routes) == [7, 7, 7, 300]
