"""bf16 linear layers in fp32 on CPUs without a fast bf16 matmul (example_trainer/cpu_matmul.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from example_trainer.batching import build_batch
from example_trainer.config import TrainerConfig
from example_trainer.cpu_matmul import bf16_matmul_is_slow, linear, use_fast_linears
from tests.unit.test_parallel import groups, tiny_model


def test_only_a_cpu_without_avx512_counts_as_slow(monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert bf16_matmul_is_slow(torch.device("cpu")) and not bf16_matmul_is_slow(torch.device("meta"))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert not bf16_matmul_is_slow(torch.device("cpu"))


def test_a_bf16_linear_on_a_slow_cpu_is_the_fp32_product_rounded_once(monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    torch.manual_seed(0)
    x = torch.randn(5, 16, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(8, 16, dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(8, dtype=torch.bfloat16)
    out = linear(x, weight, bias)
    assert out.dtype is torch.bfloat16
    assert torch.equal(out, F.linear(x.detach().float(), weight.detach().float(), bias.float()).to(torch.bfloat16))
    out.float().sum().backward()
    assert weight.grad.dtype is torch.bfloat16 and x.grad.dtype is torch.bfloat16  # the bf16 weights get gradients
    assert torch.equal(linear(x.float(), weight.float()), F.linear(x.float(), weight.float()))  # fp32: untouched


def training_step_products(monkeypatch, capability: str) -> tuple[list[torch.dtype], list[torch.Tensor]]:
    """The training step's forward and backward (gradient checkpointing on) of a bf16 model on a
    CPU that reports ``capability``, after ``use_fast_linears``: the dtype of every product that
    went through ``linear``'s fp32 path or its bf16 one, and the gradients."""
    from types import SimpleNamespace

    from example_trainer import cpu_matmul
    from example_trainer.grpo import forward_backward

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    dtypes = []

    def recording_linear(x, weight, bias=None):
        dtypes.append(x.dtype)
        return F.linear(x, weight, bias)

    monkeypatch.setattr(cpu_matmul, "F", SimpleNamespace(linear=recording_linear))
    model = tiny_model().to(torch.bfloat16)
    model.gradient_checkpointing_enable()
    model.train()
    assert use_fast_linears(model, torch.device("cpu")) == (15 if capability == "AVX2" else 0)  # 7 a layer + lm_head
    cfg = TrainerConfig(batch_size=4, vllm_importance_sampling_mode="token_truncate")
    forward_backward(model, None, build_batch(groups(), seq_len=64), cfg, torch.device("cpu"))
    return dtypes, [p.grad.clone() for p in model.parameters()]


def test_the_training_step_computes_its_linears_in_fp32_only_where_bf16_is_slow(monkeypatch):
    """Through gradient checkpointing's recompute in backward too: a torch function mode entered
    around the step did not reach it (the recompute then ran in bf16 and checkpointing refused)."""
    slow, slow_grads = training_step_products(monkeypatch, "AVX2")
    fast, fast_grads = training_step_products(monkeypatch, "AVX512")
    assert set(slow) == {torch.float32} and len(slow) >= 2 * 14 + 1  # each layer's 7 twice, and the head
    assert torch.float32 not in fast  # nn.Linear's own forward, and the bf16 kernels, as before
    assert all(torch.allclose(a.float(), b.float(), rtol=0.1, atol=1e-2) for a, b in zip(slow_grads, fast_grads))
