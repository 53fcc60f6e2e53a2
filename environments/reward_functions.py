"""TRL-style reward functions as an environment, for users coming from TRL's GRPOTrainer.

A TRL reward function takes the group's prompts and completions, plus every other column of the
dataset row as a keyword argument (one value per completion), and returns one float per
completion, or None where it does not apply:

    def correct(prompts, completions, answer, **kwargs) -> list[float | None]: ...

Subclass ``RewardFunctionEnv`` with ``rows()`` (the dataset: dicts with a ``prompt``, a string or
chat messages, and any other columns) and ``reward_funcs``; the score of a completion is the
weighted sum of the functions' values (None counts as nothing, as in TRL). Completions are text
for a text prompt and ``[{"role": "assistant", "content": text}]`` for a chat prompt, as TRL
passes them. It runs like any environment: ``serve`` against the API, or inside the trainer in
``--weight-bridge-mode colocate`` (``--environment <name>`` for environments/<name>_server.py).
environments/arithmetic_rewards_server.py is an example.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Optional

from environments.base import BaseEnv

RewardFunction = Callable[..., Sequence[Optional[float]]]


class RewardFunctionEnv(BaseEnv):
    """Prompts from ``rows()`` in a seeded shuffled order, scored by ``reward_funcs``."""

    reward_funcs: ClassVar[Sequence[RewardFunction]] = ()
    reward_weights: ClassVar[Optional[Sequence[float]]] = None  # None: 1.0 each

    def rows(self) -> list[dict[str, Any]]:
        """The dataset: one dict per prompt, with a ``prompt`` (text or chat messages)."""
        raise NotImplementedError(f"{type(self).__name__} must define rows()")

    async def setup(self) -> None:
        """Check the rows and the reward functions; shuffle the rows with the seed."""
        rows = list(self.rows())
        if not rows or any("prompt" not in row for row in rows):
            raise ValueError(f"{type(self).__name__}.rows() must return dicts that each have a 'prompt'")
        weights = self.reward_weights or [1.0] * len(self.reward_funcs)
        if not self.reward_funcs or len(weights) != len(self.reward_funcs):
            raise ValueError(f"{type(self).__name__}: give reward_funcs, and one weight per function if any")
        random.Random(self.seed).shuffle(rows)
        self._rows, self._weights, self._next = rows, list(weights), 0

    async def get_next_item(self) -> dict[str, Any]:
        """The next row, starting over after the last."""
        row = self._rows[self._next % len(self._rows)]
        self._next += 1
        return row

    def build_messages(self, item: dict[str, Any]) -> list[dict[str, str]]:
        prompt = item["prompt"]
        if isinstance(prompt, str):
            system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
            return system + [{"role": "user", "content": prompt}]
        return list(prompt)

    def score_group(self, item: dict[str, Any], completions: list[str]) -> list[float]:
        """The weighted sum of every reward function's values for the group."""
        n = len(completions)
        if not isinstance(item["prompt"], str):
            completions = [[{"role": "assistant", "content": text}] for text in completions]
        columns = {key: [value] * n for key, value in item.items() if key != "prompt"}
        totals = combine_rewards(self.reward_funcs, self._weights, n,
                                 prompts=[item["prompt"]] * n, completions=completions, **columns)
        return [0.0 if total is None else total for total in totals]


def combine_rewards(reward_funcs: Sequence[RewardFunction], weights: Sequence[float], n: int,
                    **arguments: Any) -> list[Optional[float]]:
    """The weighted sum of every reward function's values for `n` completions, each function
    called with `arguments` (TRL's keyword arguments: prompts, completions, the dataset columns,
    ...). A None value counts as nothing; a completion every function gave None has None."""
    totals: list[Optional[float]] = [None] * n
    for weight, function in zip(weights, reward_funcs):
        values = list(function(**arguments))
        if len(values) != n:
            raise ValueError(f"reward function {function.__name__} returned {len(values)} values for {n} completions")
        totals = [t if v is None else (t or 0.0) + weight * float(v) for t, v in zip(totals, values)]
    return totals
