"""bench/learning_run.py keeps each phase as it ends, so the same command run again does only what is missing."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import bench.learning_run as learning_run  # noqa: E402


def fake_phases(monkeypatch, calls: list, fail_after: str | None = None):
    def run_loop(cfg, args):
        calls.append("train")
        (Path(cfg.run_dir) / "run" / "checkpoints" / f"step_{cfg.trainer.max_steps}").mkdir(parents=True)
        return SimpleNamespace(returncode=0, metrics=[{"step": 1, "train/reward_mean": 0.5}])

    def evaluate(model, out, tag, eval_items, port, vllm_args):
        calls.append(tag)
        if tag == fail_after:
            raise KeyboardInterrupt  # what the time limit's SIGINT raises
        correct = 10 if tag == "before" else 90
        return {"accuracy": correct / 100, "correct": correct, "n": 100, "ci95_low": correct / 100 - 0.05,
                "ci95_high": correct / 100 + 0.05}

    monkeypatch.setattr(learning_run, "run_loop", run_loop)
    monkeypatch.setattr(learning_run, "evaluate", evaluate)
    monkeypatch.setattr(learning_run, "plot", lambda rows, path: None)


def run(monkeypatch, out: Path, *extra: str) -> None:
    monkeypatch.setattr(sys, "argv", ["learning_run.py", "--out", str(out), "--model", "/m", "--steps", "2", *extra])
    learning_run.main()


def test_a_run_cut_off_in_its_last_evaluation_goes_on_with_that_evaluation_only(monkeypatch, tmp_path):
    calls: list = []
    fake_phases(monkeypatch, calls, fail_after="after")
    with pytest.raises(KeyboardInterrupt):
        run(monkeypatch, tmp_path)
    assert calls == ["train", "before", "after"]
    fake_phases(monkeypatch, calls)
    run(monkeypatch, tmp_path)
    assert calls == ["train", "before", "after", "after"]
    results = json.loads((tmp_path / "learning.json").read_text())
    assert results["before"]["correct"] == 10 and results["after"]["correct"] == 90 and results["separated"]


def test_other_settings_in_the_same_folder_are_refused(monkeypatch, tmp_path):
    fake_phases(monkeypatch, [])
    run(monkeypatch, tmp_path)
    with pytest.raises(SystemExit, match="other settings"):
        run(monkeypatch, tmp_path, "--lr", "1e-4")
