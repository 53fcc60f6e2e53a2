"""The memory plan printed at start, the gradient-checkpointing default, the KV-cache budget flag."""

import dataclasses
import logging
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from example_trainer import memory_plan
from example_trainer.config import TrainerConfig
from example_trainer.engine.vllm_process import vllm_server_args
from example_trainer.memory_plan import (GIB, check_fits, check_host_fits, count_parameters, log_memory_plan,
                                         plan_memory, use_expandable_segments, use_gradient_checkpointing)

H100 = 80 * 10**9
ROOT = Path(__file__).resolve().parents[2]


def test_an_8b_model_fits_an_h100_only_on_the_lean_path(caplog):
    lean = plan_memory(TrainerConfig(optimizer="adamw8bit", bf16_inplace=True), 8_000_000_000, H100)
    assert sum(lean.bytes_per_param.values()) == 6.0  # weights 2 (vLLM's), bf16 gradients 2, 8-bit moments 2
    default = plan_memory(TrainerConfig(), 8_000_000_000, H100)
    assert sum(default.bytes_per_param.values()) == 18.0  # 2 + fp32 masters 4 + fp32 gradients 4 + moments 8
    with caplog.at_level(logging.INFO, logger="onecopy.trainer.memory"):
        log_memory_plan(lean)
        assert "device has" not in caplog.text and "optimizer (adamw8bit)" in caplog.text
        log_memory_plan(default)
    assert "the plan needs 134.1 GiB before activations, the device has 74.5 GiB" in caplog.text


def test_mode_none_counts_the_trainers_own_copy_and_the_kv_budget_counts_once():
    plan = plan_memory(TrainerConfig(weight_bridge_mode="none", vllm_kv_cache_bytes=4 * GIB), 1_000_000_000)
    assert plan.bytes_per_param["weights, trainer"] == 2.0 and sum(plan.bytes_per_param.values()) == 20.0
    assert plan.total_bytes == 20 * 10**9 + 4 * GIB and "vLLM KV cache" in plan.table()


@pytest.mark.parametrize("mode, reference_bytes", [("shared_vllm", 2.0), ("colocate", 2.0), ("none", 2.0),
                                                    ("lora_only", 0.0), ("lora_restart", 0.0)])
def test_the_kl_reference_costs_a_frozen_bf16_copy_in_full_parameter_modes_and_nothing_with_lora(mode, reference_bytes):
    # --beta once deep-copied the model: in shared_vllm a whole second bf16 copy the plan never counted.
    with_kl = plan_memory(TrainerConfig(weight_bridge_mode=mode, beta=0.1), 10**9).bytes_per_param
    without = plan_memory(TrainerConfig(weight_bridge_mode=mode), 10**9).bytes_per_param
    assert sum(with_kl.values()) - sum(without.values()) == reference_bytes
    assert "2 bytes/param" in TrainerConfig.__dataclass_fields__["beta"].metadata["help"]


@pytest.mark.parametrize("flag, params, expected", [(None, 135_000_000, False), (None, 1_500_000_000, True),
                                                    (False, 8_000_000_000, False), (True, 1, True)])
def test_gradient_checkpointing_defaults_to_on_above_a_billion_parameters(flag, params, expected):
    assert use_gradient_checkpointing(TrainerConfig(gradient_checkpointing=flag), params) is expected


def test_kv_cache_budget_in_bytes_reaches_vllm(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = vllm_server_args(TrainerConfig(vllm_kv_cache_bytes=6 * GIB))
    assert args[args.index("--kv-cache-memory-bytes") + 1] == str(6 * GIB)
    # vLLM checks at start that this fraction of the GPU is free, byte budget or not: ours must stay.
    assert args[args.index("--gpu-memory-utilization") + 1] == "0.45"
    assert "--kv-cache-memory-bytes" not in vllm_server_args(TrainerConfig())
    with pytest.raises(ValueError, match="--vllm-kv-cache-bytes must be >= 0"):
        TrainerConfig(vllm_kv_cache_bytes=-1)


def test_expandable_segments_only_for_the_trainers_own_cuda_allocator(monkeypatch):
    calls = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert not use_expandable_segments(torch.device("cpu")) and calls == []
    assert use_expandable_segments(torch.device("cuda")) and calls == ["expandable_segments:True"]
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ  # the vLLM server the trainer starts inherits os.environ
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")  # the user's choice wins
    assert not use_expandable_segments(torch.device("cuda")) and calls == ["expandable_segments:True"]


def llama_shape(tmp_path, **shape) -> str:
    """A config-only folder of a Llama shape (no weights: the count runs on the meta device)."""
    from transformers import LlamaConfig

    LlamaConfig(architectures=["LlamaForCausalLM"], **shape).save_pretrained(tmp_path)
    return str(tmp_path)


def test_parameters_are_counted_from_the_config_without_loading_anything(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1000)
    real = LlamaForCausalLM(LlamaConfig(**shape))
    assert count_parameters(llama_shape(tmp_path, **shape)) == sum(p.numel() for p in real.parameters())


LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256)


def test_a_configuration_that_cannot_fit_is_refused_naming_the_flags_that_would(tmp_path):
    params = count_parameters(llama_shape(tmp_path, **LLAMA_8B))
    assert 8.0e9 < params < 8.1e9  # Llama-3.1-8B: 8.03B
    h100 = 80 * GIB
    # fp32 masters, gradients and moments: 16 bytes/param (119.7 GiB) of trainer state beside vLLM's 0.45 (36 GiB)
    with pytest.raises(ValueError, match=r"need 155\.7 GiB before activations .* the device has 80\.0 GiB: "
                                         r"try --profile lean \(--bf16-inplace --optimizer adamw8bit"):
        check_fits(TrainerConfig(), params, h100)
    check_fits(TrainerConfig(bf16_inplace=True, optimizer="adamw8bit"), params, h100)  # the advice fits
    # vLLM's KV budget in bytes counts as given: 66 GiB of cache beside its 15 GiB of weights leaves too
    # little even for the leanest (state and gradients in host memory)
    with pytest.raises(ValueError, match="no leaner optimizer setting of this mode fits either"):
        check_fits(TrainerConfig(bf16_inplace=True, optimizer="adamw4bit", vllm_kv_cache_bytes=66 * GIB), params, h100)


def test_the_check_counts_the_trainers_own_copy_in_mode_none_and_the_frozen_base_in_lora(tmp_path):
    params = 8_000_000_000
    # mode none: vLLM 0.45 of the device + the trainer's bf16 copy 2, fp32 masters 4, gradients 4, moments 1 bytes/param
    check_fits(TrainerConfig(weight_bridge_mode="none", optimizer="adamw4bit"), params, 200 * GIB)  # 90 + 88 GB
    with pytest.raises(ValueError, match="weight-bridge-mode none --optimizer adamw .*no leaner optimizer setting"):
        check_fits(TrainerConfig(weight_bridge_mode="none"), params, 80 * GIB)  # not even adamw4bit: --bf16-inplace n/a
    check_fits(TrainerConfig(weight_bridge_mode="lora_only"), params, 60 * GIB)  # the base once in each: 16 + 27 GB


def test_an_offloaded_optimizer_state_is_listed_in_host_memory_and_leaves_the_device_total(tmp_path):
    params = 14_770_000_000  # Qwen2.5-14B
    on_device = plan_memory(TrainerConfig(bf16_inplace=True, optimizer="adamw8bit"), params, H100)
    offloaded = plan_memory(TrainerConfig(bf16_inplace=True, optimizer="adamw8bit", offload_optimizer=True), params, H100)
    assert on_device.total_bytes - offloaded.total_bytes == pytest.approx(2.0 * params)
    assert offloaded.host_bytes == pytest.approx(2.0 * params) and on_device.host_bytes == 0
    assert "optimizer (adamw8bit), host memory" in offloaded.table() and "of which in host memory" in offloaded.table()
    # it is pinned: more than 80% of the machine's memory is refused, naming the leaner state
    lean = TrainerConfig(bf16_inplace=True, optimizer="adamw8bit", offload_optimizer=True)
    # 27.5 GiB of 8-bit moments, with the pinned allocator's rounding allowed for: 31.6 GiB
    with pytest.raises(ValueError, match=r"pin 31\.6 GiB .* more than 80% of this machine's 32\.0 GiB: use --optimizer adamw4bit"):
        check_host_fits(lean, params, H100, host_bytes=32 * GIB)
    check_host_fits(lean, params, H100, host_bytes=125 * GIB)  # the H100 machine's
    with pytest.raises(ValueError, match=r"pin 126\.6 GiB .*for 4 trainer processes"):  # data parallel: one each
        check_host_fits(lean, params, H100, host_bytes=125 * GIB, processes=4)


def test_the_leanest_advice_is_the_offloaded_state(tmp_path):
    # 48 GiB of KV cache beside the 8B: its 4-bit moments on the device (37 + 48 GiB) do not fit, offloaded they do
    params = count_parameters(llama_shape(tmp_path, **LLAMA_8B))
    with pytest.raises(ValueError, match="try --profile offload \(--bf16-inplace --optimizer adamw8bit --offload-optimizer"):
        check_fits(TrainerConfig(bf16_inplace=True, optimizer="adamw4bit", vllm_kv_cache_bytes=48 * GIB), params,
                   80 * GIB)


MEASURED = sorted((ROOT / "docs" / "results").glob("memory_h*_expandable/*.json")) + \
    sorted((ROOT / "docs" / "results" / "families_h100").glob("memory_*.json")) + \
    sorted((ROOT / "docs" / "results").glob("offload_h*/memory_*.json")) + \
    sorted((ROOT / "docs" / "results").glob("offload_grads_h*/memory_*.json"))


@pytest.mark.parametrize("measured", MEASURED, ids=lambda p: p.stem)
def test_the_plan_predicts_the_measured_trainer_peak_within_ten_percent(measured):
    """Against bench/memory.py's driver-measured trainer peaks with today's allocator (expandable
    segments): 8B shapes on an H100, 14B on an H200, the offloaded state at 8B and 14B (H100) and
    30B-A3B (H200), and the offloaded gradients at 8B and 14B (H100). The estimate's constants were
    set on the first rows, before the offload rows were measured; the gradients in flight to host
    memory were added after the offloaded-gradients rows (Qwen3-14B's was 10.2% under without them).
    A new shape or setting measured on a GPU belongs here too."""
    import json

    from transformers import PretrainedConfig

    from bench.memory import config_settings
    from bench.shapes import SHAPES
    from example_trainer.memory_plan import ModelShape

    row = json.loads(measured.read_text())
    cfg = TrainerConfig(seq_len=row["seq_len"], batch_size=row["batch_size"],
                        gradient_accumulation_steps=row.get("micro_batches", row["batch_size"]),
                        vllm_kv_cache_bytes=row["kv_cache_gib"] * GIB, **config_settings(row["config"]))
    shape = ModelShape.from_config(PretrainedConfig(**SHAPES[row["shape"]][2]))
    estimate = plan_memory(cfg, row["params"], None, shape).trainer_peak_bytes / 2**20
    assert abs(estimate - row["trainer_peak_mib"]) <= 0.10 * row["trainer_peak_mib"], (estimate, row["trainer_peak_mib"])


def qwen25_14b(tmp_path) -> tuple[int, "ModelShape"]:
    """Qwen2.5-14B's shape (bench/shapes.py) from a config-only folder: its parameter count and ModelShape."""
    from transformers import AutoConfig, Qwen2Config

    from bench.shapes import SHAPES
    from example_trainer.memory_plan import ModelShape

    Qwen2Config(architectures=["Qwen2ForCausalLM"], **SHAPES["qwen2.5-14b"][2]).save_pretrained(tmp_path)
    return count_parameters(str(tmp_path)), ModelShape.from_config(AutoConfig.from_pretrained(tmp_path))


def test_the_shape_is_read_from_the_config_and_a_config_without_its_fields_gives_none(tmp_path):
    from transformers import GPT2Config

    from example_trainer.memory_plan import read_shape, shape_or_none

    _, shape = qwen25_14b(tmp_path / "qwen")
    assert (shape.layers, shape.hidden, shape.intermediate, shape.vocab) == (48, 5120, 13824, 152064)
    # read from config.json: the check runs before vLLM starts, without importing transformers
    probe = ("import sys; from example_trainer.memory_plan import read_shape; "
             f"print(read_shape({str(tmp_path / 'qwen')!r}), 'transformers' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == f"{shape} False", done.stderr[-2000:]
    GPT2Config(n_layer=2, n_embd=64).save_pretrained(tmp_path / "other")  # GPT-2 names no intermediate_size
    assert read_shape(str(tmp_path / "other")) is None
    assert shape_or_none(GPT2Config()) is None  # the plan at attach: activations left out, no crash


@pytest.mark.parametrize("dropped", ["moe_intermediate_size", "num_experts_per_tok", None])
def test_an_moe_config_that_leaves_an_expert_field_to_its_default_is_read_as_transformers_reads_it(tmp_path, dropped):
    import json

    from transformers import AutoConfig

    from example_trainer.memory_plan import read_shape, shape_or_none
    from tests.tiny_models import tiny_config

    tiny_config("Qwen3MoeForCausalLM").save_pretrained(tmp_path)
    fields = json.loads((tmp_path / "config.json").read_text())
    fields.pop(dropped, None)
    (tmp_path / "config.json").write_text(json.dumps(fields))
    assert read_shape(str(tmp_path)) == shape_or_none(AutoConfig.from_pretrained(tmp_path))


def test_a_14b_model_on_an_h100_is_refused_on_the_gpu_state_and_sent_to_the_offloaded_one(tmp_path, monkeypatch):
    # Measured (docs/results.md): 4-bit moments on the GPU peaked at 49.4 GiB of trainer beside vLLM's
    # 39.3 (88.7 GiB, H200); offloaded, 34.9 + 39.3 GiB on an H100. The state alone (77 GiB) looked as if it fit.
    params, shape = qwen25_14b(tmp_path)
    h100 = 81559 * 2**20  # torch's total_memory of an H100 80GB HBM3
    lean4 = TrainerConfig(bf16_inplace=True, optimizer="adamw4bit", vllm_kv_cache_bytes=8 * GIB, seq_len=2048,
                          batch_size=8, gradient_accumulation_steps=8)
    with pytest.raises(ValueError, match=r"activations included\), the device has 79\.6 GiB: "
                                         r"try --profile offload \(--bf16-inplace --optimizer adamw8bit --offload-optimizer"):
        check_fits(lean4, params, h100, shape=shape)
    monkeypatch.setattr(memory_plan, "machine_memory_bytes", lambda: 125 * GIB)  # the H100 machine's host memory
    check_fits(dataclasses.replace(lean4, optimizer="adamw8bit", offload_optimizer=True), params, h100, shape=shape)


def test_offloaded_gradients_leave_the_trainer_only_activations_and_fit_14b_in_one_micro_batch(tmp_path, monkeypatch):
    # bench/vs_trl.py's 14B run on an H100 (docs/trl_head_to_head.md): with the state offloaded, the
    # batch of 64 in one micro-batch was refused at 88.6 GiB; the bf16 gradients (27.5 GiB) are what
    # --offload-gradients moves out.
    params, shape = qwen25_14b(tmp_path)
    h100 = 81559 * 2**20
    monkeypatch.setattr(memory_plan, "machine_memory_bytes", lambda: 125 * GIB)
    state_out = TrainerConfig(bf16_inplace=True, optimizer="adamw8bit", offload_optimizer=True, seq_len=384,
                              batch_size=64, vllm_gpu_memory_utilization=0.5, gradient_checkpointing=True)
    with pytest.raises(ValueError, match=r"the device has 79\.6 GiB: try --profile offload-grads \(--bf16-inplace "
                                         r"--optimizer adamw8bit --offload-optimizer --offload-gradients"):
        check_fits(state_out, params, h100, shape=shape)
    all_out = dataclasses.replace(state_out, offload_gradients=True)
    check_fits(all_out, params, h100, shape=shape)
    plan = plan_memory(all_out, params, h100, shape)
    assert plan.trainer_state_bytes == 0 and plan.host_bytes == pytest.approx(4.0 * params)
    # out go the gradients; in comes the largest one while its copy out runs (the embedding's)
    assert plan_memory(state_out, params, h100, shape).trainer_peak_bytes - plan.trainer_peak_bytes == \
        pytest.approx(2.0 * params - 2.0 * shape.vocab * shape.hidden)
    assert "gradients in flight to host" in plan.table()
    assert "gradients (bf16), host memory" in plan.table()
    # the 8-bit moments with the pinned allocator's rounding (31.6 GiB), the gradients registered as they are (27.5)
    with pytest.raises(ValueError, match=r"pin 59\.1 GiB of optimizer state and gradients .*: drop --offload-gradients"):
        check_host_fits(all_out, params, h100, host_bytes=64 * GIB)
    # with --parallel the gradients stay on the GPU: the leanest setting named is one that run takes
    with pytest.raises(ValueError, match=r"the leanest: --weight-bridge-mode shared_vllm --profile offload \(--bf16-inplace "
                                         r"--optimizer adamw8bit --offload-optimizer\)\)"):
        check_fits(dataclasses.replace(state_out, parallel="data", vllm_gpu_memory_utilization=0.95), params, h100,
                   shape=shape)


def test_without_gradient_checkpointing_activations_that_may_not_fit_warn_and_the_state_alone_refuses(tmp_path,
                                                                                                       caplog):
    # Before: without checkpointing the check counted the state alone (77 GiB with vLLM's) and said
    # nothing of the 27 GiB of activations a 2048-token sequence would add.
    params, shape = qwen25_14b(tmp_path)
    h100 = 81559 * 2**20
    lean4 = TrainerConfig(bf16_inplace=True, optimizer="adamw4bit", vllm_kv_cache_bytes=8 * GIB, seq_len=2048,
                          batch_size=8, gradient_accumulation_steps=8, gradient_checkpointing=False)
    caplog.set_level(logging.WARNING, logger="onecopy.trainer.memory")
    check_fits(lean4, params, h100, shape=shape)
    assert "a micro-batch of 1 sequences of --seq-len 2048 tokens would need 106.4 GiB" in caplog.text
    assert "--gradient-checkpointing, more --gradient-accumulation-steps" in caplog.text
    with pytest.raises(ValueError, match=r"before activations"):  # the state alone still refuses
        check_fits(dataclasses.replace(lean4, optimizer="adamw"), params, h100, shape=shape)


def test_without_checkpointing_a_worst_case_that_may_not_fit_starts_with_a_warning(caplog):
    from example_trainer.memory_plan import ModelShape

    caplog.set_level(logging.WARNING, logger="onecopy.trainer.memory")
    llama8b = ModelShape(layers=32, hidden=4096, intermediate=14336, vocab=128256)
    h100 = 81559 * 2**20
    # bench/vs_trl.py's 8B settings, 8 micro-batches: at --seq-len 384 the activations may not fit
    cfg = TrainerConfig(seq_len=384, batch_size=64, gradient_accumulation_steps=8, optimizer="adamw8bit",
                        bf16_inplace=True, gradient_checkpointing=False, vllm_gpu_memory_utilization=0.35)
    check_fits(cfg, 8_030_261_248, h100, shape=llama8b)
    assert "would need 86.8 GiB" in caplog.text
    caplog.clear()
    check_fits(dataclasses.replace(cfg, gradient_checkpointing=True), 8_030_261_248, h100, shape=llama8b)
    check_fits(dataclasses.replace(cfg, seq_len=187), 8_030_261_248, h100, shape=llama8b)  # as they were: ran at 74 GiB
    assert caplog.text == ""
    # the default run (SmolLM2-135M, batch 8, seq len 512, vLLM's 0.45) on a 16 GB T4 starts, with the warning
    smollm2 = ModelShape(layers=30, hidden=576, intermediate=1536, vocab=49152)
    check_fits(TrainerConfig(), 134_515_008, 15_095 * 2**20, shape=smollm2)
    assert "would need 14.8 GiB with its activations, the device has 14.7 GiB" in caplog.text


# Llama-3.1-8B shape on an H100 without checkpointing (bench/vs_trl.py, onecopy shared_vllm,
# adamw8bit, --bf16-inplace; docs/results/vs_trl_h100_steady): 64 sequences of 187 tokens (59 of
# prompt, 128 of completion) a step, in 16 or 8 micro-batches (the second with --torch-compile).
# The trainer's allocator peak over forward and backward (memory/forward_backward_peak_reserved_gib).
NO_CHECKPOINTING_8B = [(16, 36.41), (8, 42.14)]


@pytest.mark.parametrize("micro_batches, reserved_gib", NO_CHECKPOINTING_8B)
def test_the_plan_without_checkpointing_covers_the_measured_8b_peak_within_ten_percent(micro_batches, reserved_gib):
    from example_trainer.memory_plan import ModelShape

    shape = ModelShape(layers=32, hidden=4096, intermediate=14336, vocab=128256)
    cfg = TrainerConfig(seq_len=187, batch_size=64, gradient_accumulation_steps=micro_batches, optimizer="adamw8bit",
                        bf16_inplace=True, gradient_checkpointing=False)
    estimate = plan_memory(cfg, 8_030_261_248, None, shape).trainer_peak_bytes / GIB
    assert reserved_gib <= estimate <= 1.10 * reserved_gib, (estimate, reserved_gib)


def test_data_parallel_ranks_each_count_the_activations_of_their_share_of_the_batch(tmp_path):
    from example_trainer.memory_plan import ModelShape

    shape = ModelShape(layers=32, hidden=4096, intermediate=14336, vocab=128256)
    cfg = TrainerConfig(batch_size=32, gradient_accumulation_steps=1, seq_len=2048, gradient_checkpointing=True)
    one = plan_memory(cfg, 8_000_000_000, None, shape).activation_bytes
    two = plan_memory(cfg, 8_000_000_000, None, shape, data_ranks=2).activation_bytes
    half = plan_memory(dataclasses.replace(cfg, batch_size=16), 8_000_000_000, None, shape).activation_bytes
    assert two == half < one


def test_a_lora_checkpoint_is_described_by_the_base_model_its_adapter_names(tmp_path):
    import json

    from example_trainer.model.checkpoint import base_model_folder

    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/models/base"}))
    assert base_model_folder(str(tmp_path)) == "/models/base"  # the adapter folder has no config.json
    assert base_model_folder("/models/base") == "/models/base"


@pytest.mark.parametrize("compile_on,mode,graphs", [(True, None, None), (False, "NONE", "FULL_DECODE_ONLY")])
def test_vllm_compile_reaches_vllms_compilation_config(monkeypatch, compile_on, mode, graphs):
    """--vllm-compile false: vLLM's own parser turns the flags into no torch.compile and decode-only
    whole-model CUDA graphs; the default leaves vLLM's choice (None: decided at engine start)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    argv = ["--model", "m", *vllm_server_args(TrainerConfig(vllm_compile=compile_on))]
    compilation = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(argv).compilation_config
    assert (getattr(compilation.mode, "name", None), getattr(compilation.cudagraph_mode, "name", None)) == (mode, graphs)


@pytest.mark.parametrize("extra", ["--enforce-eager", "-O3", "-cc.cudagraph_mode=PIECEWISE",
                                   "--compilation-config '{\"mode\": 3}'"])
def test_vllm_compile_leaves_a_compilation_choice_in_the_extra_args_alone(monkeypatch, caplog, extra):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = vllm_server_args(TrainerConfig(vllm_compile=False, vllm_extra_args=extra))
    assert "-cc.mode=none" not in args and args[-len(shlex.split(extra)):] == shlex.split(extra)
    assert "--vllm-compile false left out" in caplog.text


def test_a_tensor_parallel_plan_counts_one_gpus_share_and_70b_fits_four_h200s_only_lean(monkeypatch, caplog):
    """--parallel tensor: vLLM's weights and the trainer's state are split alike, so each GPU holds
    1/N of every kind per parameter; the activations stay whole (each rank trains the whole batch)."""
    from bench.shapes import SHAPES
    from example_trainer.memory_plan import ModelShape
    from transformers import PretrainedConfig

    params = 70_553_706_496  # bench/shapes.py's llama3.1-70b, counted on the meta device
    shape = ModelShape.from_config(PretrainedConfig(**SHAPES["llama3.1-70b"][2]))
    h200 = 143_771 * 2**20  # torch's total_memory of an H200
    monkeypatch.setattr(memory_plan, "machine_memory_bytes", lambda: 2000 * GIB)  # a 4x H200 machine's host memory
    lean8 = TrainerConfig(parallel="tensor", bf16_inplace=True, optimizer="adamw8bit", vllm_kv_cache_bytes=16 * GIB)
    one_gpu, four = plan_memory(lean8, params, h200, shape), plan_memory(lean8, params, h200, shape, tensor_ranks=4)
    assert four.params == params // 4 and four.bytes_per_param == one_gpu.bytes_per_param  # 2 vLLM + 2 gradients + 2 moments
    assert four.trainer_state_bytes == pytest.approx(one_gpu.trainer_state_bytes / 4)
    assert four.activation_bytes == one_gpu.activation_bytes
    assert four.vllm_weight_bytes / GIB == pytest.approx(32.9, abs=0.05)
    check_fits(lean8, params, h200, shape=shape, tensor_ranks=4)  # 32.9 + 16 + 65.7 GiB of state + activations
    with pytest.raises(ValueError, match=r"70\.55 B parameters over 4 tensor-parallel GPUs .* try --profile lean "
                                         r"\(--bf16-inplace --optimizer adamw8bit\)"):
        check_fits(dataclasses.replace(lean8, bf16_inplace=False, optimizer="adamw"), params, h200, shape=shape,
                   tensor_ranks=4)  # fp32 masters: 16 bytes/param of trainer state, 263 GiB per GPU
    offloaded = dataclasses.replace(lean8, offload_optimizer=True, offload_gradients=True)
    plan = plan_memory(offloaded, params, h200, shape, tensor_ranks=4)
    assert plan.trainer_state_bytes == 0 and plan.host_bytes / GIB == pytest.approx(65.7, abs=0.05)  # per rank
    with caplog.at_level(logging.INFO, logger="onecopy.trainer.memory"):
        log_memory_plan(plan)
    assert "plan for 17.64 B parameters (one GPU's 1/4 of a tensor-parallel model)" in caplog.text
