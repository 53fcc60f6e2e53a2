"""A checkpoint's config names the dtype of the tensors written (bf16), not the trainer's (fp32
masters, or a meta model's), so ``from_pretrained(dtype="auto")`` and vLLM load what is there."""

from __future__ import annotations

import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from example_trainer.model.checkpoint import save_hf_checkpoint


def test_an_fp32_model_is_saved_as_bf16_and_its_config_says_so(tmp_path, default_model):
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128)
    model = LlamaForCausalLM(config).float()
    save_hf_checkpoint(model, AutoTokenizer.from_pretrained(default_model), tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype="auto")
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    for name, param in loaded.named_parameters():
        torch.testing.assert_close(param, model.get_parameter(name).detach().to(torch.bfloat16), atol=0, rtol=0)
