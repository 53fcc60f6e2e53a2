"""POST /generate's answers when sampling fails (vllm_patching/generate_route.py), against a fake
engine client: an unexpected exception is logged with its traceback and answered 500 with its type
and message, never an empty one, marked as the engine's (a client stops rather than retry it) while
the engine runs; vLLM's own checks stay 400, an aborted request 503."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from fastapi import FastAPI, HTTPException
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient
from vllm.exceptions import VLLMValidationError
from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

from environments.clients import Unavailable, checked_json
from vllm_patching.generate_route import router


class RaisingEngine:
    """An engine client whose generate raises `error` before yielding anything (None: it yields
    nothing, as an aborted request ends); `errored`: the engine is dead (vLLM's EngineClient.errored)."""

    def __init__(self, error: BaseException | None, errored: bool = False):
        self.error, self.errored = error, errored

    async def generate(self, prompt, params, request_id, lora_request=None):
        if self.error is not None:
            raise self.error
        return
        yield


async def answer_as_vllm_does(request, exc: HTTPException) -> JSONResponse:
    """vLLM's server's handler of HTTPException: its own error body, and the exception's headers dropped."""
    error = {"message": exc.detail, "type": "Internal Server Error", "param": None, "code": exc.status_code}
    return JSONResponse({"error": error}, status_code=exc.status_code)


def client_for(error: BaseException | None, raise_server_exceptions: bool = False, errored: bool = False,
               vllm_handlers: bool = False) -> TestClient:
    app = FastAPI()
    app.include_router(router)
    app.state.engine_client = RaisingEngine(error, errored)
    app.state.onecopy_base_model = "base"
    if vllm_handlers:
        app.add_exception_handler(HTTPException, answer_as_vllm_does)
    return TestClient(app, raise_server_exceptions=raise_server_exceptions)


def engine_generate_error(cause: BaseException) -> EngineGenerateError:
    """What vLLM's AsyncLLM.generate raises for an unexpected error: EngineGenerateError(), no
    message, from the error."""
    try:
        try:
            raise cause
        except BaseException as err:
            raise EngineGenerateError() from err
    except EngineGenerateError as wrapped:
        return wrapped


def test_an_exception_with_no_message_is_answered_500_naming_it_and_logged_with_its_traceback(caplog):
    """vLLM's handler answered {"message": ""} and logged nothing: the user saw an empty 500."""
    with caplog.at_level(logging.ERROR, logger="vllm.onecopy"):
        answer = client_for(AssertionError()).post("/generate", json={"prompt_token_ids": [1, 2, 3]})
    assert answer.status_code == 500
    assert "AssertionError" in answer.json()["error"]["message"]
    failed = [r for r in caplog.records if r.exc_info]
    assert failed and failed[0].exc_info[0] is AssertionError


def test_vllms_empty_engine_generate_error_is_answered_with_the_error_it_wraps(caplog):
    error = engine_generate_error(RuntimeError("grammar compiler failed"))
    with caplog.at_level(logging.ERROR, logger="vllm.onecopy"):
        answer = client_for(error).post("/generate", json={"prompt_token_ids": [1, 2, 3]})
    assert answer.status_code == 500
    detail = answer.json()["error"]["message"]
    assert "EngineGenerateError" in detail and "RuntimeError: grammar compiler failed" in detail
    assert "grammar compiler failed" in caplog.text  # the cause's traceback is in the server's log


def test_a_request_the_running_engine_failed_is_marked_so_that_the_environment_stops_with_its_cause():
    """A vLLM without a package its structured outputs need fails every constrained request: the
    environment, which waits out any other 5xx, logged "inference server unavailable" forever."""
    error = engine_generate_error(ModuleNotFoundError("No module named 'lmformatenforcer'"))
    answer = client_for(error, vllm_handlers=True).post("/generate", json={"prompt_token_ids": [1]})
    assert answer.status_code == 500 and answer.headers.get("X-Onecopy-Error") == "engine"
    assert "ModuleNotFoundError: No module named 'lmformatenforcer'" in answer.json()["error"]["message"]
    with pytest.raises(RuntimeError, match="lmformatenforcer") as raised:
        checked_json(answer)
    assert not isinstance(raised.value, Unavailable)


def test_a_failure_of_a_dead_engine_stays_one_to_wait_out():
    """A dead engine's server stops (vLLM's watchdog), and the trainer starts it again."""
    error = engine_generate_error(RuntimeError("engine core died"))
    answer = client_for(error, errored=True, vllm_handlers=True).post("/generate", json={"prompt_token_ids": [1]})
    assert answer.status_code == 500 and "X-Onecopy-Error" not in answer.headers
    with pytest.raises(Unavailable, match="engine core died"):
        checked_json(answer)


def test_vllms_own_checks_stay_400_and_an_aborted_request_503():
    assert client_for(ValueError("prompt too long")).post(
        "/generate", json={"prompt_token_ids": [1]}).json() == {"detail": "prompt too long"}
    aborted = client_for(None).post("/generate", json={"prompt_token_ids": [1]})
    assert aborted.status_code == 503 and "aborted" in aborted.json()["detail"]


def test_a_dead_engine_is_left_to_vllms_handler_which_stops_the_server():
    with pytest.raises(EngineDeadError):
        client_for(EngineDeadError(), raise_server_exceptions=True).post("/generate", json={"prompt_token_ids": [1]})


def test_a_client_mistake_vllm_raises_is_never_turned_into_a_500():
    """vLLM 0.26's VLLMValidationError is a ValueError (answered 400 here); 0.32's is not, and goes
    on to vLLM's handler, which answers it 400 with its parameter."""
    client = client_for(VLLMValidationError("invalid regex"), raise_server_exceptions=True)
    try:
        answer = client.post("/generate", json={"prompt_token_ids": [1]})
    except VLLMValidationError:
        return
    assert answer.status_code == 400 and answer.json() == {"detail": "invalid regex"}
