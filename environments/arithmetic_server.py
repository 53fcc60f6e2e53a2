"""Procedural arithmetic: the default demo environment, no data to download.

    python -m environments.arithmetic_server serve --env.group_size 8 --env.difficulty 2
    python -m environments.arithmetic_server process --env.total_steps 4 \\
        --env.data_path_to_save_groups groups.jsonl
    python -m environments.arithmetic_server evaluate --openai.base_url http://127.0.0.1:9001

Items are "What is A op B?" with `difficulty`-digit operands, drawn from `--env.seed`. The reward is
1.0 when the last \\boxed{} value (else the last number) of the completion equals the answer.
The eval set is drawn from `--env.eval_seed`, a separate stream, and removed from training items.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Optional

from environments.base import BaseEnv, seeded_items
from environments.config import BaseEnvConfig, ConfigError, check_eval_seed, opt

SYSTEM_PROMPT = (
    "You are a careful calculator. Work the problem out step by step, then give the final "
    "answer as \\boxed{N}, for example \\boxed{42}."
)
OPERATIONS = "+-*"
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?!\d)|-?\d+(?:\.\d+)?")


@dataclass
class ArithmeticEnvConfig(BaseEnvConfig):
    """`--env.*` of the arithmetic environment."""

    difficulty: int = opt(2, "digits per operand (1 to 9)")
    operations: str = opt("+*", "operators to draw from, any of '+-*'")
    eval_seed: int = opt(1_000_003, "seed of the held-out eval problems (must differ from --env.seed)")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_problem_settings(self.difficulty, self.operations)
        check_eval_seed(self.seed, self.eval_seed)


def check_problem_settings(difficulty: int, operations: str) -> None:
    """Refuse a difficulty or an operator set ``make_problem`` cannot draw from, naming the flag."""
    if not 1 <= difficulty <= 9:
        raise ConfigError("difficulty", f"must be 1 to 9 digits, got {difficulty}")
    if not operations or set(operations) - set(OPERATIONS):
        raise ConfigError("operations", f"must be made of {OPERATIONS!r}, got {operations!r}")


def make_problem(rng: random.Random, difficulty: int, operations: str = "+*") -> dict:
    """One problem {"question", "answer"} with two `difficulty`-digit operands."""
    low, high = 10 ** (difficulty - 1), 10**difficulty - 1
    a, b, op = rng.randint(low, high), rng.randint(low, high), rng.choice(operations)
    answer = {"+": a + b, "-": a - b, "*": a * b}[op]
    return {"question": f"What is {a} {op} {b}?", "answer": answer}


def last_boxed(text: str) -> Optional[str]:
    """Content of the last \\boxed{...} in `text` (nested braces allowed), or None."""
    start = text.rfind("\\boxed")
    while start != -1:
        i = start + len("\\boxed")
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                if depth == 0:
                    return text[i + 1 : j]
        start = text.rfind("\\boxed", 0, start)  # unclosed: try an earlier one
    return None


def parse_integer(text: str) -> Optional[int]:
    """The last number in `text` as an int ('1,234' and '72.0' count; '7.5' does not), or None."""
    matches = _NUMBER.findall(text.replace("{,}", ","))  # LaTeX writes 1{,}234
    if not matches:
        return None
    number = matches[-1].replace(",", "")
    if "." in number:
        whole, frac = number.split(".")
        if frac.strip("0"):
            return None
        number = whole
    return int(number)


def score_arithmetic(completion: str, answer: int) -> float:
    """1.0 if the final answer in `completion` equals `answer`, else 0.0.

    The final answer is the last \\boxed{} value if there is one (a box without a number scores
    0), otherwise the last number in the text (covers "Answer: N").
    """
    boxed = last_boxed(completion)
    value = parse_integer(boxed if boxed is not None else completion)
    return 1.0 if value is not None and value == answer else 0.0


class ArithmeticEnv(BaseEnv):
    """Multi-digit addition/subtraction/multiplication, scored by exact integer match."""

    name = "arithmetic"
    system_prompt = SYSTEM_PROMPT
    env_config_cls = ArithmeticEnvConfig
    config: ArithmeticEnvConfig

    async def setup(self) -> None:
        """Build the eval set from eval_seed and the training stream from seed."""
        cfg = self.config
        self.eval_items, self._rng = seeded_items(lambda rng: make_problem(rng, cfg.difficulty, cfg.operations),
                                                  cfg.eval_seed, cfg.num_eval_items or 64, self.seed)
        self._eval_questions = {item["question"] for item in self.eval_items}

    async def get_next_item(self) -> dict:
        """The next training problem, skipping problems of the eval set."""
        cfg = self.config
        for _ in range(100):  # bounded: with 1-digit operands the eval set may cover most problems
            item = make_problem(self._rng, cfg.difficulty, cfg.operations)
            if item["question"] not in self._eval_questions:
                return item
        return item

    def score_completion(self, item: dict, completion: str) -> float:
        """Exact integer match, see score_arithmetic."""
        return score_arithmetic(completion, item["answer"])


if __name__ == "__main__":
    ArithmeticEnv.cli()
