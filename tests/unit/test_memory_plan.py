"""The memory plan printed at start, the gradient-checkpointing default, the KV-cache budget flag."""

import logging
import os

import pytest
import torch

from example_trainer.config import TrainerConfig
from example_trainer.memory_plan import (GIB, log_memory_plan, plan_memory, use_expandable_segments,
                                        use_gradient_checkpointing)
from example_trainer.vllm_process import vllm_server_args

H100 = 80 * 10**9


def test_an_8b_model_fits_an_h100_only_on_the_lean_path(caplog):
    lean = plan_memory(TrainerConfig(optimizer="adamw8bit", bf16_inplace=True), 8_000_000_000, H100)
    assert sum(lean.bytes_per_param.values()) == 6.0  # weights 2 (vLLM's), bf16 gradients 2, 8-bit moments 2
    default = plan_memory(TrainerConfig(), 8_000_000_000, H100)
    assert sum(default.bytes_per_param.values()) == 18.0  # 2 + fp32 masters 4 + fp32 gradients 4 + moments 8
    with caplog.at_level(logging.INFO, logger="onecopy.trainer.memory"):
        log_memory_plan(lean)
        assert "device has" not in caplog.text and "optimizer (adamw8bit)" in caplog.text
        log_memory_plan(default)
    assert "the plan needs 134.1 GiB before activations, the device has 74.5 GiB" in caplog.text


def test_mode_none_counts_the_trainers_own_copy_and_the_kv_budget_counts_once():
    plan = plan_memory(TrainerConfig(weight_bridge_mode="none", vllm_kv_cache_bytes=4 * GIB), 1_000_000_000)
    assert plan.bytes_per_param["weights, trainer"] == 2.0 and sum(plan.bytes_per_param.values()) == 20.0
    assert plan.total_bytes == 20 * 10**9 + 4 * GIB and "vLLM KV cache" in plan.table()


@pytest.mark.parametrize("mode, reference_bytes", [("shared_vllm", 2.0), ("colocate", 2.0), ("none", 2.0),
                                                    ("lora_only", 0.0), ("lora_restart", 0.0)])
def test_the_kl_reference_costs_a_frozen_bf16_copy_in_full_parameter_modes_and_nothing_with_lora(mode, reference_bytes):
    # --kl-coef once deep-copied the model: in shared_vllm a whole second bf16 copy the plan never counted.
    with_kl = plan_memory(TrainerConfig(weight_bridge_mode=mode, kl_coef=0.1), 10**9).bytes_per_param
    without = plan_memory(TrainerConfig(weight_bridge_mode=mode), 10**9).bytes_per_param
    assert sum(with_kl.values()) - sum(without.values()) == reference_bytes
    assert "2 bytes/param" in TrainerConfig.__dataclass_fields__["kl_coef"].metadata["help"]


@pytest.mark.parametrize("flag, params, expected", [(None, 135_000_000, False), (None, 1_500_000_000, True),
                                                    (False, 8_000_000_000, False), (True, 1, True)])
def test_gradient_checkpointing_defaults_to_on_above_a_billion_parameters(flag, params, expected):
    assert use_gradient_checkpointing(TrainerConfig(gradient_checkpointing=flag), params) is expected


def test_kv_cache_budget_in_bytes_reaches_vllm(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = vllm_server_args(TrainerConfig(vllm_kv_cache_bytes=6 * GIB))
    assert args[args.index("--kv-cache-memory-bytes") + 1] == str(6 * GIB)
    # vLLM checks at start that this fraction of the GPU is free, byte budget or not: ours must stay.
    assert args[args.index("--gpu-memory-utilization") + 1] == "0.45"
    assert "--kv-cache-memory-bytes" not in vllm_server_args(TrainerConfig())
    with pytest.raises(ValueError, match="--vllm-kv-cache-bytes must be >= 0"):
        TrainerConfig(vllm_kv_cache_bytes=-1)


def test_expandable_segments_only_for_the_trainers_own_cuda_allocator(monkeypatch):
    calls = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert not use_expandable_segments(torch.device("cpu")) and calls == []
    assert use_expandable_segments(torch.device("cuda")) and calls == ["expandable_segments:True"]
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ  # the vLLM server the trainer starts inherits os.environ
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")  # the user's choice wins
    assert not use_expandable_segments(torch.device("cuda")) and calls == ["expandable_segments:True"]
