"""A verifiers environment through VerifiersEnv: verifiers' own rollout code (SingleAgentEnv, the null
harness's chat program in a subprocess, its interception server and train client) against a fake
vLLM token route, and the rows built from its traces (skipped without the optional extra:
pip install --no-deps -r requirements-verifiers.txt)."""

from __future__ import annotations

import asyncio
import logging
import re
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.openenv_extra import VERIFIERS_LEFT_OUT, openenv_path  # noqa: E402

if openenv_path():
    pytest.skip(VERIFIERS_LEFT_OUT, allow_module_level=True)
pytest.importorskip("verifiers.v1")

from env_fakes import FakeServer, model_card, one_group  # noqa: E402

from environments.config import ConfigError, ServerConfig  # noqa: E402
from environments.schemas import PROMPT_LOGPROB, PROMPT_MASK  # noqa: E402
from environments.verifiers_server import (  # noqa: E402
    VerifiersEnv,
    VerifiersEnvConfig,
    branch_row,
    episode_score,
    played_episode,
    warn_if_no_renderer,
)

TASKSETS = Path(__file__).resolve().parents[1] / "fixtures" / "verifiers_tasksets"
REPLY_LOGPROB = -0.25


class FakeTokenRoute:
    """vLLM's GET /v1/models and POST /inference/v1/generate (tokens in, tokens out). Even requests
    answer the word the prompt asks for, one id per character (ids a tokenizer would never produce
    from that text: it has one token for the word), then end-of-turn; odd requests answer "no"."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests: list[dict] = []
        self.answers: list[list[int]] = []
        self.current_lora = None  # GET /lora/status: 409 (LoRA off) while None
        self._lock = threading.Lock()

    def __call__(self, method, path, body, headers):
        if (method, path) == ("GET", "/v1/models"):
            return 200, {"object": "list", "data": [model_card("policy", self.tokenizer.name_or_path)]}
        if (method, path) == ("GET", "/lora/status"):
            return (409, {"detail": "LoRA is off"}) if self.current_lora is None else (200, {"current": self.current_lora})
        assert (method, path) == ("POST", "/inference/v1/generate"), (method, path)
        with self._lock:
            i = len(self.requests)
            self.requests.append(body)
        word = re.findall(r"Say the word (\w+)\.", self.tokenizer.decode(body["token_ids"]))[-1]
        text = word if i % 2 == 0 else "no"
        ids = [self.tokenizer.convert_tokens_to_ids(c) for c in text] + [self.tokenizer.eos_token_id]
        with self._lock:
            self.answers.append(ids)
        logprobs = {"content": [{"token": f"token_id:{t}", "logprob": REPLY_LOGPROB, "bytes": [], "top_logprobs": []}
                                for t in ids]}
        return 200, {"request_id": f"r{i}", "prompt_token_ids": body["token_ids"],
                     "choices": [{"index": 0, "token_ids": ids, "logprobs": logprobs, "finish_reason": "stop"}]}


@pytest.fixture
def smollm_tokenizer(default_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model, local_files_only=True)


@pytest.fixture
def token_route(smollm_tokenizer):
    route = FakeTokenRoute(smollm_tokenizer)
    server = FakeServer(route).start()
    route.url = server.url
    yield route
    server.stop()


def echo_env(url: str, tokenizer, **settings) -> VerifiersEnv:
    cfg = VerifiersEnvConfig(taskset="onecopy_vf_echo", group_size=2, max_tokens=16, max_turns=1,
                             ensure_scores_are_not_same=False, seed=3, **settings)
    return VerifiersEnv(cfg, ServerConfig(base_url=url), tokenizer=tokenizer)


def test_rows_hold_the_ids_vllm_returned_not_a_retokenisation(token_route, smollm_tokenizer, monkeypatch):
    monkeypatch.syspath_prepend(str(TASKSETS))
    group, backlog = asyncio.run(one_group(echo_env(token_route.url, smollm_tokenizer)))

    assert backlog == [] and len(token_route.requests) == 2 and len(group.tokens) == 2
    word = re.findall(r"Say the word (\w+)\.", smollm_tokenizer.decode(token_route.requests[0]["token_ids"]))[-1]
    # The precondition that makes this test mean something: the text of the split answer tokenises otherwise.
    assert smollm_tokenizer.encode(word, add_special_tokens=False) != token_route.answers[0][:-1]
    sampled = []
    for tokens, masks, logprobs, score in zip(group.tokens, group.masks, group.inference_logprobs, group.scores):
        first = next(i for i, m in enumerate(masks) if m != PROMPT_MASK)
        assert tokens[:first] == token_route.requests[0]["token_ids"]  # the prompt is exactly the ids vLLM was sent
        assert masks[first:] == tokens[first:]
        assert logprobs[first:] == [REPLY_LOGPROB] * (len(tokens) - first) and logprobs[:first] == [PROMPT_LOGPROB] * first
        assert score == (1.0 if len(tokens) - first > 3 else 0.0)  # the task's own @vf.reward: the word, or "no"
        sampled.append(tokens[first:])
    # The trained ids are the ids vLLM returned, as returned (one episode got each answer).
    assert sorted(sampled) == sorted(token_route.answers)
    assert sorted(group.scores) == [0.0, 1.0] and group.weight_versions is None and group.advantages is None
    assert {r["model"] for r in token_route.requests} == {"policy"}  # the base model: LoRA is off


def test_requests_name_the_current_lora_adapter(token_route, smollm_tokenizer, monkeypatch):
    """In the LoRA modes the trainer's newest adapter is the server's current one; vLLM's token route
    serves the model a request names, so verifiers' requests must name it."""
    monkeypatch.syspath_prepend(str(TASKSETS))
    token_route.current_lora = "step-3"
    asyncio.run(one_group(echo_env(token_route.url, smollm_tokenizer)))
    assert [r["model"] for r in token_route.requests] == ["step-3", "step-3"]


def test_branch_row_masks_what_the_model_did_not_sample():
    row = branch_row([5, 6, 7, 8], [False, False, True, True], [0.0, 0.0, -0.1, -0.2])
    assert row.tokens == [5, 6, 7, 8] and row.masks == [PROMPT_MASK, PROMPT_MASK, 7, 8]
    assert row.logprobs == [PROMPT_LOGPROB, PROMPT_LOGPROB, -0.1, -0.2] and row.versions is None
    with pytest.raises(ValueError, match="must align"):
        branch_row([5, 6], [True], [0.0, 0.0])


def fake_trace(reward: float | None, trainable: bool = True, branches=()):
    rewards = {} if reward is None else {"r": SimpleNamespace(value=reward)}
    return SimpleNamespace(rewards=rewards, reward=reward or 0.0, agent=SimpleNamespace(trainable=trainable),
                           branches=list(branches), num_turns=1, errors=[], messages=[])


def fake_branch(ids, sampled):
    return SimpleNamespace(token_ids=ids, sampled_mask=sampled, logprobs=[-1.0] * len(ids), trainable=True)


def test_an_episode_that_failed_or_was_not_scored_leaves_the_group():
    branch = fake_branch([1, 2, 3], [False, True, True])
    ok = played_episode(SimpleNamespace(ok=True, errors=[], traces=[fake_trace(0.5, branches=[branch])]))
    failed = played_episode(SimpleNamespace(ok=False, errors=[], traces=[fake_trace(0.5, branches=[branch])]))
    unscored = played_episode(SimpleNamespace(ok=True, errors=[], traces=[fake_trace(None, branches=[branch])]))
    assert ok.score == 0.5 and len(ok.rows) == 1
    assert failed.score is None and unscored.score is None
    # A reward that should have run and did not (verifiers records it as None) is no score either.
    assert episode_score([SimpleNamespace(rewards={"r": None}, reward=0.0)]) is None


def test_only_trainable_traces_and_sampled_branches_become_rows():
    judge = fake_trace(1.0, trainable=False, branches=[fake_branch([1, 2], [False, True])])
    solver = fake_trace(0.25, branches=[fake_branch([1, 2, 3], [False, True, False]), fake_branch([4], [False])])
    episode = played_episode(SimpleNamespace(ok=True, errors=[], traces=[solver, judge]))
    assert episode.score == 0.25  # the judge's trace is not the policy's: neither its reward nor its tokens
    assert [row.tokens for row in episode.rows] == [[1, 2]]  # trailing context trimmed, no unsampled branch


def test_config_needs_a_taskset_and_a_known_runtime(token_route, smollm_tokenizer):
    with pytest.raises(ConfigError, match="taskset: is required"):
        asyncio.run(one_group(VerifiersEnv(VerifiersEnvConfig(), ServerConfig(base_url=token_route.url),
                                           tokenizer=smollm_tokenizer)))
    with pytest.raises(ConfigError, match="runtime"):
        VerifiersEnvConfig(taskset="x", runtime="modal")
    with pytest.raises(ConfigError, match="taskset_args: must be a JSON object"):
        VerifiersEnvConfig(taskset="x", taskset_args="[1]")
    with pytest.raises(ConfigError, match="taskset_args: is not JSON"):
        VerifiersEnvConfig(taskset="x", taskset_args="{size: 3}")


class TwoTurnTrace:
    """A verifiers trace built turn by turn by verifiers' own graph code (prepare_turn, then commit
    of each turn's response, as its train client commits them): a user message, a first turn, a
    tool result, a second turn. Ids 1-9 are template tokens; each turn samples ids and logprobs of
    its own, so a position shows which turn it came from."""

    USER = (1, 2, 3)  # the user message's ids; the generation prompt is 4, 5
    TURNS = ([10, 11, 12], [30, 31])
    LOGPROBS = ([-0.1, -0.2, -0.3], [-0.4, -0.5])

    def __init__(self):
        import verifiers.v1 as vf
        from verifiers.v1.trace import AgentInfo, Trace, TraceTask

        self.vf = vf
        self.trace = Trace(task=TraceTask(type="Echo", data=vf.TaskData(prompt="Say hello."), key="k", hash="h"),
                           agent=AgentInfo(config=vf.AgentConfig()))
        self.user = vf.UserMessage(content="Say hello.")

    def turn(self, prompt, prompt_ids, spans, k):
        from verifiers.v1 import graph
        from verifiers.v1.types import Response, TurnTokens

        message = self.vf.AssistantMessage(content=f"turn {k}")
        tokens = TurnTokens(prompt_ids=prompt_ids, completion_ids=self.TURNS[k], completion_logprobs=self.LOGPROBS[k],
                            message_spans=spans)
        graph.prepare_turn(self.trace, prompt).commit(
            Response(id=f"r{k}", created=0, model="policy", message=message, finish_reason="stop", tokens=tokens))
        return message

    def play(self, second_prompt_history):
        """Both turns; the second turn's prompt renders the first turn's message as
        `second_prompt_history` ids (its sampled ids: the row extends; others: a new row)."""
        first = self.turn([self.user], [*self.USER, 4, 5], [(0, 3)], 0)
        history = [*self.USER, *second_prompt_history]
        result = self.vf.UserMessage(content="tool says: hello")
        second_prompt = [*history, 20, 21, 4, 5]  # the tool result's ids, then the generation prompt
        self.turn([self.user, first, result], second_prompt,
                  [(0, 3), (3, len(history)), (len(history), len(history) + 2)], 1)
        return played_episode(SimpleNamespace(ok=True, errors=[], traces=[self.trace]))


def sampled(row):
    """(id, logprob) at each sampled position of `row`, in order."""
    return [(t, lp) for t, m, lp in zip(row.tokens, row.masks, row.logprobs) if m != PROMPT_MASK]


def test_a_multi_turn_trace_keeps_each_turns_ids_and_logprobs_at_their_positions():
    """A two-turn verifiers episode through verifiers' own trace graph and played_episode: where the
    second prompt extends the first turn's ids, one row holds both turns, each sampled id beside
    the logprob vLLM gave it; where it re-renders the first turn (other ids), each turn is a row of
    its own, the re-rendered turn masked as context. No weight versions: verifiers keeps none."""
    trace = TwoTurnTrace()
    turns = [list(zip(ids, lps)) for ids, lps in zip(trace.TURNS, trace.LOGPROBS)]
    (row,) = trace.play(second_prompt_history=[4, 5, *trace.TURNS[0]]).rows
    assert sampled(row) == turns[0] + turns[1]
    assert row.tokens[:5] == [*trace.USER, 4, 5] and row.tokens[-2:] == trace.TURNS[1] and row.versions is None
    assert row.tokens[8:12] == [20, 21, 4, 5] and row.masks[8:12] == [PROMPT_MASK] * 4

    rerendered = [4, 5, 13, 14]  # the first turn as the template writes it back: not the ids sampled
    rows = TwoTurnTrace().play(second_prompt_history=rerendered).rows
    assert [sampled(r) for r in rows] == [turns[0], turns[1]]
    assert rows[1].tokens[3:7] == rerendered and all(r.versions is None for r in rows)


@pytest.fixture
def tool_tokenizer(tokenizer_dir, tmp_path):
    """The byte-level test tokenizer with <tool_call> and </tool_call> as tokens of their own (as
    Qwen's are), saved to a local folder: its name_or_path is a path, as onecopy's always is."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    tokenizer.save_pretrained(tmp_path / "policy")
    return AutoTokenizer.from_pretrained(tmp_path / "policy", local_files_only=True)


def rendered_tool_calls(env, tokenizer) -> list[str]:
    """The tool calls that the renderer of `env`'s train client reads from a turn that calls add."""
    from renderers.base import create_renderer

    renderer = create_renderer(tokenizer, env.model_context("policy", 1.0, 16).client.renderer)
    ids = tokenizer.encode('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>',
                           add_special_tokens=False)
    return [call.name for call in renderer.parse_response(ids).tool_calls if call.name]


def test_env_renderer_gives_the_train_client_a_renderer_that_reads_tool_calls(tool_tokenizer, caplog):
    """verifiers resolves its renderer from the tokenizer's name, which a local folder never
    matches: the default renderer reads no tool call, so a tool-using (multi-turn) episode ended
    after its first turn. --env.renderer names the renderer (and its tool parser)."""
    url = "http://127.0.0.1:9"
    assert rendered_tool_calls(echo_env(url, tool_tokenizer), tool_tokenizer) == []  # the name resolves nothing
    qwen_calls = echo_env(url, tool_tokenizer, renderer='{"name": "default", "tool_parser": "qwen3"}')
    assert rendered_tool_calls(qwen_calls, tool_tokenizer) == ["add"]
    with pytest.raises(ConfigError, match="renderer: "):
        echo_env(url, tool_tokenizer, renderer='{"name": "no-such-renderer"}')
    with caplog.at_level(logging.WARNING, logger="onecopy.env"):
        warn_if_no_renderer("", tool_tokenizer.name_or_path)
        warn_if_no_renderer('{"name": "qwen3"}', tool_tokenizer.name_or_path)
    assert caplog.text.count("with its default renderer, which reads no tool call") == 1
