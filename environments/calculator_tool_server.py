"""Arithmetic with a calculator: the demo of a multi-turn, tool-using environment (no data).

    python -m environments.calculator_tool_server serve --env.group_size 8 --env.max_turns 4
    python -m environments.calculator_tool_server process --env.total_steps 4 \\
        --env.data_path_to_save_groups groups.jsonl

Items are the arithmetic environment's "What is A op B?" problems. `Calculator` is a TRL-style
environment class (it imports nothing of onecopy's): its tools are add, multiply and submit, and
its reward is 1.0 when the submitted answer is right. Use a model whose chat template shows tools
(Qwen-style); with one that does not (SmolLM2's), the system prompt is all the model learns of them,
and `--env.shots N` puts N worked episodes before each question as earlier turns (a pretrained
model such as Gemma 3 270M calls no tool without them).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Optional

from environments.arithmetic_server import check_problem_settings, make_problem
from environments.base import seeded_items
from environments.config import ConfigError, opt
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
    shots: int = opt(0, "worked episodes shown before each question as earlier turns (the question, a call "
                     "of its operation's tool, the result, a call of submit, its result, a reply with no "
                     "call), operators in turn, drawn from a seed of their own")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_problem_settings(self.difficulty, self.operations)
        if self.shots < 0:
            raise ConfigError("shots", f"must be >= 0, got {self.shots}")


SHOTS_SEED = 1_000_002  # the worked episodes' problems (the eval set's seed is 1_000_003)


def worked_episode(a: int, op: str, b: int) -> list[dict]:
    """The messages of one solved episode of "What is a op b?": the question, the tool call that
    computes it (a difference as add(a, -b)), its result, the submit call, its result, and a reply
    that calls no tool (which ends an episode)."""
    name, arguments = {"+": ("add", (a, b)), "-": ("add", (a, -b)), "*": ("multiply", (a, b))}[op]
    calculator = Calculator()
    result = getattr(calculator, name)(*arguments)

    def turn(tool: str, args: dict, output: str) -> list[dict]:
        call = {"type": "function", "function": {"name": tool, "arguments": args}}
        return [{"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": tool, "content": output}]

    return [{"role": "user", "content": f"What is {a} {op} {b}?"},
            *turn(name, dict(zip("ab", arguments)), json.dumps(result)),
            *turn("submit", {"answer": result}, calculator.submit(result)),
            {"role": "assistant", "content": f"The answer is {result}."}]


class CalculatorToolEnv(ToolEnv):
    """Arithmetic problems solved with the Calculator's tools, scored by its get_reward()."""

    name = "calculator_tool"
    system_prompt = SYSTEM_PROMPT
    env_config_cls = CalculatorToolEnvConfig
    environment_factory = Calculator
    config: CalculatorToolEnvConfig

    async def setup(self) -> None:
        """A fixed eval set (seed 1_000_003), the worked episodes (--env.shots) and the training
        stream from --env.seed."""
        cfg = self.config
        self.eval_items, self._rng = seeded_items(lambda rng: make_problem(rng, cfg.difficulty, cfg.operations),
                                                  1_000_003, cfg.num_eval_items or 64, self.seed)
        shots_rng = random.Random(SHOTS_SEED)
        problems = [make_problem(shots_rng, cfg.difficulty, cfg.operations[i % len(cfg.operations)])
                    for i in range(cfg.shots)]
        self._shots = [m for p in problems for m in worked_episode(*_operands(p["question"]))]
        self._held_out = {item["question"] for item in self.eval_items} | {p["question"] for p in problems}

    async def get_next_item(self) -> dict:
        """The next problem {"question", "answer"}, skipping the eval set's and the shots'."""
        cfg = self.config
        for _ in range(100):  # bounded: with 1-digit operands the held-out problems may cover most
            item = make_problem(self._rng, cfg.difficulty, cfg.operations)
            if item["question"] not in self._held_out:
                return item
        return item

    def build_messages(self, item: dict) -> list[dict]:
        """The system prompt, the worked episodes (--env.shots) and the item's question."""
        system, question = super().build_messages(item)
        return [system, *self._shots, question]


def _operands(question: str) -> tuple[int, str, int]:
    """(a, op, b) of make_problem's "What is a op b?"."""
    a, op, b = question.removeprefix("What is ").removesuffix("?").split()
    return int(a), op, int(b)


if __name__ == "__main__":
    CalculatorToolEnv.cli()
