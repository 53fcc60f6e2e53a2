"""A real OpenEnv MCP environment (tests/fixtures/openenv_mcp_calculator: openenv's MCPEnvironment,
FastMCP tools and create_app, nothing of onecopy's) through OpenEnvMCPEnv against a scripted
/generate: the tools the template renders are the ones its MCP server lists, the model's tool
calls are steps on each episode's own session, their results (and errors) come back as tool
messages, and the environment's submit reward scores the episode.

Skipped without the optional extra (requirements-openenv.txt; tests/openenv_extra.py finds it)."""

import asyncio
import json
import re

import pytest
from env_fakes import FAST, FakeServer
from multiturn_fakes import QWEN_TEMPLATE, ScriptedInference, play_one_group, with_template

from environments.config import ServerConfig
from environments.multiturn.factory import mcp_tool_schemas
from environments.multiturn.openenv_session import OpenEnvToolSession
from environments.openenv_mcp_server import OpenEnvMCPEnv, OpenEnvMCPEnvConfig
from tests.openenv_extra import INSTALL, on_path

OPENENV_PATH = on_path()
pytest.importorskip("openenv.core.env_server.mcp_environment", reason=INSTALL)

from openenv.core.env_server.mcp_types import CallToolAction, ListToolsAction  # noqa: E402

from tests.fixtures.openenv_mcp_calculator.server.calculator_environment import CalculatorEnvironment  # noqa: E402

pytestmark = pytest.mark.timeout(120)

APP = "tests.fixtures.openenv_mcp_calculator.server.app:app"
SEED = 3
# Turn 1 calls add on the question's numbers and add with an argument the server refuses; turn 2
# submits {n}: the sum read from the question, right in one episode and one off in the other.
TURNS = ('<tool_call>\n{"name": "add", "arguments": {"a": {a}, "b": {b}}}\n</tool_call>\n'
         '<tool_call>\n{"name": "add", "arguments": {"a": "x"}}\n</tool_call>',
         '<tool_call>\n{"name": "submit", "arguments": {"answer": {n}}}\n</tool_call>')


def question_numbers(prompt: str) -> tuple[int, int]:
    a, b = re.search(r"What is (\d+) \+ (\d+)\?", prompt).groups()
    return int(a), int(b)


class Calls(ScriptedInference):
    """TURNS, the question's numbers filled in."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer, TURNS, right=lambda prompt: sum(question_numbers(prompt)),
                         tool_marker="<tool_response>", end_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))

    def _text(self, prompt_ids, i) -> str:
        text = super()._text(prompt_ids, i)
        a, b = question_numbers(self.tokenizer.decode(prompt_ids, skip_special_tokens=False))
        return text.replace("{a}", str(a)).replace("{b}", str(b))


def in_process(seed: int, *actions):
    """The fixture environment played here, unserved: its observations for `actions` after reset(seed)."""
    environment = CalculatorEnvironment()
    first = environment.reset(seed=seed)
    return first, [environment.step(action) for action in actions]


class OneSeed(OpenEnvMCPEnv):
    async def get_next_item(self):
        return {"seed": SEED}


def make_env(tokenizer, url, env_class=OneSeed, **settings):
    config = OpenEnvMCPEnvConfig(**{"group_size": 2, "max_token_length": 4096, "max_tokens": 256,
                                    "tokenizer_name": "unused", "seed": 1, "app": APP, "openenv_path": OPENENV_PATH,
                                    "observation_field": "prompt", "max_turns": 4, **settings})
    env = env_class(config, ServerConfig(base_url=url, timeout=5.0), tokenizer=tokenizer)
    env.backoff = FAST
    return env


def test_the_mcp_tools_answer_the_models_calls_and_the_environment_scores_the_episodes(tokenizer_dir):
    """The episodes of a group hold their own sessions at once: each reset waits until both have
    connected (played one after another, the first would wait for ever: the test's timeout)."""
    tokenizer = with_template(tokenizer_dir, QWEN_TEMPLATE)
    session_ids, resets = [], []

    class BothAtOnce(OpenEnvToolSession):
        async def reset(self, **item):
            session_ids.append(self.client._production_session_id)  # the server's id of this client's session
            waiting = asyncio.get_running_loop().create_future()
            resets.append(waiting)
            if len(resets) == 2:
                for future in resets:
                    future.set_result(None)
            await waiting
            return await super().reset(**item)

    class Concurrent(OneSeed):
        session_cls = BothAtOnce

    inference = Calls(tokenizer)
    server = FakeServer(inference).start()
    env = make_env(tokenizer, server.url, Concurrent)
    try:
        group, _ = play_one_group(env, timeout=90)
    finally:
        server.stop()

    # The tools rendered to the model are the ones the environment's MCP server lists.
    first, _ = in_process(SEED)
    listed = CalculatorEnvironment().step(ListToolsAction()).tools
    assert env.codec.tools == mcp_tool_schemas(listed)
    assert [t["function"]["name"] for t in env.codec.tools] == ["add", "submit"]
    prompt = tokenizer.decode(inference.requests[0]["prompt_token_ids"], skip_special_tokens=False)
    assert all(json.dumps(schema) in prompt for schema in env.codec.tools) and first.prompt in prompt

    # Two sessions of their own on the server, both open at once.
    assert len(set(session_ids)) == 2 and None not in session_ids
    assert len(inference.requests) == 4  # 2 episodes x 2 turns, then submit ends each

    # Each call reached the server: its result, or its error, came back as the next tool message.
    a, b = question_numbers(first.prompt)
    _, (added, refused) = in_process(SEED, CallToolAction(tool_name="add", arguments={"a": a, "b": b}),
                                     CallToolAction(tool_name="add", arguments={"a": "x"}))
    for messages in group.messages:
        assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool", "assistant"]
        assert messages[2] == {"role": "tool", "name": "add", "content": json.dumps(added.result.data)}
        assert json.loads(messages[3]["content"]) == {"error": refused.error.message}

    # The scores are the environment's own submit rewards: right in one episode, one off in the other.
    _, (right,) = in_process(SEED, CallToolAction(tool_name="submit", arguments={"answer": a + b}))
    _, (wrong,) = in_process(SEED, CallToolAction(tool_name="submit", arguments={"answer": a + b + 1}))
    assert right.done and wrong.done
    assert sorted(group.scores) == sorted([right.reward, wrong.reward]) == [0.0, 1.0]
    assert env.server.exit_code() is not None  # close_clients stopped the server it started
