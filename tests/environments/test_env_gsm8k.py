"""The GSM8K environment: loading GSM8K-format JSONL and scoring with math-verify."""

import asyncio
import sys
from pathlib import Path

import pytest

from environments.config import ServerConfig
from environments.gsm8k_server import GSM8kEnv, GSM8kEnvConfig, gold_answer, load_jsonl, score_gsm8k

TINY = str(Path(__file__).parents[1] / "fixtures" / "gsm8k_tiny.jsonl")


def test_gold_answer_is_text_after_last_hashes_without_commas():
    assert gold_answer("6 * 14 = 84\n#### 84") == "84"
    assert gold_answer("so 2,500 seats\n#### 2,500") == "2500"
    with pytest.raises(ValueError, match="####"):
        gold_answer("no final answer marker")


def test_load_tiny_fixture():
    items = load_jsonl(TINY)
    assert len(items) == 5
    assert items[0]["question"].startswith("A baker fills 6 trays")
    assert [item["gold"] for item in items] == ["59", "54", "50", "10", "2500"]


def test_load_names_the_bad_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"question": "q", "answer": "#### 1"}\n{"question": "q2"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        load_jsonl(str(path))


@pytest.mark.parametrize(
    "completion, gold, expected",
    [
        ("84 - 25 = 59, so the answer is \\boxed{59}", "59", 1.0),
        ("\\boxed{58}", "59", 0.0),
        ("The final answer is 54", "54", 1.0),
        ("Answer: $10", "10", 1.0),
        ("\\boxed{2,500}", "2500", 1.0),
        ("\\boxed{10.0}", "10", 1.0),
        ("\\boxed{\\$10}", "10", 1.0),
        ("I computed 59 along the way but I am not sure.", "59", 0.0),  # no anchor, no box
        ("<think>maybe \\boxed{59}</think> The answer is \\boxed{60}", "59", 0.0),
        ("\\boxed{59} or maybe \\boxed{60}", "59", 0.0),  # hedging with two answers
        ("", "59", 0.0),
    ],
)
def test_score_gsm8k(completion, gold, expected):
    assert score_gsm8k(completion, gold) == expected


def test_setup_shuffles_with_seed_and_cycles(tokenizer):
    def env(seed):
        config = GSM8kEnvConfig(tokenizer_name="unused", data_path=TINY, eval_data_path=TINY, seed=seed)
        e = GSM8kEnv(config, ServerConfig(), tokenizer=tokenizer)
        asyncio.run(e.setup())
        return e

    first, again = env(1), env(1)
    order = [asyncio.run(first.get_next_item())["question"] for _ in range(10)]
    assert order == [asyncio.run(again.get_next_item())["question"] for _ in range(10)]
    assert order[:5] == order[5:]  # cycles through all 5 problems
    assert len(set(order)) == 5
    assert len(first.eval_items) == 5
    assert first.score_completion(first.eval_items[0], f"\\boxed{{{first.eval_items[0]['gold']}}}") == 1.0


def test_without_data_path_or_datasets_says_pass_data_path(tokenizer, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # as on a machine without it (the test deps bring it)
    env = GSM8kEnv(GSM8kEnvConfig(tokenizer_name="unused"), ServerConfig(), tokenizer=tokenizer)
    with pytest.raises(RuntimeError, match="--env.data_path"):
        asyncio.run(env.setup())
