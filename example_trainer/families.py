"""The model families single copy supports: one entry per HF architecture, with every fact the
trainer needs about it in one place.

- ``weights``: where each HF parameter lives in vLLM's (fused, padded) parameters, as
  (HF name regex, vLLM name template, block) rules (bridges/hf_mapping.py reads them). The block
  picks rows of a fused vLLM tensor: "q"/"k"/"v" of ``qkv_proj``, "gate"/"up" of ``gate_up_proj``,
  "vocab" = the first vocab_size rows (vLLM pads embeddings and the LM head), None = the whole
  tensor. A rule per HF parameter; an HF parameter no rule matches fails the attach by name.
- ``plain_head``: the model's forward is decoder -> ``lm_head`` and nothing after it (no logit
  scaling or soft-capping), so logprobs may project onto the vocabulary in chunks (logprobs.py).
- ``tensor_parallel``: vLLM shards it as bridges/tensor_parallel.py's plan does (Megatron-style
  q/k/v and gate/up by rows, o_proj and down_proj by columns, norms whole), so ``--parallel
  tensor`` can share it.
- ``vllm_gpu_args``: flags the trainer adds when it starts vLLM on a GPU in a single-copy mode,
  to pick kernels that compute on the weights as loaded (example_trainer/inference.py).

To support a new architecture, add its entry here and a test that attaches to a real vLLM (or,
where vLLM cannot hold it in a viewable layout, to a fake export) and compares logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass

WeightRule = tuple[str, str, "str | None"]  # (HF name regex, vLLM name template, block)

_LAYER = r"model\.layers\.(\d+)\."
_VLLM_LAYER = r"model.layers.\1."

# Embeddings, the final norm and the LM head: the same names in every family here.
_ENDS: tuple[WeightRule, ...] = (
    (r"model\.embed_tokens\.weight", "model.embed_tokens.weight", "vocab"),
    (r"lm_head\.weight", "lm_head.weight", "vocab"),
    (r"model\.norm\.weight", "model.norm.weight", None),
)
# Separate q/k/v (with or without biases) that vLLM fuses into qkv_proj, and o_proj.
_ATTENTION: tuple[WeightRule, ...] = (
    (_LAYER + r"self_attn\.q_proj\.(weight|bias)", _VLLM_LAYER + r"self_attn.qkv_proj.\2", "q"),
    (_LAYER + r"self_attn\.k_proj\.(weight|bias)", _VLLM_LAYER + r"self_attn.qkv_proj.\2", "k"),
    (_LAYER + r"self_attn\.v_proj\.(weight|bias)", _VLLM_LAYER + r"self_attn.qkv_proj.\2", "v"),
    (_LAYER + r"self_attn\.o_proj\.weight", _VLLM_LAYER + r"self_attn.o_proj.weight", None),
)
# Separate gate/up that vLLM fuses into gate_up_proj, and down_proj.
_GATED_MLP: tuple[WeightRule, ...] = (
    (_LAYER + r"mlp\.gate_proj\.weight", _VLLM_LAYER + r"mlp.gate_up_proj.weight", "gate"),
    (_LAYER + r"mlp\.up_proj\.weight", _VLLM_LAYER + r"mlp.gate_up_proj.weight", "up"),
    (_LAYER + r"mlp\.down_proj\.weight", _VLLM_LAYER + r"mlp.down_proj.weight", None),
)


def _same_name(*hf_suffixes: str) -> tuple[WeightRule, ...]:
    """Per-layer parameters that vLLM keeps whole under the HF name."""
    return tuple((_LAYER + suffix.replace(".", r"\."), _VLLM_LAYER + suffix, None) for suffix in hf_suffixes)


_PRE_NORMS = _same_name("input_layernorm.weight", "post_attention_layernorm.weight")
_LLAMA = _ENDS + _ATTENTION + _GATED_MLP + _PRE_NORMS


@dataclass(frozen=True)
class Family:
    """What onecopy knows about one HF architecture (see the module docstring)."""

    weights: tuple[WeightRule, ...]
    plain_head: bool = True
    tensor_parallel: bool = False


FAMILIES: dict[str, Family] = {
    # Llama (SmolLM2, Llama-3) and Qwen2/Qwen2.5 (q/k/v biases) share names and fused layouts in vLLM.
    "LlamaForCausalLM": Family(_LLAMA, tensor_parallel=True),
    "Qwen2ForCausalLM": Family(_LLAMA, tensor_parallel=True),
    # Qwen3: Llama's layout plus per-head q/k norms, which vLLM keeps under HF's names (replicated
    # under tensor parallelism: one head_dim vector each).
    "Qwen3ForCausalLM": Family(_LLAMA + _same_name("self_attn.q_norm.weight", "self_attn.k_norm.weight"),
                               tensor_parallel=True),
}


def family(architecture: str) -> Family:
    """The entry for ``architecture``; an unsupported one fails naming the supported ones and the fallback."""
    if architecture not in FAMILIES:
        raise ValueError(
            f"architecture {architecture} has no single-copy mapping; supported: {', '.join(FAMILIES)}. "
            "Use --weight-bridge-mode none (checkpoint + restart) or lora_only for it, or add its entry to "
            "example_trainer/families.py."
        )
    return FAMILIES[architecture]
