"""The weights gate: vLLM runs no step while the trainer writes the shared weights, and never
steps on weights that a dead trainer left half-written.

One small file per export, in ``/dev/shm`` (a lock on a network file system under ``$LOGDIR``
would make every step a round trip). It is both a lock and a shared record:

- the lock (``flock``): the worker holds it shared from the start of a step's ``execute_model``
  to the end of that step's ``sample_tokens``, so one step sees one weight version; the trainer
  holds it exclusively while it writes. With tensor parallelism only rank 0's lock decides: the
  TP workers step together (each step's collectives wait for all of them), so a worker that
  entered a step while another waits at its own gate would hold its lock until that gate opens,
  and the trainer ranks would wait on each other for ever. Workers of rank > 0 instead wait at a
  barrier with rank 0 (vLLM's TP group) before each step, and count the steps they end; their
  trainer rank waits until its worker has ended every step rank 0 entered. On a GPU a launched step
  still runs after the call returns, so the worker records an interprocess CUDA event after each
  launch, and the trainer, once it holds the lock, waits for that event before writing. Either
  side logs a wait at the gate longer than ``$ONECOPY_GATE_STALL_SECONDS``; the trainer gives up
  after its deadline (``TrainerGate``'s ``timeout``) with what it waited for.
- writer first: ``flock`` lets a new shared lock in while an exclusive one waits, and wakes the
  waiter only to retry, so a worker that starts its next step within microseconds of ending the
  last can keep the trainer out for seconds (seen on a loaded 2-core CI machine: 16 one-token
  requests in a row, none let a write in). A trainer that finds the gate taken therefore puts its
  pid in the record's ``writer_waiting``; the worker starts no new step while that trainer lives,
  so the write goes in as soon as the step in flight ends.
- the record (``GateRecord``, memory-mapped): ``write_seq`` is even while the weights are whole
  and odd from the start of a write to its end. A worker that gets the lock and finds it odd knows
  the writer is gone mid-write (or that it was started to wait for the trainer's weights): it
  refuses to step, and ``/health`` says so, until a complete write arrives. The weights version
  ``(write_seq + 1) // 2`` salts the prefix cache (vllm_patching.scheduler). The worker also keeps
  its gate-wait counters here, for ``/metrics`` and the trainer's ``sync/*`` metrics.

Why not pause vLLM's scheduler over HTTP: the pause is answered by vLLM's API server process,
whose event loop is busy with the outputs of every running request. On an H200 with SmolLM2-135M
and 128 sequences in flight it took 109 ms (median), against 3 ms with nothing generating.
"""

from __future__ import annotations

import base64
import ctypes
import fcntl
import logging
import mmap
import os
import select
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from pydantic import BaseModel

logger = logging.getLogger("vllm.onecopy.gate")  # under "vllm" to use its log handler in the worker
trainer_logger = logging.getLogger("onecopy.trainer.gate")  # TrainerGate runs in the trainer

GATE_DIR = Path("/dev/shm")
MAGIC = 0x6F6E65636F707933  # "onecopy3" (2: ended_steps; 3: writer_waiting)
STALL_SECONDS_ENV = "ONECOPY_GATE_STALL_SECONDS"
AWAIT_PUSH_ENV = "ONECOPY_AWAIT_PUSH"  # "1": start refusing to step until the trainer's first write
DEFAULT_STALL_SECONDS = 30.0
# How long the trainer waits to write before it stops (TrainerGate's timeout). A vLLM step holds
# the gate for milliseconds on a GPU and seconds at most on a CPU; minutes mean a hung worker.
DEFAULT_WRITE_TIMEOUT_SECONDS = 300.0


class GateInfo(BaseModel):
    """Where the trainer finds the worker's gate (a field of the bridge file)."""

    lock_path: str
    export_id: str = ""
    step_event_b64: str | None = None  # CUDA IPC event handle; None on CPU (steps end with the call)


def remove_gate_file(gate: GateInfo | None) -> int:
    """Remove a stopped worker's gate file; return 1 if it was there, else 0. The worker removes it
    at exit (``WorkerGate.close``), which a killed worker never reaches."""
    if gate is None or not gate.lock_path:
        return 0
    try:
        os.unlink(gate.lock_path)
    except FileNotFoundError:
        return 0
    return 1


class GateRecord(ctypes.Structure):
    """The shared record at the start of the gate file. 8-byte fields: single loads and stores."""

    _fields_ = [
        ("magic", ctypes.c_uint64),
        ("write_seq", ctypes.c_uint64),  # even: weights whole; odd: a write started and has not ended
        ("writer_pid", ctypes.c_uint64),  # the trainer that started the last write
        ("worker_pid", ctypes.c_uint64),
        ("steps", ctypes.c_uint64),  # steps the worker ran through the gate
        ("waited_steps", ctypes.c_uint64),  # of those, how many found the gate closed
        ("wait_ns", ctypes.c_uint64),  # total time steps waited
        ("waiting_since_ns", ctypes.c_uint64),  # CLOCK_MONOTONIC when the waiting step began; 0 = none waits
        ("refusing", ctypes.c_uint64),  # 1 while the worker refuses to step on half-written weights
        ("mixed_steps", ctypes.c_uint64),  # steps whose execute_model and sample_tokens saw two versions
        ("ended_steps", ctypes.c_uint64),  # steps whose last launch is done (after the step event)
        ("writer_waiting", ctypes.c_uint64),  # pid of a trainer waiting to write (0: none); no new step starts
        ("export_id", ctypes.c_char * 32),
    ]

    @property
    def weights_version(self) -> int:
        """The version the weights have, or will have once the write in progress ends."""
        return weights_version(self.write_seq)

    @property
    def half_written(self) -> bool:
        return self.write_seq % 2 == 1


def weights_version(write_seq: int) -> int:
    """The weights version of a record's ``write_seq``: complete writes, counting one in progress."""
    return (write_seq + 1) // 2


class GateFile:
    """The gate file opened and mapped: ``fd`` for the lock, ``record`` for the shared fields."""

    def __init__(self, path: str | os.PathLike, create: bool = False) -> None:
        self.path = Path(path)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        self.fd = os.open(self.path, flags, 0o600)
        if create:
            os.ftruncate(self.fd, mmap.PAGESIZE)
        self._map = mmap.mmap(self.fd, mmap.PAGESIZE)
        self.record = GateRecord.from_buffer(self._map)
        if not create and self.record.magic != MAGIC:
            self.close()
            raise ValueError(f"{path} is not a onecopy weights gate (or was written by another version)")

    def status(self) -> dict:
        """The record as a dict, for /bridge/info and logs."""
        r = self.record
        return {
            "export_id": r.export_id.decode(), "worker_pid": r.worker_pid, "weights_version": r.weights_version,
            "half_written": r.half_written, "writer_pid": r.writer_pid, "refusing": bool(r.refusing),
            "steps": r.steps, "waited_steps": r.waited_steps, "wait_seconds": r.wait_ns / 1e9,
            "waiting_seconds": waiting_seconds(r), "mixed_steps": r.mixed_steps, "writer_waiting": r.writer_waiting,
        }

    def close(self) -> None:
        if self.fd < 0:
            return
        del self.record  # the mapping cannot close while a ctypes view of it exists
        self._map.close()
        os.close(self.fd)
        self.fd = -1


def waiting_seconds(record: GateRecord) -> float:
    """How long the step now waiting at the gate has waited (0 when none waits)."""
    since = record.waiting_since_ns
    return 0.0 if since == 0 else max(0.0, (time.monotonic_ns() - since) / 1e9)


def stall_seconds() -> float:
    return float(os.environ.get(STALL_SECONDS_ENV, DEFAULT_STALL_SECONDS))


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def health_problem(record: GateRecord) -> str | None:
    """Why vLLM must not be called healthy now, or None. Read by the server's ``/health``."""
    # A half-written record with a live writer is a write in progress; with none, it was abandoned
    # (or the worker awaits the trainer's first push). The worker's refusing flag outlives the
    # write that ends it until the next step, so it counts only while the weights are half-written.
    if record.half_written and (record.refusing or not pid_alive(record.writer_pid)):
        who = f"trainer pid {record.writer_pid}" if record.writer_pid else "no trainer yet"
        return (f"weights are half-written ({who}; weights version {record.weights_version}): vLLM runs no "
                "step until a trainer pushes complete weights (rerun the trainer with --resume)")
    waited = waiting_seconds(record)
    if waited > stall_seconds():
        return (f"a step has waited {waited:.0f} s at the weights gate, held by trainer pid {record.writer_pid} "
                f"(threshold ${STALL_SECONDS_ENV}={stall_seconds():g} s)")
    return None


class WorkerGate:
    """The worker's side: ``begin_step()`` at the start of ``execute_model``, ``end_step()`` after
    the step's last launch. Creates the gate file; removes it on ``close()``.

    ``tp_barrier`` (tensor parallelism): a barrier of all TP workers, taken by every worker at the
    start of each step; rank 0 (``tp_rank == 0``) passes its gate first, the others follow it."""

    def __init__(self, export_id: str, device: torch.device, directory: str | os.PathLike | None = None,
                 tp_rank: int = 0, tp_barrier: Callable[[], None] | None = None) -> None:
        directory = Path(directory) if directory else (GATE_DIR if GATE_DIR.is_dir() else Path(os.environ.get("LOGDIR", ".")))
        directory = directory.resolve()  # the trainer may run in another working directory
        directory.mkdir(parents=True, exist_ok=True)
        self.file = GateFile(directory / f"onecopy-gate-{export_id}", create=True)
        record = self.file.record
        record.export_id = export_id.encode()
        record.worker_pid = os.getpid()
        if os.environ.get(AWAIT_PUSH_ENV) == "1":
            record.write_seq = 1  # a restarted vLLM: the trainer's weights are not in yet
            record.refusing = 1
        record.magic = MAGIC  # last: a reader that sees the magic sees the rest
        self.export_id = export_id
        self.stall = stall_seconds()
        self._event = torch.cuda.Event(interprocess=True) if device.type == "cuda" else None
        if self._event is not None:
            self._event.record()  # created on the worker's device, before a handle is taken
        self.held = False
        self.leads = tp_rank == 0  # its lock decides for every TP worker
        self.tp_barrier = tp_barrier

    def info(self) -> GateInfo:
        handle = None if self._event is None else base64.b64encode(self._event.ipc_handle()).decode()
        return GateInfo(lock_path=str(self.file.path), export_id=self.export_id, step_event_b64=handle)

    def begin_step(self) -> None:
        """Take the gate for one step; wait while the trainer writes or the weights are half-written."""
        if self.leads:
            self._wait_and_enter()
        if self.tp_barrier is not None:
            self.tp_barrier()  # no TP worker reads a weight before rank 0 is through its gate
        if not self.leads:
            self.held = True
            self.file.record.steps += 1

    def _wait_and_enter(self) -> None:
        if self._try_enter():
            return
        record = self.file.record
        started = time.monotonic_ns()
        record.waiting_since_ns = started
        warned, delay = False, 20e-6
        while not self._try_enter():
            waited = (time.monotonic_ns() - started) / 1e9
            if not warned and waited > self.stall:
                warned = True
                why = ("the weights are half-written" if record.refusing else
                       f"trainer pid {record.writer_pid} holds the gate")
                logger.warning("[vLLM Patch] weights gate: a step has waited %.1f s (%s; /health reports it)",
                               waited, why)
            time.sleep(delay)
            delay = min(2 * delay, 1e-3)
        waited_ns = time.monotonic_ns() - started
        record.waiting_since_ns = 0
        record.waited_steps += 1
        record.wait_ns += waited_ns
        if warned:
            logger.warning("[vLLM Patch] weights gate: the step went on after %.1f s", waited_ns / 1e9)

    def _try_enter(self) -> bool:
        if not self.held and self._writer_waits():
            return False  # the trainer goes first (module docstring: writer first)
        try:
            fcntl.flock(self.file.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # the trainer is writing
        record = self.file.record
        if record.half_written:
            # We hold the lock, so no writer does: the last one left without finishing.
            fcntl.flock(self.file.fd, fcntl.LOCK_UN)
            if not record.refusing:
                record.refusing = 1
                logger.error("[vLLM Patch] refusing to step: trainer pid %d left the weights half-written (write "
                             "%d never ended). Waiting for a complete push: rerun the trainer with --resume",
                             record.writer_pid, record.write_seq)
            return False
        if record.refusing:
            record.refusing = 0
            logger.info("[vLLM Patch] complete weights arrived (version %d): stepping again", record.weights_version)
        self.held = True
        record.steps += 1
        return True

    def _writer_waits(self) -> bool:
        """Whether a live trainer waits to write. A trainer that died waiting is forgotten."""
        record = self.file.record
        waiter = record.writer_waiting
        if waiter == 0:
            return False
        if pid_alive(waiter):
            return True
        if record.writer_waiting == waiter:
            record.writer_waiting = 0
        return False

    def end_step(self) -> None:
        """The step's last launch is done: mark where its GPU work ends and let the trainer in."""
        if not self.held:
            return
        if self._event is not None:
            self._event.record()  # the current stream is vLLM's compute stream in this thread
        self.held = False
        self.file.record.ended_steps += 1
        if self.leads:
            fcntl.flock(self.file.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        """Remove the gate file (at worker exit)."""
        if self.file.fd >= 0:
            self.file.path.unlink(missing_ok=True)
            self.file.close()


class ExporterGone(RuntimeError):
    """The vLLM worker whose memory the trainer maps has exited: its mappings must not be touched."""


class GateTimeout(RuntimeError):
    """The trainer waited past its deadline to write the weights; it wrote nothing."""


class TrainerGate:
    """The trainer's side: ``begin_write()`` before writing the weights, ``end_write()`` once the
    writes have landed, or ``end_unwritten()`` when it gave up before writing anything. A write that
    never ends leaves the weights marked half-written.

    A wait to write longer than the worker's stall threshold (``$ONECOPY_GATE_STALL_SECONDS``) is
    logged once and counted: ``stalls`` such waits so far, ``stalled_seconds`` their total length.
    A wait longer than ``timeout`` seconds raises GateTimeout (``math.inf``: wait for ever)."""

    def __init__(self, info: GateInfo, device: torch.device, exporter_pid: int,
                 timeout: float = DEFAULT_WRITE_TIMEOUT_SECONDS) -> None:
        if not timeout > 0:
            raise ValueError(f"the weights gate's timeout must be > 0 seconds, not {timeout}")
        self.timeout = timeout
        self.stalls = 0
        self.stalled_seconds = 0.0
        self._lock_fd = -1  # the descriptor whose exclusive lock closes the gate, while closed
        self._marked = False  # this write marked the weights half-written (they were whole before it)
        self.file = GateFile(info.lock_path)
        found = self.file.record.export_id.decode()
        if info.export_id and found != info.export_id:
            self.file.close()
            raise ValueError(f"gate {info.lock_path} belongs to export {found}, not {info.export_id}")
        # A pidfd names this very process: no confusion with a later process that reuses the pid.
        self._pidfd = os.pidfd_open(exporter_pid)
        self.exporter_pid = exporter_pid
        self._event = None
        if info.step_event_b64 is not None:
            self._event = torch.cuda.Event.from_ipc_handle(device, base64.b64decode(info.step_event_b64))
        self.closed = False

    @property
    def record(self) -> GateRecord:
        return self.file.record

    def exporter_alive(self) -> bool:
        """False once the exporting worker has exited (its memory may be freed)."""
        return not select.select([self._pidfd], [], [], 0)[0]

    def begin_write(self) -> None:
        """Block new steps, wait until the GPU work of the launched ones is done, mark the weights
        half-written. Raises ExporterGone (nothing touched) if the worker is gone, and GateTimeout
        (gate open, nothing touched) if the gate stays taken past ``timeout``."""
        try:
            fcntl.flock(self.file.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self._lock_fd = self.file.fd
        except BlockingIOError:  # a vLLM step holds it: wait for it, against the deadline
            self.record.writer_waiting = os.getpid()  # no new step starts meanwhile
            try:
                self._lock_fd = self._wait_for_lock()
            finally:
                self.record.writer_waiting = 0
        self.closed = True
        if not self.exporter_alive():
            raise ExporterGone(f"vLLM worker pid {self.exporter_pid} exited")
        if self._event is not None:
            self._event.synchronize()
        self._mark_writing()

    def _wait_for_lock(self) -> int:
        """The exclusive lock, taken by a blocking ``flock`` (the kernel wakes it the moment the
        step unlocks; polling would miss the short gaps between back-to-back steps) in a helper
        thread, so that this thread can log a stall and give up at the deadline. The helper locks
        its own open file description, and on a wait given up, lets go of it once it gets it."""
        fd = os.open(f"/proc/self/fd/{self.file.fd}", os.O_RDWR | os.O_CLOEXEC)  # the same file, even unlinked
        got, mutex, state = threading.Event(), threading.Lock(), {"abandoned": False}

        def take() -> None:
            fcntl.flock(fd, fcntl.LOCK_EX)
            with mutex:
                if state["abandoned"]:
                    os.close(fd)  # the last descriptor of its description: the lock goes with it
                got.set()

        threading.Thread(target=take, name="onecopy-gate-lock", daemon=True).start()
        try:
            self._wait_until(got.is_set, self._lock_holder, sleep=got.wait, longest_sleep=0.1)
        except BaseException:
            with mutex:
                if not got.is_set():
                    state["abandoned"] = True
                    raise
            os.close(fd)  # got it just as we gave up: let go now
            raise
        return fd

    def _wait_until(self, done: Callable[[], bool], waits_for: Callable[[], str],
                    sleep: Callable[[float], object] = time.sleep, longest_sleep: float = 1e-3) -> None:
        """Wait until ``done()``: log a stall once past the worker's threshold, raise GateTimeout past
        ``timeout``, ExporterGone if the worker exits. ``waits_for()`` says what holds the trainer up;
        ``sleep(seconds)`` waits between checks (it may return early, e.g. an event's wait)."""
        started = time.monotonic()
        stall, warned, delay = stall_seconds(), False, 20e-6
        try:
            while not done():
                waited = time.monotonic() - started
                if not self.exporter_alive():
                    raise ExporterGone(f"vLLM worker pid {self.exporter_pid} exited")
                if waited >= self.timeout:
                    raise GateTimeout(
                        f"the trainer waited {self.timeout:g} s to write the weights: {waits_for()}. vLLM is hung or "
                        "far slower than expected: look at its log and /health, restart vLLM (and rerun the trainer "
                        "with --resume), or pass a longer --gate-timeout if its steps really take this long")
                if not warned and waited >= stall:
                    warned = True
                    self.stalls += 1
                    trainer_logger.warning("[sync] weights gate: the trainer has waited %.1f s to write the weights: "
                                           "%s (it stops after %g s)", waited, waits_for(), self.timeout)
                sleep(max(0.0, min(delay, (self.timeout if warned else stall) - waited)))
                delay = min(2 * delay, longest_sleep)
        finally:
            if warned:
                self.stalled_seconds += time.monotonic() - started
        if warned:
            trainer_logger.warning("[sync] weights gate: the write went ahead after %.1f s", time.monotonic() - started)

    def _lock_holder(self) -> str:
        """Who holds the gate the trainer waits to close, from the shared record."""
        r = self.record
        in_flight = r.steps - r.ended_steps
        if in_flight > 0:
            steps = "1 step" if in_flight == 1 else f"{in_flight} steps"
            return f"vLLM worker pid {r.worker_pid} holds the weights gate with {steps} in flight"
        if r.half_written and r.writer_pid != os.getpid() and pid_alive(r.writer_pid):
            return f"trainer pid {r.writer_pid} holds the weights gate in the middle of a write"
        return (f"another process holds the weights gate {self.file.path} (vLLM worker pid {r.worker_pid} has no step "
                "in flight)")

    def begin_follower_write(self, leader_steps: int) -> None:
        """Tensor parallelism, trainer rank > 0, while rank 0 holds the leading gate closed after
        its worker entered ``leader_steps`` steps: wait until this rank's worker has ended as many
        (it starts no other: it waits at the TP barrier), then as ``begin_write``."""
        # Through self, not a local: a GateTimeout's traceback keeps this frame, and a view of the
        # record in it would keep close() from unmapping the file while the error is handled.
        self._wait_until(lambda: self.record.ended_steps >= leader_steps,
                         lambda: f"vLLM worker pid {self.record.worker_pid} has ended {self.record.ended_steps} of "
                                 f"the {leader_steps} steps rank 0's worker entered")
        if self._event is not None:
            self._event.synchronize()
        self._mark_writing()

    def _mark_writing(self) -> None:
        record = self.record
        record.writer_pid = os.getpid()
        self._marked = not record.half_written  # else an earlier write left them so, or vLLM awaits a push
        if self._marked:
            record.write_seq += 1

    def end_write(self) -> None:
        """The writes have landed (the caller synchronized): weights whole again, gate open."""
        self.record.write_seq += 1
        self._marked = False
        self.open_gate()

    def end_unwritten(self) -> None:
        """The write that began (``begin_write`` or ``begin_follower_write``) wrote nothing: end it
        and open the gate, leaving the weights as whole as they were before it began (half-written
        only if they were then). The version moves on, as after a write, not back: vLLM's scheduler
        may already have salted requests with the version the mark announced, and the KV they
        compute on the unchanged weights must not match a later write's requests."""
        if self._marked:
            self.record.write_seq += 1
            self._marked = False
        self.open_gate()

    def open_gate(self) -> None:
        """Let vLLM step again. After a write that did not end, it refuses to (half-written)."""
        fcntl.flock(self.file.fd, fcntl.LOCK_UN)
        if self._lock_fd not in (-1, self.file.fd):
            os.close(self._lock_fd)  # the helper's description, the lock with it
        self._lock_fd = -1
        self.closed = False

    def close(self) -> None:
        """Open the gate if it is closed and let go of the file. Safe to call twice."""
        if self.file.fd < 0:
            return
        if self.closed:
            self.open_gate()
        self.file.close()
        os.close(self._pidfd)
