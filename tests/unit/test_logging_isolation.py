"""A library that reconfigures the root logger in one test must not silence the next tests' logs
(tests/conftest.py's root_logging_kept). The two tests run in this order."""

import logging

import pytest


def test_a_library_sets_the_root_logger_to_error():
    logging_config = pytest.importorskip("model_hosting_container_standards.logging_config")
    logging_config.configure_root_logger()  # what importing vLLM 0.26's serve routers runs, once
    assert logging.getLogger().level == logging.ERROR


def test_the_next_tests_warnings_still_reach_a_handler():
    # tests/environments/test_env_tokenizer.py's late-server test waits for such a warning
    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append
    log = logging.getLogger("onecopy.env")
    log.addHandler(handler)
    try:
        log.warning("[env] inference server unavailable")
    finally:
        log.removeHandler(handler)
    assert [record.getMessage() for record in seen] == ["[env] inference server unavailable"]
