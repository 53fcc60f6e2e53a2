"""Where each HF parameter lives inside vLLM's (fused, padded) parameters.

Table-driven: each family (example_trainer/model/families.py) lists, per HF name pattern, the vLLM
parameter and which row block of it the HF tensor is. Row blocks are contiguous, so every HF
parameter is a view, never a copy.

Under tensor parallelism (``tp_size`` > 1) vLLM's tensors are one rank's shards and the HF
parameter is that rank's shard too (example_trainer/bridges/tensor_parallel.py): fused blocks are
``1/tp_size`` as tall, whole tensors (o_proj, down_proj: split by column; norms: replicated) stay
whole, and the vocabulary is the rank's rows of the padded vocabulary.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from example_trainer.model.families import family


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
    rules = family(architecture).weights
    d = _dims(cfg, tp_size, tp_rank)
    for pattern, template, block in rules:
        m = re.fullmatch(pattern, hf_name)
        if m:
            if block is None:
                return RowSlice(m.expand(template), 0, -1)
            return RowSlice(m.expand(template), *_block(block, d))
    return None
