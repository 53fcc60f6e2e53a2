"""Which tokenizer an environment loads without --env.tokenizer_name: the inference server's model."""

import logging
import time

import pytest
from env_fakes import FAST, FakeInference, FakeServer, model_card, on_first_log

from environments.arithmetic_server import ArithmeticEnv
from environments.cli import run_cli
from environments.tokenizer import resolve_tokenizer_path, served_model_root

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def inference(tokenizer):
    fake = FakeInference(tokenizer, answer_arithmetic=True)
    fake.server = FakeServer(fake).start()
    yield fake
    fake.server.stop()


def test_without_tokenizer_name_the_served_model_folder_is_used(inference, tokenizer_dir, tmp_path, caplog):
    # vLLM serving LoRA: the base model first, then an adapter naming it as parent.
    adapter = tmp_path / "adapter"  # a folder, but no tokenizer: loading it would fail
    adapter.mkdir()
    inference.models = [model_card("base", tokenizer_dir), model_card("adapter-1", str(adapter), parent="base")]
    argv = ["evaluate", "--env.num_eval_items", "3", "--openai.base_url", inference.server.url]
    with caplog.at_level(logging.INFO, logger="onecopy.env"):
        metrics = run_cli(ArithmeticEnv, argv)
    assert metrics == {"env/eval_accuracy": 1.0, "env/eval_items": 3.0}
    assert f"[env] tokenizer from {tokenizer_dir}: the model the inference server serves" in caplog.text


def test_adapters_are_skipped_wherever_they_are_listed(inference, tokenizer_dir):
    inference.models = [model_card("adapter-1", "/adapters/1", parent="base"), model_card("base", tokenizer_dir)]
    assert served_model_root(inference.server.url, wait_s=1.0, backoff=FAST) == tokenizer_dir


def test_tokenizer_name_wins_and_the_server_is_not_asked():
    # Nothing listens on port 9: asking would fail after wait_s.
    assert resolve_tokenizer_path("/my/tokenizer", "http://127.0.0.1:9", 0.0, FAST) == "/my/tokenizer"


def test_server_down_fails_naming_tokenizer_name(caplog):
    server = FakeServer(lambda *request: (200, {}))  # never started: connections are refused
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="onecopy.env"):
        with pytest.raises(RuntimeError) as exc:
            resolve_tokenizer_path(None, server.url, wait_s=0.3, backoff=FAST)
    assert time.monotonic() - start < 5
    message = str(exc.value)
    assert f"did not answer GET {server.url}/v1/models" in message
    assert "--openai.base_url" in message and "pass --env.tokenizer_name" in message
    assert "[env] inference server unavailable, retrying in" in caplog.text


def test_lookup_waits_for_a_server_that_starts_late(tokenizer, tokenizer_dir):
    server = FakeServer(FakeInference(tokenizer))  # down until the lookup has logged it down
    try:
        with on_first_log("inference server unavailable", server.start):
            assert resolve_tokenizer_path(None, server.url, wait_s=30.0, backoff=FAST) == tokenizer_dir
    finally:
        server.stop()


def test_model_path_that_is_not_a_local_folder_says_pass_tokenizer_name(inference):
    hub_id = "HuggingFaceTB/SmolLM2-135M-Instruct"  # vLLM downloaded it: no folder of that name here
    inference.models = [model_card(hub_id, hub_id)]
    with pytest.raises(FileNotFoundError) as exc:
        resolve_tokenizer_path(None, inference.server.url, 1.0, FAST)
    assert f"serves '{hub_id}', which is not a folder on this machine" in str(exc.value)
    assert "pass --env.tokenizer_name" in str(exc.value)

