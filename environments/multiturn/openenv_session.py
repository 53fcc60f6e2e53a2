"""One episode's session with an OpenEnv environment server, through the environment's own client.

OpenEnv's client (an `EnvClient` subclass, or openenv's `GenericEnvClient`) holds one WebSocket
session on the server; the server gives each session its own environment instance, so the
episodes of a group, each with its own client, play at once. The session speaks chat:

    reset(**item)  ->  client.reset(...)    the first observation, as text: the first user message
    step(text)     ->  client.step(action)  the model's reply made the environment's Action; the
                                            observation as text is the next user message, or None
                                            when the environment says done (the episode ends)
    get_reward()                            the episode's reward from the steps' rewards ("last":
                                            the last step's, as openenv's own StepEnvSessionAdapter
                                            reads it; "sum": their sum); None when no step gave one

Nothing here imports openenv: the client, the Action constructor and the observation's text come
in `OpenEnvTurns`, so unit tests run this with small fakes.

A session whose client fails (the server died, the socket broke, the server answered an error)
raises `EpisodeBroken` naming the server's exit code when it has one: the episode fails whole and
is never scored or posted. The client is not retried: a reconnect would open a fresh session,
and the rest of the episode would be played against an environment that never saw its start.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, Callable, Optional

EXIT_WAIT_S = 2.0  # how long a failed call waits to see the server's exit before calling it running
EPISODE_REWARDS: dict[str, Callable[[list[float]], float]] = {
    "last": lambda rewards: rewards[-1],
    "sum": sum,
}


class EpisodeBroken(RuntimeError):
    """The OpenEnv session failed during an episode; the episode is abandoned, not scored."""


def observation_text(observation: Any, field: str = "") -> str:
    """The text of an observation shown to the model: its `field` when named, else every field but
    done, reward and metadata, as JSON (an observation is a pydantic model, or a dict from
    GenericEnvClient)."""
    data = observation.model_dump() if hasattr(observation, "model_dump") else dict(observation)
    if field:
        if field not in data:
            raise KeyError(f"the observation has no field {field!r}; its fields are {', '.join(sorted(data))}")
        value = data[field]
        return value if isinstance(value, str) else json.dumps(value, default=str)
    shown = {k: v for k, v in data.items() if k not in ("done", "reward", "metadata")}
    return json.dumps(shown, default=str)


@dataclass(frozen=True)
class OpenEnvTurns:
    """How chat and an OpenEnv environment meet: a new client session, the model's text made an
    Action, an observation made text, the steps' rewards made the episode's."""

    new_client: Callable[[], Any]  # an unconnected EnvClient (its base_url set)
    make_action: Callable[[str], Any]
    show: Callable[[Any], str]  # observation -> text
    episode_reward: str = "last"
    server_exit: Callable[[], Optional[int]] = lambda: None  # the server's exit code, None while it runs

    def __post_init__(self) -> None:
        if self.episode_reward not in EPISODE_REWARDS:
            raise ValueError(f"episode_reward {self.episode_reward!r} is unknown; valid: {', '.join(EPISODE_REWARDS)}")


class OpenEnvSession:
    """One client session for one episode (see the module docstring); use as `async with`."""

    def __init__(self, turns: OpenEnvTurns):
        self.turns = turns
        self.client = turns.new_client()
        self.rewards: list[float] = []
        self.done = False
        self.steps = 0

    async def __aenter__(self) -> "OpenEnvSession":
        await self._call("connect", self.client.connect)
        return self

    async def __aexit__(self, *exc_info) -> None:
        try:
            await self.client.close()
        except Exception:  # noqa: BLE001 (closing a session the server already dropped: nothing to release)
            if exc_info[0] is None and self.turns.server_exit() is None:
                raise

    async def _server_exit(self) -> Optional[int]:
        """The server's exit code, waiting up to EXIT_WAIT_S for it: a killed server's sockets
        close a moment before its exit can be seen."""
        deadline = asyncio.get_running_loop().time() + EXIT_WAIT_S
        while (code := self.turns.server_exit()) is None and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        return code

    async def _call(self, what: str, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return await call(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 (context added, re-raised)
            code = await self._server_exit()
            server = "the server is running" if code is None else f"the server exited with code {code}"
            raise EpisodeBroken(f"OpenEnv {what} failed after {self.steps} steps ({server}): "
                                f"{type(exc).__name__}: {exc}; the episode is abandoned, not posted") from exc

    async def reset(self, **item: Any) -> str:
        """Reset the session's environment with the item's fields; the first observation's text."""
        result = await self._call("reset", self.client.reset, **item)
        return self.turns.show(result.observation)

    async def step(self, text: str) -> Optional[str]:
        """The model's `text` as one action; the observation's text, or None once the environment is done."""
        if self.done:
            raise EpisodeBroken("step after the environment said done")
        action = self.turns.make_action(text)
        result = await self._call("step", self.client.step, action)
        self.steps += 1
        if result.reward is not None:
            self.rewards.append(float(result.reward))
        self.done = bool(result.done)
        return None if self.done else self.turns.show(result.observation)

    def get_reward(self) -> Optional[float]:
        """The episode's reward (episode_reward: last or sum of the steps'); None when no step gave one."""
        if not self.rewards:
            return None
        return float(EPISODE_REWARDS[self.turns.episode_reward](self.rewards))


class ToolCallFailed(RuntimeError):
    """The environment answered a tool call with an error (or the episode was already over): the
    model is told, the episode goes on."""


def tool_result(result: Any) -> Any:
    """What an MCP tool returned, from its result (FastMCP's CallToolResult, as a dict over the
    wire): its `data` where it has one (what openenv's MCPToolClient.call_tool returns), else the
    text of its content blocks, else the result as it came."""
    if isinstance(result, dict):
        if result.get("is_error"):
            raise ToolCallFailed(_content_text(result) or "the tool failed")
        if result.get("data") is not None:
            return result["data"]
        if result.get("content"):
            return _content_text(result)
    return result


def _content_text(result: dict) -> str:
    return "\n".join(block.get("text", "") for block in result.get("content") or [] if isinstance(block, dict))


class OpenEnvToolSession(OpenEnvSession):
    """One session with an OpenEnv MCP environment (openenv's MCPEnvironment) for one episode:
    each tool call the model makes is one step, `turns.make_action(name, arguments)` (a
    CallToolAction), on this episode's own session; the steps' rewards and done are read as for
    chat, so the environment scores the episode (a tool whose step is done, e.g. submit, ends it).

        list_tools()                ->  client.list_tools(): the tools' names, descriptions and input schemas
        call_tool(name, **args)     ->  client.step(CallToolAction): the tool's result, or ToolCallFailed with
                                        the environment's error; EpisodeBroken (kept in `broken`) when the
                                        session itself fails
    """

    broken: Optional[EpisodeBroken] = None

    async def list_tools(self) -> list[Any]:
        """The environment's tools, as its MCP server lists them."""
        return list(await self._call("list_tools", self.client.list_tools))

    async def call_tool(self, name: str, **arguments: Any) -> Any:
        """Call the tool `name` with `arguments` as one step of the session; its result."""
        if self.done:
            raise ToolCallFailed(f"the episode is over; {name!r} was not called")
        try:
            result = await self._call(f"call_tool {name!r}", self.client.step, self.turns.make_action(name, arguments))
        except EpisodeBroken as exc:
            self.broken = exc  # the tool runner answers any exception as a tool error: the episode reads this
            raise
        self.steps += 1
        if result.reward is not None:
            self.rewards.append(float(result.reward))
        self.done = bool(result.done)
        error = getattr(result.observation, "error", None)
        if error:
            raise ToolCallFailed(getattr(error, "message", None) or str(error))
        return tool_result(getattr(result.observation, "result", None))
