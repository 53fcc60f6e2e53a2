"""Hand the KV cache's GPU memory to training between generations, and take it back (mode colocate).

With ``--enable-cumem-allocator`` vLLM 0.26 allocates the weights and the KV cache through its
cuMem pool, tagged ``weights`` and ``kv_cache``. Its sleep unmaps every allocation of the pool
(level 1 first copies the weights to host), which would take the memory from under the trainer's
views of the weights. These two functions, run in the worker through ``collective_rpc``, unmap
only the ``kv_cache`` allocations and map them again at the same virtual addresses, so the
engine's tensors and CUDA graphs stay valid; the weights are never touched. The KV contents are
lost: the caller drops the prefix cache (colocate does after every optimizer step anyway).
"""

from __future__ import annotations

KV_CACHE_TAG = "kv_cache"


def release_kv_cache(worker) -> int:
    """Unmap the KV cache's physical memory; return the bytes given back to the driver."""
    import torch
    from vllm.device_allocator.cumem import CuMemAllocator, unmap_and_release

    torch.cuda.synchronize()  # no kernel may still read the cache
    freed = 0
    for data in CuMemAllocator.get_instance().pointer_to_data.values():
        if data.tag == KV_CACHE_TAG and not data.is_asleep:
            unmap_and_release(data.handle)
            data.is_asleep = True
            freed += data.handle[1]
    if not freed:
        raise RuntimeError("no KV-cache allocation in vLLM's cuMem pool: start vLLM with --enable-cumem-allocator")
    return freed


def restore_kv_cache(worker) -> None:
    """Map the KV cache again (same addresses, new physical memory); then the runner's own after-wake step."""
    worker.wake_up(tags=[KV_CACHE_TAG])
