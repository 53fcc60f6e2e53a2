"""Which failures of POST /generate the environment waits out and which stop it (environments/clients.py).

A server that is down, restarting or aborting a generation (connection refused, 503, an unmarked 500)
is waited out, forever. A request that failed inside vLLM's engine while the server stays up (the
route's 500 marked ``X-Onecopy-Error: engine``, say a package vLLM needs for structured outputs is
missing) fails the same way on every retry: the environment raises at once with the server's message
and exits non-zero, where it used to log "inference server unavailable" every 10 s forever.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
from env_fakes import FAST, FakeInference, FakeServer

from environments.arithmetic_server import ArithmeticEnv
from environments.cli import run_cli
from environments.clients import InferenceClient

pytestmark = pytest.mark.timeout(60)

CAUSE = "EngineGenerateError, raised from ModuleNotFoundError: No module named 'lmformatenforcer'"


def engine_failure(method, path, body, headers):
    """onecopy's /generate when the engine failed the request and the server stays up."""
    return 500, {"error": {"message": CAUSE, "type": "Internal Server Error", "param": None, "code": 500}}, {
        "X-Onecopy-Error": "engine"}


class Counted:
    """`app`, counting the POST /generate requests it was sent."""

    def __init__(self, app):
        self.app, self.generates = app, 0

    def __call__(self, method, path, body, headers):
        self.generates += path == "/generate"
        return self.app(method, path, body, headers)


async def generate_once(url: str):
    client = InferenceClient(url, 5.0, 4, FAST)
    try:
        return await client.generate([1, 2], n=1, max_tokens=4, temperature=1.0, structured_outputs={"regex": "a+"})
    finally:
        await client.aclose()


def test_a_generate_that_failed_inside_the_engine_is_raised_at_once_with_the_servers_message(caplog):
    server = Counted(engine_failure)
    fake = FakeServer(server).start()
    try:
        with caplog.at_level(logging.WARNING, logger="onecopy.env"):
            with pytest.raises(RuntimeError, match="lmformatenforcer") as raised:
                asyncio.run(asyncio.wait_for(generate_once(fake.url), 20))
    finally:
        fake.stop()
    assert server.generates == 1 and "unavailable" not in caplog.text
    assert "HTTP 500" in str(raised.value) and "vLLM server's log" in str(raised.value)


def test_an_unmarked_500_and_a_503_are_still_waited_out(tokenizer):
    """vLLM's own 500s (a dead engine, whose server then stops) and a server going down stay retried."""
    inference = FakeInference(tokenizer)
    answers = iter([(500, {"error": "engine dead"}), (503, {"error": "restarting"})])
    server = Counted(lambda *request: next(answers, None) or inference(*request))
    fake = FakeServer(server).start()
    try:
        out = asyncio.run(asyncio.wait_for(generate_once(fake.url), 20))
    finally:
        fake.stop()
    assert server.generates == 3 and out.choices[0].text == "yes"


def test_the_environment_process_stops_with_the_cause_as_its_last_line(tokenizer_dir, tmp_path, caplog):
    """What the launcher shows of env.log when the environment exits: its last lines."""
    fake = FakeServer(engine_failure).start()
    try:
        with caplog.at_level(logging.ERROR, logger="onecopy.env"), pytest.raises(SystemExit) as exited:
            run_cli(ArithmeticEnv, ["process", "--env.tokenizer_name", tokenizer_dir, "--env.total_steps", "1",
                                    "--env.data_path_to_save_groups", str(tmp_path / "groups.jsonl"),
                                    "--openai.base_url", fake.url])
    finally:
        fake.stop()
    assert exited.value.code == 1
    assert "[env] stopped: " in caplog.records[-1].getMessage() and "lmformatenforcer" in caplog.records[-1].getMessage()
