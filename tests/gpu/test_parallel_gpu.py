"""The loop under torchrun on every GPU of the machine (NCCL): --parallel data (a vLLM and a
single copy per GPU) and --parallel tensor (one vLLM over all GPUs). On a one-GPU machine this
runs one rank of each — the CUDA paths (NCCL, the rank's GPU for its vLLM, DTensor views of
CUDA IPC memory) without the scaling; several GPUs run the real thing. Skipped without CUDA.

    SMOLLM2_DIR=... python3 -m pytest tests/gpu/test_parallel_gpu.py -q -s

Results: $OUT/gpu_parallel_<mode>.json (per-step samples/s, sync seconds, peak memory per GPU).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from tests.gpu.results import results_folder

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def smollm2() -> str:
    from example_trainer.model.default_model import default_model_path

    return os.environ.get("SMOLLM2_DIR") or default_model_path()


def run(tmp_path, parallel: str, model: str, steps: int = 3, env_args: str = "", label: str = ""):
    from example_trainer import launcher
    from example_trainer.config import TrainerConfig

    gpus = torch.cuda.device_count()
    cfg = launcher.LoopConfig(run_dir=str(tmp_path), gpus=gpus, timeout=900,
                              trainer=TrainerConfig(weight_bridge_mode="shared_vllm", max_steps=steps,
                                                    model_name=model, parallel=parallel, batch_size=8 * gpus,
                                                    seq_len=320, learning_rate=2e-5))
    cfg.env_args += " " + env_args
    result = launcher.run_loop(cfg, ["--batch-wait-timeout", "600", "--vllm-gpu-memory-utilization", "0.3",
                                     "--benchmark"])
    assert result.returncode == 0, result.failure_report()
    steps_logged = [m for m in result.metrics if "train/loss" in m]
    assert [m["step"] for m in steps_logged] == list(range(1, steps + 1))
    summary = {"gpus": gpus, "parallel": parallel, "batch_size": 8 * gpus,
               "samples_per_s": [8 * gpus / m["time/step"] for m in steps_logged[1:]],
               "sync_seconds": [m["sync/seconds"] for m in steps_logged],
               "rank0_peak_reserved_gib": [m.get("memory/optimizer_sync_peak_reserved_gib") for m in steps_logged],
               # parity: vLLM's probe before any step (same weights at every TP degree: the model is
               # drawn from a seed) and the trainer's logprobs against vLLM's at the sampled tokens
               "probe_logprob_before_training": next(m["gen/probe_logprob"] for m in result.metrics
                                                     if m.get("gen/probe_logprob") is not None),
               "logp_difference_mean": [m.get("sampling/logp_difference/mean") for m in steps_logged],
               "logp_difference_max": [m.get("sampling/logp_difference/max") for m in steps_logged]}
    out = results_folder(tmp_path)
    out.joinpath(f"gpu_parallel_{parallel}{label}_{gpus}gpu.json").write_text(json.dumps(summary, indent=2))
    print(f"\n[parallel {parallel}] {json.dumps(summary)}")
    return result, steps_logged, gpus


def test_data_parallel_on_every_gpu(tmp_path):
    result, steps, gpus = run(tmp_path, "data", smollm2())
    assert all(m["parallel/replica_spread"] == 0.0 for m in steps)
    for rank in range(gpus):
        assert (tmp_path / "run" / f"rank{rank}" / "vllm.log").exists()


def random_tensor_parallel_model(path: Path) -> str:
    """A random model whose heads (16) and KV heads (4) split over 1, 2 and 4 GPUs (SmolLM2's 9 do
    not), drawn from a fixed seed: every TP degree serves the same weights (the parity rows)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(smollm2())
    config.update(dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
                       num_key_value_heads=4, head_dim=64))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
    AutoTokenizer.from_pretrained(smollm2()).save_pretrained(path)
    return str(path)


def test_tensor_parallel_over_every_gpu(tmp_path):
    path = random_tensor_parallel_model(tmp_path / "model")
    # A random model scores 0 on every answer: keep those groups (advantages 0; the loop still runs).
    result, steps, gpus = run(tmp_path / "loop", "tensor", path, env_args="--env.ensure_scores_are_not_same false")
    assert f"--tensor-parallel-size {gpus}" in (tmp_path / "loop" / "run" / "vllm.log").read_text()
    assert (tmp_path / "loop" / "run" / "checkpoints" / "step_3" / "model.safetensors").exists()


def kill_after_step_1(run_dir: Path, bridge_file: Path, killed: list[tuple[int, float]]) -> None:
    """Start a thread that SIGKILLs the vLLM worker named in ``bridge_file`` once step 1 is in the
    metrics; ``killed`` gets (pid, monotonic time)."""
    import signal
    import threading
    import time

    from vllm_patching.bridge_file import read_bridge_file

    def kill() -> None:
        deadline = time.monotonic() + 600
        metrics = run_dir / "metrics.jsonl"
        while time.monotonic() < deadline:
            text = metrics.read_text() if metrics.exists() else ""
            if any(json.loads(line).get("step") == 1 for line in text.splitlines(keepends=True) if line.endswith("\n")):
                pid = read_bridge_file(bridge_file).exporter_pid
                os.kill(pid, signal.SIGKILL)
                killed.append((pid, time.monotonic()))
                return
            time.sleep(0.05)

    threading.Thread(target=kill, daemon=True).start()


def test_tensor_parallel_stops_every_rank_when_a_vllm_worker_dies(tmp_path):
    """The last rank's vLLM TP worker is SIGKILLed after step 1: a tensor-parallel vLLM is not
    restarted, so the job must end non-zero within 60 s with the cause in the trainer's log."""
    import time

    from example_trainer import launcher
    from example_trainer.config import TrainerConfig
    from vllm_patching.bridge_file import bridge_filename

    gpus = torch.cuda.device_count()
    if gpus < 2:
        pytest.skip("needs 2 GPUs: one TP worker dies while the others train")
    model = random_tensor_parallel_model(tmp_path / "model")
    killed: list[tuple[int, float]] = []
    kill_after_step_1(tmp_path / "loop" / "run", tmp_path / "loop" / "run" / bridge_filename(gpus - 1), killed)
    cfg = launcher.LoopConfig(run_dir=str(tmp_path / "loop"), gpus=gpus, timeout=900,
                              trainer=TrainerConfig(weight_bridge_mode="shared_vllm", max_steps=6, model_name=model,
                                                    parallel="tensor", batch_size=8 * gpus, seq_len=320, learning_rate=2e-5))
    cfg.env_args += " --env.ensure_scores_are_not_same false"
    result = launcher.run_loop(cfg, ["--batch-wait-timeout", "600", "--vllm-gpu-memory-utilization", "0.3"])
    ended = time.monotonic()
    assert killed, "step 1 was never logged"
    seconds = ended - killed[0][1]
    summary = {"gpus": gpus, "killed_pid": killed[0][0], "seconds_to_stop": seconds, "outcome": result.outcome,
               "steps_logged": [m["step"] for m in result.metrics if "train/loss" in m]}
    out = results_folder(tmp_path)
    out.joinpath(f"gpu_parallel_tensor_killed_vllm_{gpus}gpu.json").write_text(json.dumps(summary, indent=2))
    print(f"\n[parallel tensor, killed vLLM] {json.dumps(summary)}")
    assert result.returncode not in (0, None), result.outcome  # the trainer ended by itself, with an error
    assert seconds < 60, summary
    assert "[trainer] stopped:" in result.trainer_log and "tensor-parallel" in result.trainer_log, result.failure_report()


def test_data_parallel_survives_a_killed_vllm_on_the_last_rank(tmp_path):
    """The last rank's vLLM worker is SIGKILLed after step 1: that rank restarts its server, pushes
    its weights, and the run finishes with every rank's copy equal."""
    from vllm_patching.bridge_file import read_bridge_file

    gpus = torch.cuda.device_count()
    if gpus < 2:
        pytest.skip("needs 2 GPUs: one rank's vLLM dies while the others train")
    last = tmp_path / "run" / f"rank{gpus - 1}" / "vllm_bridge_config.json"
    killed: list[tuple[int, float]] = []
    kill_after_step_1(tmp_path / "run", last, killed)
    result, steps, _ = run(tmp_path, "data", smollm2(), steps=4, label="_killed_vllm")
    assert killed, "step 1 was never logged"
    assert f"rank{gpus - 1}" in result.trainer_log and "vLLM restarted and re-attached" in result.trainer_log
    assert read_bridge_file(last).exporter_pid != killed[0][0]
    assert all(m["parallel/replica_spread"] == 0.0 for m in steps)
