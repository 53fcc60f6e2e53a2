"""onecopy's vLLM worker for server mode: vLLM keeps its own weights; the trainer sends new ones
over a process group after every step (vllm_patching.weight_transfer says which route and why).

The worker runs every step through the same weights gate as the single-copy worker
(``SharedWeightsMixin``: one step sees one version, each token is tagged with it, the scheduler
salts the prefix cache with it, ``/health`` refuses half-written weights), and writes a bridge
file that names the gate but exports no tensors. A receiver thread does the rest:

  joined?   the trainer writes ``JoinInfo`` beside the leading worker's gate; a new join id means
            a new group (the trainer restarted, or re-attached): the old one is dropped
  write?    the trainer has closed the leading gate for a write: its record is half-written by a
            live trainer pid that is the group's, and the lock is taken; and not by the write this
            receiver acked last (between the ack and the trainer's ``end_write`` the record still
            reads so: a receive entered then would wait in the header broadcast with the gate open)
  receive   header, then every bucket into the model's ``load_weights``, then the ack
            (tensor-parallel workers of rank > 0 first wait until they ended every step the
            leading worker entered, as ``TrainerGate.begin_follower_write`` does in shared_vllm;
            on a GPU, until the device has done the launched steps' work). A worker that cannot
            load (``load_weights`` raises, or its steps do not end) still receives every bucket,
            acks 0 and says why through the group's store, then leaves: the trainer raises with
            the reason, instead of a broken connection (gloo) or a hang to the timeout (NCCL).
            Only a transport error leaves the group at once.

The engine thread never takes part in a collective: while the trainer writes it waits at the gate,
so a trainer that dies leaves no engine blocked; the receiver's collectives end at the group's
timeout at the latest (the module docstring of weight_transfer).
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
import uuid

import torch
from vllm.distributed import get_tp_group
from vllm.v1.worker.gpu_worker import Worker

from vllm_patching.bridge_file import BridgeFile, bridge_directory, write_bridge_file
from vllm_patching.compat import engine_index, no_cpu_weight_packing
from vllm_patching.export import use_plain_cpu_linear
from vllm_patching.gate import GateFile, WorkerGate, pid_alive
from vllm_patching.weight_transfer import (JoinInfo, WeightGroup, join_path, plan_buckets, read_join,
                                           receive_weights)
from vllm_patching.worker import SharedWeightsMixin

logger = logging.getLogger("vllm.onecopy.receiver")  # under "vllm" to use its log handler in the worker

JOIN_POLL_SECONDS = 0.2  # how often an idle receiver looks for a (new) join
LONGEST_WRITE_POLL = 2e-3  # the longest sleep between looks at the gate, once joined


class WeightReceiver:
    """The receiver thread's loop (module docstring). ``load(pairs)`` writes (HF name, tensor)
    pairs into the model; ``own`` is this worker's gate, ``leader_gate_path`` tensor-parallel
    rank 0's (the one the trainer closes)."""

    def __init__(self, leader_gate_path: str, own: WorkerGate, tp_rank: int, device: torch.device, load) -> None:
        self.leader = GateFile(leader_gate_path)  # our own open file: probing its lock never touches the engine's
        self.join_file = join_path(leader_gate_path)
        self.own, self.tp_rank, self.device, self.load = own, tp_rank, device, load
        self.info: JoinInfo | None = None
        self.group: WeightGroup | None = None
        self.buckets = []
        self.received_writes = 0
        self._stop = threading.Event()
        self._join_identity: tuple[int, int] | None = None
        self._acked_seq: int | None = None  # the write_seq of the last write this group's trainer got our ack for
        self.thread = threading.Thread(target=self.run, name="onecopy-weight-receiver", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        delay = LONGEST_WRITE_POLL
        next_join_look = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_join_look:
                next_join_look = now + JOIN_POLL_SECONDS
                self._join_if_new()
            if self.group is not None and self._write_announced():
                self._receive()
                delay = 20e-6
                continue
            time.sleep(delay if self.group is not None else JOIN_POLL_SECONDS)
            delay = min(2 * delay, LONGEST_WRITE_POLL)

    def _join_if_new(self) -> None:
        try:
            stat = os.stat(self.join_file)
        except FileNotFoundError:
            return
        identity = (stat.st_ino, stat.st_mtime_ns)  # a join is written anew (a rename): a new inode
        if identity == self._join_identity:
            return  # read already: parsing a large model's tensor list five times a second costs the engine's CPU
        self._join_identity = identity
        info = read_join(self.join_file)
        if info is None or (self.info is not None and info.join_id == self.info.join_id):
            return
        self._leave()
        self.info = info
        if not pid_alive(info.trainer_pid):
            return  # a dead trainer's join: wait for the next
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        try:
            self.group = WeightGroup(info, rank=info.first_rank + self.tp_rank, device=self.device)
        except Exception as err:  # noqa: BLE001 (the thread must live on to take the next join)
            logger.error("[vLLM Patch] could not join trainer pid %d's weight group at %s:%d: %s", info.trainer_pid,
                         info.host, info.port, err)
            self.group = None
            return
        self.buckets = plan_buckets(info.tensors, info.bucket_bytes)
        logger.info("[vLLM Patch] joined trainer pid %d's weight group (%s, rank %d of %d, %d tensors in %d "
                    "buckets)", info.trainer_pid, info.backend, info.first_rank + self.tp_rank, info.world_size,
                    len(info.tensors),
                    len(self.buckets))

    def _write_announced(self) -> bool:
        """The group's trainer has closed the leading gate for a write (the lock is held) that this
        receiver has not acked yet."""
        record = self.leader.record
        if not (record.half_written and record.writer_pid == self.info.trainer_pid):
            return False
        if record.write_seq == self._acked_seq:
            return False  # received and acked; the trainer has not ended it yet
        if not pid_alive(self.info.trainer_pid):
            return False
        try:
            fcntl.flock(self.leader.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True  # the trainer holds it exclusively: it is writing
        fcntl.flock(self.leader.fd, fcntl.LOCK_UN)
        return False

    def _receive(self) -> None:
        started = time.perf_counter()
        try:
            header = torch.zeros(2 * self.info.engines, dtype=torch.int64, device=self.device)
            self.group.broadcast(header)
            pairs = [int(x) for x in header.tolist()]
            write_seq, leader_steps = pairs[2 * self.info.engine:2 * self.info.engine + 2]  # our engine's
            failure = self._receive_and_load(leader_steps)
            if failure is not None:  # under the write's first pair, where the trainer looks
                self.group.report_load_error(pairs[0], f"{type(failure).__name__}: {failure}")
            ack = torch.tensor([0 if failure else 1], dtype=torch.int64, device=self.device)
            self.group.all_reduce(ack)
        except Exception as err:  # noqa: BLE001 (the thread must live on to take the next join)
            logger.error("[vLLM Patch] weight write from trainer pid %d broke off (%s): left the group; vLLM runs no "
                         "step until a trainer writes complete weights", self.info.trainer_pid, err)
            self._leave()
            return
        if failure is not None:
            logger.error("[vLLM Patch] could not load write %d from trainer pid %d (%s: %s): left the group; vLLM "
                         "runs no step until a trainer writes complete weights", write_seq, self.info.trainer_pid,
                         type(failure).__name__, failure, exc_info=failure)
            self._leave()
            return
        self._acked_seq = write_seq
        self.received_writes += 1
        logger.debug("[vLLM Patch] weights of write %d received in %.3f s", write_seq, time.perf_counter() - started)

    def _receive_and_load(self, leader_steps: int) -> Exception | None:
        """Every bucket of the write, each into ``load`` until one load fails (or this worker's steps
        did not end): the error, the rest received and dropped, so that the trainer gets the ack.
        Transport errors raise."""
        failure: Exception | None = None
        try:
            self._wait_for_own_steps(leader_steps)
        except TimeoutError as err:
            failure = err

        def load(pairs) -> None:
            nonlocal failure
            if failure is None:
                try:
                    self.load(pairs)
                except Exception as err:  # noqa: BLE001 (a shape or name mismatch: reported through the ack)
                    failure = err

        with torch.no_grad():
            receive_weights(self.group, self.info.tensors, self.buckets, load)
        if failure is None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the writes have landed before the trainer opens the gate
        return failure

    def _wait_for_own_steps(self, leader_steps: int) -> None:
        """Tensor parallelism, rank > 0: every step the leader entered has ended here too; a GPU
        has done the launched work."""
        if self.tp_rank > 0:
            deadline = time.monotonic() + self.info.timeout_seconds
            while self.own.file.record.ended_steps < leader_steps:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"this worker ended {self.own.file.record.ended_steps} steps, the leading one "
                                       f"entered {leader_steps}")
                time.sleep(20e-6)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _leave(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group = None
        self._acked_seq = None  # a new group's trainer may write the same write_seq again


class WeightReceiverMixin(SharedWeightsMixin):
    """The single-copy worker's gate and version tags, with a receiver instead of an export."""

    _onecopy_receiver: WeightReceiver | None = None

    def load_model(self, *args, **kwargs) -> None:
        self._onecopy_refuse_unsupported()
        if self.device.type == "cpu":
            # Weights vLLM's CPU backend packed into private buffers would never see a write.
            with no_cpu_weight_packing():
                super(SharedWeightsMixin, self).load_model(*args, **kwargs)  # vLLM's own, not the export's
            use_plain_cpu_linear(self.model_runner.get_model())
        else:
            super(SharedWeightsMixin, self).load_model(*args, **kwargs)
        self._onecopy_bridge_path = self._onecopy_open_gate()

    def _onecopy_refuse_unsupported(self) -> None:
        parallel = self.vllm_config.parallel_config
        if parallel.pipeline_parallel_size > 1:
            raise RuntimeError("server mode does not support pipeline parallelism: use --tensor-parallel-size")
        # vLLM runs a dense model's data-parallel engines as independent engines of size 1 (each its
        # own gate and bridge file); only an MoE model's keep their size, and step in lockstep: one
        # engine waiting at its gate would hold the others inside a step, and the trainer would wait
        # for them to end it.
        if parallel.data_parallel_size > 1:
            raise RuntimeError("server mode does not support an MoE model's data-parallel engines (they step in "
                               "lockstep): use --tensor-parallel-size, or --data-parallel-size with a dense model")

    def _onecopy_open_gate(self) -> str:
        export_id = uuid.uuid4().hex
        tp_group = get_tp_group()
        self._onecopy_gate = gate = WorkerGate(export_id, self.device, tp_rank=tp_group.rank_in_group,
                                               tp_barrier=tp_group.barrier if tp_group.world_size > 1 else None)
        model_config = self.vllm_config.model_config
        import vllm

        bridge = BridgeFile(
            model=model_config.model, architecture=(model_config.hf_config.architectures or ["unknown"])[0],
            vllm_version=vllm.__version__, transport="collective", exporter_pid=os.getpid(), export_id=export_id,
            created_at=time.time(), tp_degree=tp_group.world_size, tp_rank=tp_group.rank_in_group,
            dp_index=engine_index(self.vllm_config),
            shared_weights_enabled=False, single_copy_enabled=False, num_params=0, param_names=[],
            param_mappings={}, ipc_handles={}, gate=gate.info(),
        )
        path = write_bridge_file(bridge_directory(), bridge)
        leader_gate = str(gate.file.path)
        if tp_group.world_size > 1:
            leader_gate = tp_group.broadcast_object(leader_gate, src=0)
        model = self.model_runner.get_model()
        self._onecopy_receiver = WeightReceiver(leader_gate, gate, tp_group.rank_in_group, self.device,
                                                load=model.load_weights)
        self._onecopy_receiver.start()
        logger.info("[vLLM Patch] server mode: weights gate %s; the trainer's weights arrive over a process group "
                    "(join file %s)", gate.file.path, self._onecopy_receiver.join_file)
        return str(path)

    def onecopy_weights_digest(self) -> dict:
        """A checksum of every parameter as this worker holds it, and the weights version, read
        between two steps (through the gate: never during a write). For tests and debugging: it reads
        vLLM's memory itself, not anything the transfer counted."""
        import hashlib

        gate = self._onecopy_gate
        gate.begin_step()
        try:
            version = self._onecopy_receiver.leader.record.weights_version  # the trainer writes only rank 0's record
            digests = {}
            for name, param in self.model_runner.get_model().named_parameters():
                data = param.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
                digests[name] = {"sha256": hashlib.sha256(data.tobytes()).hexdigest(), "shape": list(param.shape),
                                 "dtype": str(param.dtype).removeprefix("torch.")}
        finally:
            gate.end_step()
        return {"weights_version": version, "tp_rank": get_tp_group().rank_in_group,
                "engine": engine_index(self.vllm_config), "tensors": digests}

    def shutdown(self) -> None:
        receiver = self._onecopy_receiver
        if receiver is not None:
            receiver.stop()
            if receiver.tp_rank == 0:
                receiver.join_file.unlink(missing_ok=True)  # beside the gate, which goes too
        super().shutdown()


class WeightReceiverGPUWorker(WeightReceiverMixin, Worker):
    """vLLM's GPU worker in server mode."""
