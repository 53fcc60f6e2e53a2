"""ToolEnv: a MultiTurnEnv whose episodes are TRL `environment_factory` classes, their public
methods the tools that answer each turn (factory.py has the contract).

A subclass names the class and where items come from; everything else is MultiTurnEnv's and
BaseEnv's (serve, process, evaluate, scoring, the checks before posting):

    class CalculatorEnv(ToolEnv):
        name = "calculator"
        environment_factory = Calculator          # reset(**item), tools, get_reward()

        async def setup(self): self.items = [...]
        async def get_next_item(self): return next(...)

    if __name__ == "__main__":
        CalculatorEnv.cli()

The tools' JSON schemas are rendered by the chat template (when it shows tools); an episode ends
when a turn calls no tool, after max_turns, or when the context is full. Each episode's tool
calls are counted by its ToolRunner (calls, error replies, seconds per call) and logged as env/
metrics with the other episode metrics.
"""

from __future__ import annotations

from typing import Any, Optional

from environments.multiturn.factory import ToolRunner, environment_tools, tool_schemas
from environments.multiturn.multiturn_env import MultiTurnEnv, MultiTurnEnvConfig

ToolEnvConfig = MultiTurnEnvConfig  # `--env.*` of a tool-using environment: max_turns, episode_advantage_scale


class ToolEnv(MultiTurnEnv):
    """Groups of episodes of a TRL environment_factory class, its tools answering the model."""

    def tool_schemas(self) -> Optional[list[dict]]:
        """The schemas of the class's tools, read from one instance."""
        return tool_schemas(environment_tools(self.new_environment()))

    def respond(self, environment: Any) -> ToolRunner:
        """The episode's tools answer each turn that calls them."""
        return ToolRunner(environment_tools(environment))

    def respond_info(self, respond: ToolRunner) -> dict[str, Any]:
        """The episode's tool calls as its runner counted them (factory.ToolStats)."""
        return {"tools": respond.stats}
