"""Rollouts without the API (mode colocate): an environment runs in the trainer's process and
samples from the in-process engine.

The environment is the project's own ``BaseEnv`` (``environments/<name>_server.py``) with its
items, prompts, scoring and group checks unchanged: only its inference client is replaced by
``EngineInference``, which answers the same ``generate`` call from the engine. The groups of one
step are sampled in one engine call (``EngineInference`` batches the calls made together).
``InProcessRollouts`` offers the trainer the two calls it makes of the API client, ``register``
and ``get_batch``, so the loop reads the same in every mode.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import shlex

from api.models import ScoredData
from environments.base import BaseEnv
from environments.cli import environment_module, parse_configs
from environments.schemas import Choice, GenerateResponse
from example_trainer.bridges.inprocess_engine import InProcessEngine
from vllm_patching.routed_experts import wire_routes

logger = logging.getLogger("onecopy.trainer.rollouts")


class EngineInference:
    """The ``generate`` of ``environments.clients.InferenceClient``, served by the in-process engine.
    Calls made in the same turn of the event loop go to vLLM as one batch."""

    def __init__(self, engine: InProcessEngine) -> None:
        self.engine = engine
        self._pending: list[tuple[list[int], dict, asyncio.Future]] = []

    async def generate(self, prompt_token_ids: list[int], *, n: int, max_tokens: int, temperature: float,
                       top_p: float = 1.0, stop: list[str] | None = None, seed: int | None = None) -> GenerateResponse:
        """Sample ``n`` completions of one tokenised prompt; sampled-token logprobs are vLLM's raw ones."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        params = {"n": n, "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "stop": stop,
                  "seed": seed}
        self._pending.append((list(prompt_token_ids), params, future))
        if len(self._pending) == 1:
            loop.call_soon(self._flush)  # runs after every task started with this one has queued its call
        return await future

    def _flush(self) -> None:
        from vllm import SamplingParams

        pending, self._pending = self._pending, []
        try:
            outputs = self.engine.generate([p for p, _, _ in pending],
                                           [SamplingParams(logprobs=0, **params) for _, params, _ in pending])
        except Exception as err:  # handed to each caller: the environment decides what a failure means
            for _, _, future in pending:
                future.set_exception(err)
            return
        for (_, _, future), out in zip(pending, outputs):
            future.set_result(GenerateResponse(prompt_token_ids=list(out.prompt_token_ids), choices=[
                Choice(token_ids=list(c.token_ids), logprobs=[step[t].logprob for t, step in zip(c.token_ids, c.logprobs)],
                       finish_reason=c.finish_reason, text=c.text,
                       routed_experts=wire_routes(c.routed_experts, len(out.prompt_token_ids), len(c.token_ids)))
                for c in out.outputs]))

    async def aclose(self) -> None:
        """Nothing to close: the loop stops the engine."""


def load_environment(name: str, env_args: str, seq_len: int, tokenizer, engine: InProcessEngine) -> BaseEnv:
    """The ``BaseEnv`` of ``environments/<name>_server.py`` (or of the dotted module ``name``) with
    ``env_args`` (its ``--env.*`` flags), set up, sampling from ``engine``."""
    module = importlib.import_module(environment_module(name))
    classes = [c for _, c in inspect.getmembers(module, inspect.isclass)
               if issubclass(c, BaseEnv) and c is not BaseEnv and c.__module__ == module.__name__]
    if len(classes) != 1:
        raise ValueError(f"{module.__name__} must define one BaseEnv subclass, found {len(classes)}")
    _, env_config, server_config = parse_configs(classes[0], ["serve", "--env.max_token_length", str(seq_len),
                                                              *shlex.split(env_args)])
    env = classes[0](env_config, server_config, tokenizer=tokenizer)
    env.inference = EngineInference(engine)
    asyncio.run(env.setup())
    return env


class InProcessRollouts:
    """Batches of scored groups from an in-process environment, in the API client's shape."""

    def __init__(self, env: BaseEnv, batch_size: int, engine: InProcessEngine | None = None) -> None:
        group_size = env.config.group_size
        if batch_size % group_size:
            raise ValueError(f"--batch-size {batch_size} is not a multiple of the environment's group size "
                             f"{group_size} (--env.group_size): a batch is whole groups")
        self.env, self.batch_size, self.group_size = env, batch_size, group_size
        self.engine = engine  # given: its KV cache goes to training once a batch is generated

    def register(self, *args, **kwargs) -> dict:
        """Nothing to register with: the environment is here."""
        return {}

    def step_metrics(self) -> dict[str, float]:
        """Nothing to report: every batch is served as it comes."""
        return {}

    def count_step(self) -> None:
        """Nothing to count: no API, no environment process waits for the last step."""

    def get_batch(self, timeout: float, while_waiting=lambda: None, count_step: bool = True) -> list[ScoredData]:
        """``batch_size`` sequences of kept groups, sampled with the weights of now (strictly on-policy).
        ``count_step`` changes nothing here (``count_step()``)."""
        batch = asyncio.run(self._collect(timeout))
        if self.engine is not None:
            freed = self.engine.release_kv_cache()
            logger.debug("[memory] KV cache released for training: %.2f GiB", freed / 2**30)
        return batch

    async def _collect(self, timeout: float) -> list[ScoredData]:
        groups: list[ScoredData] = []
        async with asyncio.timeout(timeout):
            while len(groups) < self.batch_size // self.group_size:
                wanted = self.batch_size // self.group_size - len(groups)
                items = [item for item in [await self.env.get_next_item() for _ in range(wanted)] if item is not None]
                if not items:
                    raise RuntimeError(f"environment {self.env.name} has no more items")
                for group, _ in await asyncio.gather(*(self.env.collect_trajectories(item) for item in items)):
                    if group is not None and self.env.accept_group(group):  # the checks serve mode makes
                        groups.append(ScoredData.model_validate(group.model_dump(exclude_none=True)))
        return groups
