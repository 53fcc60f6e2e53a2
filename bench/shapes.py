"""Real models' shapes with random weights: a folder holding a real checkpoint's config.json values
and a tokenizer whose vocabulary has the model's size, so vLLM (``--load-format dummy``) and the
trainer build the model as they would the real one, with nothing written to disk but the config.

Used by bench/memory.py and tests/gpu/test_families_gpu.py. A system that cannot draw random weights
itself (TRL's GRPOTrainer loads the model from disk) gets them written by ``random_weights_folder``.
"""

from __future__ import annotations

import json
from pathlib import Path

# name -> (architecture, model_type, config.json values). MoE shapes named "-Nl" keep every
# per-layer shape and the vocabulary with N layers (the whole model is the next issue's size).
SHAPES: dict[str, tuple[str, str, dict]] = {
    "smollm2-135m": ("LlamaForCausalLM", "llama", dict(  # a CPU smoke run
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        vocab_size=49152, tie_word_embeddings=True)),
    "qwen2.5-1.5b": ("Qwen2ForCausalLM", "qwen2", dict(
        hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        vocab_size=151936, tie_word_embeddings=True)),
    "qwen2.5-3b": ("Qwen2ForCausalLM", "qwen2", dict(
        hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
        vocab_size=151936, tie_word_embeddings=True)),
    "qwen2.5-7b": ("Qwen2ForCausalLM", "qwen2", dict(
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        vocab_size=152064, tie_word_embeddings=False)),
    "llama3.1-8b": ("LlamaForCausalLM", "llama", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        vocab_size=128256, tie_word_embeddings=False)),
    "llama3.1-70b": ("LlamaForCausalLM", "llama", dict(  # tensor parallel over 4-8 GPUs
        hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
        vocab_size=128256, tie_word_embeddings=False)),
    "qwen2.5-14b": ("Qwen2ForCausalLM", "qwen2", dict(
        hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8,
        vocab_size=152064, tie_word_embeddings=False)),
    "qwen3-8b": ("Qwen3ForCausalLM", "qwen3", dict(
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, vocab_size=151936, tie_word_embeddings=False)),
    "qwen3-14b": ("Qwen3ForCausalLM", "qwen3", dict(
        hidden_size=5120, intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=8,
        head_dim=128, vocab_size=151936, tie_word_embeddings=False)),
    "qwen3-32b": ("Qwen3ForCausalLM", "qwen3", dict(
        hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8,
        head_dim=128, vocab_size=151936, tie_word_embeddings=False)),
    "qwen3-30b-a3b": ("Qwen3MoeForCausalLM", "qwen3_moe", dict(
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, vocab_size=151936, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
        decoder_sparse_step=1, norm_topk_prob=True, tie_word_embeddings=False)),
    "mistral-7b": ("MistralForCausalLM", "mistral", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, vocab_size=32768, tie_word_embeddings=False)),
    "phi3-mini": ("Phi3ForCausalLM", "phi3", dict(
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
        vocab_size=32064, tie_word_embeddings=False)),
    "olmo2-7b": ("Olmo2ForCausalLM", "olmo2", dict(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
        vocab_size=100352, tie_word_embeddings=False)),
    "olmo3-7b": ("Olmo3ForCausalLM", "olmo3", dict(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
        vocab_size=100278, sliding_window=4096, tie_word_embeddings=False)),
    "gemma3-1b": ("Gemma3ForCausalLM", "gemma3_text", dict(
        hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
        head_dim=256, vocab_size=262144, sliding_window=512, tie_word_embeddings=True)),
}


def with_layers(name: str, layers: int) -> tuple[str, str, dict]:
    """``name``'s shape with ``layers`` layers (every per-layer shape and the vocabulary kept)."""
    architecture, model_type, values = SHAPES[name]
    return architecture, model_type, {**values, "num_hidden_layers": layers}


def padded_tokenizer(source: str, out: Path, vocab_size: int) -> None:
    """``source``'s tokenizer with entries ``<pad_N>`` up to ``vocab_size``: random weights sample any
    row, and each must decode. They are in the BPE vocabulary with no merges, so no text encodes to
    them. A vocabulary smaller than the tokenizer's keeps the tokenizer as it is (the caller keeps
    prompt ids below the vocabulary)."""
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(source).save_pretrained(out)
    spec = json.loads((out / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    used = set(vocab.values()) | {t["id"] for t in spec["added_tokens"]}
    vocab.update({f"<pad_{i}>": i for i in range(vocab_size) if i not in used})
    (out / "tokenizer.json").write_text(json.dumps(spec))


def shape_folder(name: str, tokenizer_dir: str, root: Path, layers: int | None = None) -> tuple[str, int]:
    """A folder with ``name``'s config (``layers`` layers if given) and a padded tokenizer; its parameter count."""
    from transformers import AutoConfig, AutoTokenizer

    from example_trainer.memory_plan import count_parameters

    architecture, model_type, values = SHAPES[name] if layers is None else with_layers(name, layers)
    path = Path(root) / (name if layers is None else f"{name}-{layers}l")
    path.mkdir(parents=True, exist_ok=True)
    padded_tokenizer(tokenizer_dir, path, values["vocab_size"])
    tok = AutoTokenizer.from_pretrained(path)
    cfg = AutoConfig.for_model(model_type, max_position_embeddings=32768, bos_token_id=tok.bos_token_id,
                               eos_token_id=tok.eos_token_id, torch_dtype="bfloat16", **values)
    cfg.architectures = [architecture]
    cfg.save_pretrained(path)
    return str(path), count_parameters(str(path))


def random_weights_folder(name: str, tokenizer_dir: str, root: Path) -> str:
    """``shape_folder`` with random bf16 weights saved in it (once: a folder that holds them is
    reused). Drawn in a child process, on the GPU when there is one, so the caller holds no CUDA
    context; 14B is 29.5 GB of safetensors."""
    import subprocess
    import sys

    path, _ = shape_folder(name, tokenizer_dir, root)
    if not any(Path(path).glob("*.safetensors")):
        subprocess.run([sys.executable, "-c", DRAW_WEIGHTS, path], check=True,
                       cwd=Path(__file__).resolve().parents[1])
    return path


DRAW_WEIGHTS = """
import sys, torch
from transformers import AutoConfig, AutoModelForCausalLM
torch.manual_seed(0)
with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(sys.argv[1]), dtype=torch.bfloat16)
model.save_pretrained(sys.argv[1], max_shard_size="5GB")
"""
