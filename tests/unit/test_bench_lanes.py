"""bench/lanes.py: a lane runs its commands in order on its GPU, stops at the deadline, and the
archive keeps results and log tails but no caches or model files."""

from __future__ import annotations

import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.lanes import MAX_FILE_BYTES, archive, assign, plan, run_lane  # noqa: E402


def test_lane_runs_in_order_on_its_gpu_and_stops_at_the_deadline(tmp_path):
    report: dict = {}
    commands = [["-c", "import os; print('gpu', os.environ['CUDA_VISIBLE_DEVICES'])"],
                ["-c", "import time; time.sleep(60)"],
                ["-c", "print('never runs')"]]
    t0 = time.monotonic()
    run_lane(3, commands, tmp_path, deadline=t0 + 5, report=report)
    assert time.monotonic() - t0 < 20  # the sleeper was stopped, not waited for
    assert [r["exit"] for r in report["gpu3"]] == [0, "deadline"]
    assert (tmp_path / "lane3" / "command0.log").read_text().strip() == "gpu 3"


def test_archive_keeps_results_and_log_tails_only(tmp_path):
    (tmp_path / "modes" / "m" / "run" / "step_2").mkdir(parents=True)
    (tmp_path / "modes" / "modes_x_a.json").write_text("{}")
    (tmp_path / "modes" / "m" / "run" / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "modes" / "m" / "run" / "step_2" / "config.json").write_text("{}")  # a checkpoint's
    (tmp_path / "modes" / "m" / "run" / "step_2" / "model.safetensors").write_bytes(b"0" * 10)
    (tmp_path / "modes" / "m" / "run" / "vllm.log").write_bytes(b"a" * MAX_FILE_BYTES + b"END")
    (tmp_path / "cache0" / "vllm").mkdir(parents=True)
    (tmp_path / "cache0" / "vllm" / "x.log").write_text("cache")
    archive(tmp_path, tmp_path / "a.tar.gz")
    with tarfile.open(tmp_path / "a.tar.gz") as tar:
        names = sorted(tar.getnames())
        tail = tar.extractfile("modes/m/run/vllm.log").read()
    assert names == ["modes/m/run/metrics.jsonl", "modes/m/run/vllm.log", "modes/modes_x_a.json"]
    assert len(tail) == MAX_FILE_BYTES and tail.endswith(b"END")


def test_plans_name_every_mode_once_per_model(tmp_path, monkeypatch):
    monkeypatch.setenv("SMOLLM2_DIR", "/models/smollm2")
    monkeypatch.setenv("SMOLLM2_CONFIG_DIR", "/models/tok")
    for which in ("smollm2", "qwen2"):
        commands = [" ".join(args) for lane in assign(plan(which, tmp_path), 4, None) for args in lane]
        for mode in ("none", "lora_only", "lora_restart", "shared_vllm"):
            assert sum(f"--modes {mode} " in c for c in commands) == 1, (which, mode)
        assert sum(c.endswith("--modes") for c in commands) == 1  # the patch overhead


def test_fewer_gpus_run_lanes_one_after_another_and_only_filters(tmp_path, monkeypatch):
    monkeypatch.setenv("SMOLLM2_DIR", "/models/smollm2")
    monkeypatch.setenv("SMOLLM2_CONFIG_DIR", "/models/tok")
    lanes = plan("smollm2", tmp_path)
    on_one = assign(lanes, 1, None)
    assert len(on_one) == 1 and on_one[0] == [args for lane in lanes for _, args in lane]
    on_two = assign(lanes, 2, ["shared_vllm", "overhead", "learning"])
    parts = [[a[a.index("--part") + 1] if "--part" in a else a[0] for a in gpu] for gpu in on_two]
    assert parts == [["shared_vllm", "overhead"], ["bench/learning_run.py"]]  # lanes 0, 2 and 1, 3
