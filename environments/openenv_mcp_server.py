"""Train on an OpenEnv MCP tool environment (openenv's `MCPEnvironment`: tools registered with
FastMCP), its code unchanged: its server runs as our child as for openenv_server.py, each episode
is one session of openenv's `MCPToolClient`, the episodes of a group at once, and the tools
answer the model's tool calls as a ToolEnv's do.

    python -m environments.openenv_mcp_server serve --env.openenv_path .venv/openenv-extra \\
        --env.app my_env.server.app:app --env.observation_field prompt --env.group_size 8 --env.max_turns 4

An episode:

    setup: list_tools on one session  ->  the tools' JSON schemas (factory.mcp_tool_schemas), rendered
                                          into the chat template as tools for every episode
    reset(seed=<item seed>)           ->  the observation as text: the first user message
    each tool call the model makes    ->  CallToolAction(tool_name, arguments)  ->  step on the episode's
                                          own session  ->  the tool's result as a tool message, or
                                          {"error": ...} (the environment's error, an unknown tool, an
                                          unreadable call), as factory.ToolRunner answers
    a turn that calls no tool, or a step the environment says is done  ->  the episode ends
    the steps' rewards                ->  the episode's score (--env.episode_reward last | sum); none at
                                          all (the model never reached a rewarded step): unscored, or
                                          --env.unrewarded_score when it is set

The environment sets the rewards: MCPEnvironment's tool steps carry no reward of their own, so an
environment written for training sets `reward` and `done` on the step that ends the episode (a
`submit` tool). The tool calls are counted like a ToolEnv's (env/episode_tool_* metrics).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional

from environments.base import Item
from environments.config import ConfigError, opt
from environments.multiturn.chat_codec import Message
from environments.multiturn.factory import ToolRunner, mcp_tool_schemas
from environments.multiturn.ledger import Episode
from environments.multiturn.openenv_session import OpenEnvToolSession
from environments.multiturn.tool_calls import ParsedTurn
from environments.multiturn.tool_env import ToolEnv, ToolEnvConfig
from environments.openenv_server import OpenEnvEnv, OpenEnvServerConfig, load_object

CALL_TOOL_ACTION = "openenv.core.env_server.mcp_types:CallToolAction"


@dataclass
class OpenEnvMCPEnvConfig(OpenEnvServerConfig, ToolEnvConfig):
    """`--env.*` of an OpenEnv MCP environment: the OpenEnv server's, the tool env's (stop_after_call), and
    the score of an episode the environment did not reward."""

    client: str = opt("openenv.core.mcp_client:MCPToolClient", "the environment's MCP client class, as "
                      "module:attribute; each episode opens one session with it")
    unrewarded_score: Optional[float] = opt(None, "the score of an episode none of whose steps gave a reward (the "
                                            "model never reached a rewarded step, e.g. never submitted); none: it "
                                            "is unscored and leaves its group, not moving the group's baseline")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.unrewarded_score is not None and not math.isfinite(self.unrewarded_score):
            raise ConfigError("unrewarded_score", f"must be a finite number or none, got {self.unrewarded_score}")


class MCPToolAnswers:
    """What answers the turns of one MCP episode (an episode.Respond): a ToolRunner over the
    session's tools, each call one step; the episode ends when a turn calls no tool or a step is
    done. A session that fails fails the episode (the runner alone would tell the model)."""

    def __init__(self, session: OpenEnvToolSession, names: list[str]):
        self.session = session
        self.runner = ToolRunner({name: functools.partial(session.call_tool, name) for name in names})

    @property
    def stats(self):
        """What answering the episode's tool calls gave (factory.ToolStats: error replies, seconds per call)."""
        return self.runner.stats

    async def __call__(self, parsed: ParsedTurn, assistant: Message) -> Optional[list[Message]]:
        answer = await self.runner(parsed, assistant)
        if self.session.broken is not None:
            raise self.session.broken
        return None if self.session.done else answer


class OpenEnvMCPEnv(ToolEnv, OpenEnvEnv):
    """Episodes of an OpenEnv MCP environment, one MCPToolClient session each (see the module
    docstring): OpenEnvEnv's server, sessions and seeds; ToolEnv's sampling and tool metrics."""

    name = "openenv_mcp"
    env_config_cls = OpenEnvMCPEnvConfig
    session_cls = OpenEnvToolSession
    ended_by_respond: ClassVar[str] = "answered"  # a turn without a tool call, or a step the environment ended
    config: OpenEnvMCPEnvConfig
    tools: Optional[list[Any]] = None  # as the server listed them at setup

    async def setup(self) -> None:
        """OpenEnvEnv's (the server, the reset seeds), then the tools, listed once on a session of their own."""
        await super().setup()
        async with self.session_cls(self.turns) as session:
            self.tools = await session.list_tools()
        if not self.tools:
            raise RuntimeError(f"the OpenEnv environment {self.config.app} lists no MCP tools; an MCPEnvironment "
                               "registers them with FastMCP (environments.openenv_server runs one without tools)")

    def make_action(self) -> Callable[[str, dict], Any]:
        """A tool call made openenv's CallToolAction."""
        action_cls = load_object(CALL_TOOL_ACTION, "openenv_path")  # openenv itself: the extra
        return lambda name, arguments: action_cls(tool_name=name, arguments=arguments)

    def tool_schemas(self) -> Optional[list[dict]]:
        """The schemas of the environment's tools, as its MCP server listed them."""
        if self.tools is None:
            raise RuntimeError("setup() lists the MCP tools; call it before playing episodes")
        return mcp_tool_schemas(self.tools)

    def score_episode(self, item: Item, environment: OpenEnvToolSession, episode: Episode) -> Optional[float]:
        """The session's reward (OpenEnvEnv's); an episode without one scores --env.unrewarded_score
        (none: unscored, it leaves its group)."""
        score = super().score_episode(item, environment, episode)
        return self.config.unrewarded_score if score is None else score

    def respond(self, environment: OpenEnvToolSession) -> MCPToolAnswers:
        """The episode's session answers each tool call."""
        return MCPToolAnswers(environment, [tool.name for tool in self.tools or []])


if __name__ == "__main__":
    OpenEnvMCPEnv.cli()
