"""Tool calls parsed from one turn's sampled ids.

A tokenizer with a response template (transformers' `response_template`, read by its
`parse_response`) is parsed by transformers. Any other is parsed as the Qwen/ChatML format,
the only one handled here:

    <tool_call>
    {"name": "add", "arguments": {"a": 2, "b": 3}}
    </tool_call>

A block whose JSON cannot be read, or that names no function, is kept as a ToolCall with `error`
set: the model is told what was wrong (`factory.ToolRunner.call`), rather than the episode ending.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Optional

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass
class ToolCall:
    """One call: the function's name and its arguments, or why the call could not be read."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: Optional[str] = None

    def as_message_entry(self) -> dict[str, Any]:
        """The entry of an assistant message's `tool_calls`, as chat templates read it."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedTurn:
    """One assistant turn: its text without the tool-call blocks, and its tool calls."""

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)

    def message(self) -> dict[str, Any]:
        """The assistant message of this turn (content always a string: templates concatenate it)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        readable = [call.as_message_entry() for call in self.tool_calls if call.error is None]
        if readable:
            message["tool_calls"] = readable
        return message


def parse_qwen(text: str) -> ParsedTurn:
    """The `<tool_call>{json}</tool_call>` blocks of `text`, and the text around them."""
    calls = []
    for body in _TOOL_CALL.findall(text):
        try:
            data = json.loads(body)
        except json.JSONDecodeError as exc:
            calls.append(ToolCall("", error=f"the tool call is not valid JSON ({exc.msg} at character {exc.pos})"))
            continue
        calls.append(_call_from(data))
    return ParsedTurn(_TOOL_CALL.sub("", text).strip(), calls)


def _call_from(data: Any) -> ToolCall:
    """A ToolCall from {"name", "arguments"} or {"function": {"name", "arguments"}}."""
    if isinstance(data, dict) and isinstance(data.get("function"), dict):
        data = data["function"]
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return ToolCall("", error='a tool call must be {"name": ..., "arguments": {...}}')
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):  # OpenAI style: arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return ToolCall(data["name"], error="the tool call's arguments are not valid JSON")
    if not isinstance(arguments, dict):
        return ToolCall(data["name"], error="the tool call's arguments must be an object")
    return ToolCall(data["name"], arguments)


def parse_turn(tokenizer, sampled_ids: list[int], prompt_ids: Optional[list[int]] = None,
               tools: Optional[list[dict]] = None) -> ParsedTurn:
    """The content and tool calls of one turn's sampled ids (trailing special tokens such as the
    end-of-turn token are not content)."""
    if getattr(tokenizer, "response_template", None) is not None:
        parsed = tokenizer.parse_response(list(sampled_ids), prefix=list(prompt_ids or []), tools=tools)
        return ParsedTurn(str(parsed.get("content") or "").strip(),
                          [_call_from(call) for call in parsed.get("tool_calls") or []])
    special = set(tokenizer.all_special_ids)
    ids = list(sampled_ids)
    while ids and ids[-1] in special:
        ids.pop()
    return parse_qwen(tokenizer.decode(ids, skip_special_tokens=False))
