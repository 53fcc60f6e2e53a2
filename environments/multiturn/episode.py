"""The turn loop of one episode, whatever answers the model: tools, a game, a user simulator.

    prompt = the row so far  ->  POST /generate (prompt ids)  ->  check the echo, add the sampled
    ids  ->  parse the turn  ->  respond(turn)  ->  None: the episode ends
                                                ->  messages: bridge them into the row, next turn

`respond` is the one thing that varies (factory.ToolRunner answers with tool results;
ChatEnv with an environment's reply as a user message). The bridge is the chat codec's exact
suffix when the template is prefix-preserving, else the whole history rendered again
(`EpisodeLedger.continue_with`, which closes the row when the history does not extend it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional

from environments.multiturn.chat_codec import ChatCodec, Message, TemplateError
from environments.multiturn.ledger import Episode, EpisodeLedger
from environments.multiturn.tool_calls import ParsedTurn, parse_turn

logger = logging.getLogger("onecopy.env")

# What answers a turn: the parsed turn and its assistant message in, the messages that answer it
# out (tool results, an environment's reply), or None when the episode ends with this turn.
Respond = Callable[[ParsedTurn, Message], Awaitable[Optional[list[Message]]]]


@dataclass(frozen=True)
class TurnLimits:
    """How long an episode may run: model turns, tokens per turn, tokens per row; and how long a
    tool result or environment reply may be, in characters (0: no cap)."""

    max_turns: int
    max_tokens: int
    max_token_length: int
    max_message_chars: int = 0


def capped(message: Message, max_chars: int) -> Message:
    """`message` with its content cut to `max_chars` characters and a note saying how many were
    left out (a tool that prints a whole file would otherwise fill the row)."""
    content = message.get("content")
    if not max_chars or not isinstance(content, str) or len(content) <= max_chars:
        return message
    return {**message, "content": f"{content[:max_chars]}\n[{len(content) - max_chars} more characters cut]"}


async def play_turns(
    messages: list[Message],
    *,
    codec: ChatCodec,
    inference,
    limits: TurnLimits,
    sampling: dict[str, Any],
    respond: Respond,
    ended_by_respond: str = "answered",
) -> Episode:
    """Play one episode from the chat `messages`; returns the Episode with the whole conversation
    in `messages` and its score not yet set (0.0).

    `inference` is an InferenceClient (or anything with its `generate`); `sampling` the keyword
    arguments of each generate call besides the prompt, n and max_tokens (temperature, top_p,
    seed, or any vLLM sampling field). The last allowed turn is still answered (the environment's
    state then holds every action the model took), but no turn follows it. `info["ended"]` says
    why the episode ended: `ended_by_respond` (respond returned None), length, max_turns or
    context_full (with `info["turns"]` 0 when the first prompt alone fills max_token_length);
    `info["prompt_tokens"]` the first prompt's length; `info["restarts"]` how often a row was
    closed because the history did not extend it, `info["tool_calls"]` every tool call the model's
    turns made (an unreadable one and one in a turn cut by length included; the one count that the
    evaluation and the training metrics of tool calls read), `info["unreadable_calls"]` those of
    them that could not be read.
    """
    messages = list(messages)
    ledger = EpisodeLedger(codec.prompt_ids(messages))
    prompt_tokens = len(ledger.prompt_ids)
    turns, ended, calls, unreadable = 0, "", 0, 0
    while True:
        prompt = ledger.prompt_ids
        budget = min(limits.max_tokens, limits.max_token_length - len(prompt))
        if budget < 1:
            ended = "context_full"
            break
        out = await inference.generate(prompt, n=1, max_tokens=budget, **sampling)
        ledger.check_echo(out.prompt_token_ids)
        choice = out.choices[0]
        ledger.add_sampled(choice.token_ids, choice.logprobs, choice.weight_versions, choice.routed_experts)
        turns += 1
        parsed = parse_turn(codec.tokenizer, choice.token_ids, prompt, codec.tools)
        calls += len(parsed.tool_calls)
        unreadable += sum(call.error is not None for call in parsed.tool_calls)
        assistant = parsed.message()
        messages.append(assistant)
        if choice.finish_reason == "length":
            ended = "length"
            break
        answer = await respond(parsed, assistant)
        if not answer:
            ended = ended_by_respond
            break
        answer = [capped(m, limits.max_message_chars) for m in answer]
        messages.extend(answer)
        if turns >= limits.max_turns:
            ended = "max_turns"
            break
        bridge = None
        if codec.prefix_preserving:
            try:
                bridge = codec.turn_end_ids(choice.token_ids) + codec.bridge_ids(assistant, answer)
            except TemplateError as exc:  # this turn's messages only: re-render it, as a non-preserving template
                logger.debug("[env] re-rendering the history: %s", exc)
        if bridge is not None:
            ledger.add_context(bridge)
        else:
            ledger.continue_with(codec.prompt_ids(messages))
    info = {"turns": turns, "ended": ended, "prompt_tokens": prompt_tokens, "restarts": ledger.restarts,
            "tool_calls": calls, "unreadable_calls": unreadable}
    return Episode(ledger.finish(), 0.0, messages, info)
