"""LoRA hot-swap latency on a real GPU (vLLM 0.26.0): save the PEFT adapter, load it into the
running server under a new name, unload the previous one — what mode lora_only does per sync.
Skipped without CUDA. Results: $OUT/gpu_lora_results.json.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import pytest
import requests
import torch

from tests.gpu.test_shared_vllm_gpu import models
from tests.weight_checks import chat_prompts, vllm_logprobs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
RESULTS: dict[str, dict] = {}
SWAPS = 10


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2-random-1.4b"])
def test_lora_swap_latency_on_gpu(name, tmp_path_factory):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from example_trainer.bridges import launch_server
    from example_trainer.bridges.lora import save_adapter
    from example_trainer.config import TrainerConfig
    from tests.conftest import free_port

    model_path = models(tmp_path_factory.getbasetemp())[name]
    cfg = TrainerConfig(weight_bridge_mode="lora_only", seq_len=1024, lora_r=16, vllm_port=free_port(),
                        vllm_kv_cache_bytes=4 * 2**30, vllm_start_timeout=600)
    logdir = tmp_path_factory.mktemp(f"{name}-lora")
    server = launch_server(cfg, logdir)  # as mode lora_only launches it
    server.start(model_path)
    try:
        base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).cuda()
        peft_model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], task_type="CAUSAL_LM"))
        ids = chat_prompts(AutoTokenizer.from_pretrained(model_path))[0]
        base_lp = vllm_logprobs(server.url, ids)
        saves, loads, previous = [], [], None
        for i in range(SWAPS):
            with torch.no_grad():
                for n, p in peft_model.named_parameters():
                    if "lora_B" in n:
                        p.normal_(0, 0.02)
            t0 = time.perf_counter()
            nbytes = save_adapter(peft_model, logdir / f"v{i}")
            t1 = time.perf_counter()
            r = requests.post(f"{server.url}/lora/load", json={"lora_name": f"v{i}", "lora_path": str(logdir / f"v{i}")}, timeout=120)
            assert r.status_code == 200, r.text
            if previous:
                assert requests.post(f"{server.url}/lora/unload", json={"lora_name": previous}, timeout=60).status_code == 200
            t2 = time.perf_counter()
            saves.append(t1 - t0)
            loads.append(t2 - t1)
            previous = f"v{i}"
        adapted = vllm_logprobs(server.url, ids)  # no model named: the current adapter serves
        assert (adapted - base_lp).abs().mean() > 0.05, "the current adapter did not change vLLM's output"
        swaps = [s + l for s, l in zip(saves, loads)]
        result = {"model": name, "adapter_bytes": nbytes, "swaps": SWAPS,
                  "sync/seconds_median": statistics.median(swaps[1:]), "sync/seconds_max": max(swaps[1:]),
                  "sync/save_seconds_median": statistics.median(saves[1:]),
                  "sync/load_seconds_median": statistics.median(loads[1:])}
    finally:
        server.stop()
    RESULTS[name] = result
    out = Path(os.environ.get("OUT", tmp_path_factory.getbasetemp()))
    (out / "gpu_lora_results.json").write_text(json.dumps(RESULTS, indent=2))
    print(json.dumps(result, indent=2))
