"""The OpenEnv MCP environment with its calculator episodes' tool calls forced, run by the launcher as
its environment process (`--environment tests.e2e.forced_mcp_env`) in tests/e2e/test_openenv_mcp_loop.py.

SmolLM2-135M calls no tool by itself, so each turn is constrained with vLLM's structured outputs:
the first to `add` the question's two numbers, the second to `submit` an answer. The answers are
forced right and wrong in turn, so that with one group in flight (--env.max_num_workers 1) every
group of two episodes scores 1.0 and 0.0 (the environment's rewards) and its step has a signal to
train on, with no dependence on what the model would have sampled.

    python -m tests.e2e.forced_mcp_env serve --env.app tests.fixtures.openenv_mcp_calculator.server.app:app ...
"""

from __future__ import annotations

import json
import re

from environments.openenv_mcp_server import OpenEnvMCPEnv

TOOL_TURN = "<|im_start|>tool"  # SmolLM2's template puts each tool result in a turn of its own
QUESTION = re.compile(r"What is (\d+) \+ (\d+)\?")  # the fixture's observation


def tool_call(name: str, arguments: dict) -> str:
    """A tool call written as the chat template's tool prompt shows it."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def literal(text: str) -> str:
    """A regex matching `text` only, in the syntax vLLM's structured-output backends all read
    (re.escape's escaped spaces and newlines are Python's own)."""
    return re.sub(r"([\\.^$|?*+()\[\]{}])", r"\\\1", text).replace("\n", "\\n")


def forced_turn(a: int, b: int, turn: int, right: bool) -> str:
    """The regex (a literal) that turn `turn` of an episode asking a + b must match."""
    if turn == 0:
        return literal(tool_call("add", {"a": a, "b": b}))
    return literal(tool_call("submit", {"answer": a + b if right else a + b + 1}))


class ForcedCalculatorTurns:
    """The inference client with every turn forced (forced_turn); the k-th submit is right when k is even."""

    def __init__(self, client, tokenizer):
        self.client, self.tokenizer, self.submits = client, tokenizer, 0

    async def generate(self, prompt_token_ids, **params):
        prompt = self.tokenizer.decode(prompt_token_ids, skip_special_tokens=False)
        a, b = map(int, QUESTION.search(prompt).groups())
        turn = min(prompt.count(TOOL_TURN), 1)
        right = True
        if turn == 1:  # counted before the await: the two episodes of a group ask in either order
            right, self.submits = self.submits % 2 == 0, self.submits + 1
        params["structured_outputs"] = {"regex": forced_turn(a, b, turn, right)}
        return await self.client.generate(prompt_token_ids, **params)

    async def aclose(self):
        await self.client.aclose()


class ForcedOpenEnvMCPEnv(OpenEnvMCPEnv):
    """OpenEnvMCPEnv, sampling through ForcedCalculatorTurns."""

    def open_clients(self, post_to_api: bool = False) -> None:
        """OpenEnvMCPEnv's clients, the inference client wrapped."""
        super().open_clients(post_to_api)
        self.inference = ForcedCalculatorTurns(self.inference, self.tokenizer)


if __name__ == "__main__":
    ForcedOpenEnvMCPEnv.cli()
