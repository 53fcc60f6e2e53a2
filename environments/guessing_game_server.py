"""Guess the number, with higher/lower feedback: a multi-turn task without tools (no data).

    python -m environments.guessing_game_server serve --env.group_size 8 --env.high 16 --env.max_turns 6
    python -m environments.guessing_game_server process --env.total_steps 4 \\
        --env.data_path_to_save_groups groups.jsonl

Each item is a secret whole number from 1 to `high`, drawn from `--env.seed` (the eval set from
`--env.eval_seed`). The model guesses, one number per turn; the environment answers "Higher. ..."
or "Lower. ..." (HIGHER, LOWER) as the next user message, and a right guess ends the game. The reward favours winning
in few turns: (max_turns - guesses + 1) / max_turns for a win (1.0 on the first guess), 0.0 for
a loss. Binary search wins every game within ceil(log2(high + 1)) guesses (5 for 16), so with
max_turns 6 a policy that learns it scores at least 2/6 on every item.

The wording is the one SmolLM2-135M-Instruct (the default model) plays: no system prompt (with one
it played the one who thinks of the number), and each reply asks for the next guess (after a bare
"Higher." it repeated the word). Greedy, it won 11 of 32 held-out games of 1 to 16 in 6 turns.

`GuessingGame` is the environment class (it imports nothing of onecopy's); GuessingGameEnv runs
it as a ChatEnv.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional

from environments.arithmetic_server import parse_integer
from environments.base import seeded_items
from environments.config import ConfigError, check_eval_seed, opt
from environments.multiturn.chat_env import ChatEnv
from environments.multiturn.multiturn_env import MultiTurnEnvConfig

QUESTION = "I am thinking of a number between 1 and {high}. Guess it! Answer with just the number."
HIGHER = "Higher. Guess again! Answer with just the number."
LOWER = "Lower. Guess again! Answer with just the number."
NOT_A_NUMBER = "Answer with just a number from 1 to {high}."


class GuessingGame:
    """One game: reset with the secret, step(text) with each guess, get_reward() at the end."""

    def reset(self, **row) -> Optional[str]:
        self.secret, self.high, self.max_guesses = row["secret"], row["high"], row["max_guesses"]
        self.guesses = 0
        self.won = False
        return None  # the item's question is the first user message

    def step(self, text: str) -> Optional[str]:
        """The reply to one turn: HIGHER/LOWER, a reminder to answer with a number, or None (won)."""
        self.guesses += 1
        guess = parse_integer(text)
        if guess is None:
            return NOT_A_NUMBER.format(high=self.high)
        if guess == self.secret:
            self.won = True
            return None
        return HIGHER if guess < self.secret else LOWER

    def get_reward(self) -> float:
        if not self.won:
            return 0.0
        return (self.max_guesses - self.guesses + 1) / self.max_guesses


def make_game(rng: random.Random, high: int, max_guesses: int) -> dict:
    """One item: {"question", "secret", "high", "max_guesses"}."""
    return {"question": QUESTION.format(high=high), "secret": rng.randint(1, high),
            "high": high, "max_guesses": max_guesses}


@dataclass
class GuessingGameEnvConfig(MultiTurnEnvConfig):
    """`--env.*` of the guessing game."""

    max_turns: int = opt(6, "most guesses per game; the reward is (max_turns - guesses + 1) / max_turns for a win")
    high: int = opt(16, "the secret is a whole number from 1 to high")
    eval_seed: int = opt(1_000_003, "seed of the held-out eval games (must differ from --env.seed)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.high < 2:
            raise ConfigError("high", f"must be >= 2, got {self.high}")
        check_eval_seed(self.seed, self.eval_seed)


class GuessingGameEnv(ChatEnv):
    """Guess the number; the game's feedback is the next user turn."""

    name = "guessing_game"
    env_config_cls = GuessingGameEnvConfig
    environment_factory = GuessingGame
    config: GuessingGameEnvConfig

    async def setup(self) -> None:
        """A fixed eval set of games (eval_seed) and the training stream (seed)."""
        cfg = self.config
        self.eval_items, self._rng = seeded_items(lambda rng: make_game(rng, cfg.high, cfg.max_turns), cfg.eval_seed,
                                                  cfg.num_eval_items or 64, self.seed)

    async def get_next_item(self) -> dict:
        """The next game."""
        return make_game(self._rng, self.config.high, self.config.max_turns)


if __name__ == "__main__":
    GuessingGameEnv.cli()
