"""--parallel tensor shares only the families whose entry says vLLM shards them as the trainer's
plan does (families.py's ``tensor_parallel``); any other is refused before anything is attached,
with the families it can use and what to run instead."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from example_trainer.bridges.attach import AttachError
from example_trainer.bridges.tensor_parallel import attach_tensor_parallel, check_tensor_parallel
from example_trainer.model.families import FAMILIES, Family
from tests.tiny_models import tiny_config

UNSHARDED = "FakeForCausalLM"


@pytest.fixture
def unsharded_family(monkeypatch, tmp_path) -> str:
    """A family with Qwen3's weights but ``tensor_parallel=False``, and a model folder of it whose
    shapes two ranks could split (so only the family can be what refuses it)."""
    monkeypatch.setitem(FAMILIES, UNSHARDED, Family(FAMILIES["Qwen3ForCausalLM"].weights, tensor_parallel=False))
    config = tiny_config("Qwen3ForCausalLM")
    config.architectures = [UNSHARDED]
    config.save_pretrained(tmp_path)
    return str(tmp_path)


def test_a_family_without_tensor_parallel_is_refused_naming_the_ones_that_have_it(unsharded_family):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(unsharded_family)
    with pytest.raises(AttachError) as refused:
        check_tensor_parallel(config, 2, 2)
    message = str(refused.value)
    assert message.startswith(f"{UNSHARDED} is not sharded by vLLM the way --parallel tensor's plan shards")
    supported = message.split("supported: ")[1].split(")")[0].split(", ")
    assert {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"} <= set(supported) and UNSHARDED not in supported
    assert "--parallel data" in message
    config.architectures = ["Qwen3ForCausalLM"]  # the same shapes as a family that has it: accepted
    check_tensor_parallel(config, 2, 2)


def test_the_refusal_comes_before_any_tensor_is_viewed(unsharded_family):
    # A mesh that only knows its size and no tensors to view: the check is all that can run.
    mesh = SimpleNamespace(size=lambda: 2)
    with pytest.raises(AttachError, match=f"{UNSHARDED} is not sharded"):
        attach_tensor_parallel(unsharded_family, {"model.embed_tokens.weight": torch.empty(24576, 128)},
                               UNSHARDED, 2, mesh, "a fake export")


@pytest.mark.parametrize("architecture", [a for a, f in FAMILIES.items() if not f.tensor_parallel] or
                         [pytest.param("none", marks=pytest.mark.skip("every family in FAMILIES has tensor_parallel"))])
def test_every_family_without_tensor_parallel_is_refused(architecture):
    config = SimpleNamespace(architectures=[architecture], num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=256, vocab_size=49152)
    with pytest.raises(AttachError, match=f"{architecture} is not sharded"):
        check_tensor_parallel(config, 2, 2)
