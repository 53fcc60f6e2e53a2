"""RunState: what one run of an environment knows about the trainer and the API.

EnvRunner (runner.py) writes it as the run goes (registration, status polls); BaseEnv's hooks
read it (the trainer step for logs and wandb, max_token_length for completion budgets) and count
the groups they send in it. The environment holds it from construction, so its hooks also work
without a runner (tests drive them one at a time). A leaf module: base.py and runner.py both
import it, and neither imports the other's internals for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass
class RunState:
    """The run's counters and the trainer's settings as learned from the API."""

    max_token_length: int  # --env.max_token_length, lowered to the trainer's at registration
    batch_size: Optional[int]  # --env.batch_size, else the trainer's (asked at registration)
    wandb_name: str  # the name to register with; the API's answer replaces it
    total_steps: Optional[int] = None  # groups to send (--env.total_steps); None: no quota
    env_id: Optional[int] = None  # given by the API at registration
    curr_step: int = 0  # the trainer's step, from the API
    num_steps: Optional[int] = None  # the trainer's total steps, from the API
    queue_size: int = 0  # groups waiting in the API
    queued_rows: int = 0  # the rows (sequences) in them
    batch_ready: Optional[bool] = None  # whether the API can serve a batch from them; None: unknown
    groups_sent: int = 0  # groups posted (serve) or written (process)

    def quota_reached(self) -> bool:
        """True once total_steps groups are sent."""
        return self.total_steps is not None and self.groups_sent >= self.total_steps

    def trainer_done(self) -> bool:
        """True once the trainer has reached its last step."""
        return self.num_steps is not None and self.curr_step >= self.num_steps


class InRunState:
    """An attribute of the environment kept in its RunState: `env.curr_step` is `env.run_state.curr_step`.

    Keeps the Atropos names that environments and tests read (`self.curr_step`, `self.groups_sent`,
    ...) pointing at the one record the runner updates, so there is no second copy to go stale.
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, env: Any, owner: Optional[type] = None) -> Any:
        if env is None:
            return self
        return getattr(env.run_state, self.name)

    def __set__(self, env: Any, value: Any) -> None:
        setattr(env.run_state, self.name, value)
