"""--float8-matmuls on a CPU through torchao's float8 emulation (the same casts and scales, the
matmul emulated in high precision): which modules are converted, that the converted model still
trains the tensors it was given (shared_vllm's views of vLLM's storage), what each recipe leaves in
bf16, and the clear refusals. The float8 tensor cores themselves: tests/gpu/test_float8_gpu.py."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from example_trainer.config import TrainerConfig
from example_trainer.float8_matmuls import PROJECTIONS, check_device, convert_projections
from example_trainer.logprobs import sequence_logprobs
from tests.tiny_models import tiny_config


def tiny(arch: str = "LlamaForCausalLM") -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.bfloat16).train()


def logprobs_and_grads(model, inputs):
    model.zero_grad(set_to_none=True)
    logprobs = sequence_logprobs(model, inputs, chunk_tokens=8)
    (logprobs * inputs["attention_mask"][:, 1:]).sum().backward()
    return logprobs.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}


INPUTS = {"input_ids": torch.randint(0, 1000, (3, 13), generator=torch.Generator().manual_seed(1)),
          "attention_mask": torch.tensor([[1] * 13, [0] * 4 + [1] * 9, [0] * 2 + [1] * 11])}


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"])
def test_only_the_decoders_projections_are_converted_and_the_parameters_stay_the_given_tensors(arch):
    from torchao.float8.float8_linear import Float8Linear

    model = tiny(arch)
    given = {name: (p, p.data_ptr()) for name, p in model.named_parameters()}
    expected = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear and n.rsplit(".", 1)[-1] in PROJECTIONS]

    assert convert_projections(model, "backward", torch.device("cpu"), emulate=True) == len(expected) > 0
    converted = [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]
    assert converted == expected
    assert type(model.lm_head) is torch.nn.Linear  # the logprobs' last matmul stays bf16
    routers = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    assert all(not isinstance(m, Float8Linear) for m in routers)  # MoE: routing decisions stay bf16
    for name, p in model.named_parameters():
        assert p is given[name][0] and p.data_ptr() == given[name][1], name  # the attached tensors, not copies


def test_backward_recipe_keeps_the_forward_bit_for_bit_and_its_gradients_near_fp32s():
    exact = tiny().float()
    _, exact_grads = logprobs_and_grads(exact, INPUTS)
    ref_logprobs, ref_grads = logprobs_and_grads(tiny(), INPUTS)
    model = tiny()
    convert_projections(model, "backward", torch.device("cpu"), emulate=True)
    logprobs, grads = logprobs_and_grads(model, INPUTS)

    assert torch.equal(logprobs, ref_logprobs)  # logprobs, ratio and loss as without the flag
    # The gradient carries float8 rounding (bf16's own lowest cosine to fp32's here: 0.998), and
    # stays the same direction: measured lowest 0.984 (layer 0's k_proj).
    for name, grad in exact_grads.items():
        cosine = torch.nn.functional.cosine_similarity(grads[name].flatten(), grad.flatten(), dim=0)
        assert cosine > 0.97, (name, cosine.item())
    assert any(not torch.equal(grads[name], ref_grads[name]) for name in grads)  # the float8 matmuls ran


def test_an_optimizer_step_on_the_converted_model_moves_the_tensors_it_was_given():
    model = tiny()
    shared = model.get_decoder().layers[0].mlp.down_proj.weight  # as the bridge's view of vLLM's tensor
    before = shared.detach().clone()
    convert_projections(model, "backward", torch.device("cpu"), emulate=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    logprobs_and_grads(model, INPUTS)
    optimizer.step()
    assert not torch.equal(shared, before)


def test_a_cpu_and_an_old_gpu_are_refused_with_the_reason(monkeypatch):
    with pytest.raises(ValueError, match="needs a CUDA GPU.*runs on cpu: drop the flag"):
        check_device(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match="compute capability 8.9.*A100 has 8.0"):
        check_device(torch.device("cuda", 0))
    with pytest.raises(ValueError, match="is unknown; valid: off, backward"):
        convert_projections(tiny(), "rowwise", torch.device("cpu"), emulate=True)


@pytest.mark.parametrize("flags, message", [
    ({"weight_bridge_mode": "lora_only"}, "trains LoRA adapters around frozen ones"),
    ({"weight_bridge_mode": "lora_restart"}, "trains LoRA adapters around frozen ones"),
    ({"parallel": "tensor"}, "not built for --parallel tensor"),
])
def test_modes_it_is_not_built_for_are_refused(flags, message):
    with pytest.raises(ValueError, match=message):
        TrainerConfig(float8_matmuls="backward", **flags)
    TrainerConfig(float8_matmuls="backward", weight_bridge_mode="none")  # full-parameter modes take it
