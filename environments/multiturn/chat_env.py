"""ChatEnv: a MultiTurnEnv whose environment answers each model turn with a message of its own
(a game master, a user simulator, a grader giving feedback): no tools.

The environment class needs nothing from onecopy:

    class Guess:
        def reset(self, **row) -> str | None:     # the dataset row; a string is appended to the prompt
            self.secret = row["secret"]
        def step(self, text: str) -> str | None:  # the model's turn as text -> the reply, None: episode over
            ...
        def get_reward(self) -> float | None:     # or reward_funcs on the ChatEnv subclass
            ...

The reply is the next user message, bridged into the row as exact ids like a tool result. A
sync step() runs in a worker thread (factory.call_off_loop). An episode ends when step()
returns None ("done"), after max_turns, or when the context is full.
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional

from environments.multiturn.chat_codec import Message
from environments.multiturn.episode import Respond
from environments.multiturn.factory import call_off_loop
from environments.multiturn.multiturn_env import MultiTurnEnv
from environments.multiturn.tool_calls import ParsedTurn


class ChatEnv(MultiTurnEnv):
    """Groups of episodes of an environment class whose step(text) replies to each turn."""

    ended_by_respond: ClassVar[str] = "done"
    reply_role: ClassVar[str] = "user"  # the role of the environment's messages

    def respond(self, environment: Any) -> Respond:
        """The environment's step() answers each turn with its reply, until it returns None."""
        step = getattr(environment, "step", None)
        if not callable(step):
            raise TypeError(f"{type(environment).__name__} has no step(text) method; a ChatEnv class answers "
                            "each model turn with step(text) -> reply or None")

        async def reply(parsed: ParsedTurn, assistant: Message) -> Optional[list[Message]]:
            answer = await call_off_loop(step, assistant["content"])
            return None if answer is None else [{"role": self.reply_role, "content": str(answer)}]

        return reply
