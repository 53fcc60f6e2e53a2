"""The processes we start die with us: a trainer killed with SIGKILL must not leave vLLM running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PARENT = """
import subprocess, sys, time
from example_trainer.vllm_process import spawn_in_own_group
child = spawn_in_own_group(["sleep", "300"], subprocess.DEVNULL)
print(child.pid, flush=True)
time.sleep(300)
"""


def alive(pid: int) -> bool:
    """Running, and not a zombie waiting for a reaper."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_child_gets_sigterm_when_its_parent_is_killed():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    child_pid = int(parent.stdout.readline())
    try:
        assert alive(child_pid)
        assert os.getpgid(child_pid) == child_pid  # its own group: stoppable by the PID we keep
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 10
        while alive(child_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(child_pid), "the child outlived its SIGKILLed parent"
    finally:
        if alive(child_pid):
            os.killpg(child_pid, signal.SIGKILL)
