"""Mode lora_only's bridge on a real GPU (vLLM 0.26.0): ``LoraOnlyBridge.sync`` saves the PEFT
adapter, hot-swaps it into the server the loop would launch, unloads the previous version and
deletes the versions vLLM no longer reads. Checks that vLLM then serves what the trainer's model
computes, and measures the swap latency. Skipped without CUDA. Results: $OUT/gpu_lora_results.json.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import requests
import torch

from tests.gpu.test_shared_vllm_gpu import models
from tests.integration.test_lora_cpu import randomize
from tests.weight_checks import assert_close, chat_prompts, hf_logprobs, vllm_logprobs
from tests.gpu.results import results_folder

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
RESULTS: dict[str, dict] = {}
SWAPS = 10


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2-random-1.4b"])
def test_lora_only_bridge_swaps_adapters_into_vllm_on_gpu(name, tmp_path_factory):
    from transformers import AutoTokenizer

    from example_trainer.bridges import bridge_class
    from example_trainer.config import TrainerConfig
    from example_trainer.inference import launch_inference
    from tests.conftest import free_port

    model_path = models(tmp_path_factory.getbasetemp())[name]
    cfg = TrainerConfig(weight_bridge_mode="lora_only", seq_len=1024, lora_r=16, lora_alpha=32, vllm_server_port=free_port(),
                        vllm_kv_cache_bytes=4 * 2**30, vllm_server_timeout=600)
    run_dir = tmp_path_factory.mktemp(f"{name}-lora")
    bridge_cls = bridge_class(cfg.weight_bridge_mode)
    server = launch_inference(cfg, run_dir, bridge_cls)  # as the loop launches it in this mode
    bridge = bridge_cls(cfg, model_path, run_dir, torch.device("cuda"), server)
    try:
        server.start(*bridge.serve_on())
        model = bridge.attach()
        model.eval()  # no dropout in the comparison below (vLLM applies none)
        ids = chat_prompts(AutoTokenizer.from_pretrained(model_path))[0]
        base_lp = vllm_logprobs(server.url, ids)
        metrics = []
        for step in range(1, SWAPS + 1):
            randomize(model, seed=step)  # a new adapter, as an optimizer step would leave it
            metrics.append(bridge.sync(model, step, final=step == SWAPS))
        adapted = vllm_logprobs(server.url, ids)  # no model named: the current adapter serves
        assert (adapted - base_lp).abs().mean() > 0.05, "the current adapter did not change vLLM's output"
        diff = assert_close(hf_logprobs(model, ids), adapted)  # vLLM serves what the trainer holds
        status = requests.get(f"{server.url}/lora/status", timeout=60).json()
        assert status["current"] == bridge.current and status["loaded"] == [bridge.current], status
        # Nothing generated during the swaps: the current version and the one before it stay.
        assert {p.name for p in (run_dir / "adapters").iterdir()} == {f"step_{SWAPS - 1}", f"step_{SWAPS}"}
        timed = metrics[1:]  # the first load warms vLLM's LoRA path
        result = {"model": name, "adapter_bytes": metrics[-1]["sync/bytes_moved"], "swaps": SWAPS,
                  "sync/seconds_median": statistics.median(m["sync/seconds"] for m in timed),
                  "sync/seconds_max": max(m["sync/seconds"] for m in timed),
                  "sync/save_seconds_median": statistics.median(m["sync/save_seconds"] for m in timed),
                  "sync/load_seconds_median": statistics.median(m["sync/load_seconds"] for m in timed),
                  "hf_vs_vllm_logprob_max_mean": diff}
    finally:
        bridge.close()
        server.stop()
    RESULTS[name] = result
    out = results_folder(tmp_path_factory.getbasetemp())
    (out / "gpu_lora_results.json").write_text(json.dumps(RESULTS, indent=2))
    print(json.dumps(result, indent=2))
