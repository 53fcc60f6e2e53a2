"""Where each HF parameter lives inside vLLM's (fused, padded) parameters.

Table-driven: a family lists, per HF name pattern, the vLLM parameter and which row block of it
the HF tensor is. Row blocks are contiguous, so every HF parameter is a view, never a copy.
To support a new family, add its architecture and table here.

Under tensor parallelism (``tp_size`` > 1) vLLM's tensors are one rank's shards and the HF
parameter is that rank's shard too (example_trainer/bridges/tensor_parallel.py): fused blocks are
``1/tp_size`` as tall, whole tensors (o_proj, down_proj: split by column; norms: replicated) stay
whole, and the vocabulary is the rank's rows of the padded vocabulary.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class RowSlice:
    """HF parameter = rows [start, start + rows) of vLLM parameter ``vllm_name``."""

    vllm_name: str
    start: int
    rows: int
    fused_rows: int | None = None  # rows the whole vLLM tensor must have (fused blocks); None = any


def _dims(cfg, tp_size: int = 1, tp_rank: int = 0) -> dict[str, int]:
    """Rows of each block on one tensor-parallel rank (the whole model at ``tp_size`` 1)."""
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    vocab_chunk = -(-cfg.vocab_size // tp_size)  # torch's Shard(0): ceil-sized chunks, the last one shorter
    return {"q": heads * head_dim // tp_size, "kv": kv_heads * head_dim // tp_size,
            "inter": cfg.intermediate_size // tp_size,
            "vocab": max(0, min(vocab_chunk, cfg.vocab_size - tp_rank * vocab_chunk))}


# (HF name regex, vLLM name template, block) — block picks rows of a fused tensor:
# "q"/"k"/"v" of qkv_proj, "gate"/"up" of gate_up_proj, "vocab" = first vocab_size rows
# (vLLM pads embeddings and LM head), None = the whole tensor.
_DECODER_TABLE: list[tuple[str, str, str | None]] = [
    (r"model\.embed_tokens\.weight", "model.embed_tokens.weight", "vocab"),
    (r"lm_head\.weight", "lm_head.weight", "vocab"),
    (r"model\.norm\.weight", "model.norm.weight", None),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj\.(weight|bias)", r"model.layers.\1.self_attn.qkv_proj.\2", "q"),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj\.(weight|bias)", r"model.layers.\1.self_attn.qkv_proj.\2", "k"),
    (r"model\.layers\.(\d+)\.self_attn\.v_proj\.(weight|bias)", r"model.layers.\1.self_attn.qkv_proj.\2", "v"),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight", r"model.layers.\1.self_attn.o_proj.weight", None),
    (r"model\.layers\.(\d+)\.mlp\.gate_proj\.weight", r"model.layers.\1.mlp.gate_up_proj.weight", "gate"),
    (r"model\.layers\.(\d+)\.mlp\.up_proj\.weight", r"model.layers.\1.mlp.gate_up_proj.weight", "up"),
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.weight", r"model.layers.\1.mlp.down_proj.weight", None),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", r"model.layers.\1.input_layernorm.weight", None),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", r"model.layers.\1.post_attention_layernorm.weight", None),
]

# Llama (SmolLM2, Llama-3) and Qwen2/Qwen2.5 (q/k/v biases) share names and fused layouts in vLLM.
FAMILIES: dict[str, list[tuple[str, str, str | None]]] = {
    "LlamaForCausalLM": _DECODER_TABLE,
    "Qwen2ForCausalLM": _DECODER_TABLE,
}


def _block(block: str, d: dict[str, int]) -> tuple[int, int, int | None]:
    """(start row, rows, rows of the whole fused tensor) of ``block``."""
    qkv = d["q"] + 2 * d["kv"]
    blocks: dict[str, tuple[int, int, int | None]] = {
        "q": (0, d["q"], qkv),
        "k": (d["q"], d["kv"], qkv),
        "v": (d["q"] + d["kv"], d["kv"], qkv),
        "gate": (0, d["inter"], 2 * d["inter"]),
        "up": (d["inter"], d["inter"], 2 * d["inter"]),
        "vocab": (0, d["vocab"], None),  # vLLM pads the vocabulary rows: any count >= vocab
    }
    return blocks[block]


def map_hf_parameter(architecture: str, hf_name: str, cfg, tp_size: int = 1, tp_rank: int = 0) -> RowSlice | None:
    """The vLLM parameter and row block for ``hf_name`` (on tensor-parallel rank ``tp_rank`` of
    ``tp_size``: both sides' shards); rows=-1 means the whole tensor."""
    if architecture not in FAMILIES:
        raise ValueError(
            f"architecture {architecture} has no single-copy mapping; supported: {', '.join(FAMILIES)}. "
            "Add its table to example_trainer/bridges/hf_mapping.py, or use --weight-bridge-mode none."
        )
    d = _dims(cfg, tp_size, tp_rank)
    for pattern, template, block in FAMILIES[architecture]:
        m = re.fullmatch(pattern, hf_name)
        if m:
            if block is None:
                return RowSlice(m.expand(template), 0, -1)
            return RowSlice(m.expand(template), *_block(block, d))
    return None
