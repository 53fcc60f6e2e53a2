"""The arithmetic environment: problem generation and its scoring function."""

import asyncio
import random
import re

import pytest

from environments.arithmetic_server import (
    ArithmeticEnv,
    ArithmeticEnvConfig,
    last_boxed,
    make_problem,
    parse_integer,
    score_arithmetic,
)
from environments.config import ConfigError, ServerConfig


def _problems(seed, n=20, difficulty=3, operations="+*"):
    rng = random.Random(seed)
    return [make_problem(rng, difficulty, operations) for _ in range(n)]


def test_generation_is_deterministic_per_seed():
    assert _problems(7) == _problems(7)
    assert _problems(7) != _problems(8)


@pytest.mark.parametrize("difficulty", [1, 2, 4, 7])
def test_operands_have_difficulty_digits(difficulty):
    for problem in _problems(0, n=50, difficulty=difficulty, operations="+-*"):
        a, op, b = re.fullmatch(r"What is (\d+) ([-+*]) (\d+)\?", problem["question"]).groups()
        assert len(a) == len(b) == difficulty
        assert problem["answer"] == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]


def test_operations_respected():
    ops = {re.search(r" ([-+*]) ", p["question"]).group(1) for p in _problems(1, n=100, operations="*")}
    assert ops == {"*"}


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("12 * 3 = 36, so \\boxed{36}", 36, 1.0),
        ("\\boxed{35}", 36, 0.0),
        ("Answer: 36", 36, 1.0),
        ("First 12, then 24, finally 36.", 36, 1.0),
        ("36 is close but the answer is 37", 36, 0.0),
        ("\\boxed{36} and then some text with 99", 36, 1.0),  # the box wins over a later number
        ("I think 36. \\boxed{40}", 36, 0.0),
        ("\\boxed{1,234}", 1234, 1.0),
        ("\\boxed{1{,}234}", 1234, 1.0),
        ("\\boxed{ 36.0 }", 36, 1.0),
        ("\\boxed{36.5}", 36, 0.0),
        ("\\boxed{-12}", -12, 1.0),
        ("\\boxed{}", 36, 0.0),
        ("\\boxed{\\text{thirty-six}}", 36, 0.0),
        ("asdf qwerty", 36, 0.0),
        ("", 36, 0.0),
    ],
)
def test_score_arithmetic(completion, answer, expected):
    assert score_arithmetic(completion, answer) == expected


def test_last_boxed_handles_nesting_and_unclosed():
    assert last_boxed("\\boxed{\\frac{1}{2}} then \\boxed{7}") == "7"
    assert last_boxed("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{5} and \\boxed{6") == "5"
    assert last_boxed("no box") is None
    assert parse_integer("no digits") is None


def _env(tokenizer, **kw):
    config = ArithmeticEnvConfig(tokenizer_name="unused", **kw)
    env = ArithmeticEnv(config, ServerConfig(), tokenizer=tokenizer)
    asyncio.run(env.setup())
    return env


def test_eval_set_is_fixed_and_held_out(tokenizer):
    first = _env(tokenizer, seed=1, difficulty=2, num_eval_items=32)
    second = _env(tokenizer, seed=2, difficulty=2, num_eval_items=32)
    assert first.eval_items == second.eval_items  # from eval_seed, not seed
    train = [asyncio.run(first.get_next_item()) for _ in range(200)]
    assert not {p["question"] for p in train} & {p["question"] for p in first.eval_items}


def test_training_stream_is_deterministic_per_seed(tokenizer):
    def stream(seed):
        env = _env(tokenizer, seed=seed)
        return [asyncio.run(env.get_next_item()) for _ in range(10)]

    assert stream(3) == stream(3)
    assert stream(3) != stream(4)


def test_config_rejects_bad_difficulty_and_seed_clash():
    with pytest.raises(ConfigError, match="difficulty"):
        ArithmeticEnvConfig(difficulty=0)
    with pytest.raises(ConfigError, match="operations"):
        ArithmeticEnvConfig(operations="/")
    with pytest.raises(ConfigError, match="eval_seed"):
        ArithmeticEnvConfig(seed=5, eval_seed=5)
