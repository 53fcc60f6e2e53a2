"""Mode server without vLLM: the refusals at start, the GPUs vLLM is given, the memory plan's two
copies, the buckets, one write over a real gloo group, and when a worker's receiver sees a write."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
import torch

from example_trainer.bridges.server import ServerBridge, check_tensor_parallel
from example_trainer.config import TrainerConfig
from example_trainer.engine.ports import free_port
from example_trainer.memory_plan import needed_bytes, plan_memory
from vllm_patching.gate import GateInfo, TrainerGate, WorkerGate
from vllm_patching.weight_transfer import (ALIGN, JoinInfo, TensorSpec, WeightGroup, bucket_size, pack, plan_buckets,
                                           receive_weights, send_weights, unpack)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def two_gpus(monkeypatch):
    """The config checks as on a machine with 2 GPUs (none is touched)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def server_cfg(**flags) -> TrainerConfig:
    return TrainerConfig(weight_bridge_mode="server", **flags)


@pytest.mark.parametrize("flags, says", [
    ({}, "needs --vllm-gpus: the 1 GPU(s) vLLM runs on, others than the trainer's (GPU 0), e.g. --vllm-gpus 1"),
    ({"vllm_gpus": "0"}, "includes the trainer's GPU 0"),
    ({"vllm_gpus": "1", "device": "cuda:1"}, "includes the trainer's GPU 1"),
    ({"vllm_gpus": "1", "vllm_tensor_parallel_size": 2}, "names 1 GPU(s) for a vLLM of --vllm-tensor-parallel-size 2"),
    ({"vllm_gpus": "2"}, "this process sees 2 GPU(s), no GPU 2"),
    ({"vllm_gpus": "1,1"}, "each GPU once"),
    ({"vllm_gpus": "one"}, "takes GPU indices separated by commas"),
    ({"vllm_gpus": "1", "launch_vllm": False}, "with --launch-vllm false the server already runs where it runs"),
])
def test_server_mode_refuses_gpus_that_cannot_work_and_says_what_to_change(two_gpus, flags, says):
    with pytest.raises(ValueError, match="--vllm-gpus") as refused:
        server_cfg(**flags)
    assert says in str(refused.value)


def test_server_mode_takes_other_gpus_than_the_trainers(two_gpus):
    assert server_cfg(vllm_gpus="1").vllm_gpus == "1"


def test_server_mode_on_a_cpu_run_takes_no_gpus():
    assert server_cfg().vllm_gpus == ""
    with pytest.raises(ValueError, match="--vllm-gpus 1 on a CPU run"):
        server_cfg(vllm_gpus="1", device="cpu")


@pytest.mark.parametrize("flag, value", [("vllm_gpus", "1"), ("vllm_tensor_parallel_size", 2)])
def test_the_server_flags_are_refused_in_the_other_modes(flag, value):
    with pytest.raises(ValueError, match=f"--{flag.replace('_', '-')} only applies to --weight-bridge-mode server"):
        TrainerConfig(weight_bridge_mode="shared_vllm", **{flag: value})


def test_a_tensor_parallel_size_that_does_not_divide_the_heads_is_refused(default_model):
    check_tensor_parallel(default_model, 3)  # SmolLM2-135M: 9 heads
    with pytest.raises(ValueError, match="--vllm-tensor-parallel-size 2 does not divide the model's 9 attention "
                                         "heads: pick one of 1, 3 \\(and as many --vllm-gpus\\)"):
        check_tensor_parallel(default_model, 2)


def test_vllm_gets_the_gpus_named_as_the_trainer_numbers_them(two_gpus, monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")  # the trainer's GPU 1 is the machine's GPU 6
    env = ServerBridge.vllm_env(server_cfg(vllm_gpus="1"), tmp_path)
    assert env["CUDA_VISIBLE_DEVICES"] == "6" and env["ONECOPY_WEIGHT_SERVER"] == "1"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6,7")
    both = server_cfg(vllm_gpus="1,2", vllm_tensor_parallel_size=2)
    assert ServerBridge.vllm_args(both) == ["--tensor-parallel-size", "2"]
    assert ServerBridge.vllm_env(both, tmp_path)["CUDA_VISIBLE_DEVICES"] == "6,7"


def test_the_memory_plan_counts_vllms_copy_on_its_gpus_not_the_trainers():
    params, gpu = 8 * 10**9, 141 * 2**30
    server, none = server_cfg(optimizer="adamw8bit"), TrainerConfig(weight_bridge_mode="none", optimizer="adamw8bit")
    plan = plan_memory(server, params, gpu)
    assert plan.bytes_per_param == {"weights, vLLM (bf16), on --vllm-gpus": 2.0, "weights, trainer": 2.0,
                                    "masters (fp32)": 4.0, "gradients (fp32)": 4.0, "optimizer (adamw8bit)": 2.0}
    assert plan.total_bytes == params * (2 + 4 + 4 + 2)  # the trainer's GPU: no vLLM weights, no KV cache
    # Mode none keeps the same two copies, both on one GPU with vLLM's share of it (its fraction).
    assert needed_bytes(none, params, gpu) - needed_bytes(server, params, gpu) == pytest.approx(0.45 * gpu)
    assert "(not in the total)" in plan.table()


def specs_of(tensors: dict[str, torch.Tensor]) -> list[TensorSpec]:
    return [TensorSpec(name=n, shape=list(t.shape), dtype=str(t.dtype).removeprefix("torch.")) for n, t in tensors.items()]


def test_buckets_hold_whole_tensors_in_order_and_a_big_one_alone():
    sizes = [100, 300, 2000, 10, 10]  # bytes of uint8 tensors
    specs = [TensorSpec(name=f"t{i}", shape=[n], dtype="uint8") for i, n in enumerate(sizes)]
    buckets = plan_buckets(specs, bucket_bytes=512)
    assert [[slot.index for slot in bucket] for bucket in buckets] == [[0, 1], [2], [3, 4]]
    assert all(slot.offset % ALIGN == 0 for bucket in buckets for slot in bucket)
    assert [bucket_size(b) for b in buckets] == [ALIGN * 2 + 300, 2000, ALIGN + 10]
    with pytest.raises(ValueError, match="bucket size"):
        plan_buckets(specs, 0)


def test_a_bucket_unpacks_to_the_tensors_packed_into_it():
    tensors = {"a": torch.randn(3, 5, dtype=torch.bfloat16), "b": torch.randn(7), "c": torch.arange(4, dtype=torch.int64)}
    specs = specs_of(tensors)
    (bucket,) = plan_buckets(specs, 2**20)
    buffer = torch.zeros(bucket_size(bucket), dtype=torch.uint8)
    pack(bucket, list(tensors.values()), buffer)
    out = dict(unpack(bucket, specs, buffer))
    assert all(torch.equal(out[name], value) and out[name].dtype == value.dtype for name, value in tensors.items())


def one_write_over_gloo_in_threads(out: str) -> None:
    """The trainer's and a worker's side of ``send_weights`` / ``receive_weights`` in two threads of
    this process; what arrived is saved to ``out``."""
    tensors = {f"layer{i}.weight": torch.randn(64, 33).to(torch.bfloat16) for i in range(5)}
    specs = specs_of(tensors)
    info = JoinInfo(join_id=uuid.uuid4().hex, host="127.0.0.1", port=free_port(), world_size=2, trainer_pid=os.getpid(),
                    backend="gloo", timeout_seconds=60, bucket_bytes=3 * 64 * 33 * 2, tensors=specs)
    buckets = plan_buckets(specs, info.bucket_bytes)
    received, header, loads = {}, torch.zeros(2, dtype=torch.int64), []

    def worker() -> None:
        group = WeightGroup(info, rank=1, device=torch.device("cpu"))
        group.broadcast(header)
        receive_weights(group, specs, buckets, lambda pairs: (loads.append(len(pairs)),
                                                               received.update({n: t.clone() for n, t in pairs})))
        group.all_reduce(torch.ones(1, dtype=torch.int64))

    thread = threading.Thread(target=worker)
    thread.start()
    trainer = WeightGroup(info, rank=0, device=torch.device("cpu"))
    sent = send_weights(trainer, specs, buckets, list(tensors.values()), header=[7, 3])
    thread.join(timeout=60)
    torch.save({"n_buckets": len(buckets), "header": header.tolist(), "loads": loads, "sent": sent,
                "expected_sent": sum(bucket_size(b) for b in buckets), "tensors": tensors, "received": received}, out)


def test_one_write_over_gloo_reaches_the_worker_whole(tmp_path):
    """Both sides in a process of their own, which exits without freeing its groups: two gloo
    groups of one process, freed there, crashed pytest (SIGSEGV) a test or two later, in 5 of
    85 runs of this test with the receiver tests after it (and once in CI)."""
    out = tmp_path / "write.pt"
    code = ("import os, sys; from tests.unit.test_server_mode import one_write_over_gloo_in_threads as run; "
            f"run({str(out)!r}); sys.stdout.flush(); os._exit(0)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    r = torch.load(out)
    assert r["n_buckets"] == 2
    assert r["header"] == [7, 3] and r["loads"] == [3, 2]  # one load_weights call per bucket
    assert r["sent"] == r["expected_sent"]
    assert all(torch.equal(r["received"][name], value) for name, value in r["tensors"].items())


def test_a_receiver_sees_a_write_only_while_its_trainer_holds_the_gate(tmp_path):
    from vllm_patching.weight_receiver import WeightReceiver

    own = WorkerGate(uuid.uuid4().hex, torch.device("cpu"), directory=tmp_path)
    receiver = WeightReceiver(str(own.file.path), own, tp_rank=0, device=torch.device("cpu"), load=None)
    receiver.info = JoinInfo(join_id="j", host="127.0.0.1", port=1, world_size=2, trainer_pid=os.getpid(),
                             backend="gloo", timeout_seconds=1, bucket_bytes=1, tensors=[])
    trainer = TrainerGate(GateInfo(lock_path=str(own.file.path), export_id=own.export_id), torch.device("cpu"),
                          os.getpid())
    try:
        assert not receiver._write_announced()
        trainer.begin_write()
        assert receiver._write_announced()
        receiver.info = receiver.info.model_copy(update={"trainer_pid": os.getppid()})  # another trainer's group
        assert not receiver._write_announced()
        receiver.info = receiver.info.model_copy(update={"trainer_pid": os.getpid()})
        trainer.end_write()
        assert not receiver._write_announced()  # whole again
        own.file.record.write_seq += 1  # half-written with the lock free: a write that broke off
        assert not receiver._write_announced()
    finally:
        trainer.close()
        receiver.leader.close()
        own.close()


def joined_receiver(tmp_path, load, timeout_seconds: float = 60):
    """A real receiver (not its thread) on a real gate, joined to this process's trainer group: the
    trainer's ``WeightGroup`` and ``TrainerGate`` are returned with it."""
    from vllm_patching.weight_receiver import WeightReceiver
    from vllm_patching.weight_transfer import join_path, write_join

    own = WorkerGate(uuid.uuid4().hex, torch.device("cpu"), directory=tmp_path)
    receiver = WeightReceiver(str(own.file.path), own, tp_rank=0, device=torch.device("cpu"), load=load)
    specs = [TensorSpec(name=f"w{i}", shape=[16], dtype="float32") for i in range(3)]
    info = JoinInfo(join_id=uuid.uuid4().hex, host="127.0.0.1", port=free_port(), world_size=2, trainer_pid=os.getpid(),
                    backend="gloo", timeout_seconds=timeout_seconds, bucket_bytes=16 * 4, tensors=specs)
    write_join(join_path(own.file.path), info)
    joining = threading.Thread(target=receiver._join_if_new)
    joining.start()
    group = WeightGroup(info, rank=0, device=torch.device("cpu"))
    joining.join(timeout=60)
    assert receiver.group is not None
    trainer = TrainerGate(GateInfo(lock_path=str(own.file.path), export_id=own.export_id), torch.device("cpu"),
                          os.getpid())
    return receiver, own, trainer, group, specs


def write_once(receiver, trainer, group, specs, tensors) -> None:
    """The trainer's side of one write (as ServerBridge._send, up to the ack) with the receiver's
    ``_receive`` in a thread; returns with the trainer still holding the gate."""
    trainer.begin_write()
    assert receiver._write_announced()
    receiving = threading.Thread(target=receiver._receive)
    receiving.start()
    try:
        send_weights(group, specs, plan_buckets(specs, 16 * 4), tensors,
                     header=[trainer.record.write_seq, trainer.record.steps])
    finally:
        receiving.join(timeout=60)
    assert not receiving.is_alive()


def close_all(receiver, own, trainer, group) -> None:
    trainer.close()
    group.close()
    receiver._leave()
    receiver.leader.close()
    own.close()


def test_a_receiver_does_not_take_a_write_it_received_for_a_new_one(tmp_path):
    """Between the workers' ack and the trainer's ``end_write`` the record still says "half-written
    by our trainer, lock held": the receiver must not enter another receive then (it would sit in
    the header broadcast with the gate open, and break at the group's timeout)."""
    loaded = {}
    receiver, own, trainer, group, specs = joined_receiver(
        tmp_path, load=lambda pairs: loaded.update({name: t.clone() for name, t in pairs}))
    try:
        for write in (1, 2):
            tensors = [torch.full((16,), float(write + i)) for i in range(3)]
            write_once(receiver, trainer, group, specs, tensors)
            assert receiver.received_writes == write
            assert all(torch.equal(t, loaded[s.name]) for s, t in zip(specs, tensors))
            assert trainer.record.half_written  # the trainer has not ended the write yet
            assert not receiver._write_announced()  # failed before the fix: the same write, announced again
            trainer.end_write()
            assert not receiver._write_announced()
    finally:
        close_all(receiver, own, trainer, group)


def test_a_worker_that_cannot_load_the_weights_makes_the_trainer_say_why(tmp_path):
    """``load_weights`` raising (a name or shape mismatch) on the first bucket: the worker still
    receives the others and acks 0, so the trainer raises with the worker's reason, not with a
    broken connection (gloo) or after a hang to the group's timeout (NCCL)."""
    calls = []

    def load(pairs) -> None:
        calls.append([name for name, _ in pairs])
        raise KeyError(f"no parameter {pairs[0][0]!r} in this model")

    receiver, own, trainer, group, specs = joined_receiver(tmp_path, load=load)
    try:
        with pytest.raises(RuntimeError, match=r"1 of 1 vLLM workers did not load the weights \(worker rank 1: "
                                               r"KeyError: .no parameter 'w0' in this model"):
            write_once(receiver, trainer, group, specs, [torch.zeros(16)] * 3)
        assert calls == [["w0"]]  # no load after the first that failed
        assert receiver.group is None and receiver.received_writes == 0  # it left the group
        assert trainer.record.half_written  # vLLM refuses to step until a complete write
    finally:
        close_all(receiver, own, trainer, group)


def test_workers_that_never_join_make_the_trainer_say_where_to_look(tmp_path, monkeypatch):
    """No receiver reads the join file: the trainer's group times out with what to check, not with
    torch's store timeout alone."""
    from types import SimpleNamespace

    from example_trainer.bridges import server
    from example_trainer.bridges.server import ServerError

    own = WorkerGate(uuid.uuid4().hex, torch.device("cpu"), directory=tmp_path)
    bridge = object.__new__(ServerBridge)
    bridge.cfg, bridge.device, bridge.specs, bridge.bucket_bytes = server_cfg(gate_timeout=1), torch.device("cpu"), [], 1
    monkeypatch.setattr(bridge, "_bridge_info", lambda: [{"gate_path": str(own.file.path), "pid": os.getpid(),
                                                          "export_id": own.export_id, "bridge_path": "unused"}])
    monkeypatch.setattr(server, "read_bridge_file", lambda path: SimpleNamespace(transport="collective", tp_degree=1))
    try:
        with pytest.raises(ServerError, match=r"did not join .*\[vLLM Patch\] could not join.*one machine"):
            bridge._connect()
    finally:
        bridge.gates.close()
        for join_file in bridge.join_files:
            join_file.unlink(missing_ok=True)
        own.close()


def test_a_killed_tensor_parallel_vllm_leaves_no_gate_of_any_worker(tmp_path):
    """``_recover`` removes every worker's gate file, the followers' too (they named them in their
    bridge files), and the bridge files."""
    import time

    from example_trainer.bridges.server import remove_worker_files
    from vllm_patching.bridge_file import BridgeFile, bridge_filename, write_bridge_file

    run_dir, shm = tmp_path / "run", tmp_path / "shm"
    gates = [WorkerGate(uuid.uuid4().hex, torch.device("cpu"), directory=shm, tp_rank=rank) for rank in range(2)]
    for rank, gate in enumerate(gates):
        write_bridge_file(run_dir, BridgeFile(
            model="m", architecture="a", vllm_version="v", transport="collective", exporter_pid=os.getpid(),
            export_id=gate.export_id, created_at=time.time(), tp_degree=2, tp_rank=rank, num_params=0, param_names=[],
            param_mappings={}, ipc_handles={}, gate=gate.info()))
    paths = [gate.file.path for gate in gates]
    try:
        assert all(os.path.exists(path) for path in paths)
        remove_worker_files(run_dir, tp_degree=2)
        assert not any(os.path.exists(path) for path in paths)
        assert not any((run_dir / bridge_filename(rank)).exists() for rank in range(2))
    finally:
        for gate in gates:
            gate.close()


class ExitsAfter:
    """A gate whose worker is seen alive for the first ``polls`` looks (a killed worker's sockets
    close a moment before its process is seen to have exited)."""

    def __init__(self, polls: int) -> None:
        self.polls = polls

    def exporter_alive(self) -> bool:
        self.polls -= 1
        return self.polls >= 0


def test_a_write_broken_by_a_killed_worker_is_taken_as_its_exit_though_the_exit_is_seen_a_moment_later():
    from example_trainer.bridges.server_engines import EngineGates

    bridge = object.__new__(ServerBridge)
    bridge.gates = EngineGates([ExitsAfter(polls=3)])
    assert bridge._worker_exits(within=5.0)  # before: the first look said alive, and the error was raised
    bridge.gates = EngineGates([ExitsAfter(polls=10**9)])
    assert not bridge._worker_exits(within=0.2)  # a live worker's error is raised after the bound


def test_vllm_takes_most_of_its_own_gpus_in_mode_server_and_a_given_share_wins(two_gpus):
    from example_trainer.engine.vllm_process import vllm_server_args

    def share(cfg: TrainerConfig) -> float:
        args = vllm_server_args(cfg)
        return float(args[args.index("--gpu-memory-utilization") + 1])

    assert share(server_cfg(vllm_gpus="1")) == 0.9  # its GPU holds vLLM alone
    assert share(TrainerConfig(weight_bridge_mode="none")) == 0.45  # beside the trainer's copy
    assert share(server_cfg(vllm_gpus="1", vllm_gpu_memory_utilization=0.6)) == 0.6
    # The same from the command line, through the launcher, which passes the trainer its own flags.
    from example_trainer.launcher import parse_loop_config, trainer_flags

    for argv, expected in ((["--weight-bridge-mode", "server", "--vllm-gpus", "1"], 0.9),
                           (["--weight-bridge-mode", "server", "--vllm-gpus", "1", "--vllm-gpu-memory-utilization",
                             "0.5"], 0.5)):
        trainer = parse_loop_config(argv).trainer
        assert share(trainer) == expected
        assert ("--vllm-gpu-memory-utilization" in trainer_flags(trainer)) == (expected != 0.9)


def test_data_parallel_ranks_share_one_vllm_that_rank_0_starts(two_gpus):
    from example_trainer.bridges import bridge_class
    from example_trainer.bridges.server import DataParallelServerBridge
    from example_trainer.parallel import Parallel

    cfg = server_cfg(parallel="data", launch_vllm=False)  # attaching is allowed: there is one vLLM to attach to
    assert bridge_class("server", "data") is DataParallelServerBridge
    ranks = [Parallel.from_environment("data", {"WORLD_SIZE": "2", "RANK": str(r)}, one_vllm=True) for r in range(2)]
    assert [r.starts_vllm for r in ranks] == [True, False]
    assert [r.rank_view(cfg, "/run") for r in ranks] == [(cfg, Path("/run"))] * 2  # one port, one folder
    own = [Parallel.from_environment("data", {"WORLD_SIZE": "2", "RANK": str(r)}) for r in range(2)]
    assert [r.starts_vllm for r in own] == [True, True]  # shared_vllm: a vLLM per rank
    assert own[1].rank_view(TrainerConfig(parallel="data"), "/run")[1] == Path("/run/rank1")
    # The one vLLM runs on --vllm-gpus (the bridge's environment), not on rank 0's GPU.
    assert ranks[0].server_env() == {} and own[1].server_env() == {"CUDA_VISIBLE_DEVICES": "1"}
    with pytest.raises(ValueError, match="--parallel tensor is not built for --weight-bridge-mode 'server'; it takes "
                                         "none, data \\(use shared_vllm for it\\)"):
        server_cfg(parallel="tensor")


@pytest.mark.parametrize("gpus, flags, says", [
    (2, {"vllm_gpus": "1"}, "includes the trainer's GPU 1 (--device auto) (--parallel data: one rank per GPU from "
                            "GPU 0, 2 of them): server mode keeps two copies"),
    (4, {}, "others than the trainer's (GPU 0,1), e.g. --vllm-gpus 2"),
    (4, {"vllm_gpus": "0,2", "vllm_tensor_parallel_size": 2}, "includes the trainer's GPU 0"),
])
def test_data_parallel_ranks_train_on_gpus_0_to_n_and_vllm_on_others(monkeypatch, gpus, flags, says):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun's, in each trainer rank
    with pytest.raises(ValueError) as refused:
        server_cfg(parallel="data", **flags)
    assert says in str(refused.value)


def test_data_parallel_in_mode_server_takes_gpus_after_the_ranks(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert server_cfg(parallel="data", vllm_gpus="2,3", vllm_tensor_parallel_size=2).vllm_gpus == "2,3"
