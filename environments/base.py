"""BaseEnv: the environment side of GRPO, with Atropos's lifecycle and field names.

A subclass provides setup(), get_next_item(), build_messages(item) and score_completion(item,
text), or score_group(item, texts) to score a group at once; it fills `self.eval_items` for the
default evaluate(). The default collect_trajectories() makes one /generate call with
n=group_size and scores the completions; a subclass may override it
(multi-turn, custom groups) and handle_send_to_api() still checks what it returns. The serve /
process / evaluate loops live in runner.py (EnvRunner, given the environment); run one with
`python -m environments.<name>_server serve|process|evaluate` (see cli.py).

The run's state (trainer step, queue size, env id, groups sent, ...) is one RunState
(run_state.py) that the environment holds and the runner updates; the Atropos names
(`self.curr_step`, `self.groups_sent`, ...) read and write it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import time
import importlib
from abc import ABC, abstractmethod
from dataclasses import asdict
from pathlib import Path
from collections.abc import Callable
from typing import Any, ClassVar, Optional

from environments.clients import Backoff, InferenceClient, TrajectoryApiClient

DROP_REPORT_SECONDS = 5.0  # how often an environment that drops groups tells the API its totals
from environments.config import BaseEnvConfig, ServerConfig
from environments.run_state import InRunState, RunState
from environments.runner import EnvRunner
from environments.schemas import PROMPT_LOGPROB, PROMPT_MASK, PROMPT_VERSION, Choice, ScoredDataGroup
from environments.tokenizer import load_tokenizer, resolve_tokenizer_path

logger = logging.getLogger("onecopy.env")
Item = Any



def import_extra(module: str, install_hint: str):
    """``module`` of an optional extra (reasoning-gym, verifiers), or an ImportError that says how
    to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(install_hint) from err


def seeded_items(make_item: Callable[[random.Random], Item], eval_seed: int, count: int,
                 seed: int | None) -> tuple[list[Item], random.Random]:
    """A procedural task's fixed eval set (``count`` items drawn from ``eval_seed``) and the
    generator of its training stream (from ``seed``)."""
    eval_rng = random.Random(eval_seed)
    return [make_item(eval_rng) for _ in range(count)], random.Random(seed)

class BaseEnv(ABC):
    """An environment: turns items into scored groups of completions for the trainer."""

    name: ClassVar[str] = "env"
    env_config_cls: ClassVar[type[BaseEnvConfig]] = BaseEnvConfig
    backoff: Backoff = Backoff()  # retry waits; tests shorten them
    status_poll_s: float = 2.0  # how often serve asks the API for the trainer step and queue
    room_poll_s: float = 0.05  # how often a worker held back by max_batches_offpolicy asks for the queue
    # How often a registering environment asks whether the trainer has started: the first batch
    # starts within this of the trainer's registration (an API on the same host answers in a millisecond).
    register_poll_s: float = 0.2
    # How long to wait for the inference server to name its model (no --env.tokenizer_name): the
    # launcher starts the environment beside the trainer, which may take 15 min to start vLLM.
    tokenizer_wait_s: float = 1800.0

    # The run's state under Atropos's names; all of it lives in self.run_state (see RunState).
    env_id = InRunState()
    curr_step = InRunState()
    num_steps = InRunState()
    queue_size = InRunState()
    batch_size = InRunState()
    max_token_length = InRunState()
    groups_sent = InRunState()
    wandb_name = InRunState()

    def __init__(self, config: BaseEnvConfig, server_config: ServerConfig, tokenizer=None):
        self.config = config
        self.server_config = server_config
        self.run_state = RunState(
            max_token_length=config.max_token_length,
            batch_size=config.batch_size,
            wandb_name=config.wandb_name or self.name,
            total_steps=config.total_steps,
        )
        self.tokenizer = tokenizer or load_tokenizer(
            resolve_tokenizer_path(
                config.tokenizer_name, server_config.base_url, self.tokenizer_wait_s, self.backoff
            )
        )
        self.seed = config.seed if config.seed is not None else random.SystemRandom().randrange(2**31)
        logger.info("[env] %s seed=%d", self.name, self.seed)
        self.eval_items: list[Item] = []
        self.counts = {"dropped_equal_scores": 0, "skipped_too_long": 0, "skipped_bad_values": 0}
        self._dropped_reported_at: Optional[float] = -math.inf  # None: the API has no /env-dropped
        self._scores: list[float] = []  # since the last wandb_log
        self._completion_lengths: list[int] = []
        self._eval_metrics: dict[str, float] = {}
        self._sample_counter = 0
        self._jsonl = None
        self._wandb = None
        self.inference: Optional[InferenceClient] = None
        self.api: Optional[TrajectoryApiClient] = None

    @classmethod
    def config_init(cls) -> tuple[BaseEnvConfig, ServerConfig]:
        """Defaults before YAML and CLI overrides; override to change an environment's defaults."""
        return cls.env_config_cls(), ServerConfig()

    @classmethod
    def cli(cls, argv: Optional[list[str]] = None) -> None:
        """Command line: `serve`, `process` or `evaluate` (see environments/cli.py)."""
        from environments.cli import run_cli

        run_cli(cls, argv)

    # ----- running (the loops are EnvRunner's, runner.py) ----------------------------------------

    async def env_manager(self) -> None:
        """`serve`: post groups to the API until total_steps groups, or the trainer's last step."""
        await EnvRunner(self).serve()

    async def process_manager(self) -> None:
        """`process`: write total_steps kept groups to data_path_to_save_groups; no API."""
        await EnvRunner(self).process()

    async def run_evaluate(self) -> dict[str, float]:
        """`evaluate`: setup() then evaluate() once against the inference server."""
        return await EnvRunner(self).evaluate_once()

    def open_clients(self, post_to_api: bool = False) -> None:
        """Open the inference client, the JSONL file (if configured) and, to post, the API client."""
        path = self.config.data_path_to_save_groups
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            try:
                self._jsonl = open(path, "x", encoding="utf-8")  # never overwrite earlier groups
            except FileExistsError:
                raise FileExistsError(
                    f"--env.data_path_to_save_groups {path} exists; pass a new path"
                ) from None
        self.inference = InferenceClient(
            self.server_config.base_url,
            self.server_config.timeout,
            self.server_config.num_max_requests_at_once,
            self.backoff,
            model=self.server_config.model_name,
        )
        if post_to_api:
            self.api = TrajectoryApiClient(
                self.config.rollout_server_url, self.config.resolved_api_key(), self.backoff
            )

    async def close_clients(self) -> None:
        """Close what open_clients() and init_wandb() opened."""
        if self._jsonl is not None:
            self._jsonl.close()
        for client in (self.inference, self.api):
            if client is not None:
                await client.aclose()
        if self._wandb is not None:
            self._wandb.finish()

    # ----- what a subclass provides -----------------------------------------------------------

    @abstractmethod
    async def setup(self) -> None:
        """Called once before anything else: load data, build the eval set."""

    @abstractmethod
    async def get_next_item(self) -> Optional[Item]:
        """The next training item; None when there are no more (the worker then stops)."""

    system_prompt: Optional[str] = None

    def build_messages(self, item: Item) -> list[dict[str, str]]:
        """Chat messages of the prompt for `item` (used by the default collect_trajectories).

        The default: `system_prompt` (when set) and `item["question"]` as the user turn."""
        if not isinstance(item, dict) or "question" not in item:
            raise NotImplementedError(f"{type(self).__name__} must define build_messages or collect_trajectories")
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return system + [{"role": "user", "content": item["question"]}]

    def score_completion(self, item: Item, completion: str) -> float:
        """Reward of one completion text for `item` (used by the default score_group)."""
        raise NotImplementedError(
            f"{type(self).__name__} must define score_completion, score_group or collect_trajectories"
        )

    def score_group(self, item: Item, completions: list[str]) -> list[float]:
        """Rewards of a group's completion texts for `item` (used by the default
        collect_trajectories): score_completion of each, unless a subclass scores them together."""
        return [float(self.score_completion(item, text)) for text in completions]

    # ----- one group -----------------------------------------------------------------------------

    def tokenize_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """Prompt token ids from the tokenizer's chat template, ending with the assistant header."""
        ids = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        if hasattr(ids, "keys"):  # a BatchEncoding from tokenizers that ignore return_dict
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def _text(self, choice: Choice) -> str:
        """A completion's text: the server's, else decoded from its token ids."""
        if choice.text is not None:
            return choice.text
        return self.tokenizer.decode(choice.token_ids, skip_special_tokens=True)

    def completion_budget(self, prompt_len: int) -> int:
        """Tokens to ask for: max_tokens, cut so prompt + completion fit in max_token_length."""
        return min(self.config.max_tokens, self.max_token_length - prompt_len)

    def skip_prompt_too_long(self, prompt_tokens: int) -> None:
        """Count and log a group skipped because its prompt alone leaves no room for a completion,
        saying what to change."""
        logger.warning(
            "[env] skipped group: prompt has %d tokens, max_token_length is %d: raise --env.max_token_length "
            "or shorten the prompt (fewer --env.shots where the environment has them)",
            prompt_tokens,
            self.max_token_length,
        )
        self.counts["skipped_too_long"] += 1

    async def collect_trajectories(self, item: Item) -> tuple[Optional[ScoredDataGroup], list[Item]]:
        """Sample group_size completions of `item`'s prompt in one /generate call and score them.

        Returns (group or None to skip, items to put back on the backlog).
        """
        messages = self.build_messages(item)
        prompt_ids = self.tokenize_prompt(messages)
        budget = self.completion_budget(len(prompt_ids))
        if budget < 1:
            self.skip_prompt_too_long(len(prompt_ids))
            return None, []
        seed = None
        if self.config.seed is not None:  # reproducible sampling only when asked for
            seed = (self.seed * 1_000_003 + self._sample_counter) % 2**31
            self._sample_counter += 1
        params = {
            "n": self.config.group_size,
            "max_tokens": budget,
            "temperature": self.config.temperature,
            "top_p": self.config.top_p,
            "seed": seed,
        }
        out = await self.inference.generate(prompt_ids, **params)
        prompt = out.prompt_token_ids or prompt_ids
        texts = [self._text(choice) for choice in out.choices]
        tokens, masks, logprobs, chats, versions, routes = [], [], [], [], [], []
        for choice, text in zip(out.choices, texts):
            tokens.append(prompt + choice.token_ids)
            masks.append([PROMPT_MASK] * len(prompt) + choice.token_ids)  # (prompt+completion,)
            logprobs.append([PROMPT_LOGPROB] * len(prompt) + choice.logprobs)
            chats.append(messages + [{"role": "assistant", "content": text}])
            if choice.weight_versions is not None:
                versions.append([PROMPT_VERSION] * len(prompt) + choice.weight_versions)
            if choice.routed_experts is not None:  # already the whole sequence's, prompt included
                routes.append(choice.routed_experts)
        scores = [float(s) for s in self.score_group(item, texts)]
        if len(scores) != len(texts):
            raise ValueError(f"{type(self).__name__}.score_group returned {len(scores)} scores for {len(texts)} completions")
        group = ScoredDataGroup(
            tokens=tokens,
            masks=masks,
            scores=scores,
            inference_logprobs=logprobs,
            messages=chats,
            generation_params=params,
            weight_versions=versions if len(versions) == len(tokens) else None,
            routed_experts=routes if len(routes) == len(tokens) else None,
        )
        return group, []

    def reject_reason(self, group: ScoredDataGroup) -> Optional[tuple[str, str]]:
        """(counter, why) if the group must not reach the trainer, else None."""
        longest = max(len(t) for t in group.tokens)
        if longest > self.max_token_length:
            return "skipped_too_long", f"{longest} tokens > max_token_length {self.max_token_length}"
        values = list(group.scores) + [x for row in group.inference_logprobs or [] for x in row]
        if not all(math.isfinite(v) for v in values):
            return "skipped_bad_values", "a score or logprob is NaN or infinite"
        if self.config.ensure_scores_are_not_same and len(set(group.scores)) == 1:
            # GRPO advantages are score - group mean: all equal gives zero gradient.
            return "dropped_equal_scores", f"all {len(group.scores)} scores equal {group.scores[0]}"
        return None

    def accept_group(self, group: ScoredDataGroup) -> bool:
        """Whether ``group`` may reach the trainer; a rejected one is counted and logged."""
        rejected = self.reject_reason(group)
        if rejected:
            counter, why = rejected
            self.counts[counter] += 1
            logger.info("[env] dropped group: %s", why)
            return False
        return True

    async def report_dropped(self) -> None:
        """Send the API this environment's totals of dropped groups (at most every
        DROP_REPORT_SECONDS), so a trainer that waits for a batch can say why none comes. An API
        without the route (Atropos's own) is told nothing more after the first refusal."""
        now = time.monotonic()
        if self.api is None or self.env_id is None or self._dropped_reported_at is None \
                or now - self._dropped_reported_at < DROP_REPORT_SECONDS:
            return
        self._dropped_reported_at = now
        try:
            await self.api.report_dropped(self.env_id, self.counts)
        except Exception as err:  # noqa: BLE001 (an optional report: the groups themselves are unaffected)
            logger.info("[env] the API took no drop counts (%s); the trainer will not see them", err)
            self._dropped_reported_at = None

    async def handle_send_to_api(
        self, group: ScoredDataGroup, item: Item = None, do_send_to_api: bool = True
    ) -> bool:
        """Check a group, write it to JSONL if configured, post it; True if it was kept.

        Posting retries until the API answers; the group_uuid stays the same, so a post that
        landed before a timeout is not stored twice.
        """
        if not self.accept_group(group):
            await self.report_dropped()
            return False
        state = self.run_state
        if state.quota_reached():  # another worker filled total_steps while this one generated
            return False
        # Counted before the first await, so concurrent workers never exceed total_steps.
        state.groups_sent += 1
        number = state.groups_sent
        group.env_id = state.env_id
        if self._jsonl is not None:
            self._jsonl.write(group.model_dump_json() + "\n")
            self._jsonl.flush()
        if do_send_to_api:
            await self.api.post_scored_data(group)
        lengths = [sum(m != PROMPT_MASK for m in row) for row in group.masks]
        self._scores.extend(group.scores)
        self._completion_lengths.extend(lengths)
        logger.info(
            "[env] %s group score_mean=%.3f completion_len_mean=%.1f groups=%d step=%d queue=%d uuid=%s",
            "posted" if do_send_to_api else "wrote",
            sum(group.scores) / len(group.scores),
            sum(lengths) / len(lengths),
            number,
            state.curr_step,
            state.queue_size,
            group.group_uuid,
        )
        return True

    # ----- evaluation and metrics ----------------------------------------------------------------

    def solved(self, score: float) -> bool:
        """Whether a held-out item scored ``score`` counts as solved in `env/eval_accuracy`: any
        score above 0 here; a task that gives partial credit for a wrong answer overrides it."""
        return score > 0

    async def evaluate(self) -> dict[str, float]:
        """Greedy (temperature 0) pass over `self.eval_items` (first num_eval_items).

        `env/eval_accuracy` is the fraction of items solved (see solved()); it is logged at the next wandb_log.
        """
        items = self.eval_items[: self.config.num_eval_items or None]
        if not items:
            logger.warning("[env] evaluate: %s has no eval items", self.name)
            return {}

        async def one(item: Item) -> float:
            prompt = self.tokenize_prompt(self.build_messages(item))
            out = await self.inference.generate(
                prompt, n=1, max_tokens=max(1, self.completion_budget(len(prompt))), temperature=0.0, seed=0
            )
            return float(self.score_completion(item, self._text(out.choices[0])))

        scores = await asyncio.gather(*(one(item) for item in items))
        metrics = {
            "env/eval_accuracy": sum(self.solved(s) for s in scores) / len(scores),
            "env/eval_items": float(len(scores)),
        }
        logger.info(
            "[env] eval accuracy=%.3f over %d items at step %d",
            metrics["env/eval_accuracy"],
            len(scores),
            self.curr_step,
        )
        self._eval_metrics = metrics
        return metrics

    def init_wandb(self) -> None:
        """Start the wandb run when --env.use_wandb (called after registration, which names it)."""
        if not self.config.use_wandb:
            return
        import wandb

        # Offline without credentials: the run is kept locally and can be synced later.
        mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
        config = {"env": {**asdict(self.config), "api_key": None}, "openai": asdict(self.server_config)}
        self._wandb = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "onecopy"), name=self.wandb_name, mode=mode, config=config
        )

    async def wandb_log(self, wandb_metrics: Optional[dict[str, float]] = None) -> dict[str, float]:
        """Log env/ metrics gathered since the last call (to wandb when enabled); returns them.

        Subclasses add their own metrics and call `await super().wandb_log(metrics)`.
        """
        metrics = dict(wandb_metrics or {})
        if self._scores:
            metrics["env/score_mean"] = sum(self._scores) / len(self._scores)
            metrics["env/completion_len_mean"] = sum(self._completion_lengths) / len(self._completion_lengths)
            metrics["env/completion_len_max"] = float(max(self._completion_lengths))
        metrics["env/groups_sent"] = float(self.groups_sent)
        metrics.update({f"env/groups_{k}": float(v) for k, v in self.counts.items()})
        metrics.update(self._eval_metrics)
        self._scores, self._completion_lengths, self._eval_metrics = [], [], {}
        if self._wandb is not None:
            self._wandb.log(metrics, step=self.curr_step)
        return metrics
