"""bench/learning_run.py keeps each phase as it ends, so the same command run again does only what is missing."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import bench.learning_run as learning_run  # noqa: E402


GAME = {"before": {"env/eval_accuracy": 0.25, "env/eval_turns_mean": 5.5, "env/eval_turns_std": 1.0, "env/eval_items": 64.0},
        "after": {"env/eval_accuracy": 0.75, "env/eval_turns_mean": 4.0, "env/eval_turns_std": 2.0, "env/eval_items": 64.0}}


def fake_phases(monkeypatch, calls: list, fail_after: str | None = None, metrics: dict | None = None):
    """The training and the two evaluations without processes; `calls` records what ran: "train",
    then (tag, environment module's name) per evaluation. The evaluations give `metrics[tag]`, by
    default 10 and 90 of 100 held-out items solved."""
    def run_loop(cfg, args):
        calls.append("train")
        calls.append(("env", cfg.environment, cfg.env_args))
        (Path(cfg.run_dir) / "run" / "checkpoints" / f"step_{cfg.trainer.max_steps}").mkdir(parents=True)
        return SimpleNamespace(returncode=0, metrics=[{"step": 1, "train/reward_mean": 0.5}])

    def evaluate(model, out, tag, environment, eval_items, port, vllm_args):
        calls.append((tag, environment))
        if tag == fail_after:
            raise KeyboardInterrupt  # what the time limit's SIGINT raises
        if metrics is not None:
            return metrics[tag]
        return {"env/eval_accuracy": 0.1 if tag == "before" else 0.9, "env/eval_items": 100.0}

    monkeypatch.setattr(learning_run, "run_loop", run_loop)
    monkeypatch.setattr(learning_run, "evaluate", evaluate)
    monkeypatch.setattr(learning_run, "plot", lambda rows, path, environment, model: None)


def run(monkeypatch, out: Path, *extra: str) -> None:
    monkeypatch.setattr(sys, "argv", ["learning_run.py", "--out", str(out), "--model", "/m", "--steps", "2", *extra])
    learning_run.main()


def test_a_run_cut_off_in_its_last_evaluation_goes_on_with_that_evaluation_only(monkeypatch, tmp_path):
    calls: list = []
    fake_phases(monkeypatch, calls, fail_after="after")
    with pytest.raises(KeyboardInterrupt):
        run(monkeypatch, tmp_path)
    assert [c[0] for c in calls[2:]] == ["before", "after"]
    fake_phases(monkeypatch, calls)
    run(monkeypatch, tmp_path)
    assert [c[0] for c in calls[2:]] == ["before", "after", "after"]
    results = json.loads((tmp_path / "learning.json").read_text())
    assert results["before"]["correct"] == 10 and results["after"]["correct"] == 90 and results["separated"]
    assert results["after"]["accuracy"] == 0.9 and results["after"]["n"] == 100
    assert results["after"]["ci95_low"] == pytest.approx(learning_run.wilson(90, 100)[0])


def test_arithmetic_stays_the_default_with_its_flags_and_its_settings_record(monkeypatch, tmp_path):
    calls: list = []
    fake_phases(monkeypatch, calls)
    run(monkeypatch, tmp_path)
    assert calls[1][1] == "arithmetic" and "--env.difficulty 2 --env.operations +" in calls[1][2]
    # the training stream leaves out all 400 held-out problems (its default kept out only the first 64)
    assert "--env.num_eval_items 400" in calls[1][2]
    assert {c[1] for c in calls[2:]} == {"arithmetic"}
    assert "environment" not in json.loads((tmp_path / "learning.json").read_text())  # as earlier runs' files


def test_the_guessing_game_reports_win_rate_and_turns_each_with_an_interval(monkeypatch, tmp_path):
    calls: list = []
    fake_phases(monkeypatch, calls, metrics=GAME)
    run(monkeypatch, tmp_path, "--environment", "guessing_game")
    assert calls[1][1] == "guessing_game" and "--env.high 16 --env.max_turns 6" in calls[1][2]
    assert {c[1] for c in calls[2:]} == {"guessing_game"}
    results = json.loads((tmp_path / "learning.json").read_text())
    before, after = results["before"], results["after"]
    assert (before["win_rate"], before["correct"], before["n"]) == (0.25, 16, 64)
    assert (before["ci95_low"], before["ci95_high"]) == pytest.approx(learning_run.wilson(16, 64))
    # turns: mean +- t(63) * std / sqrt(64), t(63) = 1.998
    assert after["turns"]["turns"] == 4.0 and after["turns"]["std"] == 2.0
    assert (after["turns"]["ci95_low"], after["turns"]["ci95_high"]) == pytest.approx((4.0 - 0.4995, 4.0 + 0.4995), abs=1e-3)
    assert results["separated"] and results["environment"] == "guessing_game"
    turns = learning_run.ENVIRONMENTS["guessing_game"].numbers[1]
    assert learning_run.separated(turns, before["turns"], after["turns"])  # fewer turns is better


@pytest.mark.parametrize("df, t", [(4, 2.776), (9, 2.262), (31, 2.040), (63, 1.998), (399, 1.966)])
def test_t95_matches_the_table_of_students_t(df, t):
    assert learning_run.t95(df) == pytest.approx(t, abs=1e-3)


def test_a_mean_is_better_lower_when_its_number_says_so():
    lower = learning_run.Mean("turns", "m", "s", higher_is_better=False)
    high, low = {"ci95_low": 5.0, "ci95_high": 6.0}, {"ci95_low": 3.0, "ci95_high": 4.0}
    assert learning_run.separated(lower, high, low) and not learning_run.separated(lower, low, high)
    assert not learning_run.separated(lower, high, {"ci95_low": 4.5, "ci95_high": 5.5})  # overlapping


def test_other_settings_in_the_same_folder_are_refused(monkeypatch, tmp_path):
    fake_phases(monkeypatch, [])
    run(monkeypatch, tmp_path)
    for other in (["--lr", "1e-4"], ["--environment", "guessing_game"]):
        with pytest.raises(SystemExit, match="other settings"):
            run(monkeypatch, tmp_path, *other)
