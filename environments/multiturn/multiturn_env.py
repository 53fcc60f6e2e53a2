"""MultiTurnEnv: a BaseEnv whose groups are episodes of several turns, each with its own instance
of an environment class; what answers the model's turns is the subclass's (`respond`).

    ToolEnv (tool_env.py)   TRL environment_factory classes: tools answer each turn
    ChatEnv (chat_env.py)   classes with step(text): the environment's reply is the next user turn

Everything else is shared: a group is `group_size` episodes of one item, played concurrently
through the inference client (so every weight bridge mode works, colocate included), scored
together, and turned into one group whose baseline is over episodes (ledger.episodes_group).

An episode starts from `build_messages(item)` (`item["prompt"]` when it is a list of messages,
else BaseEnv's: system_prompt and item["question"]) with the string `reset(**item)` returns
appended to the last message, as TRL does (or as the user message when there is none).

Scores: with `reward_funcs` (TRL-style reward functions), the weighted sum of their values, each
called once per group with TRL's multi-turn arguments: `prompts` (each episode's first messages),
`completions` (each episode's messages after them: assistant turns, tool results, replies),
`completion_ids` (the ids each episode sampled), `environments` (the instances, after the episode)
and the item's other fields, one value per episode. Without them, the instance's get_reward().
An episode scored None leaves the group (ledger.episodes_group): it is not counted as 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
from abc import abstractmethod
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, NamedTuple, Optional

from environments.base import BaseEnv, Item
from environments.config import BaseEnvConfig, ConfigError, check_choice, opt
from environments.multiturn.chat_codec import ChatCodec, Message
from environments.multiturn.episode import Respond, TurnLimits, play_turns
from environments.multiturn.factory import reset_messages, tool_metrics
from environments.multiturn.ledger import ADVANTAGE_SCALES, Episode, episodes_group
from environments.reward_functions import RewardFunction, combine_rewards
from environments.schemas import PROMPT_MASK, ScoredDataGroup

logger = logging.getLogger("onecopy.env")


@dataclass
class MultiTurnEnvConfig(BaseEnvConfig):
    """`--env.*` of a multi-turn environment (group_size: episodes per item)."""

    max_turns: int = opt(8, "most model turns per episode; the environment answers between turns")
    max_message_chars: int = opt(4000, "tool results and environment replies are cut to this many characters, "
                                 "with a note of how many were cut (0: no cap)")
    episode_advantage_scale: str = opt(
        "group", "when an episode spans several rows (a template or environment rewrote its history), "
        "the group carries advantages over episodes: score - mean divided by the std (group) or not (none); "
        "match the trainer's --scale-rewards")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_turns < 1:
            raise ConfigError("max_turns", f"must be >= 1, got {self.max_turns}")
        if self.max_message_chars < 0:
            raise ConfigError("max_message_chars", f"must be >= 0 (0: no cap), got {self.max_message_chars}")
        check_choice("episode_advantage_scale", self.episode_advantage_scale, ADVANTAGE_SCALES)


class Played(NamedTuple):
    """One played episode with what its scoring reads: the instance and the first messages."""

    episode: Episode
    environment: Any
    prompt: list[Message]


def environment_tokens(episode: Episode) -> tuple[int, int]:
    """(context tokens after the first sampled one, all tokens after it), summed over the rows:
    how much of what follows the first prompt the environment wrote (tool results, replies,
    the template's turn headers) rather than the model."""
    written = total = 0
    for row in episode.rows:
        first = next(i for i, m in enumerate(row.masks) if m != PROMPT_MASK)
        tail = row.masks[first:]
        written += sum(m == PROMPT_MASK for m in tail)
        total += len(tail)
    return written, total


def episode_metrics(episodes: list[Episode]) -> dict[str, float]:
    """env/ metrics of played episodes (docs/environments.md lists them)."""
    n = len(episodes)
    if not n:
        return {}
    written, total = map(sum, zip(*(environment_tokens(e) for e in episodes))) if any(e.rows for e in episodes) \
        else (0, 0)
    metrics = {
        "env/episode_turns_mean": sum(e.info["turns"] for e in episodes) / n,
        "env/episode_rows_mean": sum(len(e.rows) for e in episodes) / n,
        "env/episode_unreadable_calls": float(sum(e.info.get("unreadable_calls", 0) for e in episodes)),
        "env/episode_unscored_share": sum(e.score is None for e in episodes) / n,
        "env/environment_token_share": written / total if total else 0.0,
    }
    for reason in sorted({e.info["ended"] for e in episodes}):
        metrics[f"env/episode_ended_{reason}"] = sum(e.info["ended"] == reason for e in episodes) / n
    metrics.update(tool_metrics(episodes))
    return metrics


def sampled_ids(episode: Episode) -> list[int]:
    """The ids the model sampled over the whole episode, in order."""
    return [t for row in episode.rows for t, m in zip(row.tokens, row.masks) if m != PROMPT_MASK]


class MultiTurnEnv(BaseEnv):
    """Groups of multi-turn episodes of `environment_factory` (see the module docstring)."""

    env_config_cls: ClassVar[type[BaseEnvConfig]] = MultiTurnEnvConfig
    environment_factory: ClassVar[Optional[Callable[[], Any]]] = None
    template_kwargs: ClassVar[dict[str, Any]] = {}  # extra chat-template variables, e.g. enable_thinking
    reward_funcs: ClassVar[Sequence[RewardFunction]] = ()  # TRL-style; none: the instances' get_reward()
    reward_weights: ClassVar[Optional[Sequence[float]]] = None  # None: 1.0 each
    ended_by_respond: ClassVar[str] = "answered"  # info["ended"] when respond ends an episode
    _codec: Optional[ChatCodec] = None
    _episodes: Optional[list[Episode]] = None  # played since the last wandb_log, for its metrics

    # ----- what a subclass provides --------------------------------------------------------------

    @abstractmethod
    def respond(self, environment: Any) -> Respond:
        """What answers the turns of one episode of `environment` (episode.Respond)."""

    def tool_schemas(self) -> Optional[list[dict]]:
        """JSON schemas of the tools the chat template shows the model; None: no tools."""
        return None

    def respond_info(self, respond: Respond) -> dict[str, Any]:
        """What `respond` counted over its episode, added to the episode's info once it has
        played (ToolEnv: {"tools": its ToolStats}); nothing by default."""
        return {}

    # ----- episodes ------------------------------------------------------------------------------

    @property
    def codec(self) -> ChatCodec:
        """The chat codec, built (and self-tested) on first use."""
        if self._codec is None:
            self._codec = ChatCodec(self.tokenizer, tools=self.tool_schemas(), template_kwargs=self.template_kwargs)
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
        """Reset `environment` with the item's fields and return the episode's first messages
        (factory.reset_messages: reset()'s string appended to the last one, as TRL does)."""
        try:
            messages = self.build_messages(item)
        except NotImplementedError:
            messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages = reset_messages(environment, messages, item)
        if not messages:
            raise ValueError(f"item {item!r} gives no messages and reset() returned None: nothing to prompt with")
        return messages

    def _sampling(self, temperature: float, top_p: float) -> dict[str, Any]:
        seed = None
        if self.config.seed is not None:  # reproducible sampling only when asked for
            seed = (self.seed * 1_000_003 + self._sample_counter) % 2**31
            self._sample_counter += 1
        return {"temperature": temperature, "top_p": top_p, "seed": seed}

    @contextlib.asynccontextmanager
    async def episode_environment(self, item: Item) -> AsyncIterator[tuple[Any, list[Message]]]:
        """The environment instance of one episode of `item` and the episode's first messages,
        held for as long as the episode plays: a fresh instance (new_environment) reset with the
        item (first_messages). Override to open something for an episode and close it after,
        also when the episode fails (a session with an environment server: openenv_server.py)."""
        environment = self.new_environment()
        yield environment, self.first_messages(item, environment)

    async def play(self, item: Item, temperature: float, top_p: float) -> Played:
        """One episode of `item`, not yet scored."""
        config = self.config
        async with self.episode_environment(item) as (environment, prompt):
            respond = self.respond(environment)
            episode = await play_turns(
                prompt,
                codec=self.codec,
                inference=self.inference,
                limits=TurnLimits(config.max_turns, config.max_tokens, self.max_token_length, config.max_message_chars),
                sampling=self._sampling(temperature, top_p),
                respond=respond,
                ended_by_respond=self.ended_by_respond,
            )
        episode.info.update(self.respond_info(respond))
        return Played(episode, environment, prompt)

    # ----- scores --------------------------------------------------------------------------------

    def score_episode(self, item: Item, environment: Any, episode: Episode) -> Optional[float]:
        """One episode's score without reward functions: the instance's get_reward() (None: no
        reward applies, the episode leaves its group). Override to score otherwise."""
        get_reward = getattr(environment, "get_reward", None)
        if get_reward is None:
            raise NotImplementedError(f"{type(environment).__name__} has no get_reward(); give "
                                      f"{type(self).__name__} reward_funcs or override score_episode")
        reward = get_reward()
        return None if reward is None else float(reward)

    def score_episodes(self, item: Item, played: list[Played]) -> list[Optional[float]]:
        """The scores of a group's episodes: `reward_funcs` called with TRL's arguments (see the
        module docstring) when there are any, else score_episode of each."""
        if not self.reward_funcs:
            return [self.score_episode(item, p.environment, p.episode) for p in played]
        weights = list(self.reward_weights or [1.0] * len(self.reward_funcs))
        if len(weights) != len(self.reward_funcs):
            raise ValueError(f"{type(self).__name__}: {len(weights)} reward_weights for "
                             f"{len(self.reward_funcs)} reward_funcs")
        n = len(played)
        columns = {k: [v] * n for k, v in item.items() if k != "prompt"} if isinstance(item, dict) else {}
        return combine_rewards(
            self.reward_funcs, weights, n,
            prompts=[p.prompt for p in played],
            completions=[p.episode.messages[len(p.prompt):] for p in played],
            completion_ids=[sampled_ids(p.episode) for p in played],
            environments=[p.environment for p in played],
            **columns,
        )

    async def play_scored(self, item: Item, count: int, temperature: float, top_p: float) -> list[Episode]:
        """`count` episodes of `item`, played at once and scored together."""
        played = await asyncio.gather(*(self.play(item, temperature, top_p) for _ in range(count)))
        scores = self.score_episodes(item, list(played))
        if len(scores) != len(played):
            raise ValueError(f"{type(self).__name__} scored {len(scores)} of {len(played)} episodes")
        for p, score in zip(played, scores):
            p.episode.score = score
        return [p.episode for p in played]

    # ----- groups --------------------------------------------------------------------------------

    async def collect_trajectories(self, item: Item) -> tuple[Optional[ScoredDataGroup], list[Item]]:
        """`group_size` episodes of `item`, played at once, as one group (baseline over episodes)."""
        config = self.config
        episodes = await self.play_scored(item, config.group_size, config.temperature, config.top_p)
        params = {"n": config.group_size, "max_tokens": config.max_tokens, "max_turns": config.max_turns,
                  "temperature": config.temperature, "top_p": config.top_p}
        group = episodes_group(episodes, config.episode_advantage_scale, params)
        self._episodes = (self._episodes or []) + episodes
        unscored = sum(e.score is None for e in episodes)
        if unscored:
            logger.info("[env] %d of %d episodes have no reward (None): left out of the group", unscored, len(episodes))
        ended = [e.info["ended"] for e in episodes]
        logger.debug("[env] %d episodes: rows=%s turns=%s ended=%s", len(episodes),
                     [len(e.rows) for e in episodes], [e.info["turns"] for e in episodes], ended)
        unplayed = [e.info["prompt_tokens"] for e in episodes if e.info["turns"] == 0]  # no room for a first turn
        if group is None and unplayed:
            self.skip_prompt_too_long(max(unplayed))
        elif group is None:
            logger.warning("[env] skipped group: no episode has both a sampled token and a reward (ended: %s)",
                           ", ".join(ended))
            self.counts["skipped_too_long"] += 1
        return group, []

    async def wandb_log(self, wandb_metrics: Optional[dict[str, float]] = None) -> dict[str, float]:
        """BaseEnv's env/ metrics and those of the episodes played since the last call."""
        metrics = {**episode_metrics(self._episodes or []), **(wandb_metrics or {})}
        self._episodes = []
        return await super().wandb_log(metrics)

    async def evaluate(self) -> dict[str, float]:
        """One greedy episode per eval item; `env/eval_accuracy` is the fraction solved (see
        BaseEnv.solved; a score of None counts 0), `env/eval_turns_std` the sample standard
        deviation of the turns per episode (for an interval around `env/eval_turns_mean`), and
        likewise the tool calls per episode (`env/eval_tool_calls_*`: info["tool_calls"], the count
        env/episode_tool_calls reads in training)."""
        items = self.eval_items[: self.config.num_eval_items or None]
        if not items:
            logger.warning("[env] evaluate: %s has no eval items", self.name)
            return {}
        groups = await asyncio.gather(*(self.play_scored(item, 1, 0.0, 1.0) for item in items))
        episodes = [episode for (episode,) in groups]
        turns = [e.info["turns"] for e in episodes]
        calls = [e.info["tool_calls"] for e in episodes]
        metrics = {
            "env/eval_accuracy": sum(self.solved(e.score or 0.0) for e in episodes) / len(episodes),
            "env/eval_score_mean": sum(e.score or 0.0 for e in episodes) / len(episodes),
            "env/eval_turns_mean": statistics.fmean(turns),
            "env/eval_turns_std": statistics.stdev(turns) if len(turns) > 1 else 0.0,
            "env/eval_tool_calls_mean": statistics.fmean(calls),
            "env/eval_tool_calls_std": statistics.stdev(calls) if len(calls) > 1 else 0.0,
            "env/eval_items": float(len(episodes)),
        }
        logger.info("[env] eval accuracy=%.3f over %d items at step %d",
                    metrics["env/eval_accuracy"], len(episodes), self.curr_step)
        self._eval_metrics = metrics
        return metrics
