"""ToolEnv running a TRL-style environment class end to end against a scripted fake /generate
(real tokenizers, no vLLM): rows, masks, prompts sent, closing rows, the group posted."""

import asyncio
import json
import logging
import re

import pytest
from env_fakes import FAST, FakeInference, FakeServer
from multiturn_fakes import (
    ADD_CALL,
    CALCULATOR_TURNS,
    QWEN_TEMPLATE,
    STRIP_THINKING_TEMPLATE,
    Calculator,
    ScriptedInference,
    arithmetic_answer,
    evaluate_once,
    play_one_group,
    process_groups,
    with_template,
)

from api.models import ScoredData
from api.validation import check_shape
from environments.calculator_tool_server import Calculator as PackagedCalculator
from environments.calculator_tool_server import CalculatorToolEnv, CalculatorToolEnvConfig
from environments.config import BaseEnvConfig, ConfigError, ServerConfig
from environments.multiturn.factory import ToolRunner, environment_tools
from environments.multiturn.ledger import PromptMismatch
from environments.multiturn.tool_calls import ToolCall
from environments.multiturn.tool_env import ToolEnv, ToolEnvConfig

pytestmark = pytest.mark.timeout(60)


class CalculatorEnv(ToolEnv):
    name = "calculator"
    environment_factory = Calculator

    async def setup(self):
        self.eval_items = [{"question": "What is 2 + 3? Use the add tool.", "answer": 5}]

    async def get_next_item(self):
        return {"question": "What is 2 + 3? Use the add tool.", "answer": 5}


def make_env(tokenizer, url, **settings):
    config = ToolEnvConfig(**{"group_size": 2, "max_token_length": 2048, "max_tokens": 256, "tokenizer_name": "unused",
                              "max_turns": 4, **settings})
    env = CalculatorEnv(config, ServerConfig(base_url=url, timeout=5.0), tokenizer=tokenizer)
    env.backoff = FAST
    return env


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoTokenizer

    from example_trainer.model.default_model import default_model_path

    return AutoTokenizer.from_pretrained(default_model_path(), local_files_only=True)


def serve(tokenizer, marker, turns=CALCULATOR_TURNS):
    inference = ScriptedInference(tokenizer, turns, right=3, tool_marker=marker,
                                  end_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    return inference, FakeServer(inference).start()


def one_group(env, post_to=None):
    async def go():
        env.open_clients(post_to_api=post_to is not None)
        try:
            await env.setup()
            group, backlog = await env.collect_trajectories(await env.get_next_item())
            kept = await env.handle_send_to_api(group, do_send_to_api=post_to is not None)
            return group, backlog, kept
        finally:
            await env.close_clients()

    return asyncio.run(asyncio.wait_for(go(), 30))


def sampled_positions(row_masks):
    return [i for i, m in enumerate(row_masks) if m != -100]


@pytest.mark.parametrize("which", ["smollm2", "qwen_style"])
def test_calculator_class_plays_an_episode_end_to_end(which, request, tokenizer_dir):
    tokenizer = smollm2_or_qwen(which, request, tokenizer_dir)
    marker = "<|im_start|>tool" if which == "smollm2" else "<tool_response>"
    inference, server = serve(tokenizer, marker)
    try:
        env = make_env(tokenizer, server.url)
        group, backlog, kept = one_group(env)
    finally:
        server.stop()
    assert backlog == [] and kept
    check_shape(ScoredData.model_validate(group.model_dump(exclude_none=True)))  # what the API checks
    assert sorted(group.scores) == [0.0, 1.0]  # add(2, 3) then add(2, 4): one right, one wrong
    assert group.advantages is None  # one row per episode: the trainer takes the baseline itself
    assert len(inference.requests) == 4  # 2 episodes x 2 turns
    for tokens, masks, logprobs in zip(group.tokens, group.masks, group.inference_logprobs):
        text = tokenizer.decode(tokens, skip_special_tokens=False)
        assert text.count(marker) == 1 and text.endswith("The answer is computed.<|im_end|>")
        trained = sampled_positions(masks)
        # Sampled: the tool call and the answer; everything else, the tool result included, is masked.
        assert all(logprobs[i] == -0.5 for i in trained)
        assert all(logprobs[i] == 1.0 for i in range(len(tokens)) if i not in set(trained))
        sampled_text = tokenizer.decode([tokens[i] for i in trained], skip_special_tokens=False)
        assert sampled_text.startswith("Let me add.\n<tool_call>") and "The answer is computed." in sampled_text
        assert marker not in sampled_text and "\n5\n" not in sampled_text.replace("{", "")
    # The prompt sent each turn is the row so far, and sampling resumes right after it.
    for body in inference.requests:
        prompt = body["prompt_token_ids"]
        row = next(i for i, tokens in enumerate(group.tokens) if tokens[: len(prompt)] == prompt)
        assert group.masks[row][len(prompt) - 1] == -100 and group.masks[row][len(prompt)] != -100
    assert group.messages[0][-1] == {"role": "assistant", "content": "The answer is computed."}
    assert [m["role"] for m in group.messages[0]] == ["user", "assistant", "tool", "assistant"]


def smollm2_or_qwen(which, request, tokenizer_dir):
    return request.getfixturevalue("smollm2") if which == "smollm2" else with_template(tokenizer_dir, QWEN_TEMPLATE)


def test_the_group_posts_to_the_api(tokenizer_dir, fake_api):
    tokenizer = with_template(tokenizer_dir, QWEN_TEMPLATE)
    inference, server = serve(tokenizer, "<tool_response>")
    try:
        env = make_env(tokenizer, server.url, rollout_server_url=fake_api.server.url)
        group, _, kept = one_group(env, post_to=fake_api.server.url)
    finally:
        server.stop()
    assert kept and list(fake_api.groups) == [group.group_uuid]
    posted = fake_api.groups[group.group_uuid]
    assert posted["masks"] == group.masks and posted["scores"] == group.scores


def test_template_that_rewrites_history_gives_several_rows_per_episode(tokenizer_dir):
    """Under a template that rewrites history (it drops earlier thinking, and shows no tool calls),
    each turn re-renders the history, which here no longer extends the row: the row is closed, the
    next one starts, and the group's advantages are taken over episodes."""
    tokenizer = with_template(tokenizer_dir, STRIP_THINKING_TEMPLATE)
    turns = ("<think>\nadd them\n</think>\n\n" + ADD_CALL, "<think>\ndone\n</think>\n\nThe answer is computed.")
    inference, server = serve(tokenizer, "<|im_start|>tool", turns)
    try:
        env = make_env(tokenizer, server.url)
        assert not env.codec.prefix_preserving
        group, _, kept = one_group(env)
    finally:
        server.stop()
    assert len(group.tokens) == 4  # 2 episodes x 2 rows
    assert group.scores == [1.0, 1.0, 0.0, 0.0] or group.scores == [0.0, 0.0, 1.0, 1.0]
    assert [a[0] for a in group.advantages] == pytest.approx([1.0, 1.0, -1.0, -1.0] if group.scores[0] else
                                                             [-1.0, -1.0, 1.0, 1.0], abs=1e-4)
    first, second = group.tokens[0], group.tokens[1]
    assert second[: len(first)] != first  # the re-rendered history (no tool-call block) is not an extension
    # Every sampled token is trained in exactly one row: the first turn's in row 1, the answer's in row 2.
    trained = [tokenizer.decode([t for t, m in zip(toks, masks) if m != -100], skip_special_tokens=False)
               for toks, masks in zip(group.tokens[:2], group.masks[:2])]
    assert trained[0].startswith("<think>\nadd them") and trained[0].endswith("</tool_call><|im_end|>")
    assert trained[1] == "<think>\ndone\n</think>\n\nThe answer is computed.<|im_end|>"
    sampled = sum(m != -100 for masks in group.masks[:2] for m in masks)
    per_episode = [len(tokenizer.encode(t.replace("{n}", "3"), add_special_tokens=False)) + 1 for t in turns]
    assert sampled == sum(per_episode)


def test_max_turns_ends_an_episode_that_keeps_calling_tools(tokenizer_dir):
    tokenizer = with_template(tokenizer_dir, QWEN_TEMPLATE)
    inference, server = serve(tokenizer, "<tool_response>", turns=("Again.\n" + ADD_CALL,))
    try:
        env = make_env(tokenizer, server.url, max_turns=3, ensure_scores_are_not_same=False)
        group, _, _ = one_group(env)
    finally:
        server.stop()
    assert len(inference.requests) == 6  # 2 episodes x 3 turns
    for tokens, masks in zip(group.tokens, group.masks):
        assert tokenizer.decode(tokens).count("<tool_response>") == 2  # the third turn's result is not in the row
        assert masks[-1] != -100  # the row ends with the last sampled token


def test_a_first_prompt_longer_than_max_token_length_is_skipped_saying_its_length_and_the_flags(tokenizer_dir,
                                                                                                caplog):
    """Every episode ended context_full before its first turn, and the log said only "no episode
    has both a sampled token and a reward": a user could not tell the prompt was too long."""
    tokenizer = with_template(tokenizer_dir, QWEN_TEMPLATE)
    inference, server = serve(tokenizer, "<tool_response>")
    try:
        env = make_env(tokenizer, server.url, max_token_length=64, max_tokens=16)
        with caplog.at_level(logging.WARNING, logger="onecopy.env"):
            group, _ = play_one_group(env)
    finally:
        server.stop()
    assert group is None and inference.requests == []
    assert env.counts["skipped_too_long"] == 1
    prompt = env.codec.prompt_ids(env.first_messages(asyncio.run(env.get_next_item()), Calculator()))
    assert f"prompt has {len(prompt)} tokens, max_token_length is 64" in caplog.text
    assert "--env.max_token_length" in caplog.text and "--env.shots" in caplog.text


def test_prompt_echo_mismatch_fails_loudly(tokenizer_dir):
    tokenizer = with_template(tokenizer_dir, QWEN_TEMPLATE)

    class AddsBos(ScriptedInference):  # a server that tokenises again and adds a BOS
        def __call__(self, method, path, body, headers):
            code, answer = super().__call__(method, path, body, headers)
            if path == "/generate":
                answer["prompt_token_ids"] = [0] + answer["prompt_token_ids"]
            return code, answer

    inference = AddsBos(tokenizer, CALCULATOR_TURNS, right=3, tool_marker="<tool_response>",
                        end_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    server = FakeServer(inference).start()
    try:
        env = make_env(tokenizer, server.url)
        with pytest.raises(PromptMismatch, match="other prompt ids than the row so far"):
            one_group(env)
    finally:
        server.stop()


def test_tool_errors_are_told_to_the_model_as_trl_writes_them():
    tools = environment_tools(Calculator())
    assert list(tools) == ["add"]
    run = lambda call: json.loads(asyncio.run(ToolRunner(tools).call(call)))  # noqa: E731
    assert run(ToolCall("add", {"a": 2, "b": 3})) == 5
    assert run(ToolCall("mul", {"a": 2})) == {"error": "no tool named 'mul'; the tools are add"}
    assert "missing 1 required positional argument: 'b'" in run(ToolCall("add", {"a": 2}))["error"]
    assert run(ToolCall("", error="the tool call is not valid JSON")) == {"error": "the tool call is not valid JSON"}


def test_config_rejects_bad_turns_and_scales():
    with pytest.raises(ConfigError, match="max_turns"):
        ToolEnvConfig(max_turns=0)
    with pytest.raises(ConfigError, match="episode_advantage_scale"):
        ToolEnvConfig(episode_advantage_scale="batch")
    assert issubclass(ToolEnvConfig, BaseEnvConfig)


def test_greedy_evaluate_plays_episodes(tokenizer_dir):
    tokenizer = with_template(tokenizer_dir, QWEN_TEMPLATE)
    inference, server = serve(tokenizer, "<tool_response>")
    try:
        metrics = evaluate_once(make_env(tokenizer, server.url))
    finally:
        server.stop()
    assert metrics["env/eval_accuracy"] == 1.0 and metrics["env/eval_turns_mean"] == 2.0
    assert all(body["temperature"] == 0.0 for body in inference.requests)


def test_calculator_tool_server_process_writes_groups(smollm2, tmp_path):
    """The demo environment through its command line (`process`), on SmolLM2's tokenizer."""
    from environments.calculator_tool_server import CalculatorToolEnv

    submit = '<tool_call>\n{"name": "submit", "arguments": {"answer": {n}}}\n</tool_call>'
    inference = ScriptedInference(smollm2, (submit, "Done."), right=arithmetic_answer,
                                  tool_marker="<|im_start|>tool", end_id=smollm2.convert_tokens_to_ids("<|im_end|>"))
    groups = process_groups(CalculatorToolEnv, inference, tmp_path / "groups.jsonl")
    assert len(groups) == 2 and all(sorted(g["scores"]) == [0.0, 1.0] for g in groups)
    assert all(len(g["tokens"]) == 2 and g["messages"][0][-1]["content"] == "Done." for g in groups)


def test_a_turn_the_server_aborts_is_sampled_again_from_the_same_row(tokenizer_dir):
    """vLLM aborts requests in flight when the trainer pauses it; the aborted second turn's
    partial ids never reach the row, and the turn is asked again with the same prompt."""
    tokenizer = with_template(tokenizer_dir, QWEN_TEMPLATE)

    class AbortsOnce(ScriptedInference):
        aborted: list = []

        def __call__(self, method, path, body, headers):
            code, answer = super().__call__(method, path, body, headers)
            prompt = tokenizer.decode(body.get("prompt_token_ids", []))
            if path == "/generate" and "<tool_response>" in prompt and not self.aborted:
                self.aborted.append(body["prompt_token_ids"])
                answer["choices"][0].update(token_ids=[ord("Z")] * 3, logprobs=[-9.0] * 3, finish_reason="abort")
            return code, answer

    inference = AbortsOnce(tokenizer, CALCULATOR_TURNS, right=3, tool_marker="<tool_response>",
                           end_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    server = FakeServer(inference).start()
    try:
        group, _, _ = one_group(make_env(tokenizer, server.url))
    finally:
        server.stop()
    (aborted,) = inference.aborted
    asked = [body["prompt_token_ids"] for body in inference.requests]
    assert len(asked) == 5 and asked.count(aborted) == 2  # the aborted turn was asked again, same ids
    assert sorted(group.scores) == [0.0, 1.0] and all(-9.0 not in row for row in group.inference_logprobs)
    assert all(tokenizer.decode(tokens).endswith("The answer is computed.<|im_end|>") for tokens in group.tokens)


def test_a_multi_turn_rows_routes_come_from_each_turns_own_call(smollm2):
    """Routing replay: each /generate call returns routes for its prompt (the row so far) and its
    completion; the fake routes every position of turn k's call to expert k + 1. The trainer's batch
    must replay each turn's sampled tokens with the routes of the call that sampled them. Before,
    the ledger dropped the routes and --routing-replay refused every multi-turn group."""
    from example_trainer.data.batching import build_batch

    inference, server = serve(smollm2, "<|im_start|>tool")
    inference.routes_by_turn = True
    try:
        group, _, _ = one_group(make_env(smollm2, server.url))
    finally:
        server.stop()
    data = ScoredData.model_validate(group.model_dump(exclude_none=True))
    check_shape(data)  # the API's check: one position of routes per token but the last
    batch = build_batch([data], seq_len=2048, routing_replay=True)
    for b, tokens in enumerate(group.tokens):
        prompts = sorted({len(body["prompt_token_ids"]) for body in inference.requests  # both share the first
                          if tokens[: len(body["prompt_token_ids"])] == body["prompt_token_ids"]})
        assert len(prompts) == 2  # this episode's two turns
        for turn, (start, end) in enumerate(zip(prompts, prompts[1:] + [len(tokens)])):
            sampled = [p for p in sampled_positions(group.masks[b]) if start <= p < end]
            assert sampled and sampled[0] == start
            # Position p - 1 produced token p: the routes of the call that sampled it, every layer and slot.
            assert {int(e) for p in sampled for e in batch.routes[b, p - 1].flatten()} == {turn + 1}


class RamblesAfterCalls(FakeInference):
    """A pretrained model's turns: a call, then words until max_tokens, never the end-of-turn token
    (add the operands, then submit the sum, then a reply with no call). It honours `stop` as vLLM
    does: the turn ends at the first stop string (kept with include_stop_str_in_output)."""

    def __call__(self, method, path, body, headers):
        code, answer = super().__call__(method, path, body, headers)
        if path == "/generate" and code == 200:
            for choice in answer["choices"]:
                text = choice["text"]
                stop = next((s for s in body.get("stop") or [] if s in text), None)
                if stop is not None:
                    text = text[: text.index(stop) + (len(stop) if body.get("include_stop_str_in_output") else 0)]
                ids = self.tokenizer.encode(text, add_special_tokens=False)[: body["max_tokens"]]
                choice.update(token_ids=ids, logprobs=[-0.5] * len(ids), text=text,
                              finish_reason="stop" if stop is not None else "length")
        return code, answer

    def _text(self, prompt_ids, i) -> str:
        prompt = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        turn = prompt.count("<|im_start|>tool")
        call = [{"name": "add", "arguments": dict(zip("ab", map(int, re.findall(r"What is (\d+) \+ (\d+)\?", prompt)[-1])))},
                {"name": "submit", "arguments": {"answer": arithmetic_answer(prompt)}}][turn] if turn < 2 else None
        return (f"<tool_call>{json.dumps(call)}</tool_call>" if call else "Done.") + " subtree" * 300


@pytest.mark.parametrize("stop_after_call", [False, True])
def test_stop_after_call_answers_a_model_that_does_not_end_its_turns(smollm2, stop_after_call):
    """A model that writes on after its call: each turn runs to max_tokens, and a turn cut by
    length ends the episode unanswered (accuracy 0). With --env.stop_after_call each turn ends at
    its </tool_call>, the call is answered and the episode solves the problem. The tool calls per
    episode (env/eval_tool_calls_mean) count the calls parsed."""
    server = FakeServer(RamblesAfterCalls(smollm2)).start()
    try:
        config = CalculatorToolEnvConfig(group_size=1, max_token_length=4096, max_tokens=64, tokenizer_name="unused",
                                         max_turns=4, difficulty=2, operations="+", num_eval_items=2,
                                         stop_after_call=stop_after_call)
        env = CalculatorToolEnv(config, ServerConfig(base_url=server.url, timeout=5.0), tokenizer=smollm2)
        env.backoff = FAST
        metrics = evaluate_once(env)
    finally:
        server.stop()
    assert metrics["env/eval_accuracy"] == (1.0 if stop_after_call else 0.0)
    assert metrics["env/eval_turns_mean"] == (3.0 if stop_after_call else 1.0)
    # The calls parsed: add and submit; unanswered, the first turn's add is still one.
    assert metrics["env/eval_tool_calls_mean"] == (2.0 if stop_after_call else 1.0)


def test_calculator_shots_are_solved_episodes_and_never_training_items(smollm2):
    """--env.shots: worked episodes before the question, operators in turn; replaying each shot's
    calls on a fresh Calculator gives its tool messages and a reward of 1; no training item is a
    shot's or an eval item's problem (1-digit sums, so the stream would draw them often)."""
    config = CalculatorToolEnvConfig(group_size=2, max_token_length=2048, max_tokens=64, tokenizer_name="unused",
                                     difficulty=1, operations="+*", shots=3, num_eval_items=8, seed=5)
    env = CalculatorToolEnv(config, ServerConfig(base_url="http://127.0.0.1:9", timeout=5.0), tokenizer=smollm2)
    asyncio.run(env.setup())
    item = asyncio.run(env.get_next_item())
    messages = env.build_messages(item)
    assert messages[0]["role"] == "system" and messages[-1] == {"role": "user", "content": item["question"]}
    shots = [messages[1 + 6 * k: 7 + 6 * k] for k in range(3)]
    assert [re.search(r"[-+*]", s[0]["content"]).group() for s in shots] == ["+", "*", "+"]
    for question, *turns, reply in shots:
        assert reply["role"] == "assistant" and "tool_calls" not in reply
        calculator = PackagedCalculator()
        calculator.reset(answer=arithmetic_answer(question["content"]))
        for assistant, result in zip(turns[::2], turns[1::2]):
            (call,) = assistant["tool_calls"]
            assert result["content"] == asyncio.run(ToolRunner(environment_tools(calculator))
                                                    .call(ToolCall(**call["function"])))
        assert calculator.get_reward() == 1.0
    held_out = {s[0]["content"] for s in shots} | {e["question"] for e in env.eval_items}
    drawn = [asyncio.run(env.get_next_item())["question"] for _ in range(200)]
    assert not held_out & set(drawn) and len(set(drawn)) > 50
