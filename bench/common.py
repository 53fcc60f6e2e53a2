"""Process and measurement helpers shared by the benchmark scripts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def start(args: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    """``python args...`` in its own session (so it can be stopped with its children), logging to ``log``."""
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, **(env or {})})


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the process group we started, then SIGKILL after a minute."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class GpuMemoryPeak:
    """Samples the driver's total used GPU memory (all processes) every 0.2 s; ``peak_mib``."""

    def __init__(self) -> None:
        self.peak_mib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True)
            if out.returncode == 0:
                self.peak_mib = max(self.peak_mib, sum(int(x) for x in out.stdout.split()))

    def __enter__(self) -> "GpuMemoryPeak":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
