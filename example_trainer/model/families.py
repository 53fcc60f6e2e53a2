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

vLLM serves some of these through its generic Transformers backend (OLMo 2 on vLLM 0.26; OLMo 2
and 3 on 0.32): it builds the HF model with q/k/v and gate/up fused into ``qkv_proj`` /
``gate_up_proj`` (rows [q; k; v] and [gate; up]) and the norms replaced by vLLM's under their HF
names, which is the native models' layout, so one entry serves both. Were a backend to stop
fusing, the fused name would be missing from the export and the attach fails naming it.

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
# Per-layer q/k norms that vLLM keeps whole under HF's names (Qwen3, Gemma 3: one head_dim
# vector each; OLMo 2/3: over the whole q or k projection).
_QK_NORMS = _same_name("self_attn.q_norm.weight", "self_attn.k_norm.weight")
# OLMo 2/3: Llama's projections, q/k norms, and norms after attention and after the MLP (none before).
_OLMO = (_ENDS + _ATTENTION + _GATED_MLP + _QK_NORMS
         + _same_name("post_attention_layernorm.weight", "post_feedforward_layernorm.weight"))


@dataclass(frozen=True)
class Family:
    """What onecopy knows about one HF architecture (see the module docstring)."""

    weights: tuple[WeightRule, ...]
    plain_head: bool = True
    tensor_parallel: bool = False
    vllm_gpu_args: tuple[str, ...] = ()  # flags vLLM needs on a GPU to hold the family in a viewable layout


FAMILIES: dict[str, Family] = {
    # Llama (SmolLM2, Llama-3) and Qwen2/Qwen2.5 (q/k/v biases) share names and fused layouts in vLLM.
    "LlamaForCausalLM": Family(_LLAMA, tensor_parallel=True),
    "Qwen2ForCausalLM": Family(_LLAMA, tensor_parallel=True),
    # Qwen3: Llama's layout plus per-head q/k norms, which vLLM keeps under HF's names (replicated
    # under tensor parallelism: one head_dim vector each).
    "Qwen3ForCausalLM": Family(_LLAMA + _QK_NORMS, tensor_parallel=True),
    # Mistral: vLLM's MistralForCausalLM is Llama's model (its attention, MLP and load path: the
    # q/k permutation is only for Mistral's own consolidated format, not HF folders), so the same
    # names, rows and tensor-parallel split.
    "MistralForCausalLM": Family(_LLAMA, tensor_parallel=True),
    # Phi-3: HF already holds fused qkv_proj [q; k; v] and gate_up_proj [gate; up], the rows vLLM
    # (Llama's model) holds at one rank: whole tensors. Under tensor parallelism vLLM's rank holds
    # [q_r; k_r; v_r], not a row block of HF's fused tensor.
    "Phi3ForCausalLM": Family(_ENDS + _PRE_NORMS + _same_name("self_attn.qkv_proj.weight", "self_attn.o_proj.weight",
                                                              "mlp.gate_up_proj.weight", "mlp.down_proj.weight")),
    # OLMo 2 (vLLM's Transformers backend, which fuses q/k/v and gate/up as the native models do)
    # and OLMo 3: norms after attention and after the MLP (no input norm), and q/k norms over the
    # whole projection width, which vLLM keeps whole and all-gathers q/k for under tensor
    # parallelism (the trainer's plan would norm each rank's shard alone).
    "Olmo2ForCausalLM": Family(_OLMO),
    "Olmo3ForCausalLM": Family(_OLMO),
    # Gemma 3 (text): four norms per layer and per-head q/k norms, all x * (1 + w) with the same w
    # stored on both sides; the embedding scale sqrt(hidden_size) is a buffer, not a weight. Its
    # forward may soft-cap the logits after lm_head (final_logit_softcapping): not a plain head.
    # vLLM splits it with Llama's layers (per-head norms replicated), as the plan does.
    "Gemma3ForCausalLM": Family(_LLAMA + _QK_NORMS + _same_name("pre_feedforward_layernorm.weight",
                                                                "post_feedforward_layernorm.weight"),
                                plain_head=False, tensor_parallel=True),
    # Qwen3-MoE: Qwen3's attention; per layer the router and the routed experts, each one whole
    # tensor: transformers 5 holds the experts as gate_up_proj [E, 2I, H] (rows [gate; up] per
    # expert) and down_proj [E, H, I], the layout of vLLM's w13/w2 in the MoE kernels that compute
    # on the weights as loaded: TRITON on GPU (pinned here: FlashInfer CUTLASS swaps the halves),
    # vLLM 0.26's CPU experts with packing off. The worker reports its kernel and attach refuses
    # the others (vllm_patching/export.moe_layout). Layers in mlp_only_layers are dense (Llama's
    # MLP rules). Not tensor parallel: vLLM splits each expert's intermediate dimension, not by our plan.
    "Qwen3MoeForCausalLM": Family(
        _LLAMA + _QK_NORMS
        + ((_LAYER + r"mlp\.experts\.gate_up_proj", _VLLM_LAYER + "mlp.experts.routed_experts.w13_weight", None),
           (_LAYER + r"mlp\.experts\.down_proj", _VLLM_LAYER + "mlp.experts.routed_experts.w2_weight", None),
           (_LAYER + r"mlp\.gate\.weight", _VLLM_LAYER + "mlp.gate.weight", None)),
        vllm_gpu_args=("--moe-backend", "triton")),
}


def family(architecture: str) -> Family:
    """The entry for ``architecture``; an unsupported one fails naming the supported ones and the fallback."""
    if architecture not in FAMILIES:
        raise ValueError(
            f"architecture {architecture} has no single-copy mapping; supported: {', '.join(FAMILIES)}. "
            "Use --weight-bridge-mode none (checkpoint + restart) or lora_only for it, or add its entry to "
            "example_trainer/model/families.py."
        )
    return FAMILIES[architecture]
