"""bench/vs_trl.py's own logic: both systems get the same settings, TRL's chat completions are
scored as text, and the table compares against each TRL system."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.vs_trl import (Matched, chat_text, failed_row, print_table, reward_after, run_folders,  # noqa: E402
                          samples_per_s, trl_config_kwargs)


def test_trl_gets_the_matched_settings_and_a_constant_learning_rate(tmp_path):
    m = Matched(steps=7, prompts_per_step=3, group_size=8, max_completion_tokens=64, lr=2e-6,
                gradient_checkpointing=True, vllm_gpu_memory_utilization=0.25)
    kw = trl_config_kwargs(m, sleep=True, out=tmp_path, cuda=True)
    assert kw["per_device_train_batch_size"] == 24 and kw["num_generations"] == 8 and kw["max_steps"] == 7
    assert kw["max_completion_length"] == 64 and kw["learning_rate"] == 2e-6 and kw["lr_scheduler_type"] == "constant"
    assert kw["gradient_checkpointing"] is True and kw["vllm_enable_sleep_mode"] is True
    assert kw["vllm_gpu_memory_utilization"] == 0.25 and kw["vllm_importance_sampling_correction"] is False
    assert kw["bf16"] is True and kw["use_cpu"] is False


def test_the_lean_settings_reach_both_sides_as_the_same_torchao_optimizer_on_bf16_weights(tmp_path):
    """TRL at its leanest (bf16 weights, torchao's 8-bit AdamW by HF's name) against onecopy's
    --bf16-inplace --optimizer adamw8bit; the default stays fp32 masters on both sides."""
    lean = Matched(optimizer="adamw8bit", bf16_weights=True, gradient_checkpointing=True)
    kw = trl_config_kwargs(lean, sleep=True, out=tmp_path, cuda=True)
    assert kw["optim"] == "adamw_torch_8bit" and kw["model_init_kwargs"] == {"dtype": "bfloat16"}
    flags = lean.onecopy_flags()
    assert flags[flags.index("--optimizer") + 1] == "adamw8bit" and "--bf16-inplace" in flags
    assert flags[flags.index("--gradient-checkpointing") + 1] == "true"
    default = trl_config_kwargs(Matched(), sleep=False, out=tmp_path, cuda=True)
    assert default["optim"] == "adamw_torch" and "model_init_kwargs" not in default
    assert "--bf16-inplace" not in Matched().onecopy_flags()
    from transformers.training_args import OptimizerNames

    assert {name.value for name in OptimizerNames} >= {"adamw_torch", "adamw_torch_8bit", "adamw_torch_4bit"}


def test_a_random_shape_gets_weights_on_disk_that_load_with_its_shape_and_vocabulary(tmp_path):
    """What TRL loads (it cannot draw weights itself): the smallest shape, on this CPU."""
    import torch
    from transformers import AutoModelForCausalLM

    from bench.shapes import SHAPES, random_weights_folder
    from example_trainer.model.default_model import default_model_path

    path = random_weights_folder("smollm2-135m", default_model_path(), tmp_path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    assert model.config.vocab_size == SHAPES["smollm2-135m"][2]["vocab_size"] == model.lm_head.weight.shape[0]
    assert model.model.embed_tokens.weight.std().item() > 0.01  # drawn, not zeros
    stamp = {f.name: f.stat().st_mtime for f in Path(path).glob("*.safetensors")}
    assert random_weights_folder("smollm2-135m", default_model_path(), tmp_path) == path  # reused, not redrawn
    assert {f.name: f.stat().st_mtime for f in Path(path).glob("*.safetensors")} == stamp


def test_a_trl_run_that_fails_reports_its_error_line_peak_and_the_config_that_produced_it(tmp_path):
    """At 14B TRL is expected to run out of memory: the row must say so, with what it ran."""
    import json

    log = tmp_path / "trl.log"
    log.write_text("INFO loading\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.32 GiB.\nexiting\n")
    (tmp_path / "trl_config.json").write_text(json.dumps({"optim": "adamw_torch_8bit", "vllm_enable_sleep_mode": True}))
    row = failed_row("trl-colocate-sleep", 1, log, tmp_path / "trl_config.json", 80_100)
    assert row["error"].startswith("exit 1: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.32 GiB.")
    assert row["gpu_peak_mib"] == 80_100 and row["trl_config"]["optim"] == "adamw_torch_8bit"
    assert failed_row("x", 2, log, tmp_path / "missing.json", None)["trl_config"] is None  # failed before its config


def test_chat_completions_are_scored_as_their_text():
    assert chat_text([[{"role": "assistant", "content": "\\boxed{4}"}], "plain"]) == ["\\boxed{4}", "plain"]


def test_the_table_states_each_onecopy_row_against_trl_colocate(capsys):
    result = {"name": "m", "rows": [
        {"system": "trl-colocate", "samples_per_s": 10.0, "gpu_peak_mib": 30000, "rewards": [0.1, 0.2, 0.3, 0.4]},
        {"system": "onecopy-shared_vllm", "samples_per_s": 16.0, "gpu_peak_mib": 28000, "rewards": [0.5]},
        {"system": "trl-colocate-sleep", "error": "exit 1, see log"},
    ]}
    print_table([result])
    out = capsys.readouterr().out
    assert "onecopy-shared_vllm = 1.60x trl-colocate's samples/s at -2000 MiB peak" in out
    assert "| m | trl-colocate-sleep | exit 1, see log |" in out
    assert abs(reward_after(result["rows"][0]) - 0.3) < 1e-12  # the last 3 steps


def test_a_system_run_twice_gets_a_second_folder_so_its_steps_are_not_counted_with_the_first():
    # Before: ABBA reused one folder per system, and the second onecopy run's metrics file held both runs' steps.
    assert run_folders(["trl-colocate-sleep", "onecopy-shared_vllm", "onecopy-shared_vllm", "trl-colocate-sleep"]) == [
        "trl-colocate-sleep", "onecopy-shared_vllm", "onecopy-shared_vllm-2", "trl-colocate-sleep-2"]


def test_the_speed_up_of_an_abba_order_is_over_the_mean_of_each_systems_runs(capsys):
    result = {"name": "m", "rows": [
        {"system": "trl-colocate-sleep", "samples_per_s": 20.0, "gpu_peak_mib": 30000},
        {"system": "onecopy-shared_vllm", "samples_per_s": 30.0, "gpu_peak_mib": 25000},
        {"system": "onecopy-shared_vllm", "samples_per_s": 34.0, "gpu_peak_mib": 26000},
        {"system": "trl-colocate-sleep", "samples_per_s": 12.0, "gpu_peak_mib": 31000},
    ]}
    print_table([result])
    out = capsys.readouterr().out
    assert "onecopy-shared_vllm = 2.00x trl-colocate-sleep's samples/s at -5000 MiB peak (mean of 2 and 2 runs)" in out


def test_trl_samples_per_s_start_after_the_warm_up_steps():
    ends = [100.0, 160.0, 162.0, 164.0, 167.0, 170.0]  # step 1 ends at 100 s; step 2 took 60 s
    assert samples_per_s(ends, 64, 1) == 64 * 5 / 70.0
    assert samples_per_s(ends, 64, 2) == 64 * 4 / 10.0  # from the end of step 2 to the end of step 6
    assert samples_per_s(ends[:2], 64, 2) is None  # no step after the warm-up
    with pytest.raises(ValueError, match="at least 1"):
        samples_per_s(ends, 64, 0)
