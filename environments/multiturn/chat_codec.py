"""Token ids of a multi-turn chat, from the tokenizer's own chat template.

Sampled ids are never decoded and re-tokenised. A turn's prompt is the previous prompt, the
sampled ids, and the ids that bridge the next messages (tool results, an environment's reply)
onto them, ending with the generation prompt. `bridge_ids` takes those from the template itself:
the difference between two renders of a dummy conversation,

    a = render([user, assistant])                        ...<|im_start|>assistant\\nx<|im_end|>\\n
    b = render([user, assistant, *new], generation)      ...<|im_start|>assistant\\nx<|im_end|>\\n<|im_start|>tool\\n...

cut just after the assistant's end-of-turn token (the last special token of `a`), not at the end
of `a`: the model stops at `<|im_end|>`, and the template's separator after it (ChatML's newline)
belongs to the bridge. A cut after a special token is the same in ids and in text, since
tokenizers never merge across a special token.

That is exact only for a template whose render of n+1 messages starts with its render of n
messages (prefix-preserving). Some are not: Qwen3's strips the thinking of earlier turns, some
drop tool results. `self_test()` renders a dummy conversation at start-up and checks the
property; a template that fails it is used in re-render mode (`prefix_preserving` False): each
turn's prompt is the whole history rendered again from text, and the episode's ledger closes the
row whenever that is not an extension of it (`EpisodeLedger.continue_with`). The reason is logged.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

logger = logging.getLogger("onecopy.env")

Message = dict[str, Any]

_DUMMY_CALL = {"type": "function", "function": {"name": "dummy_tool", "arguments": {"x": 1}}}
# The dummy conversation of the self-test: tool calls and results, thinking in earlier turns, and
# a user turn after them (the point at which templates such as Qwen3's drop earlier thinking).
SELF_TEST_CONVERSATION: list[Message] = [
    {"role": "system", "content": "S0"},
    {"role": "user", "content": "U1"},
    {"role": "assistant", "content": "<think>\nR1\n</think>\n\nA1", "tool_calls": [_DUMMY_CALL]},
    {"role": "tool", "content": "T1", "name": "dummy_tool"},
    {"role": "assistant", "content": "<think>\nR2\n</think>\n\nA2"},
    {"role": "user", "content": "U2"},
    {"role": "assistant", "content": "A3"},
]


class TemplateError(RuntimeError):
    """The chat template cannot give exact ids for this conversation."""


class ChatCodec:
    """Prompt and bridge ids of one tokenizer's chat template (see the module docstring).

    `tools`: JSON schemas passed to every render (templates that describe tools put them in the
    system turn). `template_kwargs`: extra variables for the template (e.g. enable_thinking).
    """

    def __init__(self, tokenizer, tools: Optional[list[dict]] = None, template_kwargs: Optional[dict] = None):
        self.tokenizer = tokenizer
        self.tools = tools or None
        self.template_kwargs = dict(template_kwargs or {})
        self.end_of_turn = self._find_end_of_turn()
        self.prefix_preserving, self.reason = self.self_test()
        if self.tools and not self.shows_tools():
            logger.warning("[env] the chat template does not show tools to the model (it renders the same "
                           "with and without them): describe them in the system prompt")
        if not self.prefix_preserving:
            logger.warning("[env] chat template is not prefix-preserving (%s): each turn re-renders the "
                           "history, and a row is closed whenever the history does not extend it", self.reason)

    # ----- renders -------------------------------------------------------------------------------

    def render_text(self, messages: list[Message], add_generation_prompt: bool) -> str:
        """The template's text for `messages`."""
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools, add_generation_prompt=add_generation_prompt, tokenize=False,
            **self.template_kwargs,
        )

    def render_ids(self, messages: list[Message], add_generation_prompt: bool) -> list[int]:
        """The template's token ids for `messages`."""
        ids = self.tokenizer.apply_chat_template(
            messages, tools=self.tools, add_generation_prompt=add_generation_prompt, tokenize=True,
            return_dict=False, **self.template_kwargs,
        )
        if hasattr(ids, "keys"):  # a BatchEncoding from tokenizers that ignore return_dict
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def prompt_ids(self, messages: list[Message]) -> list[int]:
        """Ids of `messages` ending with the assistant's generation prompt: a first prompt, or in
        re-render mode every turn's prompt."""
        return self.render_ids(messages, add_generation_prompt=True)

    def shows_tools(self) -> bool:
        """Whether the template renders the tools' schemas at all (SmolLM2's, for one, does not)."""
        messages = [{"role": "user", "content": "x"}]
        without = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                     **self.template_kwargs)
        return self.render_text(messages, add_generation_prompt=True) != without

    # ----- the bridge ----------------------------------------------------------------------------

    def _find_end_of_turn(self) -> Optional[int]:
        """The id that ends an assistant turn: the last special token of a rendered assistant turn."""
        ids = self.render_ids([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], False)
        special = set(self.tokenizer.all_special_ids)
        return next((i for i in reversed(ids) if i in special), None)

    def turn_end_ids(self, sampled_ids: list[int]) -> list[int]:
        """The end-of-turn id when the sampled ids stop without it (the model ended with another
        stop token), so the bridge that follows sits where the template puts it; else nothing."""
        if self.end_of_turn is None or (sampled_ids and sampled_ids[-1] == self.end_of_turn):
            return []
        return [self.end_of_turn]

    def bridge_ids(self, assistant: Message, new_messages: list[Message]) -> list[int]:
        """Ids that follow an assistant turn ending with its end-of-turn token: `new_messages`
        (tool results, an environment's reply) and the next generation prompt.

        `assistant` is the parsed assistant message; its tool calls are kept in the dummy
        conversation (templates may check that a tool result answers a call), its text is not."""
        if self.end_of_turn is None:
            raise TemplateError("the chat template ends an assistant turn with no special token; "
                                "use re-render mode")
        dummy = {"role": "assistant", "content": "x"}
        if assistant.get("tool_calls"):
            dummy["tool_calls"] = assistant["tool_calls"]
        head = [{"role": "user", "content": "x"}, dummy]
        before = self.render_ids(head, add_generation_prompt=False)
        after = self.render_ids(head + list(new_messages), add_generation_prompt=True)
        cut = max(i for i, t in enumerate(before) if t == self.end_of_turn) + 1
        if after[:cut] != before[:cut]:
            raise TemplateError(
                f"rendering {[m['role'] for m in new_messages]} after an assistant turn changes the turn "
                "itself; the template is not prefix-preserving for these messages: use re-render mode"
            )
        return after[cut:]

    # ----- the start-up self-test ----------------------------------------------------------------

    def self_test(self, conversation: Optional[list[Message]] = None) -> tuple[bool, str]:
        """(True, "") if the template is prefix-preserving on `conversation` (default: a dummy one
        with tool calls, thinking and a later user turn), else (False, why).

        For each assistant turn at position n: the render of messages[:n] with the generation
        prompt, and the render of messages[:n+1] cut after its end-of-turn token, must both be
        prefixes of the render of the whole conversation (text); and `bridge_ids` must work."""
        messages = conversation or SELF_TEST_CONVERSATION
        if self.end_of_turn is None:
            return False, "an assistant turn ends with no special token, so there is no exact place to cut"
        try:
            full = self.render_text(messages, add_generation_prompt=False)
            end_text = self.tokenizer.convert_ids_to_tokens(self.end_of_turn)
            for n, message in enumerate(messages):
                if message["role"] != "assistant":
                    continue
                prompt = self.render_text(messages[:n], add_generation_prompt=True)
                if not full.startswith(prompt):
                    at = _first_difference(prompt, full)
                    return False, (f"the render of the first {n} messages with the generation prompt is not a "
                                   f"prefix of the whole conversation's (at character {at})")
                turn = self.render_text(messages[: n + 1], add_generation_prompt=False)
                turn = turn[: turn.rfind(end_text) + len(end_text)]
                if not full.startswith(turn):
                    return False, (f"assistant turn {n} renders differently once later messages follow "
                                   f"(at character {_first_difference(turn, full)}): the template rewrites "
                                   "earlier turns, e.g. drops their thinking")
                following = []
                for later in messages[n + 1:]:
                    if later["role"] == "assistant":
                        break
                    following.append(later)
                if following:
                    self.bridge_ids(message, following)
        except Exception as exc:  # noqa: BLE001 (any failure of the template means: not usable this way)
            return False, f"{type(exc).__name__}: {exc}"
        return True, ""


def _first_difference(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
