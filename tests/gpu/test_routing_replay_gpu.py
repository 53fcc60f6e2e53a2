"""--routing-replay at Qwen3-30B-A3B's layer shapes (128 experts, 8 per token, hidden 2048, expert
width 768, its vocabulary) with 4 of its 48 layers, on a GPU: vLLM (TRITON MoE kernels, as single
copy pins them) samples a batch of completions and returns their routes; the trainer's forward
(HF, bf16) computes their logprobs with its own routing and with vLLM's. Reported: per completion
token |trainer - vLLM| logprob (max, mean, share above 0.1 nats) both ways, and the share of
(position, MoE layer) routes where the trainer's router picks other experts than vLLM's (on its own
forward, and at each layer given vLLM's routes below it). Skipped without CUDA.

The weights are HF's own random init (normal, std 0.02) saved as safetensors: vLLM's
``--load-format dummy`` draws tiny uniform weights whose routers score every expert nearly alike,
which would make the routing gap meaningless.

On the device (after load1, load2 and load5, docs/gpu.md):
    python3 -m pytest -p no:cacheprovider -s tests/gpu/test_routing_replay_gpu.py
Result: $OUT/routing_replay_gpu.json. Budget: about 4 minutes on an H100 (most of it writing and
loading the 6 GB checkpoint and vLLM's start).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import requests
import torch

from api.models import ScoredData
from example_trainer.data.batching import build_batch
from example_trainer.model.routing_replay import RoutingReplay
from example_trainer.rl.logprobs import sequence_logprobs
from tests.gpu.results import results_folder

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPE, LAYERS = "qwen3-30b-a3b", 4
PROMPTS, GROUP_SIZE, MAX_TOKENS = 8, 4, 128


def tokenizer_source() -> str:
    """The first tokenizer folder there is (as tests/gpu/test_families_gpu.py picks it)."""
    from example_trainer.model.default_model import default_model_path

    return next((d for d in (os.environ.get("SMOLLM2_DIR"), os.environ.get("SMOLLM2_CONFIG_DIR"))
                 if d and any((Path(d) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))),
                None) or default_model_path()


def random_moe_folder(root: Path, shape: str = SHAPE, layers: int = LAYERS, device: str = "cuda") -> str:
    """bench/shapes.py's folder for ``shape`` with ``layers`` layers, plus HF-initialised bf16 weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from bench.shapes import shape_folder

    path, _ = shape_folder(shape, tokenizer_source(), root, layers)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.bfloat16)
    model.save_pretrained(path)
    return path


def start_vllm(model: str, logdir: Path, extra_args: str = "--moe-backend triton --enforce-eager"):
    """vLLM as the trainer starts it with --routing-replay (mode none: its own weights)."""
    from example_trainer.bridges import bridge_class
    from example_trainer.config import TrainerConfig
    from example_trainer.inference import launch_inference
    from tests.conftest import free_port

    cfg = TrainerConfig(weight_bridge_mode="none", model_name=model, seq_len=1024, routing_replay=True,
                        vllm_server_port=free_port(), vllm_kv_cache_bytes=2 * 2**30, vllm_server_timeout=600,
                        vllm_extra_args=extra_args)
    server = launch_inference(cfg, logdir, bridge_class("none"), env={"VLLM_ENABLE_SHARED_WEIGHTS": "0"})
    server.start(model)
    return server


def sample_groups(url: str, model: str, prompts: int = PROMPTS, group_size: int = GROUP_SIZE,
                  max_tokens: int = MAX_TOKENS) -> list[ScoredData]:
    """``prompts`` groups of ``group_size`` completions, laid out as an environment posts them."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    groups = []
    for i in range(prompts):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": f"What is {i + 12} times {i + 7}?"}],
                                               add_generation_prompt=True, tokenize=True, return_dict=False)
        r = requests.post(f"{url}/generate", json={"prompt_token_ids": prompt, "n": group_size, "seed": i,
                                                    "max_tokens": max_tokens, "temperature": 1.0}, timeout=600)
        r.raise_for_status()
        choices = r.json()["choices"]
        groups.append(ScoredData(
            tokens=[prompt + c["token_ids"] for c in choices],
            masks=[[-100] * len(prompt) + c["token_ids"] for c in choices],
            scores=[float(j) for j in range(len(choices))],
            inference_logprobs=[[1.0] * len(prompt) + c["logprobs"] for c in choices],
            routed_experts=[c["routed_experts"] for c in choices]))
    return groups


def own_routes_differ(model, batch, device) -> tuple[int, int]:
    """(differing, routed) (position, MoE layer) pairs of the model's own forward against the batch's routes."""
    picked: dict[int, torch.Tensor] = {}
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, out, i=i: picked.__setitem__(i, out[2]))
             for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]
    try:
        with torch.no_grad():
            model.model(input_ids=batch.tokens.to(device), attention_mask=batch.attention_mask.to(device))
    finally:
        for hook in hooks:
            hook.remove()
    counted = torch.nn.functional.pad(batch.attention_mask[:, 1:], (0, 1)).bool().reshape(-1).to(device)
    routes = batch.routes.to(device).reshape(counted.shape[0], batch.routes.shape[2], -1).long()
    differing = sum(int((own.sort(-1).values != routes[:, i].sort(-1).values).any(-1)[counted].sum())
                    for i, own in picked.items())
    return differing, int(counted.sum()) * len(picked)


def measure(model, batch, device) -> dict:
    """Trainer-vs-vLLM logprob gaps over the completion tokens, with and without routing replay."""
    inputs = {"input_ids": batch.tokens.to(device), "attention_mask": batch.attention_mask.to(device)}
    completion = batch.completion_mask.bool().to(device)
    vllm = batch.old_logprobs.to(device)
    replay = RoutingReplay(model)
    try:
        with torch.no_grad():
            own = sequence_logprobs(model, inputs, chunk_tokens=1024)
            with replay.replaying(batch.routes.to(device), inputs["attention_mask"]):
                replayed = sequence_logprobs(model, inputs, chunk_tokens=1024)
        counts = replay.take_counts()
    finally:
        replay.remove()
    differing, routed = own_routes_differ(model, batch, device)
    result = {"completion_tokens": int(completion.sum()), "routes": routed}
    for name, logprobs, share in (("without_replay", own, differing / routed),
                                  ("with_replay", replayed, counts["differing"] / counts["routed"])):
        gap = (logprobs - vllm)[completion].abs().float()
        result[name] = {"max_abs_logprob_diff": gap.max().item(), "mean_abs_logprob_diff": gap.mean().item(),
                        "share_above_0.1_nats": (gap > 0.1).float().mean().item(), "routes_differ": share}
    return result


def test_replayed_routes_close_the_gap_to_vllms_logprobs_at_qwen3_30b_a3b_shapes(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.getbasetemp()
    t0 = time.perf_counter()
    model_path = random_moe_folder(root)
    seconds = {"write_checkpoint": time.perf_counter() - t0}
    server = start_vllm(model_path, tmp_path_factory.mktemp("vllm"))
    try:
        seconds["vllm_start"] = time.perf_counter() - t0 - seconds["write_checkpoint"]
        t1 = time.perf_counter()
        groups = sample_groups(server.url, model_path)
        seconds["generate"] = time.perf_counter() - t1
    finally:
        server.stop()
    batch = build_batch(groups, seq_len=1024, routing_replay=True)
    t2 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).to("cuda")  # what vLLM loaded
    result = {"shape": f"{SHAPE}-{LAYERS}l", "device": torch.cuda.get_device_name(),
              "sequences": len(batch.scores), **measure(model, batch, "cuda")}
    seconds["trainer_forward"] = time.perf_counter() - t2
    result["seconds"] = seconds
    out = results_folder(root)
    (out / "routing_replay_gpu.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    without, with_replay = result["without_replay"], result["with_replay"]
    assert with_replay["max_abs_logprob_diff"] <= without["max_abs_logprob_diff"] + 0.02, result
    assert with_replay["mean_abs_logprob_diff"] <= without["mean_abs_logprob_diff"] + 0.002, result
