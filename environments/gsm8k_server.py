"""GSM8K: grade-school math word problems, answers checked with math-verify.

    python -m environments.gsm8k_server serve --env.data_path ../shared/data/gsm8k/train.jsonl \\
        --env.eval_data_path ../shared/data/gsm8k/test.jsonl
    python -m environments.gsm8k_server process --env.data_path train.jsonl --env.total_steps 4 \\
        --env.data_path_to_save_groups groups.jsonl

Data: JSONL lines {"question": ..., "answer": "... #### 72"} (openai/grade-school-math's format), or,
without --env.data_path, the HF `datasets` "gsm8k" dataset when that package is installed and the
dataset is cached or reachable. The gold answer is the text after the last "####".
"""

from __future__ import annotations

import functools
import json
import random
from dataclasses import dataclass
from typing import Optional

from environments.base import BaseEnv
from environments.config import BaseEnvConfig, opt

SYSTEM_PROMPT = (
    "Solve the math word problem. Reason step by step, then give the final answer as a number "
    "in \\boxed{}, for example \\boxed{42}."
)


@dataclass
class GSM8kEnvConfig(BaseEnvConfig):
    """`--env.*` of the GSM8K environment."""

    data_path: Optional[str] = opt(
        None, "training JSONL (question, answer with '#### N'); unset: HF datasets"
    )
    eval_data_path: Optional[str] = opt(
        None, "eval JSONL in the same format; unset: HF test split, or no eval"
    )


def gold_answer(answer: str) -> str:
    """The final answer of a GSM8K solution: the text after the last '####', without commas."""
    if "####" not in answer:
        raise ValueError(f"a GSM8K answer must end with '#### <number>', got {answer[-80:]!r}")
    return answer.rsplit("####", 1)[1].strip().replace(",", "")


def load_jsonl(path: str) -> list[dict]:
    """Problems {"question", "gold"} from a GSM8K-format JSONL file; errors name the line."""
    items = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                items.append({"question": row["question"], "gold": gold_answer(row["answer"])})
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{lineno}: not a GSM8K line ({exc!r})") from None
    if not items:
        raise ValueError(f"{path} holds no problems")
    return items


def load_hf_split(split: str) -> list[dict]:
    """Problems from the HF `datasets` "gsm8k" dataset ("main" config)."""
    try:
        from datasets import load_dataset
    except ImportError:
        raise RuntimeError(
            "no --env.data_path given and the `datasets` package is not installed: pass "
            "--env.data_path path/to/gsm8k/train.jsonl (lines with 'question' and 'answer')"
        ) from None
    return [
        {"question": r["question"], "gold": gold_answer(r["answer"])}
        for r in load_dataset("gsm8k", "main", split=split)
    ]


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> list:
    from math_verify import LatexExtractionConfig, parse

    parsed = parse(
        "\\boxed{" + gold + "}", extraction_mode="first_match", extraction_config=[LatexExtractionConfig()]
    )
    if not parsed:
        raise ValueError(f"gold answer {gold!r} cannot be parsed by math-verify")
    return parsed


@functools.lru_cache(maxsize=1)
def _answer_config() -> list:
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    # Anchored extraction only: \boxed{} first, then "answer is N"-style anchors. A bare number in
    # the working is not taken for the answer (that would reward guessing the last number).
    latex = LatexExtractionConfig(
        normalization_config=NormalizationConfig(
            nits=False, malformed_operators=False, basic_latex=True, boxed="all", units=True
        ),
        boxed_match_priority=0,
        try_extract_without_anchor=False,
    )
    return [latex, ExprExtractionConfig(try_extract_without_anchor=False)]


def score_gsm8k(completion: str, gold: str) -> float:
    """1.0 if math-verify finds `completion`'s final answer equal to `gold`, else 0.0.

    Text before a closing </think> is ignored. Two different boxed answers score 0.
    """
    from math_verify import parse, verify

    predicted = parse(
        completion.split("</think>")[-1], extraction_config=_answer_config(), extraction_mode="first_match"
    )
    return 1.0 if predicted and verify(_parse_gold(gold), predicted) else 0.0


class GSM8kEnv(BaseEnv):
    """GSM8K word problems; reward 1.0 for a final answer math-verify accepts."""

    name = "gsm8k"
    system_prompt = SYSTEM_PROMPT
    env_config_cls = GSM8kEnvConfig
    config: GSM8kEnvConfig

    async def setup(self) -> None:
        """Load train (shuffled with seed) and eval problems."""
        cfg = self.config
        self.train = load_jsonl(cfg.data_path) if cfg.data_path else load_hf_split("train")
        random.Random(self.seed).shuffle(self.train)
        if cfg.eval_data_path:
            self.eval_items = load_jsonl(cfg.eval_data_path)
        elif not cfg.data_path:
            self.eval_items = load_hf_split("test")
        self.iter = 0

    async def get_next_item(self) -> dict:
        """The next training problem, cycling through the shuffled set."""
        item = self.train[self.iter % len(self.train)]
        self.iter += 1
        return item

    def score_completion(self, item: dict, completion: str) -> float:
        """math-verify against the gold answer, see score_gsm8k."""
        return score_gsm8k(completion, item["gold"])


if __name__ == "__main__":
    GSM8kEnv.cli()
