"""ChatCodec and tool-call parsing on real tokenizers: SmolLM2's (ChatML, no tools) and a byte-level
one with a Qwen2.5-style tool template. No vLLM."""

import logging

import pytest
from multiturn_fakes import QWEN_TEMPLATE, STRIP_THINKING_TEMPLATE, Calculator, with_template

from environments.multiturn.chat_codec import ChatCodec
from environments.multiturn.factory import environment_tools, tool_schemas
from environments.multiturn.tool_calls import parse_turn

CALL = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
RESULT = {"role": "tool", "name": "add", "content": "5"}


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoTokenizer

    from example_trainer.model.default_model import default_model_path

    return AutoTokenizer.from_pretrained(default_model_path(), local_files_only=True)


@pytest.fixture(scope="module")
def qwen_style(tokenizer_dir):
    return with_template(tokenizer_dir, QWEN_TEMPLATE)


@pytest.fixture(scope="module")
def schemas():
    return tool_schemas(environment_tools(Calculator()))


def test_calculator_tool_schema_comes_from_signature_and_docstring(schemas):
    (schema,) = schemas
    assert schema["function"]["name"] == "add"
    properties = schema["function"]["parameters"]["properties"]
    assert properties["a"] == {"type": "integer", "description": "The first integer."}
    assert schema["function"]["parameters"]["required"] == ["a", "b"]


def test_smollm2_bridge_keeps_the_newline_after_im_end(smollm2):
    codec = ChatCodec(smollm2)
    assert codec.prefix_preserving, codec.reason
    assert codec.end_of_turn == smollm2.convert_tokens_to_ids("<|im_end|>")
    bridge = codec.bridge_ids({"role": "assistant", "content": "sum"}, [{"role": "tool", "content": "5"}])
    assert smollm2.decode(bridge) == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    assert bridge[0] == smollm2.encode("\n", add_special_tokens=False)[0]


def test_qwen_style_bridge_groups_tool_results_in_one_user_turn(qwen_style, schemas):
    codec = ChatCodec(qwen_style, tools=schemas)
    assert codec.prefix_preserving, codec.reason
    results = [{"role": "tool", "name": "add", "content": "5"}, {"role": "tool", "name": "add", "content": "7"}]
    bridge = codec.bridge_ids({"role": "assistant", "content": "", "tool_calls": [CALL, CALL]}, results)
    assert qwen_style.decode(bridge) == (
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n7\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("which", ["smollm2", "qwen_style"])
def test_prompt_plus_sampled_plus_bridges_is_the_templates_render(which, request, schemas):
    """Token in, token out builds exactly the ids the template gives the whole conversation (checked
    on texts whose tokenisation does not depend on where they are cut)."""
    tokenizer = request.getfixturevalue(which)
    codec = ChatCodec(tokenizer, tools=schemas)
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    turns = [  # (assistant message as rendered, tool results)
        ({"role": "assistant", "content": "Let me add.", "tool_calls": [CALL]}, [RESULT]),
        ({"role": "assistant", "content": "", "tool_calls": [CALL]}, [RESULT]),
        ({"role": "assistant", "content": "It is 5."}, []),
    ]
    row = codec.prompt_ids(first)
    messages = list(first)
    for assistant, results in turns:
        rendered = codec.render_ids(messages + [assistant], add_generation_prompt=False)
        sampled = rendered[len(codec.render_ids(messages, add_generation_prompt=True)):]
        # What vLLM returns: up to and including <|im_end|>.
        sampled = sampled[: len(sampled) - sampled[::-1].index(codec.end_of_turn)]
        row += sampled
        messages += [assistant, *results]
        if results:
            row += codec.turn_end_ids(sampled) + codec.bridge_ids(assistant, results)
    full = codec.render_ids(messages, add_generation_prompt=False)
    assert row == full[: len(row)] and tokenizer.decode(full[len(row):]).strip() == ""


def test_turn_end_ids_restore_an_end_of_turn_the_model_did_not_sample(smollm2):
    codec = ChatCodec(smollm2)
    im_end = codec.end_of_turn
    assert codec.turn_end_ids([5, im_end]) == []
    assert codec.turn_end_ids([5, smollm2.convert_tokens_to_ids("<|endoftext|>")]) == [im_end]


def test_template_that_drops_earlier_thinking_is_not_prefix_preserving(tokenizer_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="onecopy.env"):
        codec = ChatCodec(with_template(tokenizer_dir, STRIP_THINKING_TEMPLATE))
    assert not codec.prefix_preserving
    assert "rewrites earlier turns" in codec.reason
    assert "not prefix-preserving" in caplog.text and codec.reason in caplog.text


def test_template_that_drops_tool_results_is_not_prefix_preserving(tokenizer_dir):
    drops_tools = ("{% for m in messages %}{% if m.role != 'tool' or loop.last %}<|im_start|>{{ m.role }}\n"
                   "{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    codec = ChatCodec(with_template(tokenizer_dir, drops_tools))
    assert not codec.prefix_preserving and "not a prefix" in codec.reason


def test_qwen_tool_calls_are_parsed_from_the_sampled_ids(qwen_style, schemas):
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    ids = qwen_style.encode(text, add_special_tokens=False) + [qwen_style.convert_tokens_to_ids("<|im_end|>")]
    parsed = parse_turn(qwen_style, ids, tools=schemas)
    assert parsed.content == "Let me add."
    assert [(c.name, c.arguments, c.error) for c in parsed.tool_calls] == [("add", {"a": 2, "b": 3}, None)]
    assert parsed.message() == {"role": "assistant", "content": "Let me add.", "tool_calls": [CALL]}


def test_unreadable_tool_call_is_kept_with_its_error(smollm2):
    ids = smollm2.encode('<tool_call>{"name": "add", "arguments": {"a": 2,}}</tool_call>', add_special_tokens=False)
    (call,) = parse_turn(smollm2, ids).tool_calls
    assert call.error.startswith("the tool call is not valid JSON")
    assert "tool_calls" not in parse_turn(smollm2, ids).message()  # the template is not shown a broken call


def test_text_without_tool_calls_is_content(smollm2):
    ids = smollm2.encode("The answer is 5.", add_special_tokens=False) + [smollm2.eos_token_id]
    parsed = parse_turn(smollm2, ids)
    assert parsed.content == "The answer is 5." and parsed.tool_calls == []


def test_template_without_tools_is_reported(smollm2, qwen_style, schemas, caplog):
    with caplog.at_level(logging.WARNING, logger="onecopy.env"):
        assert not ChatCodec(smollm2, tools=schemas).shows_tools()
    assert "does not show tools to the model" in caplog.text
    assert ChatCodec(qwen_style, tools=schemas).shows_tools()


def test_a_tokenizer_with_a_response_template_is_parsed_by_transformers():
    """The wiring only (no tokenizer here ships a response template): sampled ids and the prompt
    as prefix go to parse_response, and its message becomes the turn."""

    class Parses:
        response_template = {"stands": "in"}

        def parse_response(self, response, prefix=None, tools=None):
            self.seen = (response, prefix, tools)
            return {"role": "assistant", "content": " hi ", "tool_calls": [CALL]}

    tokenizer = Parses()
    parsed = parse_turn(tokenizer, [5, 6], prompt_ids=[1, 2], tools=[{"name": "add"}])
    assert tokenizer.seen == ([5, 6], [1, 2], [{"name": "add"}])
    assert parsed.message() == {"role": "assistant", "content": "hi", "tool_calls": [CALL]}
