"""A verifiers (PyPI ``verifiers`` 0.4.0) environment, run by its own rollout code against onecopy's vLLM
(optional: pip install --no-deps -r requirements-verifiers.txt).

    python -m environments.verifiers_server serve --env.taskset my_taskset --env.group_size 8
    python -m environments.verifiers_server process --env.taskset my_taskset --env.total_steps 4 \\
        --env.data_path_to_save_groups groups.jsonl

``--env.taskset`` is a verifiers taskset id: an installed package (or module) exporting a
``vf.Taskset`` subclass, as ``vf-eval`` takes it. Each group is ``group_size`` episodes of one task,
each played by verifiers itself: its ``SingleAgentEnv.run_episode`` runs the harness program
(``--env.harness``, default ``null``: verifiers' chat loop), whose model calls reach vLLM through
verifiers' interception server and its *train* client, the one prime-rl uses: it renders each
prompt to token ids and calls vLLM's ``POST /inference/v1/generate``, which answers with the
sampled ids and their logprobs. The trace keeps them, one node per message, and
each root-to-leaf branch of its message graph is a training row (as prime-rl builds its samples):

    position      tokens        masks     inference_logprobs
    sampled       vLLM's id     the id    vLLM's logprob
    otherwise     the id        -100      1.0

so the trained ids are the ones vLLM sampled, never decoded and tokenised again. The score of an
episode is the sum of its trainable traces' weighted rewards (the task's ``@vf.reward`` methods and
judges); an episode that failed, or that no reward scored, leaves its group (it is not counted as 0).
Groups are built by ``environments.multiturn.ledger.episodes_group``: score-only GRPO groups when
every episode is one row, per-token advantages over episodes when one has several branches.

Weight versions: vLLM's /inference/v1/generate sends onecopy's per-token versions (in its
``kv_transfer_params``), but verifiers' train client (the ``renderers`` package) keeps only ids,
logprobs and text, so these groups carry no ``weight_versions``: the trainer's staleness rule
(``--max-off-policy-steps``) passes them unchecked, and ``--env.max_batches_offpolicy`` is what bounds
their lag. The cache salt per weights version is the scheduler's, so this route gets it too.

verifiers picks its renderer by the tokenizer's name, which for a local folder (onecopy's always
is one) finds none: its default renderer, which reads no tool call, so ``--env.renderer`` names one
(renderers' config as JSON) for a taskset whose agent uses tools.

Harness programs run as verifiers runs them (the runtime of ``--env.runtime``); with
``--env.program_python`` (the default) verifiers' own chat program (harnesses ``null`` and ``bash``)
runs with this Python, which has its packages, instead of in a uv environment built from PyPI on
first use.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import httpx

from environments.base import BaseEnv, import_extra
from environments.clients import inference_headers
from environments.config import BaseEnvConfig, ConfigError, check_choice, json_object, opt
from environments.multiturn.ledger import ADVANTAGE_SCALES, Episode, Row, episodes_group
from environments.schemas import PROMPT_LOGPROB, PROMPT_MASK, ScoredDataGroup, ServedModels

logger = logging.getLogger("onecopy.env")

INSTALL_HINT = "verifiers is an optional extra: pip install --no-deps -r requirements-verifiers.txt"
API_KEY_VAR = "VLLM_API_KEY"  # verifiers' clients read the key from a variable: vLLM's own (environments.clients)
RUNTIMES = ("subprocess", "docker", "podman")  # verifiers' local runtimes (the remote ones need their services)


def import_verifiers():
    """``verifiers.v1`` (the stack of verifiers 0.4), or an ImportError that says how to install it."""
    return import_extra("verifiers.v1", INSTALL_HINT)


@dataclass
class VerifiersEnvConfig(BaseEnvConfig):
    """`--env.*` of a verifiers environment (group_size: episodes per task)."""

    taskset: str = opt("", "verifiers taskset id: an installed package or module exporting a vf.Taskset subclass")
    taskset_args: str = opt("{}", "JSON object of the taskset's config fields (its `--env.taskset.*` in vf-eval)")
    harness: str = opt("null", "verifiers harness id of the agent (null: verifiers' chat loop, no tools)")
    runtime: str = opt("subprocess", f"verifiers runtime the harness program runs in: {', '.join(RUNTIMES)}")
    max_turns: int = opt(8, "most model turns per episode (verifiers' agent max_turns; 0: no limit)")
    renderer: str = opt("", "verifiers' train client's renderer, renderers' config as a JSON object: "
                            '{"name": "qwen3"}, or {"name": "default", "tool_parser": "qwen3"}; unset: verifiers '
                            "resolves one from the tokenizer's name, which a local folder never matches (the default "
                            "renderer, which reads no tool call)")
    program_python: bool = opt(True, "run verifiers' chat program (harnesses null and bash) with this Python "
                                     "instead of a uv environment that verifiers builds from PyPI")
    episode_advantage_scale: str = opt(
        "group", "when an episode has several rows (a trace with several branches), the group carries "
        "advantages over episodes: score - mean divided by the std (group) or not (none); match --scale-rewards")

    def __post_init__(self) -> None:
        super().__post_init__()
        json_object("taskset_args", self.taskset_args)
        renderer_config(self.renderer)
        check_choice("runtime", self.runtime, RUNTIMES)
        if self.max_turns < 0:
            raise ConfigError("max_turns", f"must be >= 0 (0: no limit), got {self.max_turns}")
        check_choice("episode_advantage_scale", self.episode_advantage_scale, ADVANTAGE_SCALES)


def renderer_config(text: str) -> Any:
    """``--env.renderer`` as renderers' typed config (a ``renderers.RendererConfig``), or None when
    unset; a ConfigError naming the field when it is not one."""
    if not text:
        return None
    value = json_object("renderer", text)
    import_verifiers()  # renderers comes with verifiers' extra
    from pydantic import TypeAdapter, ValidationError
    from renderers.configs import RendererConfig

    try:
        return TypeAdapter(RendererConfig).validate_python(value)
    except ValidationError as err:
        raise ConfigError("renderer", f"is no renderers config: {err.errors()[0]['msg']}") from None


def branch_row(token_ids: list[int], sampled_mask: list[bool], logprobs: list[float]) -> Row:
    """One training row from a verifiers branch's aligned lists (``Branch.token_ids``,
    ``.sampled_mask``, ``.logprobs``): sampled positions keep the id and vLLM's logprob, the others
    are masked context. No versions: verifiers' train client does not pass vLLM's on."""
    if not len(token_ids) == len(sampled_mask) == len(logprobs):
        raise ValueError(f"a verifiers branch with {len(token_ids)} ids, {len(sampled_mask)} mask entries and "
                         f"{len(logprobs)} logprobs: its lists must align")
    return Row(tokens=[int(t) for t in token_ids],
               masks=[int(t) if s else PROMPT_MASK for t, s in zip(token_ids, sampled_mask)],
               logprobs=[float(lp) if s else PROMPT_LOGPROB for lp, s in zip(logprobs, sampled_mask)],
               versions=None)


def episode_score(traces: list[Any]) -> Optional[float]:
    """The summed weighted reward of ``traces`` (the trainable ones of an episode), or None when no
    reward scored them, or one that should have did not (verifiers records a failed reward as None)."""
    rewards = [r for trace in traces for r in trace.rewards.values()]
    if not rewards or any(r is None for r in rewards):
        return None
    return float(sum(trace.reward for trace in traces))


def played_episode(episode: Any) -> Episode:
    """onecopy's Episode of a finished verifiers episode: a row per trainable branch of each trainable
    trace, scored by ``episode_score``; a failed episode (``episode.ok`` False) has score None."""
    traces = [t for t in episode.traces if t.agent.trainable]
    rows = [branch_row(b.token_ids, b.sampled_mask, b.logprobs)
            for trace in traces for b in trace.branches if b.trainable]
    rows = [row.trimmed() for row in rows if row.sampled]
    score = episode_score(traces) if episode.ok else None
    info = {"turns": sum(t.num_turns for t in traces),
            "errors": [f"{e.type}: {e.message}" for e in episode.errors] + [
                f"{e.type}: {e.message}" for t in traces for e in t.errors]}
    messages = None
    if traces:
        messages = [m.model_dump(exclude_none=True) for m in traces[-1].messages]
    return Episode(rows=rows, score=score, messages=messages, info=info)


def warn_if_no_renderer(renderer: str, tokenizer_name: str) -> None:
    """Warn when verifiers would render with its default renderer: no ``--env.renderer`` and a
    tokenizer name (a local folder, as onecopy's is) that verifiers' model table does not hold. That
    renderer reads no tool call from a turn, so a tool-using episode ends after its first turn."""
    from renderers.base import MODEL_RENDERER_MAP

    if not renderer and tokenizer_name not in MODEL_RENDERER_MAP:
        logger.warning("[env] verifiers renders %s with its default renderer, which reads no tool call: name one "
                       "with --env.renderer (e.g. '{\"name\": \"qwen3\"}') for a taskset whose agent uses tools",
                       tokenizer_name)


def use_this_python_for_chat_program() -> None:
    """Make verifiers' subprocess runtime run its chat program (harnesses null and bash) with this
    Python. The runtime keeps the interpreter of each prepared script in a cache keyed by the script's
    path, a hash of its text, and prepares one with uv (downloading the program's packages) only when
    the cache has none: the script is written where the runtime looks and this interpreter entered.
    This Python has the program's packages (openai, mcp, httpx, httpx2, tenacity, certifi)."""
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    folder = Path(SubprocessRuntime.scripts_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{hashlib.sha256(CHAT_PROGRAM_SOURCE.encode()).hexdigest()}.py"
    path.write_text(CHAT_PROGRAM_SOURCE)
    SubprocessRuntime._interpreters[str(path)] = sys.executable


async def programs_reaped(timeout_s: float = 5.0) -> None:
    """Wait (up to ``timeout_s``) until this process has no child left. An episode cancelled when the
    environment stops has its harness program killed by verifiers' runtime, which does not wait for
    the exit; the event loop must still be open when the exit is reaped, or asyncio logs an ignored
    "Event loop is closed" traceback for each such program at shutdown."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while psutil.Process().children() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await asyncio.sleep(0)  # run the exit callbacks the reaper scheduled


def served_model_name(base_url: str) -> str:
    """The name the inference server serves its base model under (GET /v1/models): verifiers sends it
    as each request's ``model``."""
    with httpx.Client(timeout=30.0, headers=inference_headers()) as http:
        resp = http.get(f"{base_url.rstrip('/')}/v1/models")
        resp.raise_for_status()
    models = ServedModels.model_validate(resp.json()).data
    base = next((m for m in models if m.parent is None), None)
    if base is None:
        raise RuntimeError(f"GET {base_url}/v1/models lists no base model: {resp.text[:300]}")
    return base.id


class VerifiersEnv(BaseEnv):
    """Groups of verifiers episodes of one task, played by verifiers' own rollout code."""

    name = "verifiers"
    env_config_cls = VerifiersEnvConfig
    config: VerifiersEnvConfig

    def __init__(self, config, server_config, tokenizer=None):
        super().__init__(config, server_config, tokenizer)
        self._serving: Optional[contextlib.AsyncExitStack] = None
        self._episodes: list[Episode] = []  # since the last wandb_log

    def vf_env_config(self):
        """verifiers' config of the run: the taskset, one agent seat with the harness, runtime and turns."""
        vf = import_verifiers()
        cfg = self.config
        agent = vf.AgentConfig(harness={"id": cfg.harness}, runtime={"type": cfg.runtime},
                               max_turns=cfg.max_turns or None)
        taskset = {"id": cfg.taskset, **json_object("taskset_args", cfg.taskset_args)}
        return vf.SingleAgentEnvConfig(taskset=taskset, agent=agent)

    async def current_model(self) -> str:
        """The model verifiers' requests name: ``--openai.model_name``, else the server's current LoRA
        adapter (GET /lora/status: the trainer's newest in the LoRA modes; onecopy's /generate serves
        it to requests that name none, vLLM's /inference/v1/generate needs its name), else the base model."""
        if self.server_config.model_name:
            return self.server_config.model_name
        async with httpx.AsyncClient(timeout=30.0, headers=inference_headers()) as http:
            resp = await http.get(f"{self.server_config.base_url.rstrip('/')}/lora/status")
        if resp.status_code == 200 and resp.json().get("current"):
            return resp.json()["current"]
        return self._model  # 409: LoRA is off on this server

    def model_context(self, model: str, temperature: float, max_tokens: int):
        """What verifiers' rollouts call: onecopy's vLLM through verifiers' train client (token ids and
        logprobs back), ``model``, and the sampling settings."""
        vf = import_verifiers()
        base = self.server_config.base_url.rstrip("/")
        client = vf.TrainClientConfig(base_url=f"{base}/v1", api_key_var=API_KEY_VAR,
                                      renderer_model_name=self.tokenizer.name_or_path,
                                      renderer=renderer_config(self.config.renderer))
        sampling = vf.SamplingConfig(temperature=temperature, top_p=self.config.top_p, max_tokens=max_tokens)
        return vf.ModelContext(model=model, client=client, sampling=sampling)

    async def setup(self) -> None:
        """Load the taskset and its env through verifiers, and hold verifiers' serving resources
        (interception server, shared tools) until close_clients()."""
        vf = import_verifiers()
        if not self.config.taskset:  # checked here, not in the config: the CLI builds the defaults first
            raise ConfigError("taskset", "is required: the id of a verifiers taskset (an installed package or module)")
        if self.config.program_python:
            use_this_python_for_chat_program()
        self._model = await asyncio.to_thread(served_model_name, self.server_config.base_url)
        warn_if_no_renderer(self.config.renderer, self.tokenizer.name_or_path)
        self.vf_env = vf.SingleAgentEnv(self.vf_env_config())
        self._serving = contextlib.AsyncExitStack()
        await self._serving.enter_async_context(self.vf_env.serving())
        self._tasks = self.task_stream()
        eval_count = self.config.num_eval_items or 64
        self.eval_items = list(itertools.islice(iter(self.vf_env.taskset), eval_count)) \
            if self.vf_env.taskset.bounded else []

    def task_stream(self):
        """The training tasks: a bounded taskset shuffled by the seed, again each pass; an infinite one as it comes."""
        taskset = self.vf_env.taskset
        if not taskset.bounded:
            yield from taskset
            return
        tasks = list(taskset)
        if not tasks:
            raise RuntimeError(f"verifiers taskset {self.config.taskset!r} has no tasks")
        rng = random.Random(self.seed)
        while True:
            rng.shuffle(tasks)
            yield from tasks

    async def close_clients(self) -> None:
        """Close verifiers' serving resources, then wait for the harness programs of episodes cut short."""
        if self._serving is not None:
            await self._serving.aclose()
            self._serving = None
        await programs_reaped()
        await super().close_clients()

    async def get_next_item(self):
        """The next verifiers task."""
        return next(self._tasks, None)

    async def play(self, task, model: str, temperature: float) -> Episode:
        """One episode of ``task``, played by verifiers (its Env.run_episode), as onecopy's Episode."""
        ctx = self.model_context(model, temperature, self.config.max_tokens)
        episode = played_episode(await self.vf_env.run_episode(task, ctx))
        if episode.info["errors"]:
            logger.warning("[env] verifiers episode failed (left out of its group): %s",
                           "; ".join(episode.info["errors"]))
        return episode

    async def collect_trajectories(self, item) -> tuple[Optional[ScoredDataGroup], list]:
        """``group_size`` episodes of the task, played concurrently; one group of their rows."""
        model = await self.current_model()
        episodes = await asyncio.gather(*(self.play(item, model, self.config.temperature)
                                          for _ in range(self.config.group_size)))
        self._episodes.extend(episodes)
        params = {"temperature": self.config.temperature, "top_p": self.config.top_p,
                  "max_tokens": self.config.max_tokens, "n": self.config.group_size}
        group = episodes_group(list(episodes), self.config.episode_advantage_scale, params)
        if group is None:
            logger.warning("[env] skipped group: no episode of %d was played and scored", len(episodes))
        return group, []

    async def evaluate(self) -> dict[str, float]:
        """Greedy episodes of the taskset's first num_eval_items tasks (bounded tasksets): reward mean and
        the share of episodes rewarded above 0."""
        if not self.eval_items:
            logger.warning("[env] evaluate: taskset %s is infinite; no eval set", self.config.taskset)
            return {}
        model = await self.current_model()
        episodes = await asyncio.gather(*(self.play(task, model, 0.0) for task in self.eval_items))
        scores = [e.score or 0.0 for e in episodes]
        self._eval_metrics = {"env/eval_accuracy": sum(s > 0 for s in scores) / len(scores),
                              "env/eval_score_mean": sum(scores) / len(scores),
                              "env/eval_items": float(len(scores))}
        return self._eval_metrics

    async def wandb_log(self, wandb_metrics: Optional[dict[str, float]] = None) -> dict[str, float]:
        metrics = dict(wandb_metrics or {})
        if self._episodes:
            n = len(self._episodes)
            metrics["env/episode_turns_mean"] = sum(e.info["turns"] for e in self._episodes) / n
            metrics["env/episode_rows_mean"] = sum(len(e.rows) for e in self._episodes) / n
            metrics["env/episode_unscored_share"] = sum(e.score is None for e in self._episodes) / n
            self._episodes = []
        return await super().wandb_log(metrics)


if __name__ == "__main__":
    VerifiersEnv.cli()
