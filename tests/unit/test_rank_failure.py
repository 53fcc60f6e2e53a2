"""A rank that fails must exit without waiting for the other ranks: they may be stuck in a
collective of their own, and torchrun stops them only once this rank has exited. Seen in CI: rank
1's vLLM could not bind its port, rank 1 waited in finish()'s monitored barrier while rank 0 waited
in prepare()'s barrier, and the data-parallel loop hung for 18 minutes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from example_trainer import grpo


class RecordingParallel:
    def __init__(self) -> None:
        self.waits: list[str] = []
        self.stopped = False

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
    assert parallel.waits == [] and parallel.stopped


def test_a_rank_that_finishes_waits_for_the_others_before_its_server_stops(monkeypatch):
    parallel = _run_main(monkeypatch, lambda run: None)
    grpo.main([])
    assert parallel.waits == ["let go of vLLM's memory"] and parallel.stopped
