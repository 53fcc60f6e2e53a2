"""The weights gate: vLLM runs no step while the trainer writes the shared weights.

One lock file per vLLM worker (``flock``). The worker holds it shared for each step it launches
(``execute_model`` and ``sample_tokens``); the trainer holds it exclusively while it writes. On a
GPU a launched step still runs after the worker's call returns, so the worker records an
interprocess CUDA event after each launch, on the stream it launched on, and the trainer, once it
holds the lock, waits for that event before writing.

Why not pause vLLM's scheduler over HTTP: the pause is answered by vLLM's API server process,
whose event loop is busy with the outputs of every running request. On an H200 with SmolLM2-135M
and 128 sequences in flight it took 109 ms (median), against 3 ms with nothing generating. The
gate costs a lock and an event per step and does not go through that process at all.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import os
from pathlib import Path

import torch
from pydantic import BaseModel

GATE_FILENAME = "onecopy_weights.lock"


class GateInfo(BaseModel):
    """Where the trainer finds the worker's gate (a field of the bridge file)."""

    lock_path: str
    step_event_b64: str | None = None  # CUDA IPC event handle; None on CPU (steps end with the call)


class WorkerGate:
    """The worker's side: wrap each step launch in ``step()``."""

    def __init__(self, directory: str | os.PathLike, device: torch.device) -> None:
        directory = Path(directory).resolve()  # the trainer may run in another working directory
        directory.mkdir(parents=True, exist_ok=True)
        self.lock_path = directory / GATE_FILENAME
        self._fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        self._event = torch.cuda.Event(interprocess=True) if device.type == "cuda" else None
        if self._event is not None:
            self._event.record()  # created on the worker's device, before a handle is taken

    def info(self) -> GateInfo:
        handle = None if self._event is None else base64.b64encode(self._event.ipc_handle()).decode()
        return GateInfo(lock_path=str(self.lock_path), step_event_b64=handle)

    @contextlib.contextmanager
    def step(self):
        """Launch one step: waits while the trainer writes; marks where the step's GPU work ends."""
        fcntl.flock(self._fd, fcntl.LOCK_SH)
        try:
            yield
        finally:
            if self._event is not None:
                self._event.record()  # the current stream is vLLM's compute stream in this thread
            fcntl.flock(self._fd, fcntl.LOCK_UN)


class TrainerGate:
    """The trainer's side: ``close_gate()`` before writing the weights, ``open_gate()`` after."""

    def __init__(self, info: GateInfo, device: torch.device) -> None:
        self._fd = os.open(info.lock_path, os.O_RDWR)
        self._event = None
        if info.step_event_b64 is not None:
            self._event = torch.cuda.Event.from_ipc_handle(device, base64.b64decode(info.step_event_b64))
        self.closed = False

    def close_gate(self) -> None:
        """Block new steps, then wait until the GPU work of the steps already launched is done."""
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        self.closed = True
        if self._event is not None:
            self._event.synchronize()

    def open_gate(self) -> None:
        """Let vLLM step again; the caller has made sure its writes have landed."""
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        self.closed = False

    def close(self) -> None:
        """Open the gate if it is closed and let go of the lock file. Safe to call twice."""
        if self._fd < 0:
            return
        if self.closed:
            self.open_gate()
        os.close(self._fd)
        self._fd = -1
