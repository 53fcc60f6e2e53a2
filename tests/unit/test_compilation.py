"""--torch-compile: the compiled layers compute what the eager ones do, see in-place weight updates
(what shared_vllm's optimizer step is), and a model without decoder layers is refused clearly.

The CPU tests turn torch.compile off (TORCH_COMPILE_DISABLE, tests/conftest.py): these tests turn it
back on. They compile with the aot_eager backend: the same graph capture and the same split of the
backward (which tensors are kept) as inductor, without inductor's C++ code generation, which took
44 s on this 2-core CI box; inductor's own kernels are torch's to test.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config

from example_trainer.config import TrainerConfig
from example_trainer.model.compilation import compile_decoder_layers
from example_trainer.rl.logprobs import sequence_logprobs
from tests.tiny_models import tiny_config


def logprobs_and_grads(model, inputs):
    model.zero_grad(set_to_none=True)
    logprobs = sequence_logprobs(model, inputs, chunk_tokens=8)
    (logprobs * inputs["attention_mask"][:, 1:]).sum().backward()
    return logprobs.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def compiling():
    """torch.compile on for this module, its graph counters from zero (both cases share the compiled
    layer code: compiling it once is most of this file's time)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(disable=False):
        yield counters
    torch._dynamo.reset()


@pytest.mark.parametrize("checkpointing", [False, True])
def test_compiled_layers_match_eager_and_see_in_place_updates(checkpointing, compiling):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("Qwen3ForCausalLM"), dtype=torch.float32)
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    inputs = {"input_ids": torch.randint(0, 1000, (3, 12)),
              "attention_mask": torch.tensor([[1] * 12, [0] * 4 + [1] * 8, [0] * 2 + [1] * 10])}
    eager_logprobs, eager_grads = logprobs_and_grads(model, inputs)
    weights = [p.data_ptr() for p in model.parameters()]

    assert compile_decoder_layers(model, backend="aot_eager") == 2
    compiled_logprobs, compiled_grads = logprobs_and_grads(model, inputs)
    assert compiling["stats"]["unique_graphs"] >= 1  # compiled, not run eagerly
    torch.testing.assert_close(compiled_logprobs, eager_logprobs, rtol=1e-4, atol=1e-4)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-3, atol=1e-4, msg=name)
    assert [p.data_ptr() for p in model.parameters()] == weights  # the attached tensors, not copies

    # Another batch shape (rows and length) and a weight changed in place, as the optimizer does it.
    other = {"input_ids": torch.randint(0, 1000, (2, 7)), "attention_mask": torch.ones(2, 7, dtype=torch.long)}
    before, _ = logprobs_and_grads(model, other)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(3.0)
    after, _ = logprobs_and_grads(model, other)
    for layer in model.model.layers:
        layer._compiled_call_impl = None  # eager again, same tensors
    eager_after, _ = logprobs_and_grads(model, other)
    assert not torch.allclose(after, before, atol=1e-3)
    torch.testing.assert_close(after, eager_after, rtol=1e-4, atol=1e-4)


def test_a_model_without_decoder_layers_is_refused_naming_the_flag():
    model = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="--torch-compile"):
        compile_decoder_layers(model)


@pytest.mark.parametrize("other", [{"routing_replay": True}, {"parallel": "tensor"}])
def test_torch_compile_is_refused_where_it_is_not_built_for(other):
    with pytest.raises(ValueError, match="--torch-compile"):
        TrainerConfig(torch_compile=True, **other)
