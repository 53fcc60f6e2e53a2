"""The bridge file, ``vllm_bridge_config.json``: what the vLLM worker exports, what the trainer reads.

One typed record for both sides, so a field renamed on one side fails loudly on the other.
A handle grants write access to the model's memory: the file is written atomically with mode 0600.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

from vllm_patching.gate import GateInfo

BRIDGE_FILENAME = "vllm_bridge_config.json"
BRIDGE_VERSION = 1
# collective: server mode, no tensors exported; the weights arrive over a process group (weight_transfer.py)
Transport = Literal["cuda_ipc", "cpu_shm", "collective"]


class ParamMapping(BaseModel):
    vllm_name: str
    shape: list[int]
    dtype: str
    device: str


class TensorHandle(BaseModel):
    """Enough to rebuild one parameter as a view of the exporter's storage in another process.

    cuda_ipc: ``ipc_handle_b64`` is the CUDA IPC memory handle; ``storage_offset`` is in bytes.
    cpu_shm: ``ipc_handle_b64`` is the shared-memory file name, ``shm_manager_b64`` torch's
    shm-manager socket; the tensor starts ``tensor_offset`` elements into the storage.
    """

    transport: Transport
    shape: list[int]
    stride: list[int]
    tensor_offset: int
    dtype: str
    device_index: int | None = None  # the exporter's CUDA index: means nothing to a process that sees other GPUs
    device_uuid: str | None = None  # the GPU's UUID (as nvidia-smi -L prints it): the same in every process
    ipc_handle_b64: str
    storage_size: int
    storage_offset: int = 0
    ref_counter_handle_b64: str | None = None
    ref_counter_offset: int | None = None
    event_handle_b64: str | None = None
    event_sync_required: bool = False
    shm_manager_b64: str | None = None


def gpu_uuid(index: int) -> str:
    """The UUID of this process's CUDA device ``index``, as ``nvidia-smi -L`` writes it
    (GPU-xxxxxxxx-...): unlike the index, it names the same GPU whatever CUDA_VISIBLE_DEVICES is."""
    import torch

    return f"GPU-{torch.cuda.get_device_properties(index).uuid}"


class MoeLayout(BaseModel):
    """How vLLM holds a model's routed experts (``w13_weight`` [E, 2I, H], ``w2_weight`` [E, H, I])
    after loading: some MoE kernels keep them as loaded, in HF's element order, others rewrite them
    for their own layout (swapped gate/up halves, shuffled or prepacked tiles)."""

    backend: str  # the kernel vLLM runs the experts with, e.g. "TRITON", "CPU (per-expert F.linear)"
    viewable: bool  # w13/w2 hold HF's gate_up_proj/down_proj elements in HF's order, so views suffice


class BridgeFile(BaseModel):
    """Schema of vllm_bridge_config.json (Atropos's fields plus version, transport, exporter pid,
    export id and the weights gate)."""

    version: int = BRIDGE_VERSION
    model: str
    architecture: str
    vllm_version: str
    transport: Transport
    exporter_pid: int
    export_id: str = ""  # a new random id per export: tells a restarted vLLM from the one attached to
    created_at: float
    tp_degree: int = 1
    tp_rank: int = 0  # which shard this file's handles are (vLLM's tensor-parallel rank)
    dp_shard_degree: int = 1
    dp_index: int = 0  # which of vLLM's data-parallel engines wrote it (--data-parallel-size, mode server)
    shared_weights_enabled: bool = True
    single_copy_enabled: bool = True
    num_params: int
    param_names: list[str]
    param_mappings: dict[str, ParamMapping]
    ipc_handles: dict[str, TensorHandle]
    gate: GateInfo | None = None  # onecopy's weights gate; written by every onecopy worker
    moe: MoeLayout | None = None  # None: the model has no routed experts


def bridge_directory() -> Path:
    """Where the worker writes the bridge file: ``$LOGDIR``, else the working directory."""
    return Path(os.environ.get("LOGDIR", ".")).resolve()


def bridge_filename(tp_rank: int = 0, dp_index: int = 0) -> str:
    """Tensor-parallel rank 0 writes ``vllm_bridge_config.json`` (what a one-GPU trainer and the
    scheduler's salt read); rank r > 0 writes ``vllm_bridge_config.rank<r>.json`` beside it. The
    workers of data-parallel engine d > 0 put ``.dp<d>`` before those suffixes (each engine's
    scheduler reads its own)."""
    engine = "" if dp_index == 0 else f".dp{dp_index}"
    return f"vllm_bridge_config{engine}.json" if tp_rank == 0 else f"vllm_bridge_config{engine}.rank{tp_rank}.json"


def write_bridge_file(directory: str | os.PathLike, bridge: BridgeFile) -> Path:
    """Write atomically (temp file in the same folder + rename) with mode 0600, under the name of
    the bridge's tensor-parallel rank and data-parallel engine; return the path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / bridge_filename(bridge.tp_rank, bridge.dp_index)
    fd, tmp = tempfile.mkstemp(prefix=".bridge-", suffix=".json", dir=directory)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(bridge.model_dump_json())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return target


def read_bridge_file(path: str | os.PathLike) -> BridgeFile:
    """Parse and validate a bridge file; errors name the file and say what to do."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"bridge file {path} is unreadable ({err}); restart vLLM with VLLM_ENABLE_SHARED_WEIGHTS=1") from err
    if raw.get("version") != BRIDGE_VERSION:
        raise ValueError(
            f"bridge file {path} has version {raw.get('version')!r}, this onecopy reads version "
            f"{BRIDGE_VERSION}: restart vLLM with this onecopy installed"
        )
    return BridgeFile.model_validate(raw)
