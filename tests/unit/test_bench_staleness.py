"""bench/staleness.py reads what a bench/learning_run.py run trained with, also from a run cut off in training."""

from __future__ import annotations

import json
import sys

import pytest

from bench import learning_run, staleness


class CutOff(Exception):
    pass


def test_a_run_cut_off_in_training_still_reports_its_flags_and_lags(tmp_path, monkeypatch):
    launched = []

    def cut_off(cfg, trainer_args):
        # the trainer logged two steps, then the run was killed (a batch's time limit)
        launched.append((cfg.env_args, trainer_args))
        (tmp_path / "run").mkdir(exist_ok=True)
        steps = [{"step": 1, "train/reward_mean": 0.1, "off_policy/tokens_by_lag": [30, 10]},
                 {"step": 2, "train/reward_mean": 0.2, "off_policy/tokens_by_lag": [20, 30, 10], "off_policy/dropped": 1}]
        (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
        raise CutOff

    monkeypatch.setattr(learning_run, "run_loop", cut_off)
    monkeypatch.setattr(sys, "argv", ["learning_run.py", "--out", str(tmp_path), "--model", str(tmp_path / "model"),
                                      "--eval-items", "0", "--trainer-args", "--max-off-policy-steps 2",
                                      "--env-args", "--env.max_batches_offpolicy 1"])
    with pytest.raises(CutOff):
        learning_run.main()

    assert "--env.max_batches_offpolicy 1" in launched[0][0] and "--max-off-policy-steps" in launched[0][1]
    histogram = staleness.lag_histogram(tmp_path)
    assert histogram["flags"] == "--max-off-policy-steps 2 --env.max_batches_offpolicy 1"
    assert histogram["tokens_by_lag"] == [50, 40, 10]
    assert histogram["groups_dropped"] == 1

    # nothing was kept, so the folder takes a rerun with other flags (a failed start does not lock it)
    monkeypatch.setattr(sys, "argv", ["learning_run.py", "--out", str(tmp_path), "--model", str(tmp_path / "model"),
                                      "--eval-items", "0", "--trainer-args", "--max-off-policy-steps 4"])
    with pytest.raises(CutOff):
        learning_run.main()
    assert staleness.lag_histogram(tmp_path)["flags"] == "--max-off-policy-steps 4"


def test_a_folder_with_a_kept_phase_refuses_other_settings(tmp_path, monkeypatch):
    (tmp_path / "learning.json").write_text(json.dumps(
        {"mode": "shared_vllm", "trainer_args": "", "steps": 120, "batch_size": 64, "group_size": 16, "lr": 5e-6,
         "model": str(tmp_path / "model"), "train_seconds": 10.0}))
    monkeypatch.setattr(sys, "argv", ["learning_run.py", "--out", str(tmp_path), "--model", str(tmp_path / "model"),
                                      "--eval-items", "0", "--env-args", "--env.max_batches_offpolicy 1"])
    with pytest.raises(SystemExit, match="other settings"):
        learning_run.main()
