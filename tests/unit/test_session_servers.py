"""The session vLLM servers of tests/conftest.py stop after the last test that uses them, not at the
session's end (with all of them alive beside a CI lane's e2e loop, memory ran low). Checked in a
pytest run of its own, with tests/conftest.py's hooks and a fake server in place of vLLM."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CONFTEST = '''
import os
import pytest
from tests import conftest as ours

pytest_collection_finish = ours.pytest_collection_finish
pytest_runtest_teardown = ours.pytest_runtest_teardown


def log(event):
    with open(os.environ["EVENTS"], "a") as f:
        f.write(event + "\\n")


class FakeServer:
    stopped = False

    def stop(self):  # as VllmServerProcess.stop: a second call does nothing
        if not self.stopped:
            self.stopped = True
            log("stop")


@pytest.fixture(scope="session")
def fake_server(request):
    server = FakeServer()
    ours.SESSION_SERVERS[request.fixturename] = server
    log("start")
    yield server
    server.stop()


@pytest.fixture
def through_another_fixture(fake_server):
    return fake_server
'''

TESTS = '''
import pytest
from conftest import log


def test_first(fake_server):
    log("first")


def test_uses_it_through_a_fixture(through_another_fixture):
    log("second")


@pytest.mark.skip(reason="its last user may be skipped")
def test_last_user_skipped(fake_server):
    pass


def test_after_it():
    log("after")
'''


def test_a_session_server_stops_after_its_last_user_even_a_skipped_one(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_order.py").write_text(TESTS)
    events = tmp_path / "events"
    env = {**os.environ, "EVENTS": str(events), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-p", "no:randomly",
                           str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # Stopped once, after the skipped last user and before the test that does not use it.
    assert events.read_text().split() == ["start", "first", "second", "stop", "after"]
