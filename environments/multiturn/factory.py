"""TRL-style `environment_factory` classes, run unchanged, and the turn loop of one episode.

Such a class needs nothing from onecopy:

    class Calculator:
        def reset(self, **row) -> str | None:      # called with the dataset row; a string is appended to the prompt
            self.answer = row["answer"]
        def add(self, a: int, b: int) -> int:       # a public method with a docstring is a tool
            \"\"\"Add two integers.

            Args:
                a: The first integer.
                b: The second integer.
            \"\"\"
            return a + b
        def get_reward(self) -> float:             # optional: the episode's score
            ...

The contract, as TRL's GRPOTrainer(environment_factory=...) documents it: the class is built
with no arguments, one instance per episode; `reset_messages` calls reset(**row) and appends the
string it returns to the last prompt message; `environment_tools` finds the tools (public methods
other than reset/get_reward; get_reward stays hidden so the model cannot read its own score) and
`tool_schemas` writes their JSON schemas with transformers' `get_json_schema` (signature and
Google-style docstring); `ToolRunner.call` awaits async tools, runs sync ones in a worker thread,
and answers an exception, an unknown tool or an unreadable call with `{"error": ...}`.

`ToolRunner` is what answers the turns of a tool-using episode (episode.play_turns): the results
of the turn's tool calls; a turn that calls no tool ends the episode. It records what answering
them gave, in its `ToolStats` (error replies, seconds per call); the calls themselves are counted
once, by play_turns as it parses each turn (info["tool_calls"]), so that a call the runner never
sees (in a turn cut by length) counts the same in the evaluation and the training metrics.
`tool_metrics` turns the episodes' counts and stats into their env/ metrics.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from environments.multiturn.chat_codec import Message
from environments.multiturn.ledger import Episode
from environments.multiturn.tool_calls import ParsedTurn, ToolCall

NOT_TOOLS = frozenset({"reset", "get_reward"})


def environment_tools(environment: Any) -> dict[str, Callable[..., Any]]:
    """The tools of an environment instance: its public methods but reset and get_reward."""
    tools = {}
    for name, member in inspect.getmembers(type(environment), callable):
        if name.startswith("_") or name in NOT_TOOLS or isinstance(member, type):
            continue
        tools[name] = getattr(environment, name)
    return tools


def tool_schemas(tools: dict[str, Callable[..., Any]]) -> list[dict[str, Any]]:
    """JSON schemas of `tools` (transformers' get_json_schema: type hints and a Google-style
    docstring with an Args section for every parameter)."""
    from transformers.utils import get_json_schema

    schemas = []
    for name, function in tools.items():
        try:
            schemas.append(get_json_schema(function))
        except Exception as exc:
            raise TypeError(
                f"tool {name!r} has no usable schema ({exc}); give it type hints and a docstring with an "
                "Args: section naming every parameter, or make it private (a leading underscore)"
            ) from exc
    return schemas


def mcp_tool_schemas(tools: list[Any]) -> list[dict[str, Any]]:
    """JSON schemas of MCP tools as listed by an MCP server (each with `name`, `description` and
    `input_schema`, as openenv's Tool; or MCP's `inputSchema`), in the shape `tool_schemas`
    writes: what chat templates render as tools."""
    schemas = []
    for tool in tools:
        parameters = getattr(tool, "input_schema", None) or getattr(tool, "inputSchema", None)
        schemas.append({"type": "function", "function": {
            "name": tool.name, "description": tool.description or "",
            "parameters": parameters or {"type": "object", "properties": {}}}})
    return schemas


def tool_error(message: str) -> str:
    """A tool message that tells the model what went wrong, as TRL writes it: {"error": ...}."""
    return json.dumps({"error": message})


# Sync tools run here, not in asyncio's default executor: that one has min(32, cores + 4)
# threads (6 on 2 cores), so the seventh of many episodes' blocking tools would wait for a thread
# while vLLM had nothing to do. Threads that wait on I/O or a sleep cost little.
TOOL_THREADS = ThreadPoolExecutor(max_workers=256, thread_name_prefix="onecopy-tool")


async def call_off_loop(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`function(*args, **kwargs)`: awaited when async; a sync function runs in a worker thread
    (TOOL_THREADS), so one that blocks holds up its own episode only, not the others the event
    loop is playing."""
    if inspect.iscoroutinefunction(function):
        return await function(*args, **kwargs)
    call = functools.partial(function, *args, **kwargs)
    result = await asyncio.get_running_loop().run_in_executor(TOOL_THREADS, call)
    if inspect.isawaitable(result):  # a sync wrapper that returns a coroutine
        result = await result
    return result


def check_environment(environment: Any) -> None:
    """Refuse an environment instance TRL would refuse: it must have a callable reset()."""
    if not callable(getattr(environment, "reset", None)):
        raise TypeError(f"{type(environment).__name__} has no reset(**row) method; an environment_factory class "
                        "needs one (it may return None, or a string added to the last prompt message)")


def reset_messages(environment: Any, messages: list[Message], row: Any) -> list[Message]:
    """Reset `environment` with the dataset row's fields and return the episode's first messages:
    `messages` with the string reset() returned appended to the last message's content, as TRL
    does (no separator added), or as a user message when there is none."""
    check_environment(environment)
    observation = environment.reset(**row) if isinstance(row, dict) else environment.reset()
    messages = [dict(m) for m in messages]
    if observation is not None:
        if messages:
            messages[-1]["content"] = f"{messages[-1]['content']}{observation}"
        else:
            messages.append({"role": "user", "content": str(observation)})
    return messages


@dataclass
class ToolStats:
    """What answering one episode's tool calls gave, as its ToolRunner answered them: the calls
    answered with {"error": ...} (`errors`: the call could not be read, named no tool, or the tool
    raised), and the wall seconds of each call that ran a tool (`seconds`, one per call, a call
    that raised included). The calls themselves are the episode's info["tool_calls"]."""

    errors: int = 0
    seconds: list[float] = field(default_factory=list)


class ToolFailed(Exception):
    """A tool call answered with {"error": <this message>}."""


class ToolRunner:
    """Answers the turns of one episode with `tools` (an episode.Respond): the results of the
    turn's tool calls, one tool message each, in the order called; a turn without a tool call
    ends the episode. `stats` counts the error replies; `clock` times the calls (seconds, monotonic)."""

    def __init__(self, tools: dict[str, Callable[..., Any]], clock: Callable[[], float] = time.perf_counter):
        self.tools = tools
        self.clock = clock
        self.stats = ToolStats()

    async def __call__(self, parsed: ParsedTurn, assistant: Message) -> Optional[list[Message]]:
        if not parsed.tool_calls:
            return None
        return [{"role": "tool", "name": call.name or "unknown", "content": await self.call(call)}
                for call in parsed.tool_calls]

    async def call(self, call: ToolCall) -> str:
        """The tool message content for `call`: the result (a string as it is, anything else as
        JSON), or `{"error": ...}` when the call cannot be read, names no tool, or the tool raises.
        The tool runs through `call_off_loop` (a sync tool in a worker thread); its time is the
        wall time of that await, thread included, as the episode waits for it."""
        try:
            return await self._result(call)
        except ToolFailed as failed:
            self.stats.errors += 1
            return tool_error(str(failed))

    async def _result(self, call: ToolCall) -> str:
        """The tool's result as message content; ToolFailed with what to tell the model."""
        if call.error is not None:
            raise ToolFailed(call.error)
        function = self.tools.get(call.name)
        if function is None:
            raise ToolFailed(f"no tool named {call.name!r}; the tools are {', '.join(sorted(self.tools))}")
        start = self.clock()
        try:
            result = await call_off_loop(function, **call.arguments)
        except Exception as exc:  # noqa: BLE001 (a failing tool is the model's mistake to learn from, not ours)
            raise ToolFailed(str(exc) or type(exc).__name__) from exc
        finally:
            self.stats.seconds.append(self.clock() - start)
        return result if isinstance(result, str) else json.dumps(result, default=str)


def tool_metrics(episodes: list[Episode]) -> dict[str, float]:
    """env/ metrics of the tool calls of those `episodes` whose turns a ToolRunner answered (their
    info["tools"] holds its ToolStats; docs/environments.md lists them); none without such episodes.
    The calls are each episode's info["tool_calls"], the count the evaluation reads too."""
    episodes = [e for e in episodes if "tools" in e.info]
    if not episodes:
        return {}
    calls = sum(e.info["tool_calls"] for e in episodes)
    turns = sum(e.info["turns"] for e in episodes)
    seconds = [t for e in episodes for t in e.info["tools"].seconds]
    return {
        "env/episode_tool_calls": float(calls),
        "env/episode_tool_calls_mean": calls / len(episodes),
        "env/episode_tool_calls_per_turn": calls / turns if turns else 0.0,
        "env/episode_tool_errors": float(sum(e.info["tools"].errors for e in episodes)),
        "env/tool_call_seconds_mean": sum(seconds) / len(seconds) if seconds else 0.0,
        "env/tool_call_seconds_max": max(seconds, default=0.0),
    }
