"""Fakes for multi-turn tests: chat templates with tools, a scripted /generate, a calculator.

Templates are set on the byte-level tokenizer of env_fakes (one token per byte, so a text's ids
are the same wherever it is cut). transformers renders with trim_blocks, so a newline right after
a block tag is written as an expression: QWEN_TEMPLATE follows Qwen2.5's layout (tools in the system
turn, `<tool_call>` blocks, consecutive tool results in one user turn of `<tool_response>`s);
STRIP_THINKING_TEMPLATE drops the `<think>` part of every assistant turn but the last, as
reasoning models' templates do (and shows no tool calls), so it is not prefix-preserving.
"""

from __future__ import annotations

import base64
import threading

from env_fakes import FakeInference, one_group

QWEN_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n"
    "Call a tool with <tool_call>\n{\"name\": ..., \"arguments\": ...}\n</tool_call><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' %}"
    "{% elif m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n<tool_response>\\n' }}{{ m.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}{% if m.content or not loop.first %}{{ '\\n' }}{% endif %}"
    "<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}\n"
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

STRIP_THINKING_TEMPLATE = (
    "{% set ns = namespace(last=-1) %}"
    "{% for m in messages %}{% if m.role == 'assistant' %}{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and loop.index0 < ns.last and '</think>' in m.content %}"
    "{{ m.content.split('</think>')[-1].lstrip() }}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def with_template(tokenizer_dir: str, template: str):
    """A fresh copy of the byte-level test tokenizer with `template` as its chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    tokenizer.chat_template = template
    return tokenizer


class Calculator:
    """A TRL-style environment class: reset(**row), one tool, get_reward()."""

    def reset(self, **row):
        self.target = row["answer"]
        self.last_result = None
        return None

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        self.last_result = a + b
        return a + b

    def get_reward(self) -> float:
        return 1.0 if self.last_result == self.target else 0.0


class ScriptedInference(FakeInference):
    """POST /generate that plays a calculator episode turn by turn, read from the prompt.

    Turn k of an episode (k = tool results in the prompt) answers `turns[k]`; `{n}` in it is
    replaced by a number that alternates between right (`right`, or `right(prompt text)`) and
    wrong (right + 1) over the episodes, so a group of two has one of each. Each answer ends with the end-of-turn id
    (`end_id`), as vLLM's token ids do when it stops at EOS; `with_end_id=False` leaves it off.
    `routes_by_turn=True`: each choice carries routed_experts as a server run with
    --enable-return-routed-experts, 2 layers x top_k 2, every position of turn k's call (its
    prompt too) routed to expert k + 1, so a row's routes tell which call each came from.
    """

    def __init__(self, tokenizer, turns, right: int, tool_marker: str, end_id: int):
        super().__init__(tokenizer)
        self.turns, self.right, self.tool_marker, self.end_id = list(turns), right, tool_marker, end_id
        self.with_end_id = True
        self.routes_by_turn = False
        self._numbers = 0  # answers with {n} given so far
        self._lock = threading.Lock()

    def __call__(self, method, path, body, headers):
        code, answer = super().__call__(method, path, body, headers)
        if path == "/generate" and code == 200 and self.with_end_id:
            for choice in answer["choices"]:
                choice["token_ids"].append(self.end_id)
                choice["logprobs"].append(-0.5)
        if path == "/generate" and code == 200 and self.routes_by_turn:
            prompt = body["prompt_token_ids"]
            turn = self.tokenizer.decode(prompt, skip_special_tokens=False).count(self.tool_marker)
            for choice in answer["choices"]:
                positions = len(prompt) + len(choice["token_ids"]) - 1
                choice["routed_experts"] = {"layers": 2, "top_k": 2, "dtype": "uint8",
                                            "data": base64.b64encode(bytes([turn + 1]) * (positions * 4)).decode()}
        return code, answer

    def _text(self, prompt_ids, i) -> str:
        prompt = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        turn = prompt.count(self.tool_marker)
        text = self.turns[min(turn, len(self.turns) - 1)]
        if "{n}" in text:
            with self._lock:
                number, self._numbers = self._numbers, self._numbers + 1
            right = self.right(prompt) if callable(self.right) else self.right
            text = text.replace("{n}", str(right if number % 2 == 0 else right + 1))
        return text


# A calculator episode: call add(2, n) (n right or wrong in turn), then answer with no tool call.
ADD_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": {n}}}\n</tool_call>'
CALCULATOR_TURNS = ("Let me add.\n" + ADD_CALL, "The answer is computed.")


def arithmetic_answer(prompt: str) -> int:
    """The answer to the last "What is A op B?" in `prompt`."""
    import re

    a, op, b = re.findall(r"What is (\d+) ([-+*]) (\d+)\?", prompt)[-1]
    return {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]


def play_one_group(env, timeout: float = 30):
    """(group, backlog) of one item of `env`, with its clients opened and closed around it."""
    import asyncio

    return asyncio.run(asyncio.wait_for(one_group(env), timeout))


def evaluate_once(env, timeout: float = 30) -> dict[str, float]:
    """`env`'s evaluate() metrics, with its clients opened and set up before and closed after."""
    import asyncio

    async def go():
        env.open_clients()
        try:
            await env.setup()
            return await env.evaluate()
        finally:
            await env.close_clients()

    return asyncio.run(asyncio.wait_for(go(), timeout))


def process_groups(env_class, inference, out, *args: str) -> list[dict]:
    """The groups `env_class`'s command line (`process`, SmolLM2's tokenizer) writes to `out`
    against `inference` served by a fake server; `args`: more flags."""
    import json

    from env_fakes import FakeServer

    from environments.cli import run_cli
    from example_trainer.model.default_model import default_model_path

    server = FakeServer(inference).start()
    try:
        run_cli(env_class, ["process", "--env.tokenizer_name", default_model_path(), "--env.total_steps", "2",
                            "--env.group_size", "2", "--env.seed", "1", "--env.max_token_length", "1024",
                            "--env.data_path_to_save_groups", str(out), "--openai.base_url", server.url, *args])
    finally:
        server.stop()
    return [json.loads(line) for line in out.read_text().splitlines()]
