"""Groups worth training on: dynamic sampling keeps only groups whose scores differ, the staleness
bound only groups sampled recently enough; the batch is refilled from further fetches, surplus
groups wait for the next step, and the trainer never waits for ever."""

from __future__ import annotations

import pytest

from api.models import ScoredData
from example_trainer.data.group_filters import FilteredBatches, signal_rule, staleness_rule


def g(*scores: float, versions: list[int] | None = None) -> ScoredData:
    rows = len(scores)
    return ScoredData(tokens=[[1, 2, 3]] * rows, masks=[[-100, 2, 3]] * rows, scores=list(scores),
                      weight_versions=None if versions is None else [[-1, *versions]] * rows)


class Batches:
    """The API's batches, in order; counts the fetches."""

    def __init__(self, *batches: list[ScoredData]) -> None:
        self.batches, self.calls, self.counted_by_fetch, self.counted = list(batches), 0, [], 0

    def get_batch(self, timeout, while_waiting=lambda: None, count_step=True):
        self.calls += 1
        self.counted_by_fetch.append(count_step)
        return self.batches.pop(0)

    def count_step(self):
        self.counted += 1


def dynamic(source, batch_size, max_batches=10):
    return FilteredBatches(source, batch_size, max_batches, [signal_rule()])


def test_flat_groups_are_dropped_and_the_batch_is_filled_from_the_next_fetches():
    source = Batches([g(1, 1), g(0, 1)], [g(0, 0), g(1, 0)], [g(0.5, 0), g(1, 0.2)])
    batches = dynamic(source, batch_size=4)
    assert [grp.scores for grp in batches.get_batch(1.0)] == [[0, 1], [1, 0]] and source.calls == 2
    # the reward: every group received, the dropped flat ones too
    assert batches.step_metrics() == {"train/groups_dropped": 2, "train/batches_fetched": 2, "train/reward_mean": 0.5}
    assert [grp.scores for grp in batches.get_batch(1.0)] == [[0.5, 0], [1, 0.2]] and source.calls == 3


def test_surplus_groups_wait_for_the_next_step():
    batches = dynamic(Batches([g(0, 1), g(1, 0), g(0, 2), g(2, 0)]), batch_size=2)
    assert [grp.scores for grp in batches.get_batch(1.0)] == [[0, 1]]
    assert [grp.scores for grp in batches.get_batch(1.0)] == [[1, 0]]  # no fetch: it was waiting
    assert batches.step_metrics()["train/batches_fetched"] == 0


def test_after_max_batches_the_trainer_gets_what_was_kept_and_nothing_kept_stops_with_the_cause(caplog):
    assert [grp.scores for grp in dynamic(Batches([g(1, 1), g(0, 1)], [g(0, 0), g(2, 2)]), 4, 2).get_batch(1.0)] \
        == [[0, 1]]
    # The warning names the flag that sets the limit (it named one the trainer never had).
    assert "only 2 of 4 sequences kept" in caplog.text and "(--max-batches-per-step 2)" in caplog.text
    with pytest.raises(RuntimeError, match="2 batches in a row left nothing.*no group whose scores differ"):
        dynamic(Batches([g(1, 1)], [g(0, 0)]), 2, 2).get_batch(1.0)


def test_groups_with_advantages_from_the_environment_are_kept():
    sent = ScoredData(tokens=[[1, 2]] * 2, masks=[[-100, 2]] * 2, scores=[1.0, 1.0], advantages=[[0.0, 0.5]] * 2)
    assert dynamic(Batches([sent]), batch_size=2, max_batches=1).get_batch(1.0) == [sent]


def test_groups_whose_advantages_from_the_environment_are_zero_where_trained_are_dropped():
    # The environment's advantages decide, not the scores: equal scores with a non-zero advantage
    # teach (kept above); differing scores whose sent advantages are zero teach nothing.
    zero = ScoredData(tokens=[[1, 2, 3]] * 2, masks=[[-100, 2, 3]] * 2, scores=[1.0, 0.0],
                      advantages=[[0.0, 0.0, 0.0]] * 2)
    on_prompt_only = ScoredData(tokens=[[1, 2, 3]] * 2, masks=[[-100, -100, 3]] * 2, scores=[1.0, 0.0],
                                advantages=[[0.7, 0.7, 0.0]] * 2)  # the loss never sees a prompt token's advantage
    sent = ScoredData(tokens=[[1, 2, 3]] * 2, masks=[[-100, 2, 3]] * 2, scores=[1.0, 1.0],
                      advantages=[[0.0, 0.0, 0.5], [0.0, 0.0, 0.0]])
    assert [signal_rule().keeps(grp) for grp in (zero, on_prompt_only, sent)] == [False, False, True]
    batches = dynamic(Batches([zero, sent], [on_prompt_only]), batch_size=4, max_batches=2)
    assert batches.get_batch(1.0) == [sent]
    assert batches.step_metrics()["train/groups_dropped"] == 2


END = 9  # the end token of the tests below; a completion ending in 3 is truncated


def ended(scores: list[float], ends: list[bool], advantages: list[list[float]] | None = None) -> ScoredData:
    """A group whose i-th completion ends with END where ``ends[i]``, else is cut off."""
    tokens = [[1, 2, END if end else 3] for end in ends]
    return ScoredData(tokens=tokens, masks=[[-100, 2, 3]] * len(ends), scores=scores, advantages=advantages)


def test_with_truncated_completions_masked_a_group_whose_differing_completions_were_all_cut_off_is_dropped():
    """A group whose completions with a non-zero advantage are all masked teaches nothing, as a flat
    one does: a step of such groups has a zero gradient. With 64-token completions, 6-7 of a step's 8
    were truncated in the start scripts' end-to-end test, and one CI run's first step left the
    served weights as they were."""
    all_cut = ended([1, 0, 0, 1], [False] * 4)
    flat_where_trained = ended([1, 0, 1, 1], [False, False, True, True])  # trained: score 1, mean 0.75
    one_trained = ended([1, 0, 0, 0], [False, False, True, False])
    sent_all_cut = ended([1, 1], [False, False], advantages=[[0.0, 0.5, 0.5]] * 2)
    rule = signal_rule({END})
    assert [rule.keeps(grp) for grp in (all_cut, flat_where_trained, one_trained, sent_all_cut)] == \
        [False, True, True, False]
    assert all(signal_rule().keeps(grp) for grp in (all_cut, flat_where_trained, one_trained, sent_all_cut))
    # The trained two scored the group's mean (0.5): their advantages are zero.
    assert not signal_rule({END}).keeps(ended([0.5, 0.5, 0, 1], [True, True, False, False]))
    # The mean as the advantages compute it (float32): in float64 the mean of 0.1, 0.2, 0.3 is not 0.2.
    assert not signal_rule({END}).keeps(ended([0.1, 0.2, 0.3], [False, True, False]))
    refill = ended([0, 1], [True, False])
    batches = FilteredBatches(Batches([all_cut, one_trained], [refill]), batch_size=6, max_batches=2,
                              rules=[signal_rule({END})])
    assert batches.get_batch(1.0) == [one_trained, refill]
    assert batches.step_metrics() == {"train/groups_dropped": 1, "train/batches_fetched": 2,
                                      "train/reward_mean": pytest.approx((2 + 1 + 1) / 10)}
    with pytest.raises(RuntimeError, match="truncated and so masked.*--mask-truncated-completions"):
        FilteredBatches(Batches([all_cut], [all_cut]), 4, 2, [signal_rule({END})]).get_batch(1.0)


def test_a_flat_group_of_fractional_scores_is_dropped():
    """A float64 mean of three scores of 0.1 is 0.10000000000000002, not 0.1: a rule comparing with it
    kept a group whose advantages are all zero (caught in review, before it shipped)."""
    for scores in ([0.1] * 3, [0.7] * 6, [0.9] * 9, [0.35] * 12):
        assert not signal_rule().keeps(g(*scores)), scores


def test_groups_with_every_token_older_than_the_bound_are_dropped_and_waiting_ones_age():
    now = [5]
    rule = staleness_rule(lambda: now[0], max_steps=2)
    source = Batches([g(0, 1, versions=[2, 1]), g(1, 0, versions=[3, 5]), g(0, 2, versions=[4, 4])])
    batches = FilteredBatches(source, batch_size=2, max_batches=3, rules=[rule])
    # 5 - 2 = 3 and 5 - 1 = 4 versions behind: nothing left, dropped; 5 - 3 = 2: kept; the third waits
    assert [grp.scores for grp in batches.get_batch(1.0)] == [[1, 0]]
    assert batches.step_metrics()["off_policy/dropped"] == 1
    now[0] = 7  # the waiting group (version 4) is now 3 behind
    source.batches.append([g(3, 0, versions=[6, 7])])
    assert [grp.scores for grp in batches.get_batch(1.0)] == [[3, 0]]
    # the reward: the group dropped now and the one trained on (the first step's drop counted there)
    assert batches.step_metrics() == {"off_policy/dropped": 1, "off_policy/masked_tokens": 0,
                                      "train/batches_fetched": 1, "train/reward_mean": (0 + 2 + 3 + 0) / 4}


def played(turn_versions: list[int], score: float, split_after: int | None = None):
    """An episode as the ledger builds it: a prompt, then one turn per entry of ``turn_versions`` (two
    tokens sampled with that weights version), a tool result after each but the last; its row is
    closed after turn ``split_after`` (a history that did not extend it). Returns the Episode and the
    row positions each turn's tokens took."""
    from environments.multiturn.ledger import Episode, EpisodeLedger

    ledger, turns = EpisodeLedger([1, 2, 3]), []
    for turn, version in enumerate(turn_versions):
        start = len(ledger.prompt_ids)
        ledger.add_sampled([10 + turn, 20 + turn], [-0.5, -0.5], [version, version])
        turns.append([start, start + 1])
        if turn == split_after:
            ledger.continue_with([1, 2, 3, 40 + turn])  # not an extension: the next turns go to a new row
        elif turn < len(turn_versions) - 1:
            ledger.add_context([30, 31, 32])
    return Episode(ledger.finish(), score), turns


def group_of(*episodes) -> ScoredData:
    """The group the environment posts for ``episodes`` (ledger.episodes_group), as the trainer receives it."""
    from environments.multiturn.ledger import episodes_group

    return ScoredData.model_validate(episodes_group(list(episodes)).model_dump(exclude_none=True))


def multi_turn_group(turn_versions: list[int], scores=(1.0, 0.0)):
    """A group of episodes of the same turns (``played``), one row each, and the positions of each turn."""
    episodes = [played(turn_versions, score) for score in scores]
    return group_of(*(episode for episode, _ in episodes)), episodes[0][1]


def test_a_multi_turn_row_whose_first_turn_is_past_the_bound_trains_its_fresh_turns_and_no_stale_token():
    """Before, the whole group was dropped for its oldest token: a long episode's first turn is the
    first to age, and its fresh later turns were thrown away with it."""
    from example_trainer.data.batching import build_batch, off_policy_metrics

    group, (first, second, third) = multi_turn_group([2, 5, 7])
    now, bound = 8, 3  # the turns are 6, 3 and 1 versions behind
    batches = FilteredBatches(Batches([group]), batch_size=2, max_batches=1,
                              rules=[staleness_rule(lambda: now, max_steps=bound)])
    (served,) = batches.get_batch(1.0)
    assert served.tokens == group.tokens and served.scores == group.scores
    for row, sent in zip(served.masks, group.masks):
        assert [row[i] for i in first] == [-100, -100]  # too old: context now, as the prompt is
        assert [row[i] for i in second + third] == [sent[i] for i in second + third] == [11, 21, 12, 22]
        assert [i for i, m in enumerate(row) if m != -100] == second + third
    assert batches.step_metrics()["off_policy/masked_tokens"] == 2 * 2 and batches.step_metrics()[
        "off_policy/dropped"] == 0
    batch = build_batch([served], seq_len=64)
    assert batch.completion_mask.sum().item() == 2 * 4  # every fresh sampled token, in both rows
    assert off_policy_metrics(batch, now)["off_policy/max"] == bound  # and none past the bound


def test_a_waiting_multi_turn_group_loses_the_turns_that_age_past_the_bound_and_goes_when_none_is_left():
    now = [8]
    fresh, _ = multi_turn_group([7, 8])
    old, (first, second) = multi_turn_group([5, 6], scores=(0.0, 1.0))
    refill, _ = multi_turn_group([9, 9])
    batches = FilteredBatches(Batches([fresh, old], [refill]), batch_size=2, max_batches=1,
                              rules=[staleness_rule(lambda: now[0], max_steps=2)])
    assert batches.get_batch(1.0) == [fresh]
    (waiting,) = batches.waiting  # its first turn (3 behind) already masked, its second (2 behind) not
    assert [[row[i] for i in first + second] for row in waiting.masks] == [[-100, -100, 11, 21]] * 2
    assert batches.step_metrics()["off_policy/masked_tokens"] == 2 * 2
    now[0] = 9  # its second turn is 3 behind too: nothing of it is left to train
    assert batches.get_batch(1.0) == [refill]
    assert batches.step_metrics()["off_policy/dropped"] == 1


def test_groups_without_versions_pass_the_staleness_bound():
    batches = FilteredBatches(Batches([g(0, 1)]), 2, 1, [staleness_rule(lambda: 100, max_steps=0)])
    assert len(batches.get_batch(1.0)) == 1


def test_a_step_counts_once_however_many_batches_it_fetched_and_also_when_it_fetched_none():
    # Before: every fetch counted as an API step, so with stale groups dropped the API's step ran
    # ahead of the trainer's, the environment stopped at "the last step" and the trainer waited for ever.
    source = Batches([g(1, 1), g(0, 1)], [g(0, 0), g(1, 0)], [g(0, 1), g(1, 0), g(0, 2), g(2, 0)])
    batches = dynamic(source, batch_size=4)
    batches.get_batch(1.0)  # two fetches
    assert source.counted == 1
    batches.get_batch(1.0)  # one fetch, two groups left waiting
    batches.get_batch(1.0)  # no fetch
    assert source.counted == 3 and source.counted_by_fetch == [False, False, False]


def test_the_reward_is_the_mean_over_every_group_received_dropped_ones_too(tmp_path):
    """A solved task under --dynamic-sampling: its flat groups (all 1) are dropped, and the mean
    over the kept ones alone (one right, one wrong) read 0.5 however well the model did."""
    from example_trainer.data.rollouts import TrainBatches
    from example_trainer.grpo import train_step
    from tests.unit.test_non_finite_loss import Recorder, run_of
    from tests.unit.test_parallel import groups, tiny_model

    mixed, partial = groups()  # scores [1, 0] and [0.5, 0.2]
    solved = mixed.model_copy(update={"scores": [1.0, 1.0]})
    batches = dynamic(Batches([solved, mixed, solved], [partial]), batch_size=4)
    run = run_of(tiny_model(), Recorder(), tmp_path)
    run.batches = TrainBatches(batches, run.cfg, run.parallel)
    metrics = train_step(run, 1, final=False)
    assert metrics["train/groups_dropped"] == 2
    assert metrics["train/reward_mean"] == pytest.approx((1 + 0 + 0.5 + 0.2 + 4 * 1.0) / 8)
    assert metrics["train/reward_kept_mean"] == pytest.approx((1 + 0 + 0.5 + 0.2) / 4)


def test_dynamic_sampling_judges_a_multi_turn_group_by_the_advantages_over_episodes_it_was_sent():
    """A split episode makes the environment send advantages over episodes (ledger.episodes_group):
    the rule reads those, not the scores, whose rows count the split episode twice."""
    split = lambda score: played([1, 1], score, split_after=0)[0]  # noqa: E731 (one episode, two rows)
    one_row = lambda score: played([1, 1], score)[0]  # noqa: E731
    # Rows score [1, 1, 0, 0.5] (mean 0.625) but episodes [1, 0, 0.5] (mean 0.5): the third episode's
    # advantage is 0. With the first two truncated and so masked, nothing is left to learn from.
    mixed = group_of(split(1.0), one_row(0.0), one_row(0.5))
    assert mixed.advantages is not None and len(mixed.tokens) == 4
    assert signal_rule().keeps(mixed)
    last_turn = mixed.tokens[3][-1]  # 21: an end token for the third episode alone
    cut = mixed.model_copy(update={"tokens": [row[:-1] + [7] for row in mixed.tokens[:3]] + [mixed.tokens[3]]})
    assert not signal_rule({last_turn}).keeps(cut)
    # By the rows' scores alone it would pass (0.5 - 0.625): it is the sent advantages that decide.
    assert signal_rule({last_turn}).keeps(cut.model_copy(update={"advantages": None}))
    # Equal episode scores send all-zero advantages: dropped.
    assert not signal_rule().keeps(group_of(split(1.0), one_row(1.0)))
    assert signal_rule().keeps(group_of(one_row(1.0), one_row(0.0)))  # one row each: scores, as single-turn
    assert not signal_rule().keeps(group_of(one_row(0.5), one_row(0.5)))


def test_dynamic_sampling_judges_what_the_staleness_bound_left_to_train():
    """The rows whose every token is past the bound train nothing: the group's signal is that of
    the rows left. Here only an episode at the baseline is fresh, so the group teaches nothing."""
    old_right, old_wrong = played([1, 2], 1.0, split_after=0)[0], played([1, 2], 0.0)[0]
    fresh_average = played([9, 9], 0.5)[0]
    group = group_of(old_right, old_wrong, fresh_average)  # advantages over episodes: +, -, 0
    rules = [staleness_rule(lambda: 9, max_steps=2), signal_rule()]
    batches = FilteredBatches(Batches([group]), batch_size=4, max_batches=1, rules=rules)
    with pytest.raises(RuntimeError, match="no group whose scores differ"):
        batches.get_batch(1.0)
    assert batches.dropped == {"off_policy/dropped": 0, "train/groups_dropped": 1}
    # With a fresh row of the right episode, the group teaches: kept, its stale rows masked.
    right_fresh = played([1, 9], 1.0, split_after=0)[0]
    (served,) = FilteredBatches(Batches([group_of(right_fresh, old_wrong, fresh_average)]), 4, 1, rules).get_batch(1.0)
    assert [sum(m != -100 for m in row) for row in served.masks] == [0, 2, 0, 4]
