"""bench/multiturn_tools.py against a scripted fake /generate: every turn, tool call and sampled id
of the episodes is counted, the first two turns are the constrained tool calls, and the sleeping
tools are still the calculator's tools."""

from __future__ import annotations

import asyncio

import pytest
from env_fakes import FakeServer
from multiturn_fakes import ScriptedInference

from bench import multiturn_tools
from environments.calculator_tool_server import Calculator
from environments.multiturn.factory import environment_tools, tool_schemas

TURNS = ('<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
         '<tool_call>\n{"name": "submit", "arguments": {"answer": 5}}\n</tool_call>', "Five.")


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from example_trainer.model.default_model import default_model_path

    return AutoTokenizer.from_pretrained(default_model_path(), local_files_only=True)


def test_the_sleeping_calculator_offers_the_calculators_tools_and_counts_their_calls():
    calls = [0]
    sleeping = multiturn_tools.sleeping_calculator(0.0, calls)()
    tools = environment_tools(sleeping)
    assert tool_schemas(tools) == tool_schemas(environment_tools(Calculator()))
    assert tools["add"](a=2, b=3) == 5 and calls == [1]


def test_every_turn_tool_call_and_sampled_id_of_the_episodes_is_counted(smollm2_tokenizer):
    tokenizer = smollm2_tokenizer
    end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    inference = ScriptedInference(tokenizer, TURNS, right=3, tool_marker=multiturn_tools.TOOL_TURN, end_id=end_id)
    server = FakeServer(inference).start()
    try:
        row = asyncio.run(asyncio.wait_for(multiturn_tools.run_episodes(server.url, tokenizer, 4, 0.0, 8), 60))
    finally:
        server.stop()
    per_episode = sum(len(tokenizer.encode(text, add_special_tokens=False)) + 1 for text in TURNS)  # + the end id
    assert (row["episodes"], row["turns"], row["tool_calls"]) == (4, 12, 8)
    assert row["sampled_tokens"] == 4 * per_episode and row["serial_sleep_s"] == 0
    assert row["loop_lag_max_ms"] >= row["loop_lag_p99_ms"] >= 0 and 0 < row["busy_share"] <= 1
    constrained = [body.get("structured_outputs", {}).get("regex") for body in inference.requests]
    assert sorted(constrained, key=str) == sorted([*multiturn_tools.FORCED_TURNS] * 4 + [None] * 4, key=str)
    assert all(body["max_tokens"] == 8 for body in inference.requests if "structured_outputs" not in body)
