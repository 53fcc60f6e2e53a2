"""A real OpenEnv environment (tests/fixtures/openenv_guess: openenv's create_app, EnvClient and
base classes, nothing of onecopy's) through OpenEnvEnv against a scripted /generate: its server
runs as our child, each episode is one session of its own client, its rewards score the group,
and a server killed mid-episode fails the group with nothing written.

Skipped without the optional extra (requirements-openenv.txt; tests/openenv_extra.py finds it)."""

import asyncio
import os
import signal

import pytest
from env_fakes import FakeServer
from multiturn_fakes import QWEN_TEMPLATE, play_one_group, process_groups, with_template
from test_env_openenv import Guesses
from test_env_openenv import make_env as make_fake_env

from environments.multiturn.openenv_session import EpisodeBroken
from environments.openenv_server import OpenEnvEnv
from tests.openenv_extra import INSTALL, on_path

OPENENV_PATH = on_path()
pytest.importorskip("openenv.core.env_server.http_server", reason=INSTALL)

from tests.fixtures.openenv_guess.models import GuessAction  # noqa: E402
from tests.fixtures.openenv_guess.server.guess_environment import GuessEnvironment  # noqa: E402

pytestmark = pytest.mark.timeout(120)

GAME = "tests.fixtures.openenv_guess"
FLAGS = {"app": f"{GAME}.server.app:app", "client": f"{GAME}.client:GuessEnv", "action": f"{GAME}.models:GuessAction",
         "observation_field": "prompt", "openenv_path": OPENENV_PATH}
SEED = 3


def expected_reward(seed: int, guesses: list[str]) -> float:
    """The game's own last reward for `guesses`, played in this process (stopping when done)."""
    game = GuessEnvironment()
    game.reset(seed=seed)
    for guess in guesses:
        observation = game.step(GuessAction(message=guess))
        if observation.done:
            break
    return observation.reward


class OneSeed(OpenEnvEnv):
    async def get_next_item(self):
        return {"seed": SEED}


def make_env(tokenizer, url, **settings):
    return make_fake_env(tokenizer, url, OneSeed, **FLAGS, **settings)


def test_a_group_of_the_real_environments_episodes_carries_its_rewards(tokenizer_dir):
    tokenizer = with_template(tokenizer_dir, QWEN_TEMPLATE)
    server = FakeServer(Guesses(tokenizer)).start()
    env = make_env(tokenizer, server.url)
    try:
        group, _ = play_one_group(env, timeout=90)
    finally:
        server.stop()
    assert sorted(group.scores) == sorted([expected_reward(SEED, ["2", "4"]), expected_reward(SEED, ["7", "8"])])
    replies = sorted([m["content"] for m in messages if m["role"] == "user"] for messages in group.messages)
    assert replies == [["Guess my number from 1 to 8. Reply with one number.", "Higher."],
                       ["Guess my number from 1 to 8. Reply with one number.", "Lower."]]
    assert env.server.exit_code() is not None  # close_clients stopped the server it started


class KillsTheServer(Guesses):
    """Kills the OpenEnv server (by PID, and waits for its exit) before answering any second turn."""

    env = None

    def _text(self, prompt_ids, i) -> str:
        if self.tokenizer.decode(prompt_ids, skip_special_tokens=False).count("<|im_start|>assistant") > 1:
            proc = self.env.server.proc
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
        return super()._text(prompt_ids, i)


def test_a_server_killed_mid_episode_fails_the_group_and_nothing_is_written(tokenizer_dir, tmp_path):
    tokenizer = with_template(tokenizer_dir, QWEN_TEMPLATE)
    inference = KillsTheServer(tokenizer)
    out = tmp_path / "groups.jsonl"
    server = FakeServer(inference).start()
    env = inference.env = make_env(tokenizer, server.url, total_steps=1, data_path_to_save_groups=str(out))
    try:
        # Whichever episode fails first (one in its step, another connecting or resetting) names the exit.
        with pytest.raises(EpisodeBroken, match=r"OpenEnv \w+ failed after \d+ steps \(the server exited with code -9\)"):
            asyncio.run(asyncio.wait_for(env.process_manager(), 90))
    finally:
        server.stop()
    assert out.read_text() == ""


def test_the_environment_runs_from_its_command_line(tmp_path):
    from transformers import AutoTokenizer

    from example_trainer.model.default_model import default_model_path

    inference = Guesses(AutoTokenizer.from_pretrained(default_model_path(), local_files_only=True))
    flags = [arg for name, value in FLAGS.items() if value for arg in (f"--env.{name}", value)]
    groups = process_groups(OpenEnvEnv, inference, tmp_path / "groups.jsonl", "--env.max_turns", "2", *flags)
    assert len(groups) == 2 and all(len(g["tokens"]) == 2 for g in groups)
    for g in groups:  # every episode made two guesses or guessed right: its score is the game's own
        assert all(0.0 <= s <= 1.0 for s in g["scores"]) and len(g["messages"]) == 2
