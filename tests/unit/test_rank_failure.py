"""A rank that fails must exit without waiting for the other ranks: they may be stuck in a
collective of their own, and torchrun stops them only once this rank has exited. Seen in CI: rank
1's vLLM could not bind its port, rank 1 waited in finish()'s monitored barrier while rank 0 waited
in prepare()'s barrier, and the data-parallel loop hung for 18 minutes."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from example_trainer import grpo

ROOT = Path(__file__).resolve().parents[2]


class RecordingParallel:
    def __init__(self) -> None:
        self.waits: list[str] = []
        self.stopped = False
        self.reported: list[BaseException] = []

    def report_failure(self, err: BaseException) -> None:
        self.reported.append(err)

    def exit_after_failure(self, err: BaseException, reason: str | None) -> None:
        pass  # one rank: the caller raises

    def wait_for_ranks(self, what: str, seconds: float) -> None:
        self.waits.append(what)

    def stop(self) -> None:
        self.stopped = True


def _run_main(monkeypatch, prepare):
    parallel = RecordingParallel()
    run = SimpleNamespace(optimizer=None, bridge=SimpleNamespace(close=lambda: None), parallel=parallel, server=None,
                          metrics_file=None, wandb_run=None)
    monkeypatch.setattr(grpo, "parse_config", lambda *a, **k: None)
    monkeypatch.setattr(grpo, "start_run", lambda cfg: run)
    monkeypatch.setattr(grpo, "prepare", prepare)
    monkeypatch.setattr(grpo, "train", lambda run: None)
    return parallel


def test_a_rank_that_fails_exits_without_waiting_for_the_others(monkeypatch):
    def vllm_did_not_start(run):
        raise SystemExit("[vLLM] exited with code 1 before it was healthy")

    parallel = _run_main(monkeypatch, vllm_did_not_start)
    with pytest.raises(SystemExit, match="before it was healthy"):
        grpo.main([])
    # Nor does it tear the process group down: that waits for ranks stuck in a collective.
    assert parallel.waits == [] and not parallel.stopped
    assert [str(err) for err in parallel.reported] == ["[vLLM] exited with code 1 before it was healthy"]


def test_a_rank_that_finishes_waits_for_the_others_before_its_server_stops(monkeypatch):
    parallel = _run_main(monkeypatch, lambda run: None)
    grpo.main([])
    assert parallel.waits == ["let go of vLLM's memory"] and parallel.stopped and parallel.reported == []


RANK_FAILS = """
import sys
from types import SimpleNamespace

import torch

from example_trainer import grpo
from example_trainer.parallel import Parallel

parallel = Parallel.from_environment("data")
parallel.start(torch.device("cpu"), timeout_seconds=600)
run = SimpleNamespace(optimizer=None, bridge=SimpleNamespace(close=lambda: None), parallel=parallel, server=None,
                      metrics_file=None, wandb_run=None)
grpo.parse_config = lambda *a, **k: None
grpo.start_run = lambda cfg: run


def prepare(run):
    if parallel.rank == 1:
        raise RuntimeError("rank one's vLLM answered nonsense")
    parallel.barrier("rank 1, which never comes")  # rank 0 waits in a collective, as it waits for a batch


grpo.prepare = prepare
grpo.train = lambda run: None
grpo.logging.basicConfig(level="INFO" if parallel.is_main else "WARNING",
                         format=f"%(levelname)s rank{parallel.rank}: %(message)s")
grpo.main([])
"""


def test_a_rank_that_raises_stops_the_whole_torchrun_job_with_its_error_in_the_log(tmp_path):
    """Two gloo ranks under torchrun: rank 1 raises while rank 0 waits in a barrier for it. The
    job exits non-zero well within a minute, and the log names rank 1 and its error."""
    script = tmp_path / "rank_fails.py"
    script.write_text(RANK_FAILS)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    took = time.monotonic() - started
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-3000:]
    assert "rank 1 of 2 failed: RuntimeError: rank one's vLLM answered nonsense" in output, output[-3000:]
    assert took < 60, (took, output[-3000:])
