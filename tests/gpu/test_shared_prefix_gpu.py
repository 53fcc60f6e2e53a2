"""--share-group-prefix on CUDA as the 8B runs use it: bf16, gradient checkpointing, compiled
decoder layers, the gathered attention (the packed rows' queries, keys and values through sdpa's
causal kernel in the padded layout). The packed forward gives the padded one's loss and gradients to
bf16's rounding. Skipped without CUDA."""

from __future__ import annotations

import gc

import pytest
import torch

from example_trainer.config import TrainerConfig
from example_trainer.grpo import forward_backward
from example_trainer.model.compilation import compile_decoder_layers
from tests.unit.test_shared_prefix import batch_of_groups

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(autouse=True)
def release_compiled_graphs():
    """The compiled layers keep this test's model alive; later GPU tests in the same process
    measure the memory they allocate."""
    yield
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("compiled", [False, True])
def test_packed_rows_give_the_padded_loss_and_gradients_on_cuda(compiled):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
                         num_key_value_heads=4, vocab_size=1024)
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16).train()
    model.gradient_checkpointing_enable()
    if compiled:
        torch._dynamo.reset()
        compile_decoder_layers(model)
    batch = batch_of_groups()
    results = {}
    for share in (False, True, False, True):  # twice each: the compiled code is there the second time
        cfg = TrainerConfig(batch_size=12, share_group_prefix=share, logprob_chunk_tokens=64, epsilon=0.05)
        model.zero_grad(set_to_none=True)
        metrics = forward_backward(model, None, batch, cfg, torch.device("cuda"))
        results[share] = metrics, {n: p.grad.float() for n, p in model.named_parameters()}

    (padded, padded_grads), (packed, packed_grads) = results[False], results[True]
    assert packed["train/forward_positions_saved"] > 0.2
    assert model.config._attn_implementation == "onecopy_packed_sdpa"
    assert packed["train/loss"] == pytest.approx(padded["train/loss"], rel=0.02, abs=1e-3)
    for name, grad in padded_grads.items():
        cosine = torch.nn.functional.cosine_similarity(packed_grads[name].flatten(), grad.flatten(), dim=0).item()
        assert cosine > 0.99, (name, cosine)  # bf16 rounding of other kernel shapes, not another gradient
