"""The guessing game: the game's rules and reward, and whole groups through ChatEnv against a fake
/generate that plays binary search in one episode and counts up from 1 in the other."""

import re
import statistics

import pytest
from env_fakes import FAST, FakeServer
from multiturn_fakes import (QWEN_TEMPLATE, ScriptedInference, evaluate_once, play_one_group, process_groups,
                             with_template)

from environments.config import ConfigError, ServerConfig
from environments.guessing_game_server import HIGHER, LOWER, QUESTION, GuessingGame, GuessingGameEnv, GuessingGameEnvConfig

pytestmark = pytest.mark.timeout(60)


def game(secret=11, high=16, max_guesses=6):
    g = GuessingGame()
    assert g.reset(secret=secret, high=high, max_guesses=max_guesses) is None
    return g


def test_feedback_says_higher_or_lower_and_a_right_guess_ends_the_game():
    g = game()
    assert g.step("8") == HIGHER and g.step("I say 12") == LOWER
    assert g.step("11") is None and g.won and g.guesses == 3


def test_a_reply_without_a_number_costs_a_guess_and_restates_the_rules():
    g = game()
    assert g.step("no idea") == "Answer with just a number from 1 to 16."
    assert g.guesses == 1 and not g.won


@pytest.mark.parametrize("guesses, reward", [(1, 1.0), (4, 0.5), (6, 1 / 6)])
def test_a_win_scores_more_the_fewer_the_guesses(guesses, reward):
    g = game(secret=5)
    for _ in range(guesses - 1):
        g.step("1")
    g.step("5")
    assert g.get_reward() == pytest.approx(reward)


def test_a_lost_game_scores_zero():
    g = game(secret=5)
    for _ in range(6):
        g.step("1")
    assert g.get_reward() == 0.0


def test_config_refuses_a_range_of_one():
    with pytest.raises(ConfigError, match="high"):
        GuessingGameEnvConfig(high=1)
    with pytest.raises(ConfigError, match="eval_seed"):
        GuessingGameEnvConfig(seed=2, eval_seed=2)


class Players(ScriptedInference):
    """Episode by episode (by first guess): binary search from the middle, or counting up from 1."""

    def __init__(self, tokenizer, high=16):
        super().__init__(tokenizer, (), right=0, tool_marker="", end_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
        self.high, self.games = high, 0

    def _text(self, prompt_ids, i) -> str:
        prompt = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        guesses = [int(g) for g in re.findall(r"<\|im_start\|>assistant\n(\d+)<\|im_end\|>", prompt)]
        replies = re.findall(r"<\|im_start\|>user\n(Higher|Lower)\.", prompt)
        if not guesses:
            with self._lock:
                self.games += 1
                return str((1 + self.high) // 2 if self.games % 2 else 1)
        if guesses[0] == 1:
            return str(guesses[-1] + 1)
        low, high = 1, self.high
        for guess, reply in zip(guesses, replies):
            low, high = (guess + 1, high) if reply == "Higher" else (low, guess - 1)
        return str((low + high) // 2)


class FixedGame(GuessingGameEnv):
    async def get_next_item(self):
        return {"question": QUESTION.format(high=16), "secret": 11, "high": 16, "max_guesses": 6}


def test_a_group_of_games_rewards_the_shorter_win(tokenizer_dir):
    tokenizer = with_template(tokenizer_dir, QWEN_TEMPLATE)
    inference = Players(tokenizer)
    server = FakeServer(inference).start()
    config = GuessingGameEnvConfig(group_size=2, max_token_length=2048, max_tokens=16, tokenizer_name="unused", seed=1)
    env = FixedGame(config, ServerConfig(base_url=server.url, timeout=5.0), tokenizer=tokenizer)
    env.backoff = FAST
    try:
        group, _ = play_one_group(env)
    finally:
        server.stop()
    # Binary search: 8 Higher, 12 Lower, 10 Higher, 11 (4 guesses, (6-4+1)/6); counting up: 1..6, lost.
    assert sorted(group.scores) == [0.0, 0.5] and len(inference.requests) == 10
    by_score = dict(zip(group.scores, zip(group.tokens, group.masks, group.messages)))
    tokens, masks, messages = by_score[0.5]
    assert [m["content"] for m in messages[1:]] == ["8", HIGHER, "12", LOWER, "10", HIGHER, "11"]
    sampled = tokenizer.decode([t for t, m in zip(tokens, masks) if m != -100], skip_special_tokens=False)
    assert sampled == "8<|im_end|>12<|im_end|>10<|im_end|>11<|im_end|>"  # the game's replies are all masked
    assert HIGHER in tokenizer.decode(tokens) and masks[-1] != -100
    lost = by_score[0.0][2]
    assert [m["content"] for m in lost if m["role"] == "assistant"] == ["1", "2", "3", "4", "5", "6"]


class CountsUp(ScriptedInference):
    """Guesses 1, 2, 3, ... whatever the replies: wins a game at turn `secret` if secret <= max_turns."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer, (), right=0, tool_marker="", end_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))

    def _text(self, prompt_ids, i) -> str:
        return str(self.tokenizer.decode(prompt_ids, skip_special_tokens=False).count("<|im_start|>assistant"))


def test_evaluate_reports_the_win_rate_and_the_spread_of_turns_per_game(tokenizer_dir):
    tokenizer = with_template(tokenizer_dir, QWEN_TEMPLATE)
    inference = CountsUp(tokenizer)
    server = FakeServer(inference).start()
    config = GuessingGameEnvConfig(max_turns=6, high=16, num_eval_items=24, max_token_length=2048, max_tokens=16,
                                   tokenizer_name="unused", seed=1)
    env = GuessingGameEnv(config, ServerConfig(base_url=server.url, timeout=5.0), tokenizer=tokenizer)
    env.backoff = FAST
    try:
        metrics = evaluate_once(env)
    finally:
        server.stop()
    secrets = [item["secret"] for item in env.eval_items]
    turns = [min(secret, 6) for secret in secrets]
    assert 0 < sum(s <= 6 for s in secrets) < 24  # the eval draw has both wins and losses
    assert metrics["env/eval_accuracy"] == sum(s <= 6 for s in secrets) / 24
    assert metrics["env/eval_turns_mean"] == pytest.approx(statistics.fmean(turns))
    assert metrics["env/eval_turns_std"] == pytest.approx(statistics.stdev(turns))
    assert metrics["env/eval_items"] == 24 and all(body["temperature"] == 0.0 for body in inference.requests)


def test_the_game_runs_from_its_command_line(tmp_path):
    from transformers import AutoTokenizer

    from example_trainer.model.default_model import default_model_path

    inference = Players(AutoTokenizer.from_pretrained(default_model_path(), local_files_only=True))
    groups = process_groups(GuessingGameEnv, inference, tmp_path / "groups.jsonl")
    assert len(groups) == 2 and all(len(g["tokens"]) == 2 and len(set(g["scores"])) == 2 for g in groups)
