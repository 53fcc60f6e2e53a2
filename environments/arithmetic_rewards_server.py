"""The arithmetic task written the TRL way: a dataset of prompts and reward functions
(environments/reward_functions.py). Same problems and answer check as arithmetic_server.py.

    python -m example_trainer.grpo --weight-bridge-mode colocate --environment arithmetic_rewards
    python -m environments.arithmetic_rewards_server serve --env.group_size 8      # against the API
"""

from __future__ import annotations

import random

from environments.arithmetic_server import SYSTEM_PROMPT, make_problem, score_arithmetic
from environments.reward_functions import RewardFunctionEnv


def correct_answer(prompts, completions, answer, **kwargs) -> list[float]:
    """1.0 where the completion's final number is the row's answer."""
    return [score_arithmetic(text, value) for text, value in zip(completions, answer)]


def boxed_format(prompts, completions, **kwargs) -> list[float]:
    """0.1 for giving the answer as \\boxed{N}, as the system prompt asks."""
    return [0.1 if "\\boxed{" in text else 0.0 for text in completions]


def arithmetic_rows(count: int = 512, seed: int = 0) -> list[dict]:
    """The dataset: two-digit additions and multiplications, ``prompt`` (the question) and ``answer``."""
    rng = random.Random(seed)
    return [{"prompt": p["question"], "answer": p["answer"]} for p in (make_problem(rng, 2) for _ in range(count))]


class ArithmeticRewardsEnv(RewardFunctionEnv):
    """512 two-digit additions and multiplications; rewards: the right answer, and the format."""

    name = "arithmetic_rewards"
    system_prompt = SYSTEM_PROMPT
    reward_funcs = (correct_answer, boxed_format)

    def rows(self) -> list[dict]:
        return arithmetic_rows()


if __name__ == "__main__":
    ArithmeticRewardsEnv.cli()
