"""TRL's `environment_factory` contract, point by point, on ToolEnv against a scripted fake
/generate (no TRL, no vLLM): a no-arg constructor per episode, reset(**row) and its string,
public methods as tools, exceptions as {"error": ...} tool messages, async tools awaited, sync
tools off the event loop, get_reward optional, TRL-style reward functions with TRL's multi-turn
arguments, and an episode rewarded None leaving its group."""

import asyncio
import json
import threading
import time

import pytest
from env_fakes import FAST, FakeServer
from multiturn_fakes import (
    ADD_CALL,
    CALCULATOR_TURNS,
    QWEN_TEMPLATE,
    Calculator,
    ScriptedInference,
    evaluate_once,
    play_one_group,
    with_template,
)

from environments.config import ServerConfig
from environments.multiturn.factory import ToolRunner, environment_tools, reset_messages, tool_metrics, tool_schemas
from environments.multiturn.ledger import Episode
from environments.multiturn.tool_calls import ParsedTurn, ToolCall
from environments.multiturn.tool_env import ToolEnv, ToolEnvConfig

pytestmark = pytest.mark.timeout(60)
QUESTION = "What is 2 + 3? Use the add tool."


def make_env(env_class, tokenizer, url, **settings):
    config = ToolEnvConfig(**{"group_size": 2, "max_token_length": 2048, "max_tokens": 256, "tokenizer_name": "unused",
                              "max_turns": 4, "ensure_scores_are_not_same": False, **settings})
    env = env_class(config, ServerConfig(base_url=url, timeout=5.0), tokenizer=tokenizer)
    env.backoff = FAST
    return env


def tool_env(factory, **attributes):
    """A ToolEnv subclass over `factory` whose only item is QUESTION (answer 5)."""

    async def setup(self):
        self.eval_items = []

    async def get_next_item(self):
        return {"question": QUESTION, "answer": 5, "level": "easy"}

    return type("Env", (ToolEnv,), {"name": "t", "environment_factory": factory, "setup": setup,
                                    "get_next_item": get_next_item, **attributes})


@pytest.fixture
def qwen(tokenizer_dir):
    return with_template(tokenizer_dir, QWEN_TEMPLATE)


def one_group(env_class, tokenizer, turns=CALCULATOR_TURNS, **settings):
    """(group, requests) of one group of `env_class` against scripted turns (add(2, 3) then
    add(2, 4) across the two episodes, then an answer)."""
    inference = ScriptedInference(tokenizer, turns, right=3, tool_marker="<tool_response>",
                                  end_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    server = FakeServer(inference).start()
    try:
        group, _ = play_one_group(make_env(env_class, tokenizer, server.url, **settings))
        return group, inference.requests
    finally:
        server.stop()


def group_and_metrics(env_class, tokenizer, turns=CALCULATOR_TURNS):
    """(group, wandb_log metrics, env) of one group of `env_class` against scripted `turns`."""
    inference = ScriptedInference(tokenizer, turns, right=3, tool_marker="<tool_response>",
                                  end_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    server = FakeServer(inference).start()
    env = make_env(env_class, tokenizer, server.url)
    try:
        group, _ = play_one_group(env)
        return group, asyncio.run(env.wandb_log()), env
    finally:
        server.stop()


def tool_messages(group):
    return [[m["content"] for m in messages if m["role"] == "tool"] for messages in group.messages]


# ----- the class ---------------------------------------------------------------------------------

def test_each_episode_gets_its_own_instance_from_the_no_arg_factory(qwen):
    made = []

    class Counted(Calculator):
        def __init__(self):
            made.append(self)

    group, _ = one_group(tool_env(Counted), qwen)
    # One instance per episode, one more to read the tools' schemas (never reset); each episode's
    # tool calls ran on its own instance.
    played = [env for env in made if hasattr(env, "last_result")]
    assert len(made) == 3 and sorted(env.last_result for env in played) == [5, 6]
    assert sorted(group.scores) == [0.0, 1.0]


def test_reset_gets_the_row_and_its_string_is_appended_to_the_last_message():
    class Greeter:
        def reset(self, **row):
            self.row = row
            return f" Level: {row['level']}."

    environment = Greeter()
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q?"}]
    first = reset_messages(environment, messages, {"prompt": messages, "level": "easy"})
    assert first == [{"role": "system", "content": "S"}, {"role": "user", "content": "Q? Level: easy."}]
    assert messages[-1]["content"] == "Q?"  # the row's messages are not changed in place
    assert environment.row == {"prompt": messages, "level": "easy"}
    assert reset_messages(environment, [], {"level": "hard"}) == [{"role": "user", "content": " Level: hard."}]


def test_reset_returning_none_leaves_the_prompt_and_a_class_without_reset_is_refused():
    class Silent:
        def reset(self, **row):
            return None

    messages = [{"role": "user", "content": "Q?"}]
    assert reset_messages(Silent(), messages, {}) == messages
    with pytest.raises(TypeError, match="has no reset"):
        reset_messages(object(), messages, {})


def test_public_methods_are_the_tools_with_schemas_from_their_docstrings():
    class Tools:
        def reset(self, **row):
            pass

        def lookup(self, key: str) -> str:
            """Look a key up.

            Args:
                key: The key.
            """
            return key

        async def fetch(self, url: str) -> str:
            """Fetch a page.

            Args:
                url: The address.
            """
            return url

        def _helper(self):
            pass

        def get_reward(self):
            return 1.0

    tools = environment_tools(Tools())
    assert sorted(tools) == ["fetch", "lookup"]  # not reset, get_reward or private methods
    schemas = {s["function"]["name"]: s["function"] for s in tool_schemas(tools)}
    assert schemas["lookup"]["description"] == "Look a key up."
    assert schemas["fetch"]["parameters"]["properties"]["url"] == {"type": "string", "description": "The address."}

    class Undocumented:
        def reset(self, **row):
            pass

        def act(self, x: int):
            return x

    with pytest.raises(TypeError, match="tool 'act' has no usable schema"):
        tool_schemas(environment_tools(Undocumented()))


# ----- tools in an episode -----------------------------------------------------------------------

def test_a_tool_that_raises_answers_the_model_with_an_error_message(qwen):
    class Fragile(Calculator):
        def add(self, a: int, b: int) -> int:
            """Add two integers, unless b is 4.

            Args:
                a: The first integer.
                b: The second integer.
            """
            if b == 4:
                raise ValueError("b must not be 4")
            return super().add(a, b)

    group, _ = one_group(tool_env(Fragile), qwen)
    assert sorted(tool_messages(group)) == [["5"], ['{"error": "b must not be 4"}']]
    # The error is context the model reads in its next turn, masked like any tool result.
    errored = next(i for i, m in enumerate(group.messages) if "error" in m[2]["content"])
    tokens, error = group.tokens[errored], qwen.encode('{"error": "b must not be 4"}', add_special_tokens=False)
    start = next(i for i in range(len(tokens)) if tokens[i:i + len(error)] == error)
    assert all(m == -100 for m in group.masks[errored][start:start + len(error)])


def test_async_tools_are_awaited(qwen):
    class AsyncCalculator(Calculator):
        async def add(self, a: int, b: int) -> int:
            """Add two integers.

            Args:
                a: The first integer.
                b: The second integer.
            """
            await asyncio.sleep(0)
            self.last_result = a + b
            return a + b

    group, _ = one_group(tool_env(AsyncCalculator), qwen)
    assert sorted(tool_messages(group)) == [["5"], ["6"]] and sorted(group.scores) == [0.0, 1.0]


def test_sync_tools_run_off_the_event_loop(qwen):
    """Both episodes' sync tools wait for each other: on the event loop the first would hold it,
    the second episode's turn would never come, and the barrier would break."""
    barrier = threading.Barrier(2, timeout=20)

    class Meeting(Calculator):
        def add(self, a: int, b: int) -> int:
            """Add two integers once the other episode's call has come too.

            Args:
                a: The first integer.
                b: The second integer.
            """
            barrier.wait()
            return super().add(a, b)

    group, _ = one_group(tool_env(Meeting), qwen)
    assert sorted(tool_messages(group)) == [["5"], ["6"]]


# ----- rewards -----------------------------------------------------------------------------------

def test_get_reward_is_optional_with_reward_functions_and_they_get_trls_arguments(qwen):
    seen = {}

    class NoReward(Calculator):
        get_reward = None  # a class without get_reward()

    def correct(prompts, completions, answer, environments, completion_ids, level, **kwargs):
        seen.update(prompts=prompts, completions=completions, answer=answer, environments=environments,
                    completion_ids=completion_ids, level=level, kwargs=kwargs)
        return [1.0 if env.last_result == target else 0.0 for env, target in zip(environments, answer)]

    def short(completions, **kwargs):
        return [-0.1 * len(messages) for messages in completions]

    env_class = tool_env(NoReward, reward_funcs=(correct, short), reward_weights=(1.0, 0.5))
    group, _ = one_group(env_class, qwen)
    assert seen["prompts"] == [[{"role": "user", "content": QUESTION}]] * 2
    for messages in seen["completions"]:  # everything after the prompt, as messages
        assert [m["role"] for m in messages] == ["assistant", "tool", "assistant"]
        assert messages[0]["tool_calls"][0]["function"]["name"] == "add"
    assert seen["answer"] == [5, 5] and seen["level"] == ["easy", "easy"]
    assert seen["kwargs"] == {"question": [QUESTION] * 2}  # every other column of the row
    assert all(isinstance(env, NoReward) for env in seen["environments"])
    for ids, tokens, masks in zip(seen["completion_ids"], group.tokens, group.masks):
        assert ids == [t for t, m in zip(tokens, masks) if m != -100]
    assert sorted(group.scores) == pytest.approx([-0.15, 0.85])  # 0 or 1, and -0.1 * 3 messages * 0.5


def test_without_get_reward_or_reward_functions_the_error_says_what_to_give(qwen):
    class NoReward(Calculator):
        get_reward = None

    with pytest.raises(NotImplementedError, match="has no get_reward.*reward_funcs"):
        one_group(tool_env(NoReward), qwen)


def test_an_episode_rewarded_none_leaves_the_group_instead_of_scoring_zero(qwen):
    def right_or_nothing(environments, answer, **kwargs):
        return [1.0 if env.last_result == target else None for env, target in zip(environments, answer)]

    group, requests = one_group(tool_env(Calculator, reward_funcs=(right_or_nothing,)), qwen, group_size=3)
    assert len(requests) == 6  # three episodes played: right, wrong, right
    assert group.scores == [1.0, 1.0]  # the wrong one has no reward: not a 0 pulling the baseline down
    assert all("<tool_response>\n5\n" in qwen.decode(tokens) for tokens in group.tokens)


def test_a_group_whose_episodes_all_have_no_reward_is_skipped(qwen):
    class Unrewarded(Calculator):
        def get_reward(self):
            return None

    group, _ = one_group(tool_env(Unrewarded), qwen)
    assert group is None


def test_max_turns_reached_still_scores_with_the_tool_calls_made(qwen):
    group, requests = one_group(tool_env(Calculator), qwen, turns=("Again.\n" + ADD_CALL,), max_turns=2)
    assert len(requests) == 4 and sorted(group.scores) == [0.0, 1.0]
    assert all(json.loads(m) in (5, 6) for messages in tool_messages(group) for m in messages)


def test_many_episodes_blocking_tools_run_at_once():
    """64 sync calls that each wait for all the others: asyncio's default executor (6 threads on
    2 cores) would run a few and leave the rest queued until the barrier broke."""
    from environments.multiturn.factory import call_off_loop

    barrier = threading.Barrier(64, timeout=20)

    def wait_for_all(i: int) -> int:
        barrier.wait()
        return i

    async def go():
        return await asyncio.gather(*(call_off_loop(wait_for_all, i) for i in range(64)))

    assert asyncio.run(go()) == list(range(64))


def test_a_long_tool_result_is_cut_with_a_note_before_it_enters_the_row(qwen):
    class Verbose(Calculator):
        def add(self, a: int, b: int) -> str:
            """Add two integers and explain at length.

            Args:
                a: The first integer.
                b: The second integer.
            """
            self.last_result = a + b
            return f"{a + b}" + "!" * 500

    group, _ = one_group(tool_env(Verbose), qwen, max_message_chars=40)
    for (result,), tokens in zip(sorted(tool_messages(group)), group.tokens):
        assert len(result.split("\n")[0]) == 40 and result.endswith("\n[461 more characters cut]")
    assert all("!" * 41 not in qwen.decode(tokens) for tokens in group.tokens)


def test_tool_metrics_count_the_calls_the_script_made_and_a_tool_that_raised_as_an_error(qwen):
    """Each episode's first turn calls add, fail, add; the tool that raised answers {"error": ...}
    and the episode goes on to its second turn, which calls nothing. The counts come from the
    script; each add sleeps, and its measured time is at least that sleep (no upper bound)."""
    sleep = 0.01
    fail_call = '<tool_call>\n{"name": "fail", "arguments": {"reason": "broken"}}\n</tool_call>'
    first = f"Let me add.\n{ADD_CALL}\n{fail_call}\n{ADD_CALL}"
    script = (first, "unreached", "unreached", "The answer is computed.")  # by tool results so far: 0, then 3
    played = (first, script[3])

    class Failing(Calculator):
        def add(self, a: int, b: int) -> int:
            """Add two integers, slowly.

            Args:
                a: The first integer.
                b: The second integer.
            """
            time.sleep(sleep)
            return super().add(a, b)

        def fail(self, reason: str) -> str:
            """Raise.

            Args:
                reason: What to raise with.
            """
            raise RuntimeError(reason)

    group, metrics, _ = group_and_metrics(tool_env(Failing), qwen, script)
    for messages in group.messages:  # the error is the tool's reply, and the episode went on
        assert [m["role"] for m in messages[1:]] == ["assistant", "tool", "tool", "tool", "assistant"]
        assert messages[3]["content"] == '{"error": "broken"}' and messages[-1]["content"] == script[3]
    episodes, turns = 2, len(played)
    calls = sum(turn.count("<tool_call>") for turn in played)
    adds, fails = sum(turn.count('"add"') for turn in played), sum(turn.count('"fail"') for turn in played)
    assert (calls, adds, fails) == (3, 2, 1)
    assert metrics["env/episode_tool_calls"] == episodes * calls
    assert metrics["env/episode_tool_calls_mean"] == calls
    assert metrics["env/episode_tool_calls_per_turn"] == calls / turns
    assert metrics["env/episode_tool_errors"] == episodes * fails
    assert metrics["env/tool_call_seconds_max"] >= sleep
    assert metrics["env/tool_call_seconds_mean"] >= sleep * adds / calls


class CutAtBudget(ScriptedInference):
    """ScriptedInference whose turn that would pass max_tokens is cut there and ends at length,
    as vLLM's does: no end-of-turn id after it."""

    def __call__(self, method, path, body, headers):
        code, answer = super().__call__(method, path, body, headers)
        if path == "/generate" and code == 200:
            for choice in answer["choices"]:
                if len(choice["token_ids"]) > body["max_tokens"]:
                    del choice["token_ids"][body["max_tokens"]:], choice["logprobs"][body["max_tokens"]:]
                    choice["finish_reason"] = "length"
        return code, answer


class WithFailingTool(Calculator):
    def fail(self, reason: str) -> str:
        """Raise.

        Args:
            reason: What to raise with.
        """
        raise RuntimeError(reason)


FAIL_CALL = '<tool_call>\n{"name": "fail", "arguments": {"reason": "broken"}}\n</tool_call>'
UNREADABLE_CALL = "<tool_call>\nnot json\n</tool_call>"
CUT_CALL = ADD_CALL + " and so on" * 40  # passes max_tokens (256): the turn ends at length, unanswered
# Turn k answers the script's k-th entry, k = the tool results so far: the first turn's calls
# lead to the entry after as many results as it made.
CALL_SCRIPTS = {
    "unreadable": ((f"{ADD_CALL}\n{UNREADABLE_CALL}", "", "Done."), 2, 1),
    "error_reply": ((f"{ADD_CALL}\n{FAIL_CALL}", "", "Done."), 2, 1),
    "cut_by_max_tokens": ((ADD_CALL, CUT_CALL), 2, 0),
    "all": ((f"{ADD_CALL}\n{UNREADABLE_CALL}\n{FAIL_CALL}", "", "", CUT_CALL), 4, 2),
}


@pytest.mark.parametrize("script", CALL_SCRIPTS)
def test_eval_and_training_metrics_count_the_same_tool_calls(qwen, script):
    """The held-out metric (env/eval_tool_calls_mean) and the training one
    (env/episode_tool_calls_mean) read one count of the calls the model made: an unreadable call,
    one the tool answered with an error, and one in a turn cut by max_tokens (never answered)."""
    turns, calls, errors = CALL_SCRIPTS[script]
    inference = CutAtBudget(qwen, turns, right=3, tool_marker="<tool_response>",
                            end_id=qwen.convert_tokens_to_ids("<|im_end|>"))

    async def setup(self):
        self.eval_items = [{"question": QUESTION, "answer": 5}]

    server = FakeServer(inference).start()
    try:
        env = make_env(tool_env(WithFailingTool, setup=setup), qwen, server.url)
        play_one_group(env)
        training = asyncio.run(env.wandb_log())
        held_out = evaluate_once(env)
    finally:
        server.stop()
    assert held_out["env/eval_tool_calls_mean"] == training["env/episode_tool_calls_mean"] == calls
    assert training["env/episode_tool_calls"] == 2 * calls  # the group's two episodes
    assert training["env/episode_tool_errors"] == 2 * errors
    assert training["env/episode_unreadable_calls"] == 2 * (UNREADABLE_CALL in turns[0])


def test_tool_latency_is_the_time_around_each_call_that_ran_a_tool():
    """A clock that only the tools move: each call's seconds are exactly what its tool took,
    a sync tool in its worker thread, an async one awaited, one that raised included; a call
    that names no tool or cannot be read runs nothing and has no time, but counts as an error."""
    now = [100.0]

    def clock() -> float:
        return now[0]

    class Timed:
        def sync_work(self, seconds: float) -> str:
            now[0] += seconds
            return threading.current_thread().name

        async def async_work(self, seconds: float) -> str:
            await asyncio.sleep(0)
            now[0] += seconds
            return "done"

        def broken(self, seconds: float) -> str:
            now[0] += seconds
            raise ValueError("no")

    runner = ToolRunner(environment_tools(Timed()), clock=clock)
    turn = ParsedTurn("", [ToolCall("sync_work", {"seconds": 2.0}), ToolCall("async_work", {"seconds": 0.5}),
                           ToolCall("broken", {"seconds": 1.0}), ToolCall("missing"), ToolCall("", error="bad JSON")])
    replies = [m["content"] for m in asyncio.run(runner(turn, turn.message()))]
    assert replies[0].startswith("onecopy-tool") and replies[1] == "done"
    assert [json.loads(r)["error"] for r in replies[2:]] == ["no", "no tool named 'missing'; the tools are "
                                                             "async_work, broken, sync_work", "bad JSON"]
    assert runner.stats.seconds == [2.0, 0.5, 1.0] and runner.stats.errors == 3
    metrics = tool_metrics([Episode([], 0.0, [], {"turns": 1, "tool_calls": 5, "tools": runner.stats})])
    assert metrics["env/tool_call_seconds_mean"] == pytest.approx(3.5 / 3)
    assert metrics["env/tool_call_seconds_max"] == 2.0


def test_episode_metrics_count_turns_endings_and_the_environments_share_of_tokens(qwen):
    group, metrics, env = group_and_metrics(tool_env(Calculator), qwen)
    assert metrics["env/episode_turns_mean"] == 2.0 and metrics["env/episode_ended_answered"] == 1.0
    assert metrics["env/episode_rows_mean"] == 1.0 and metrics["env/episode_unreadable_calls"] == 0.0
    written = total = 0
    for masks in group.masks:  # after the first sampled token: the tool turn and headers are the environment's
        tail = masks[next(i for i, m in enumerate(masks) if m != -100):]
        written, total = written + tail.count(-100), total + len(tail)
    assert 0 < written < total and metrics["env/environment_token_share"] == pytest.approx(written / total)
    assert asyncio.run(env.wandb_log()).get("env/episode_turns_mean") is None  # counted once
