"""Chunked vocabulary projection on a real GPU: the loss's peak memory no longer grows with
batch x sequence x vocabulary, and the gradient is the full path's. Skipped without CUDA.
Results: $OUT/gpu_logprob_memory.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.gpu.test_shared_vllm_gpu import models
from tests.gpu.results import results_folder

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def peak_of_step(model, inputs, chunk_tokens: int) -> tuple[int, torch.Tensor]:
    """Peak bytes PyTorch allocated above the model for one forward + backward of a logprob loss."""
    from example_trainer.rl.logprobs import sequence_logprobs

    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    sequence_logprobs(model, inputs, chunk_tokens).sum().backward()
    torch.cuda.synchronize()
    grad = model.get_output_embeddings().weight.grad.float().clone()
    return torch.cuda.max_memory_allocated() - base, grad


def test_chunked_logprobs_peak_does_not_scale_with_the_vocabulary(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    model_path = models(tmp_path_factory.getbasetemp())["qwen2-random-1.4b"]
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).cuda().train()
    model.gradient_checkpointing_enable()  # as the trainer runs it (checkpointing acts in train mode only)
    batch, length = 4, 2048
    tokens = torch.randint(0, model.config.vocab_size, (batch, length), device="cuda")
    inputs = {"input_ids": tokens, "attention_mask": torch.ones_like(tokens)}
    full_peak, full_grad = peak_of_step(model, inputs, chunk_tokens=0)
    chunked_peak, chunked_grad = peak_of_step(model, inputs, chunk_tokens=1024)
    fp32_logits = batch * (length - 1) * model.config.vocab_size * 4
    # Both bf16 gradients against the full path in fp32: chunking sums the lm_head gradient over
    # the chunks in bf16, so the two bf16 paths differ by rounding; it must not be more than the full path's own.
    _, reference = peak_of_step(model.float(), inputs, chunk_tokens=0)
    full_error = ((full_grad - reference).norm() / reference.norm()).item()
    chunked_error = ((chunked_grad - reference).norm() / reference.norm()).item()
    result = {"full_peak_mib": full_peak / 2**20, "chunked_peak_mib": chunked_peak / 2**20,
              "fp32_logits_mib": fp32_logits / 2**20, "batch": batch, "length": length,
              "vocab": model.config.vocab_size, "full_grad_rel_error": full_error,
              "chunked_grad_rel_error": chunked_error}
    print(f"\n[logprob memory] {result}")
    results_folder(tmp_path_factory.getbasetemp()).joinpath("gpu_logprob_memory.json").write_text(
        json.dumps(result, indent=2))
    assert full_peak - chunked_peak > fp32_logits  # at least one full fp32 logits tensor less
    assert chunked_error < 2 * full_error + 1e-3, result
