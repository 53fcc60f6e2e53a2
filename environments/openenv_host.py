"""An OpenEnv environment's server as a child process: the ASGI app the environment builds with
openenv's `create_app`, served by uvicorn on 127.0.0.1.

The port is never guessed: this process binds a socket to 127.0.0.1 port 0 and hands the listening
socket to uvicorn (`--fd`), so no other process can take the port between the pick and the bind.
The child runs in its own session with a parent-death signal (it goes when the environment process
goes, even by SIGKILL); `stop()` ends that PID only: SIGTERM, a wait, then SIGKILL.

`extra_path` is put first on the child's PYTHONPATH: the folder the optional openenv extra was
installed into (requirements-openenv.txt says why it is a folder of its own).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Optional

logger = logging.getLogger("onecopy.env")

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent() -> None:  # pragma: no cover (runs in the child, between fork and exec)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def python_path(*first: str) -> str:
    """PYTHONPATH for a child: `first` (where set), this working folder (so `module:app` names what
    it names here), then ours."""
    parts = [*first, os.getcwd(), os.environ.get("PYTHONPATH", "")]
    return os.pathsep.join(p for p in parts if p)


class OpenEnvServer:
    """An OpenEnv server started from `app` ("module:attribute" of the ASGI app), owned by PID."""

    def __init__(self, app: str, extra_path: str = ""):
        if ":" not in app:
            raise ValueError(f"app {app!r} must be 'module:attribute', the ASGI app openenv's create_app built")
        self.app, self.extra_path = app, extra_path
        self.proc: Optional[subprocess.Popen] = None
        self.url = ""

    def start(self, timeout: float = 60.0) -> str:
        """Start the server and wait until GET /health answers; its base URL."""
        self.launch()
        return self.wait_healthy(timeout)

    def launch(self) -> str:
        """Start the server process; its base URL (not answering yet: wait_healthy).

        Call it from a thread that outlives the server (the event loop's, not a worker's): Linux
        sends the parent-death signal when the thread that started the child ends."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind(("127.0.0.1", 0))
            sock.listen(128)
            port = sock.getsockname()[1]
            cmd = [sys.executable, "-m", "uvicorn", self.app, "--fd", str(sock.fileno()), "--log-level", "warning"]
            self.proc = subprocess.Popen(cmd, pass_fds=[sock.fileno()], start_new_session=True,
                                         preexec_fn=_die_with_parent,
                                         env={**os.environ, "PYTHONPATH": python_path(self.extra_path)})
        finally:
            sock.close()  # the child holds its own copy
        self.url = f"http://127.0.0.1:{port}"
        logger.info("[env] OpenEnv server %s: pid %d at %s", self.app, self.proc.pid, self.url)
        return self.url

    def wait_healthy(self, timeout: float) -> str:
        """Wait until GET /health answers 200 (the app is imported and serving); its base URL.
        Raises when the process exits first, or (after stopping it) when `timeout` passes."""
        deadline = time.monotonic() + timeout
        while True:
            code = self.exit_code()
            if code is not None:
                raise RuntimeError(f"the OpenEnv server {self.app} (pid {self.proc.pid}) exited with code {code} "
                                   "before it answered /health; its output is in this log above")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2.0) as answer:
                    if answer.status == 200:
                        return self.url
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"the OpenEnv server {self.app} did not answer {self.url}/health within "
                                   f"{timeout:.0f} s; stopped it")
            time.sleep(0.1)

    def exit_code(self) -> Optional[int]:
        """The server's exit code; None while it runs (or before start)."""
        return None if self.proc is None else self.proc.poll()

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM the server's PID, wait `grace` seconds, then SIGKILL it."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
