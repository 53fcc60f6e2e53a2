"""The weights gate's own logic, both sides in one process (real files, locks and pidfds; no vLLM)."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import threading
import time

import pytest
import torch

from vllm_patching.gate import (AWAIT_PUSH_ENV, STALL_SECONDS_ENV, ExporterGone, GateTimeout, TrainerGate, WorkerGate,
                                 health_problem)
from vllm_patching.scheduler import salted

CPU = torch.device("cpu")


@pytest.fixture
def gates(tmp_path):
    worker = WorkerGate("e" * 32, CPU, directory=tmp_path)
    trainer = TrainerGate(worker.info(), CPU, exporter_pid=worker.file.record.worker_pid)
    yield worker, trainer
    trainer.close()
    worker.close()


def test_a_complete_write_bumps_the_version_and_lets_steps_in(gates):
    worker, trainer = gates
    assert worker.file.record.weights_version == 0 and not worker.file.record.half_written
    trainer.begin_write()
    assert worker.file.record.half_written and worker.file.record.weights_version == 1
    assert not worker._try_enter()  # the trainer holds the gate
    trainer.end_write()
    assert worker.file.record.weights_version == 1 and not worker.file.record.half_written
    worker.begin_step()
    worker.end_step()
    assert health_problem(worker.file.record) is None


def test_worker_refuses_weights_a_writer_left_half_written(gates, tmp_path):
    worker, trainer = gates
    trainer.begin_write()
    trainer.close()  # e.g. the write raised: the gate opens, the write never ended
    assert not worker._try_enter()
    assert worker.file.record.refusing == 1
    assert "half-written" in health_problem(worker.file.record)
    again = TrainerGate(worker.info(), CPU, exporter_pid=worker.file.record.worker_pid)
    again.begin_write()
    again.end_write()  # a complete push
    again.close()
    assert health_problem(worker.file.record) is None
    assert worker._try_enter() and worker.file.record.refusing == 0
    worker.end_step()


def test_a_worker_started_to_await_the_trainer_refuses_until_the_first_push(tmp_path, monkeypatch):
    monkeypatch.setenv(AWAIT_PUSH_ENV, "1")
    worker = WorkerGate("a" * 32, CPU, directory=tmp_path)
    try:
        assert "half-written (no trainer yet" in health_problem(worker.file.record)
        assert not worker._try_enter()
        trainer = TrainerGate(worker.info(), CPU, exporter_pid=worker.file.record.worker_pid)
        trainer.begin_write()
        trainer.end_write()
        trainer.close()
        assert health_problem(worker.file.record) is None  # healthy once pushed, before any step
        assert worker._try_enter()
        worker.end_step()
    finally:
        worker.close()


def test_a_write_that_wrote_nothing_ends_with_the_weights_as_whole_as_before_and_the_version_moved_on(gates, tmp_path,
                                                                                                       monkeypatch):
    worker, trainer = gates
    trainer.begin_write()  # e.g. another tensor-parallel rank could not stop its worker
    trainer.end_unwritten()
    assert not worker.file.status()["half_written"] and health_problem(worker.file.record) is None
    # Forward, not back: requests salted with version 1 during the wait computed their KV on these weights.
    assert worker.file.status()["weights_version"] == 1
    assert worker._try_enter()
    worker.end_step()
    monkeypatch.setenv(AWAIT_PUSH_ENV, "1")  # a restarted vLLM, still waiting for the trainer's weights
    waiting = WorkerGate("b" * 32, CPU, directory=tmp_path)
    unwritten = TrainerGate(waiting.info(), CPU, exporter_pid=waiting.file.record.worker_pid)
    try:
        unwritten.begin_write()
        unwritten.end_unwritten()
        assert waiting.file.status()["half_written"] and not waiting._try_enter()  # still no weights pushed
    finally:
        unwritten.close()
        waiting.close()


def test_a_step_waiting_too_long_is_reported(gates, monkeypatch):
    worker, trainer = gates
    monkeypatch.setenv("ONECOPY_GATE_STALL_SECONDS", "0.2")
    trainer.begin_write()
    stepped = threading.Event()
    thread = threading.Thread(target=lambda: (worker.begin_step(), stepped.set()))
    thread.start()
    # Until the worker's wait passes the threshold (a sleep of 0.5 s was too short on a loaded machine).
    deadline = time.monotonic() + 60
    while "has waited" not in (health_problem(worker.file.record) or ""):
        assert time.monotonic() < deadline, "the waiting step was never reported"
        time.sleep(0.01)
    assert not stepped.is_set()
    trainer.end_write()
    thread.join(5)
    worker.end_step()
    record = worker.file.record
    assert record.waited_steps == 1 and record.wait_ns > 0.2e9 and record.waiting_since_ns == 0
    assert health_problem(record) is None


def test_a_trainer_kept_waiting_past_the_stall_threshold_warns_and_counts(gates, monkeypatch, caplog):
    worker, trainer = gates
    monkeypatch.setenv(STALL_SECONDS_ENV, "0.1")  # the worker's threshold: the trainer uses the same one
    worker.begin_step()  # a vLLM step in flight holds the gate

    def end_the_step_once_the_trainer_warned():
        # Not a timer: on a loaded machine a 0.4 s timer fired before the write began, which then
        # waited for nothing (seen once, 7 jobs on 2 cores).
        deadline = time.monotonic() + 60
        while "to write the weights" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.01)
        worker.end_step()

    ender = threading.Thread(target=end_the_step_once_the_trainer_warned)
    with caplog.at_level(logging.WARNING, logger="onecopy.trainer.gate"):
        ender.start()
        started = time.monotonic()
        trainer.begin_write()  # waits for the step, then writes
        waited = time.monotonic() - started
    ender.join()
    assert re.search(rf"WARNING .*has waited \d+\.\d s to write the weights: vLLM worker pid "
                     rf"{worker.file.record.worker_pid} holds the weights gate with 1 step in flight", caplog.text)
    assert trainer.stalls == 1 and 0.1 <= trainer.stalled_seconds <= waited
    assert worker.file.record.half_written  # the write went ahead
    trainer.end_write()
    trainer.begin_write()  # a wait under the threshold is not a stall
    trainer.end_write()
    assert trainer.stalls == 1


def wait_until_the_trainer_waits(deadline_seconds: float = 5) -> None:
    """Until a trainer's begin_write waits on the gate (its lock helper thread runs)."""
    deadline = time.monotonic() + deadline_seconds
    while not any(t.name == "onecopy-gate-lock" and t.is_alive() for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the trainer never waited"
        time.sleep(0.001)
    time.sleep(0.005)  # into its flock


def test_a_waiting_trainer_goes_before_the_next_step(gates):
    """A worker that starts its next step right after ending one must not keep a waiting write out
    (flock lets shared locks in past a waiting exclusive one). 20 rounds: each time the step in
    flight ends and the worker at once tries the next, the write goes first."""
    worker, trainer = gates
    for _ in range(20):
        worker.begin_step()  # a step in flight
        version = worker.file.record.weights_version
        writer = threading.Thread(target=trainer.begin_write)
        writer.start()
        wait_until_the_trainer_waits()
        worker.end_step()
        assert not worker._try_enter(), "the next step went before the waiting write"
        writer.join(5)
        assert not writer.is_alive() and worker.file.record.half_written
        assert not worker._try_enter()  # the write holds the gate
        trainer.end_write()
        assert worker.file.record.weights_version == version + 1
        assert worker.file.record.writer_waiting == 0
        assert worker._try_enter()  # the write is done: steps go on
        worker.end_step()


def test_a_trainer_that_died_waiting_does_not_keep_steps_out(gates):
    worker, _ = gates
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    worker.file.record.writer_waiting = child.pid  # it marked itself waiting, then died
    assert worker._try_enter() and worker.file.record.writer_waiting == 0
    worker.end_step()


def test_a_trainer_kept_out_past_the_deadline_stops_with_the_cause_and_touches_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(STALL_SECONDS_ENV, "0.1")
    worker = WorkerGate("t" * 32, CPU, directory=tmp_path)
    trainer = TrainerGate(worker.info(), CPU, exporter_pid=worker.file.record.worker_pid, timeout=0.5)
    try:
        worker.begin_step()  # a step that never ends (a hung vLLM)
        started = time.monotonic()
        with pytest.raises(GateTimeout) as err:
            trainer.begin_write()
        assert 0.5 <= time.monotonic() - started < 2
        message = str(err.value)
        assert (f"waited 0.5 s to write the weights: vLLM worker pid {worker.file.record.worker_pid} holds the weights "
                "gate with 1 step in flight") in message
        assert "restart vLLM" in message and "--gate-timeout" in message
        assert trainer.stalls == 1 and trainer.stalled_seconds >= 0.5
        assert not trainer.closed and not worker.file.record.half_written  # nothing was marked or written
        assert worker.file.record.writer_waiting == 0  # the worker may step again
        worker.end_step()
        trainer.begin_write()  # the abandoned wait let go of the lock: the next write goes through
        trainer.end_write()
        # The abandoned wait's thread may take the freed lock just after this write and hold it
        # until it closes its descriptor: a step gets in within moments (vLLM's worker retries).
        deadline = time.monotonic() + 2
        while not worker._try_enter():
            assert time.monotonic() < deadline, "the abandoned wait kept the lock"
            time.sleep(0.001)
        worker.end_step()
    finally:
        trainer.close()
        worker.close()


def test_a_tensor_parallel_follower_whose_worker_never_ends_its_step_stops_with_the_cause(gates, monkeypatch):
    worker, _ = gates
    monkeypatch.setenv(STALL_SECONDS_ENV, "0.1")
    trainer = TrainerGate(worker.info(), CPU, exporter_pid=worker.file.record.worker_pid, timeout=0.3)
    try:
        with pytest.raises(GateTimeout, match=r"waited 0.3 s to write the weights: vLLM worker pid \d+ has ended 0 "
                                              r"of the 1 steps rank 0's worker entered"):
            trainer.begin_follower_write(1)
        assert trainer.stalls == 1 and not worker.file.record.half_written
    finally:
        trainer.close()


def test_trainer_notices_a_dead_exporter_and_touches_nothing(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    worker = WorkerGate("d" * 32, CPU, directory=tmp_path)
    trainer = TrainerGate(worker.info(), CPU, exporter_pid=child.pid)
    try:
        assert trainer.exporter_alive()
        child.kill()
        child.wait()
        assert not trainer.exporter_alive()
        with pytest.raises(ExporterGone):
            trainer.begin_write()
        assert not worker.file.record.half_written  # nothing was marked or written
    finally:
        trainer.close()
        worker.close()


def test_trainer_refuses_a_gate_of_another_export(gates):
    worker, _ = gates
    info = worker.info().model_copy(update={"export_id": "f" * 32})
    with pytest.raises(ValueError, match="belongs to export"):
        TrainerGate(info, CPU, exporter_pid=worker.file.record.worker_pid)


def test_salt_keeps_the_clients_own_salt():
    assert salted(None, 0) == "onecopy-weights-0"
    assert salted("mine", 3) == "mine|onecopy-weights-3"
    assert salted("mine", 3) != salted("mine", 4)


@pytest.mark.parametrize("flags,message", [
    (["--data-parallel-size", "2"], "--data-parallel-size > 1 conflicts"),
    (["--pipeline-parallel-size", "2"], "--pipeline-parallel-size > 1 conflicts"),
    (["--enable-sleep-mode"], "--enable-sleep-mode conflicts"),
    (["--scheduler-cls", "my.Scheduler"], "--scheduler-cls my.Scheduler conflicts"),
])
def test_server_refuses_what_single_copy_cannot_serve(flags, message, monkeypatch, tmp_path):
    from vllm_patching.api_server import parse_args

    monkeypatch.setenv("VLLM_ENABLE_SHARED_WEIGHTS", "1")
    with pytest.raises(SystemExit, match=message):
        parse_args(["--model", str(tmp_path), *flags])


def test_server_gates_steps_salts_the_cache_and_guards_health_in_single_copy(monkeypatch, tmp_path):
    from vllm_patching.api_server import parse_args

    monkeypatch.setenv("VLLM_ENABLE_SHARED_WEIGHTS", "1")
    args = parse_args(["--model", str(tmp_path)])
    assert args.worker_cls.startswith("vllm_patching.") and args.scheduler_cls == "vllm_patching.scheduler.salted_scheduler"
    assert "vllm_patching.api_server.health_gate" in args.middleware
