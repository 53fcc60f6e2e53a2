"""Arithmetic with a calculator: the demo of a multi-turn, tool-using environment (no data).

    python -m environments.calculator_tool_server serve --env.group_size 8 --env.max_turns 4
    python -m environments.calculator_tool_server process --env.total_steps 4 \\
        --env.data_path_to_save_groups groups.jsonl

Items are the arithmetic environment's "What is A op B?" problems. `Calculator` is a TRL-style
environment class (it imports nothing of onecopy's): its tools are add, multiply and submit, and
its reward is 1.0 when the submitted answer is right. Use a model whose chat template shows tools
(Qwen-style); with one that does not (SmolLM2's), the system prompt is all the model learns of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from environments.arithmetic_server import check_problem_settings, make_problem
from environments.base import seeded_items
from environments.config import opt
from environments.multiturn.tool_env import ToolEnv, ToolEnvConfig

SYSTEM_PROMPT = (
    "You solve arithmetic with tools: add(a, b), multiply(a, b), and submit(answer) to give your "
    "final answer. Call a tool as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>."
)


class Calculator:
    """A calculator episode: reset with the problem, tools to compute and submit, get_reward."""

    def reset(self, **row) -> Optional[str]:
        self.answer = row["answer"]
        self.submitted: Optional[int] = None
        return None  # the question is the item's user message

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        return a + b

    def multiply(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        return a * b

    def submit(self, answer: int) -> str:
        """Submit the final answer; the last submission counts.

        Args:
            answer: The answer to the question.
        """
        self.submitted = answer
        return "Submitted."

    def get_reward(self) -> float:
        return 1.0 if self.submitted == self.answer else 0.0


@dataclass
class CalculatorToolEnvConfig(ToolEnvConfig):
    """`--env.*` of the calculator environment."""

    difficulty: int = opt(3, "digits per operand (1 to 9)")
    operations: str = opt("+*", "operators to draw from, any of '+-*'")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_problem_settings(self.difficulty, self.operations)


class CalculatorToolEnv(ToolEnv):
    """Arithmetic problems solved with the Calculator's tools, scored by its get_reward()."""

    name = "calculator_tool"
    system_prompt = SYSTEM_PROMPT
    env_config_cls = CalculatorToolEnvConfig
    environment_factory = Calculator
    config: CalculatorToolEnvConfig

    async def setup(self) -> None:
        """A fixed eval set (seed 1_000_003) and the training stream from --env.seed."""
        cfg = self.config
        self.eval_items, self._rng = seeded_items(lambda rng: make_problem(rng, cfg.difficulty, cfg.operations),
                                                  1_000_003, cfg.num_eval_items or 64, self.seed)

    async def get_next_item(self) -> dict:
        """The next problem: {"question", "answer"}."""
        return make_problem(self._rng, self.config.difficulty, self.config.operations)


if __name__ == "__main__":
    CalculatorToolEnv.cli()
