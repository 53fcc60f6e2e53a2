"""ToolEnv: a BaseEnv whose groups are multi-turn, tool-using episodes of a TRL-style class.

A subclass names the class and where items come from; everything else is BaseEnv's (serve,
process, evaluate, the checks before posting):

    class CalculatorEnv(ToolEnv):
        name = "calculator"
        environment_factory = Calculator          # reset(**item), tools, get_reward()

        async def setup(self): self.items = [...]
        async def get_next_item(self): return next(...)

    if __name__ == "__main__":
        CalculatorEnv.cli()

A group is `group_size` episodes of one item, played concurrently, each with its own instance of
the class. The first messages are `build_messages(item)` (`item["prompt"]` when it is a list of
messages, else BaseEnv's: system_prompt and item["question"]); a string returned by
`reset(**item)` is added to the last user message (or is the user message when there is none).
The score of an episode is `score_episode` (default: the instance's get_reward()).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional

from environments.base import BaseEnv, Item
from environments.config import BaseEnvConfig, ConfigError, opt
from environments.multiturn.chat_codec import ChatCodec, Message
from environments.multiturn.factory import TurnLimits, environment_tools, play_episode, tool_schemas
from environments.multiturn.ledger import ADVANTAGE_SCALES, Episode, episodes_group
from environments.schemas import ScoredDataGroup

logger = logging.getLogger("onecopy.env")


@dataclass
class ToolEnvConfig(BaseEnvConfig):
    """`--env.*` of a tool-using environment (group_size: episodes per item)."""

    max_turns: int = opt(8, "most model turns per episode; tools answer between turns")
    episode_advantage_scale: str = opt(
        "group", "when an episode spans several rows (a template or environment rewrote its history), "
        "the group carries advantages over episodes: score - mean divided by the std (group) or not (none); "
        "match the trainer's --scale-rewards")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_turns < 1:
            raise ConfigError("max_turns", f"must be >= 1, got {self.max_turns}")
        if self.episode_advantage_scale not in ADVANTAGE_SCALES:
            raise ConfigError("episode_advantage_scale",
                              f"must be one of {', '.join(ADVANTAGE_SCALES)}, got {self.episode_advantage_scale!r}")


class ToolEnv(BaseEnv):
    """Groups of episodes of `environment_factory` (see the module docstring)."""

    env_config_cls: ClassVar[type[BaseEnvConfig]] = ToolEnvConfig
    environment_factory: ClassVar[Optional[Callable[[], Any]]] = None
    template_kwargs: ClassVar[dict[str, Any]] = {}  # extra chat-template variables, e.g. enable_thinking
    _codec: Optional[ChatCodec] = None

    @property
    def codec(self) -> ChatCodec:
        """The chat codec, built (and self-tested) on first use with the tools' schemas."""
        if self._codec is None:
            schemas = tool_schemas(environment_tools(self.new_environment()))
            self._codec = ChatCodec(self.tokenizer, tools=schemas, template_kwargs=self.template_kwargs)
        return self._codec

    def new_environment(self) -> Any:
        """A fresh instance of the environment class, one per episode."""
        if self.environment_factory is None:
            raise NotImplementedError(f"{type(self).__name__} must set environment_factory (a class or callable)")
        return type(self).environment_factory()

    def build_messages(self, item: Item) -> list[Message]:
        """`item["prompt"]` when it is a list of chat messages, else BaseEnv's build_messages."""
        if isinstance(item, dict) and isinstance(item.get("prompt"), list):
            return [dict(m) for m in item["prompt"]]
        return super().build_messages(item)

    def first_messages(self, item: Item, environment: Any) -> list[Message]:
        """Reset `environment` with the item's fields and return the episode's first messages."""
        observation = environment.reset(**item) if isinstance(item, dict) else environment.reset()
        try:
            messages = self.build_messages(item)
        except NotImplementedError:
            messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        if observation is not None:
            if messages and messages[-1]["role"] == "user":
                messages[-1] = {**messages[-1], "content": f"{messages[-1]['content']}\n\n{observation}"}
            else:
                messages.append({"role": "user", "content": str(observation)})
        if not messages:
            raise ValueError(f"item {item!r} gives no messages and reset() returned None: nothing to prompt with")
        return messages

    def score_episode(self, item: Item, environment: Any, episode: Episode) -> float:
        """The episode's score: the environment's get_reward() (override to score otherwise)."""
        get_reward = getattr(environment, "get_reward", None)
        if get_reward is None:
            raise NotImplementedError(f"{type(environment).__name__} has no get_reward(); override "
                                      f"{type(self).__name__}.score_episode")
        return float(get_reward())

    def _sampling(self, temperature: float, top_p: float) -> dict[str, Any]:
        seed = None
        if self.config.seed is not None:  # reproducible sampling only when asked for
            seed = (self.seed * 1_000_003 + self._sample_counter) % 2**31
            self._sample_counter += 1
        return {"temperature": temperature, "top_p": top_p, "seed": seed}

    async def play(self, item: Item, temperature: float, top_p: float) -> Episode:
        """One scored episode of `item`."""
        environment = self.new_environment()
        config = self.config
        episode = await play_episode(
            environment,
            self.first_messages(item, environment),
            codec=self.codec,
            inference=self.inference,
            limits=TurnLimits(config.max_turns, config.max_tokens, self.max_token_length),
            sampling=self._sampling(temperature, top_p),
        )
        episode.score = self.score_episode(item, environment, episode)
        return episode

    async def collect_trajectories(self, item: Item) -> tuple[Optional[ScoredDataGroup], list[Item]]:
        """`group_size` episodes of `item`, played at once, as one group (baseline over episodes)."""
        config = self.config
        episodes = await asyncio.gather(*(self.play(item, config.temperature, config.top_p)
                                          for _ in range(config.group_size)))
        params = {"n": config.group_size, "max_tokens": config.max_tokens, "max_turns": config.max_turns,
                  "temperature": config.temperature, "top_p": config.top_p}
        group = episodes_group(list(episodes), config.episode_advantage_scale, params)
        ended = [e.info["ended"] for e in episodes]
        logger.debug("[env] %d episodes: rows=%s turns=%s ended=%s", len(episodes),
                     [len(e.rows) for e in episodes], [e.info["turns"] for e in episodes], ended)
        if group is None:
            logger.warning("[env] skipped group: no episode sampled a token (ended: %s)", ", ".join(ended))
            self.counts["skipped_too_long"] += 1
        return group, []

    async def evaluate(self) -> dict[str, float]:
        """One greedy episode per eval item; `env/eval_accuracy` is the fraction scoring > 0."""
        items = self.eval_items[: self.config.num_eval_items or None]
        if not items:
            logger.warning("[env] evaluate: %s has no eval items", self.name)
            return {}
        episodes = await asyncio.gather(*(self.play(item, 0.0, 1.0) for item in items))
        metrics = {
            "env/eval_accuracy": sum(e.score > 0 for e in episodes) / len(episodes),
            "env/eval_turns_mean": sum(e.info["turns"] for e in episodes) / len(episodes),
            "env/eval_items": float(len(episodes)),
        }
        logger.info("[env] eval accuracy=%.3f over %d items at step %d",
                    metrics["env/eval_accuracy"], len(episodes), self.curr_step)
        self._eval_metrics = metrics
        return metrics
