"""OpenEnv's sessions as onecopy episodes, with small fakes of openenv's client (no openenv needed):
observations become user turns, replies become actions, the steps' rewards the episode's score,
the episodes of a group hold their sessions at once, and a session that breaks fails its group."""

import asyncio
import json
import re
from types import SimpleNamespace

import pytest
from env_fakes import FAST, FakeServer
from multiturn_fakes import QWEN_TEMPLATE, ScriptedInference, play_one_group, with_template

from environments.config import ConfigError, ServerConfig
from environments.multiturn.factory import mcp_tool_schemas
from environments.multiturn.openenv_session import (
    EpisodeBroken,
    OpenEnvSession,
    OpenEnvToolSession,
    OpenEnvTurns,
    ToolCallFailed,
    observation_text,
    tool_result,
)
from environments.multiturn.tool_calls import ParsedTurn, ToolCall
from environments.openenv_mcp_server import MCPToolAnswers, OpenEnvMCPEnv, OpenEnvMCPEnvConfig
from environments.openenv_server import OpenEnvEnv, OpenEnvEnvConfig

pytestmark = pytest.mark.timeout(60)


class FakeClient:
    """openenv's EnvClient contract, in memory: connect / reset(**kw) / step(action) / close, each
    awaitable, each answering a StepResult-like object. The game: guess the seed's number (seed % 8
    + 1); reward 1 - distance / 8 per step; done on the right number or the second step."""

    opened: list["FakeClient"] = []
    fail_at_step: int = 0  # the 1-based step that raises (the server went away); 0: none

    def __init__(self, base_url="unused"):
        self.connected = self.closed = False
        self.steps = 0
        FakeClient.opened.append(self)

    async def connect(self):
        self.connected = True
        return self

    async def reset(self, seed=None, **kwargs):
        self.secret = seed % 8 + 1
        return SimpleNamespace(observation={"prompt": "Guess from 1 to 8.", "metadata": {}}, reward=None, done=False)

    async def step(self, action):
        self.steps += 1
        if self.steps == FakeClient.fail_at_step:
            raise ConnectionError("connection closed")
        guess = int(re.search(r"\d+", action["message"]).group())
        done = guess == self.secret or self.steps >= 2
        hint = "Right!" if guess == self.secret else ("Higher." if guess < self.secret else "Lower.")
        return SimpleNamespace(observation={"prompt": hint, "metadata": {}}, reward=1 - abs(guess - self.secret) / 8,
                               done=done)

    async def close(self):
        self.closed = True


def turns(client=FakeClient, **kwargs) -> OpenEnvTurns:
    return OpenEnvTurns(new_client=client, make_action=lambda text: {"message": text},
                        show=lambda obs: observation_text(obs, "prompt"), **kwargs)


def play(session_steps, **kwargs):
    async def go():
        async with OpenEnvSession(turns(**kwargs)) as session:
            first = await session.reset(seed=3)  # secret 4
            replies = [await session.step(text) for text in session_steps]
        return session, first, replies

    return asyncio.run(go())


def test_a_session_turns_observations_into_messages_and_replies_into_actions():
    session, first, replies = play(["I guess 2", "6"])
    assert first == "Guess from 1 to 8." and replies == ["Higher.", None]  # the second step is done
    assert session.rewards == [0.75, 0.75] and session.get_reward() == 0.75 and session.client.closed


def test_the_episode_reward_is_the_last_steps_or_their_sum():
    assert play(["2", "4"], episode_reward="sum")[0].get_reward() == pytest.approx(1.75)
    assert play(["2", "4"], episode_reward="last")[0].get_reward() == 1.0
    with pytest.raises(ValueError, match="episode_reward 'best' is unknown; valid: last, sum"):
        turns(episode_reward="best")


def test_a_session_without_a_reward_scores_none():
    session = OpenEnvSession(turns())
    assert session.get_reward() is None  # no step: unscored, left out of its group, not counted as 0


def test_the_observation_text_is_its_field_or_its_fields_as_json():
    observation = {"prompt": "Higher.", "guesses": 1, "done": False, "reward": 0.5, "metadata": {"x": 1}}
    assert observation_text(observation, "prompt") == "Higher."
    assert json.loads(observation_text(observation)) == {"prompt": "Higher.", "guesses": 1}
    with pytest.raises(KeyError, match="no field 'text'; its fields are done, guesses, metadata, prompt, reward"):
        observation_text(observation, "text")


def test_a_broken_session_names_the_servers_exit_and_abandons_the_episode(monkeypatch):
    monkeypatch.setattr(FakeClient, "fail_at_step", 2)
    with pytest.raises(EpisodeBroken, match=r"OpenEnv step failed after 1 steps \(the server exited with code -9\): "
                                            r"ConnectionError: connection closed; the episode is abandoned"):
        play(["2", "4"], server_exit=lambda: -9)
    assert FakeClient.opened[-1].closed  # the session was closed on the way out


# ----- through OpenEnvEnv: groups of episodes against a scripted /generate --------------------------


class Guesses(ScriptedInference):
    """Episode k's turns guess 2 then 4 (even k) or 7 then 8 (odd k), read from the prompt."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer, (), right=0, tool_marker="", end_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
        self.episodes = 0

    def _text(self, prompt_ids, i) -> str:
        prompt = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        guesses = re.findall(r"<\|im_start\|>assistant\n(\d+)<\|im_end\|>", prompt)
        if not guesses:
            with self._lock:
                self.episodes += 1
                return "2" if self.episodes % 2 else "7"
        return {"2": "4", "7": "8"}[guesses[0]]


class FakeOpenEnv(OpenEnvEnv):
    """OpenEnvEnv with FakeClient sessions instead of a server; every item resets with seed 3 (secret 4)."""

    async def setup(self):
        self.turns = turns()
        self.eval_items = []

    async def get_next_item(self):
        return {"seed": 3}


def make_env(tokenizer, url, env_class=FakeOpenEnv, **settings):
    config = env_class.env_config_cls(**{"group_size": 2, "max_token_length": 2048, "max_tokens": 8,
                                         "tokenizer_name": "unused", "seed": 1, "app": "unused:app", **settings})
    env = env_class(config, ServerConfig(base_url=url, timeout=5.0), tokenizer=tokenizer)
    env.backoff = FAST
    return env


def test_a_group_is_episodes_scored_by_the_environments_rewards(tokenizer_dir):
    tokenizer = with_template(tokenizer_dir, QWEN_TEMPLATE)
    server = FakeServer(Guesses(tokenizer)).start()
    try:
        group, _ = play_one_group(make_env(tokenizer, server.url, system_prompt="Play."))
    finally:
        server.stop()
    # Guessing 2 then 4: Higher., then right (reward 1.0); 7 then 8: Lower., then done after two steps (0.5).
    assert sorted(group.scores) == [0.5, 1.0]
    by_score = dict(zip(group.scores, zip(group.tokens, group.masks, group.messages)))
    tokens, masks, messages = by_score[1.0]
    assert [(m["role"], m["content"]) for m in messages] == [
        ("system", "Play."), ("user", "Guess from 1 to 8."), ("assistant", "2"), ("user", "Higher."), ("assistant", "4")]
    sampled = tokenizer.decode([t for t, m in zip(tokens, masks) if m != -100], skip_special_tokens=False)
    assert sampled == "2<|im_end|>4<|im_end|>"  # the observations are masked context
    assert "Higher." in tokenizer.decode(tokens)


def test_the_episodes_of_a_group_hold_their_sessions_at_once(tokenizer_dir):
    """Each reset waits until every episode of the group has connected: with episodes played one
    after another the first reset would wait for ever (the test's timeout)."""
    tokenizer = with_template(tokenizer_dir, QWEN_TEMPLATE)
    group_size = 4

    resets: list[asyncio.Future] = []

    class AllAtOnce(FakeClient):
        async def reset(self, seed=None, **kwargs):
            waiting = asyncio.get_running_loop().create_future()
            resets.append(waiting)
            if len(resets) == group_size:  # the last episode to arrive lets them all go on
                for future in resets:
                    future.set_result(None)
            await waiting
            return await super().reset(seed, **kwargs)

    class Concurrent(FakeOpenEnv):
        async def setup(self):
            self.turns = turns(AllAtOnce)

    server = FakeServer(Guesses(tokenizer)).start()
    try:
        group, _ = play_one_group(make_env(tokenizer, server.url, Concurrent, group_size=group_size), timeout=20)
    finally:
        server.stop()
    assert len(group.scores) == group_size and all(c.closed for c in FakeClient.opened[-group_size:])


def test_max_sessions_caps_the_sessions_open_at_once(tokenizer_dir):
    tokenizer = with_template(tokenizer_dir, QWEN_TEMPLATE)
    open_at_connect = []

    class Counted(FakeClient):
        async def connect(self):
            open_at_connect.append(sum(c.connected and not c.closed for c in FakeClient.opened) + 1)
            return await super().connect()

    class Capped(FakeOpenEnv):
        async def setup(self):
            await super().setup()
            self.turns = turns(Counted)

    server = FakeServer(Guesses(tokenizer)).start()
    try:
        group, _ = play_one_group(make_env(tokenizer, server.url, Capped, group_size=4, max_sessions=2))
    finally:
        server.stop()
    assert len(group.scores) == 4 and len(open_at_connect) == 4 and max(open_at_connect) <= 2


def test_a_session_that_breaks_mid_episode_fails_the_group_and_nothing_is_written(tokenizer_dir, tmp_path,
                                                                                  monkeypatch):
    tokenizer = with_template(tokenizer_dir, QWEN_TEMPLATE)
    monkeypatch.setattr(FakeClient, "fail_at_step", 2)
    out = tmp_path / "groups.jsonl"
    server = FakeServer(Guesses(tokenizer)).start()
    try:
        env = make_env(tokenizer, server.url, total_steps=1, data_path_to_save_groups=str(out))
        with pytest.raises(EpisodeBroken, match="OpenEnv step failed after 1 steps"):
            asyncio.run(asyncio.wait_for(env.process_manager(), 30))
    finally:
        server.stop()
    assert out.read_text() == ""  # no group, not even the other episode's half


def test_config_checks_name_the_flag():
    with pytest.raises(ConfigError, match="episode_reward"):
        OpenEnvEnvConfig(episode_reward="best")
    with pytest.raises(ConfigError, match="eval_seed"):
        OpenEnvEnvConfig(seed=5, eval_seed=5)
    with pytest.raises(ConfigError, match="max_sessions"):
        OpenEnvEnvConfig(max_sessions=-1)


def test_setup_without_an_app_says_what_to_name(tokenizer):
    env = OpenEnvEnv(OpenEnvEnvConfig(tokenizer_name="unused"), ServerConfig(base_url="http://127.0.0.1:9"),
                     tokenizer=tokenizer)
    with pytest.raises(ConfigError, match="app.*module:attribute"):
        asyncio.run(env.setup())


def test_a_server_that_cannot_start_says_so_with_its_exit_code():
    from environments.openenv_host import OpenEnvServer

    server = OpenEnvServer("no_such_module_here:app")
    with pytest.raises(RuntimeError, match=r"OpenEnv server no_such_module_here:app \(pid \d+\) exited with code [1-9]\d* "
                                           r"before it answered /health"):
        server.start(timeout=60)
    assert server.exit_code() > 0  # uvicorn's own code for an app it cannot import
    with pytest.raises(ValueError, match="must be 'module:attribute'"):
        OpenEnvServer("no_colon")


# ----- MCP tool sessions (openenv_mcp_server.py), with a fake MCPToolClient ------------------------


class FakeToolClient(FakeClient):
    """openenv's MCPToolClient contract, in memory: list_tools, and step(CallToolAction) answering a
    CallToolObservation-like result. Tools: add(a, b); submit(answer), done with reward 1.0 when
    the answer is the seed's secret, else 0.0; any other name answers the environment's error."""

    async def list_tools(self):
        return [SimpleNamespace(name="add", description="Add two integers.",
                                input_schema={"type": "object", "properties": {"a": {"type": "integer"}}})]

    async def step(self, action):
        self.steps += 1
        if self.steps == FakeClient.fail_at_step:
            raise ConnectionError("connection closed")
        name, arguments = action
        if name == "add":
            return SimpleNamespace(observation=SimpleNamespace(result={"data": arguments["a"] + arguments["b"]},
                                                               error=None), reward=None, done=False)
        if name == "submit":
            return SimpleNamespace(observation=SimpleNamespace(result={"data": "Submitted."}, error=None),
                                   reward=float(arguments["answer"] == self.secret), done=True)
        unknown = SimpleNamespace(result=None, error=SimpleNamespace(message="Unknown tool"))
        return SimpleNamespace(observation=unknown, reward=None, done=False)


def tool_session(**kwargs) -> OpenEnvToolSession:
    """A session whose actions are (tool name, arguments), as FakeToolClient reads them."""
    return OpenEnvToolSession(OpenEnvTurns(new_client=FakeToolClient, make_action=lambda name, args: (name, args),
                                           show=lambda obs: observation_text(obs, "prompt"), **kwargs))


def test_mcp_tools_become_the_schemas_a_chat_template_renders():
    listed = [SimpleNamespace(name="add", description="Add.", input_schema={"type": "object", "properties": {}}),
              SimpleNamespace(name="ping", description=None, inputSchema=None)]  # MCP's own spelling, no schema
    assert mcp_tool_schemas(listed) == [
        {"type": "function", "function": {"name": "add", "description": "Add.",
                                          "parameters": {"type": "object", "properties": {}}}},
        {"type": "function", "function": {"name": "ping", "description": "",
                                          "parameters": {"type": "object", "properties": {}}}}]


def test_an_mcp_tool_result_is_its_data_else_its_text_and_an_error_result_fails_the_call():
    assert tool_result({"data": 5, "content": [{"type": "text", "text": "5"}]}) == 5
    two_blocks = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert tool_result({"data": None, "content": two_blocks}) == "a\nb"
    with pytest.raises(ToolCallFailed, match="bad input"):
        tool_result({"is_error": True, "content": [{"type": "text", "text": "bad input"}]})


def test_tool_calls_are_steps_of_the_episodes_session_and_its_submit_scores_it():
    async def go():
        async with tool_session() as session:
            await session.reset(seed=3)  # secret 4
            answers = MCPToolAnswers(session, ["add", "submit", "nope"])
            first = await answers(ParsedTurn("", [ToolCall("add", {"a": 2, "b": 2}), ToolCall("nope", {})]), {})
            submit_then_add = [ToolCall("submit", {"answer": 4}), ToolCall("add", {"a": 1, "b": 1})]
            last = await answers(ParsedTurn("", submit_then_add), {})
            return session, answers, first, last

    session, answers, first, last = asyncio.run(go())
    assert first == [{"role": "tool", "name": "add", "content": "4"},
                     {"role": "tool", "name": "nope", "content": json.dumps({"error": "Unknown tool"})}]
    assert last is None  # submit's step is done: the episode ends (a call after it is refused, not stepped)
    assert session.steps == 3 and session.get_reward() == 1.0
    # 4 calls answered, each a call into the session (timed); 2 of them errors (an unknown tool, a call after done)
    assert (len(answers.stats.seconds), answers.stats.errors) == (4, 2)


def test_a_session_that_breaks_during_a_tool_call_fails_the_episode_not_the_call(monkeypatch):
    """The tool runner answers a raising tool with {"error": ...}; a broken session is no tool error."""
    monkeypatch.setattr(FakeClient, "fail_at_step", 1)

    async def go():
        async with tool_session(server_exit=lambda: -9) as session:
            await session.reset(seed=3)
            await MCPToolAnswers(session, ["add"])(ParsedTurn("", [ToolCall("add", {"a": 1, "b": 1})]), {})

    with pytest.raises(EpisodeBroken, match=r"OpenEnv call_tool 'add' failed after 0 steps \(the server exited "
                                            r"with code -9\): ConnectionError"):
        asyncio.run(go())


class SubmitOrNot(ScriptedInference):
    """Each episode's one turn: the odd ones submit 4 (the right answer for seed 3), the even ones
    answer without a tool call, which ends the episode with no step rewarded."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer, (), right=0, tool_marker="", end_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
        self.episodes = 0

    def _text(self, prompt_ids, i) -> str:
        with self._lock:
            self.episodes += 1
            odd = self.episodes % 2
        return '<tool_call>\n{"name": "submit", "arguments": {"answer": 4}}\n</tool_call>' if odd else "No idea."


class FakeMCPEnv(OpenEnvMCPEnv):
    """OpenEnvMCPEnv with FakeToolClient sessions instead of a server; every item resets with seed 3 (secret 4)."""

    async def setup(self):
        self.turns = tool_session().turns
        self.tools = [SimpleNamespace(name="submit", description="Submit the answer.",
                                      input_schema={"type": "object", "properties": {"answer": {"type": "integer"}}})]
        self.eval_items = []

    async def get_next_item(self):
        return {"seed": 3}


@pytest.mark.parametrize("unrewarded_score, scores", [(None, [1.0]), (0.0, [0.0, 1.0])])
def test_an_unrewarded_mcp_episode_leaves_its_group_unless_unrewarded_score_scores_it(tokenizer_dir, unrewarded_score,
                                                                                       scores):
    """Issue 48's rule by default (an episode no step rewarded is not counted as 0); --env.unrewarded_score
    0 scores it, for an environment where not submitting is a failure to train against."""
    tokenizer = with_template(tokenizer_dir, QWEN_TEMPLATE)
    server = FakeServer(SubmitOrNot(tokenizer)).start()
    try:
        group, _ = play_one_group(make_env(tokenizer, server.url, FakeMCPEnv, max_tokens=256,
                                           unrewarded_score=unrewarded_score))
    finally:
        server.stop()
    assert sorted(group.scores) == scores
    unrewarded = [messages for messages, score in zip(group.messages, group.scores) if score == 0.0]
    assert [[m["content"] for m in messages[1:]] for messages in unrewarded] == [["No idea."]] * len(unrewarded)
    with pytest.raises(ConfigError, match="unrewarded_score"):
        OpenEnvMCPEnvConfig(unrewarded_score=float("nan"))
