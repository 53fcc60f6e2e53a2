"""Shared helpers for the trajectory API tests: an in-process client and a real server process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
from api_testlib import register_trainer
from fastapi.testclient import TestClient

from api.app import create_app
from api.settings import API_KEY_ENV, ApiSettings
from example_trainer.engine.ports import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def settings(tmp_path: Path) -> ApiSettings:
    return ApiSettings(db_path=str(tmp_path / "api.db"), api_key=None)


@pytest.fixture
def client(settings: ApiSettings) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as test_client:
        yield test_client


@pytest.fixture
def trainer_client(client: TestClient) -> TestClient:
    """A client whose API has a trainer registered (batch_size=8, max_token_len=16)."""
    register_trainer(client)
    return client


@dataclass
class ApiProcess:
    """`python -m api.server` started by a test; stopped by its PID only."""

    process: subprocess.Popen
    url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill_hard(self) -> None:
        """SIGKILL this exact process, as a crash would."""
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)


def start_api(db_path: Path, log_path: Path, api_key: str | None = None,
              timeout: float = 30.0) -> ApiProcess:
    """Start the API on a free port and wait until GET / answers (or fail with its log)."""
    port = free_port()
    command = [sys.executable, "-m", "api.server", "--port", str(port), "--db-path", str(db_path)]
    env = {key: value for key, value in os.environ.items() if key != API_KEY_ENV}
    if api_key is not None:
        env[API_KEY_ENV] = api_key
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    with open(log_path, "ab") as log_file:
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log_file,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    server = ApiProcess(process, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"API exited with {process.returncode} before answering:\n{server.log()}")
        try:
            if requests.get(server.url + "/", timeout=1).status_code == 200:
                return server
        except requests.ConnectionError:
            time.sleep(0.05)
    server.stop()
    raise RuntimeError(f"API did not answer GET / within {timeout}s:\n{server.log()}")


@pytest.fixture
def launch_api(tmp_path: Path) -> Iterator[Callable[..., ApiProcess]]:
    """`launch_api(db_path, api_key=None)` starts a server; all are stopped at teardown."""
    started: list[ApiProcess] = []

    def launch(db_path: Path, api_key: str | None = None) -> ApiProcess:
        server = start_api(db_path, tmp_path / "api.log", api_key)
        started.append(server)
        return server

    yield launch
    for server in started:
        server.stop()
