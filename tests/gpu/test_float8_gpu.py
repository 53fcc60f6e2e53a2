"""--float8-matmuls on the GPU's float8 tensor cores (H100, H200): eager and compiled, with gradient
checkpointing, on a batch whose token count is not a multiple of 16. The forward stays what bf16
computes; the gradients keep fp32's direction. Skipped without a CUDA GPU of compute capability 8.9+.
The 8B speed: bench/vs_trl.py (docs/results.md)."""

from __future__ import annotations

import pytest
import torch

from example_trainer.compilation import compile_decoder_layers
from example_trainer.float8_matmuls import MIN_CAPABILITY, convert_projections
from example_trainer.logprobs import sequence_logprobs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < MIN_CAPABILITY,
    reason="needs a CUDA GPU with float8 tensor cores")]


def llama(dtype: torch.dtype) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
                         num_key_value_heads=4, vocab_size=4096)
    return LlamaForCausalLM(config).to("cuda", dtype).train()


def logprobs_and_grads(model, inputs):
    model.zero_grad(set_to_none=True)
    logprobs = sequence_logprobs(model, inputs, chunk_tokens=64)
    (logprobs * inputs["attention_mask"][:, 1:]).sum().backward()
    return logprobs.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}


@pytest.mark.parametrize("compiled", [False, True])
def test_float8_gradients_keep_fp32s_direction_and_the_forward_stays_bf16(compiled):
    generator = torch.Generator().manual_seed(1)
    inputs = {"input_ids": torch.randint(0, 4096, (3, 37), generator=generator).cuda(),  # 111 tokens
              "attention_mask": torch.ones(3, 37, dtype=torch.long, device="cuda")}
    inputs["attention_mask"][1, :5] = 0
    _, exact = logprobs_and_grads(llama(torch.float32), inputs)
    bf16_logprobs, _ = logprobs_and_grads(llama(torch.bfloat16), inputs)

    model = llama(torch.bfloat16)
    weights = [p.data_ptr() for p in model.parameters()]
    assert convert_projections(model, "backward", torch.device("cuda")) == 4 * 7
    model.gradient_checkpointing_enable()
    if compiled:
        torch._dynamo.reset()
        compile_decoder_layers(model)
    for _ in range(2):  # the second call: compiled code already there, weights unchanged
        logprobs, grads = logprobs_and_grads(model, inputs)

    torch.testing.assert_close(logprobs, bf16_logprobs, rtol=0, atol=0.02)  # compiled bf16 may fuse differently
    for name, grad in exact.items():
        cosine = torch.nn.functional.cosine_similarity(grads[name].flatten(), grad.flatten(), dim=0).item()
        assert cosine > 0.97, (name, cosine)
    assert [p.data_ptr() for p in model.parameters()] == weights
