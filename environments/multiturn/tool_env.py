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
when a turn calls no tool, after max_turns, or when the context is full. `--env.stop_after_call`
ends each turn at its first `</tool_call>`, for models that go on writing after a call instead of
ending their turn (a pretrained model: a turn cut by max_tokens ends the episode unanswered).
Each episode's tool calls are counted as its turns are parsed (episode.play_turns), their error
replies and seconds per call by its ToolRunner, and logged as env/ metrics with the other
episode metrics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from environments.config import opt
from environments.multiturn.factory import ToolRunner, environment_tools, tool_schemas
from environments.multiturn.multiturn_env import MultiTurnEnv, MultiTurnEnvConfig


@dataclass
class ToolEnvConfig(MultiTurnEnvConfig):
    """`--env.*` of a tool-using environment: MultiTurnEnv's (max_turns, episode_advantage_scale, ...)
    and stop_after_call."""

    stop_after_call: bool = opt(False, "end each turn at its first </tool_call> (one call a turn), for a model "
                                       "that does not end its turn after a call, e.g. a pretrained one")


class ToolEnv(MultiTurnEnv):
    """Groups of episodes of a TRL environment_factory class, its tools answering the model."""

    env_config_cls = ToolEnvConfig
    config: ToolEnvConfig

    def _sampling(self, temperature: float, top_p: float) -> dict[str, Any]:
        sampling = super()._sampling(temperature, top_p)
        if self.config.stop_after_call:  # the stop string stays in the turn, so its call is parsed
            sampling.update(stop=["</tool_call>"], include_stop_str_in_output=True)
        return sampling

    def tool_schemas(self) -> Optional[list[dict]]:
        """The schemas of the class's tools, read from one instance."""
        return tool_schemas(environment_tools(self.new_environment()))

    def respond(self, environment: Any) -> ToolRunner:
        """The episode's tools answer each turn that calls them."""
        return ToolRunner(environment_tools(environment))

    def respond_info(self, respond: ToolRunner) -> dict[str, Any]:
        """What answering the episode's tool calls gave, as its runner counted it (factory.ToolStats)."""
        return {"tools": respond.stats}
