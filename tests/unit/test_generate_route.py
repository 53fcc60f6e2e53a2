"""POST /generate's answers when sampling fails (vllm_patching/generate_route.py), against a fake
engine client: an unexpected exception is logged with its traceback and answered 500 with its type
and message, never an empty one; vLLM's own checks stay 400, an aborted request 503."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from vllm.exceptions import VLLMValidationError
from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

from vllm_patching.generate_route import router


class RaisingEngine:
    """An engine client whose generate raises `error` before yielding anything (None: it yields
    nothing, as an aborted request ends)."""

    def __init__(self, error: BaseException | None):
        self.error = error

    async def generate(self, prompt, params, request_id, lora_request=None):
        if self.error is not None:
            raise self.error
        return
        yield


def client_for(error: BaseException | None, raise_server_exceptions: bool = False) -> TestClient:
    app = FastAPI()
    app.include_router(router)
    app.state.engine_client = RaisingEngine(error)
    app.state.onecopy_base_model = "base"
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
    assert "AssertionError" in answer.json()["detail"]
    failed = [r for r in caplog.records if r.exc_info]
    assert failed and failed[0].exc_info[0] is AssertionError


def test_vllms_empty_engine_generate_error_is_answered_with_the_error_it_wraps(caplog):
    error = engine_generate_error(RuntimeError("grammar compiler failed"))
    with caplog.at_level(logging.ERROR, logger="vllm.onecopy"):
        answer = client_for(error).post("/generate", json={"prompt_token_ids": [1, 2, 3]})
    assert answer.status_code == 500
    detail = answer.json()["detail"]
    assert "EngineGenerateError" in detail and "RuntimeError: grammar compiler failed" in detail
    assert "grammar compiler failed" in caplog.text  # the cause's traceback is in the server's log


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
