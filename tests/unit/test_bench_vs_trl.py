"""bench/vs_trl.py's own logic: both systems get the same settings, TRL's chat completions are
scored as text, and the table compares against TRL colocate."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.vs_trl import Matched, chat_text, print_table, reward_after, trl_config_kwargs  # noqa: E402


def test_trl_gets_the_matched_settings_and_a_constant_learning_rate(tmp_path):
    m = Matched(steps=7, prompts_per_step=3, group_size=8, max_completion_tokens=64, lr=2e-6,
                gradient_checkpointing=True, vllm_gpu_memory_utilization=0.25)
    kw = trl_config_kwargs(m, sleep=True, out=tmp_path, cuda=True)
    assert kw["per_device_train_batch_size"] == 24 and kw["num_generations"] == 8 and kw["max_steps"] == 7
    assert kw["max_completion_length"] == 64 and kw["learning_rate"] == 2e-6 and kw["lr_scheduler_type"] == "constant"
    assert kw["gradient_checkpointing"] is True and kw["vllm_enable_sleep_mode"] is True
    assert kw["vllm_gpu_memory_utilization"] == 0.25 and kw["vllm_importance_sampling_correction"] is False
    assert kw["bf16"] is True and kw["use_cpu"] is False


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
    assert "onecopy-shared_vllm = 1.60x TRL colocate's samples/s at -2000 MiB peak" in out
    assert "| m | trl-colocate-sleep | exit 1, see log |" in out
    assert abs(reward_after(result["rows"][0]) - 0.3) < 1e-12  # the last 3 steps
