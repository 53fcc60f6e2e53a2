"""reasoning-gym's procedural tasks as an environment
(optional: pip install --no-deps -r requirements-reasoning-gym.txt).

    python -m environments.reasoning_gym_server serve --env.task basic_arithmetic --env.group_size 8
    python -m environments.reasoning_gym_server process --env.task chain_sum \\
        --env.task_config '{"min_terms": 2, "max_terms": 3}' --env.total_steps 4 \\
        --env.data_path_to_save_groups groups.jsonl

Any of reasoning-gym's ~100 tasks (`reasoning_gym.factory.DATASETS`) runs unchanged: items are its
entries ({"question", "answer", "metadata"}), drawn by reasoning-gym itself from `--env.seed`
(training) and `--env.eval_seed` (the held-out set, whose questions are left out of training);
the prompt is reasoning-gym's default system prompt (answer inside <answer></answer>) and the
question; the reward is the task's own `score_answer` on the text inside the last answer tags,
so a task's partial credit (some give 0.01 for any answer, or a share for a near miss) is kept as
it is. `env/eval_accuracy` counts only full scores: partial credit trains, but does not count as
solved.

`--env.shots N` puts N solved entries of the same task before each question, as earlier turns
(the question, then `<answer>ANSWER</answer>`), the same N for every prompt, drawn from just below
the eval set (reasoning-gym draws entry i of seed s from Random(s + i): seed eval_seed - N gives
N entries none of the eval set's) and, like the eval set, left out of training. A small model
takes the answer format from them: SmolLM2-135M-Instruct scored 0 on four easy tasks after
reasoning-gym's system prompts alone (its replies had no answer tags), and answers in tags with one
shot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from environments.base import BaseEnv, import_extra
from environments.config import BaseEnvConfig, ConfigError, check_eval_seed, json_object, opt

INSTALL_HINT = "reasoning-gym is an optional extra: pip install --no-deps -r requirements-reasoning-gym.txt"


def import_reasoning_gym():
    """The reasoning_gym package, or an ImportError that says how to install it."""
    return import_extra("reasoning_gym", INSTALL_HINT)


@dataclass
class ReasoningGymEnvConfig(BaseEnvConfig):
    """`--env.*` of the reasoning-gym environment."""

    task: str = opt("basic_arithmetic", "reasoning-gym task name (reasoning_gym.factory.DATASETS)")
    task_config: str = opt("{}", "JSON object of the task's own settings, e.g. '{\"min_terms\": 2}'")
    dataset_size: int = opt(100_000, "training entries reasoning-gym draws before starting over")
    eval_seed: int = opt(1_000_003, "seed of the held-out eval entries (must differ from --env.seed)")
    shots: int = opt(0, "solved entries of the task shown before each question as earlier turns "
                     "(question, then <answer>ANSWER</answer>), drawn from seed eval_seed - shots")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.shots < 0:
            raise ConfigError("shots", f"must be >= 0, got {self.shots}")
        json_object("task_config", self.task_config)
        if self.dataset_size < 1:
            raise ConfigError("dataset_size", f"must be >= 1, got {self.dataset_size}")
        check_eval_seed(self.seed, self.eval_seed)

    def task_settings(self) -> dict[str, Any]:
        """--env.task_config as keyword arguments of reasoning_gym.create_dataset."""
        return json_object("task_config", self.task_config)


class ReasoningGymEnv(BaseEnv):
    """One reasoning-gym task, single-turn, scored by the task's own score_answer."""

    name = "reasoning_gym"
    env_config_cls = ReasoningGymEnvConfig
    config: ReasoningGymEnvConfig

    def make_dataset(self, seed: int, size: int):
        """reasoning-gym's dataset of the configured task (an unknown task names the valid ones)."""
        rg = import_reasoning_gym()
        task = self.config.task
        if task not in rg.factory.DATASETS:
            raise ConfigError("task", f"{task!r} is not a reasoning-gym task; valid: {', '.join(sorted(rg.factory.DATASETS))}")
        return rg.create_dataset(task, seed=seed, size=size, **self.config.task_settings())

    async def setup(self) -> None:
        """The eval entries (eval_seed), the shots (eval_seed - shots: entry i of seed s is drawn
        from Random(s + i), so none is an eval entry), the training dataset (seed) and the system
        prompt."""
        from reasoning_gym.utils import SYSTEM_PROMPTS

        cfg = self.config
        self.system_prompt = SYSTEM_PROMPTS["default"]
        solved = self.make_dataset(cfg.eval_seed - cfg.shots, cfg.shots) if cfg.shots else []
        self._shots = [turn for i in range(len(solved)) for turn in (
            {"role": "user", "content": solved[i]["question"]},
            {"role": "assistant", "content": f"<answer>{solved[i]['answer']}</answer>"})]
        evaluation = self.make_dataset(cfg.eval_seed, cfg.num_eval_items or 64)
        self.eval_items = [evaluation[i] for i in range(len(evaluation))]
        self._held_out = {item["question"] for item in self.eval_items} | {m["content"] for m in self._shots[::2]}
        self._dataset = self.make_dataset(self.seed, cfg.dataset_size)
        self._next = 0

    async def get_next_item(self) -> dict[str, Any]:
        """The next training entry neither in the eval set nor a shot (bounded: small tasks may repeat it)."""
        for _ in range(100):
            item = self._dataset[self._next % len(self._dataset)]
            self._next += 1
            if item["question"] not in self._held_out:
                return item
        return item

    def build_messages(self, item: dict[str, Any]) -> list[dict[str, str]]:
        """The system prompt, the shots (--env.shots) and the entry's question."""
        system, question = super().build_messages(item)
        return [system, *self._shots, question]

    def solved(self, score: float) -> bool:
        """Only a full score: with partial credit, any score above 0 would count wrong answers."""
        return score >= 1.0

    def score_completion(self, item: dict[str, Any], completion: str) -> float:
        """The task's score_answer on the last <answer>...</answer> of the completion (None: no tags)."""
        from reasoning_gym.utils import extract_answer

        return float(self._dataset.score_answer(extract_answer(completion), entry=item))


if __name__ == "__main__":
    ReasoningGymEnv.cli()
