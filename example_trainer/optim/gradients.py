"""Where the gradients live between backward and the optimizer step: on their parameters (the
default) or, with ``--offload-gradients``, in pinned host memory.

Backward leaves each parameter's gradient beside it until the optimizer step: 2 bytes per
parameter with --bf16-inplace, 27.6 GiB at 14B, the largest thing the trainer holds there once the
optimizer's state is offloaded. Offloaded, a post-accumulate-grad hook (PyTorch's hook for exactly
this: it runs once backward has finished a parameter's gradient) copies each gradient to host
memory on a side stream as soon as backward has produced it and frees it on the device, so the
device holds only the gradients still on their way out. A later micro-batch brings the sum so far
back, adds its own gradient to it on the device (the addition backward's accumulation does, in the
gradient's dtype) and sends the sum out again: gradient accumulation stays exact, at twice the
gradient's size over the host link per extra micro-batch. The optimizer step then streams each
window's gradients back with its offloaded state (example_trainer/optim/optimizer_state.py). The norm
for clipping is taken on the device from each finished gradient, as torch's ``clip_grad_norm_``
takes it, and the clipping scale is applied as each gradient comes back.

What it costs: the gradient's size over the host link twice each step (PCIe 5 moves ~50 GB/s:
~0.6 s each way at 14B; the copy out overlaps backward, the copy back is inside the step, with the
weights gate closed), and 2 bytes per parameter of page-locked host memory: one buffer per dtype,
registered with CUDA as it is (torch's pinned allocator would round each parameter's buffer up to
a power of two, 1.7x at 14B).
"""

from __future__ import annotations

import logging

import torch
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

from example_trainer.parallel import local_grad, split_over_ranks

logger = logging.getLogger("onecopy.trainer.optimizer")

Rows = tuple[int, int] | None  # (first row, row count) of a parameter seen as rows of its last dimension; None: all


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a 2D view of rows of its last dimension (a 3D tensor's leading dimensions flattened)."""
    return t if t.dim() == 2 else t.view(-1, t.shape[-1])  # view: the row blocks must share the storage


def _rows_of(t: torch.Tensor, rows: Rows) -> torch.Tensor:
    return t if rows is None else as_rows(t).narrow(0, *rows)


class GradientsOnDevice:
    """Backward leaves each gradient on its parameter (``p.grad``), where the optimizer reads it."""

    def finish_backward(self, parallel, params: list[torch.Tensor], max_norm: float,
                        model_params: list[torch.Tensor] | None = None) -> float:
        """After the last micro-batch: sum over ``parallel``'s data-parallel ranks, clip to
        ``max_norm`` (0: no clipping) and return the whole gradient's norm."""
        parallel.sum_gradients(params)
        if model_params is not None:
            parallel.average_replicated_gradients([p.grad for p in params], model_params)
        return parallel.clip_grad_norm(params, max_norm, model_params)

    def has(self, p: torch.Tensor) -> bool:
        return p.grad is not None

    def grad(self, p: torch.Tensor, rows: Rows = None) -> torch.Tensor:
        """The (clipped) gradient of ``rows`` of ``p``, on ``p``'s device."""
        return _rows_of(p.grad, rows)

    def clear(self) -> None:
        """After the step (``zero_grad`` drops the parameters' gradients)."""

    def host_bytes(self) -> int:
        return 0

    def remove(self) -> None:
        """Nothing holds the parameters."""


class GradientsInHost:
    """Moves each gradient of ``params`` to pinned host memory as backward finishes it (see the
    module's docstring); ``grad`` brings a piece of it back for the optimizer step.

    ``model_params``: where backward accumulates each one's gradient, when that is not the tensor
    itself (tensor parallel: the model's DTensors, whose local shards the optimizer steps; a
    shard's gradient is the local part of its DTensor's). Default: ``params``."""

    def __init__(self, params: list[torch.Tensor], model_params: list[torch.Tensor] | None = None) -> None:
        self.params = list(params)
        self.model_params = self.params if model_params is None else list(model_params)
        if len(self.model_params) != len(self.params):
            raise ValueError(f"{len(self.params)} tensors to step but {len(self.model_params)} model parameters: one "
                             "model parameter per stepped tensor, in the same order")
        self._stepped = {id(m): p for m, p in zip(self.model_params, self.params)}  # id(model parameter) -> its tensor
        device = self.params[0].device if self.params else torch.device("cpu")
        self.pin = device.type == "cuda"  # page-locked memory and a side stream need CUDA
        self.stream = torch.cuda.Stream(device) if self.pin else None
        self._registered: list[torch.Tensor] = []  # the page-locked host tensors
        self.host = self._host_buffers()  # id(p) -> its gradient's place in host memory
        self.norms: dict[int, torch.Tensor] = {}  # id(p) -> the norm of its gradient so far this step, on the device
        self.scale: torch.Tensor | None = None  # the clipping factor, once the step's norm is known
        self._hooks = [m.register_post_accumulate_grad_hook(self._offload) for m in self.model_params]

    def _host_buffers(self) -> dict[int, torch.Tensor]:
        """One host tensor per dtype, exactly the parameters' size, page-locked by registering it
        with CUDA (as torch's own checkpoint stager does); each parameter's buffer is a view of it."""
        buffers: dict[int, torch.Tensor] = {}
        for dtype in dict.fromkeys(p.dtype for p in self.params):
            params = [p for p in self.params if p.dtype == dtype]
            flat = torch.empty(sum(p.numel() for p in params), dtype=dtype)
            if self.pin:
                size = flat.numel() * flat.element_size()
                logger.info("[optimizer] page-locking %.2f GiB of host memory for the gradients, once", size / 2**30)
                error = int(torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), size, 1))  # 1: portable, as torch's
                if error:
                    raise RuntimeError(f"--offload-gradients: CUDA could not page-lock {size / 2**30:.1f} GiB of host "
                                       f"memory (cudaError {error}); leave the gradients on the GPU")
                self._registered.append(flat)  # unregistered by remove(), before the memory can go
            for p, piece in zip(params, flat.split([p.numel() for p in params])):
                buffers[id(p)] = piece.view(p.shape)
        return buffers

    def _offload(self, owner: torch.Tensor) -> None:
        grad, p = local_grad(owner), self._stepped[id(owner)]
        owner.grad = None
        host = self.host[id(p)]
        side = self.stream
        if side is None:  # a CPU-only machine: the host buffer is the sum itself
            if id(p) in self.norms:
                host.add_(grad)
            else:
                host.copy_(grad)
            self.norms[id(p)] = torch.nn.utils.get_total_norm([host])
            return
        side.wait_stream(torch.cuda.current_stream(grad.device))  # the gradient is computed before it is read
        total = grad
        if id(p) in self.norms:  # a later micro-batch (or a second use of a tied weight): add to the sum so far
            total = torch.empty_like(grad)  # from the compute stream's memory, so it goes back there
        with torch.cuda.stream(side):
            if total is not grad:
                total.copy_(host, non_blocking=True)
                total.add_(grad)  # what backward's accumulation does, in the gradient's dtype
            self.norms[id(p)] = torch.nn.utils.get_total_norm([total])  # torch's clipping kernel: the same bits
            host.copy_(total, non_blocking=True)
        grad.record_stream(side)  # the allocator must not reuse their memory before the side stream is done
        total.record_stream(side)

    def _wait_for_copies(self) -> None:
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)

    def finish_backward(self, parallel, params: list[torch.Tensor], max_norm: float,
                        model_params: list[torch.Tensor] | None = None) -> float:
        """After the last micro-batch: wait for the copies out, take the whole gradient's norm as
        torch's ``clip_grad_norm_`` does (from each tensor's norm) and the clipping factor. Tensor
        parallel: the whole model's norm over the ranks (``Parallel.norm_over_ranks``). Not built
        for data parallel (the config refuses it): the ranks' gradients would have to be summed."""
        self._wait_for_copies()
        with_grad = [p for p in params if id(p) in self.norms]
        if parallel.tensor:  # every rank joins the collective, with a gradient or not
            owners = dict(zip(map(id, self.params), self.model_params))
            replicated = [p for p in with_grad if not split_over_ranks(owners[id(p)])]
            if replicated and self.stream is not None:
                self.stream.synchronize()  # the host reads them now: the side stream's copies must have landed
            parallel.average_replicated_gradients([self.host[id(p)] for p in replicated], [owners[id(p)] for p in replicated])
            for p in replicated:  # their norms, of the averages
                self.norms[id(p)] = torch.nn.utils.get_total_norm([self.host[id(p)].to(p.device)])
            total = torch.tensor(parallel.norm_over_ranks([self.norms[id(p)].double().square() for p in with_grad],
                                                          [owners[id(p)] for p in with_grad]))
        elif not with_grad:
            return 0.0
        else:
            # in the order clip_grad_norm_ takes them (grouped by device and dtype by its own helper), so the sum has its bits
            groups = _group_tensors_by_device_and_dtype([with_grad]).values()
            total = torch.linalg.vector_norm(torch.stack([self.norms[id(p)] for (group,), _ in groups for p in group]))
        # clip_grad_norm_'s factor, an infinite max_norm included (a non-finite norm then makes every gradient NaN, as there)
        self.scale = torch.clamp((max_norm if max_norm > 0 else float("inf")) / (total + 1e-6), max=1.0)
        return float(total)

    def has(self, p: torch.Tensor) -> bool:
        return id(p) in self.norms

    def grad(self, p: torch.Tensor, rows: Rows = None) -> torch.Tensor:
        """The clipped gradient of ``rows`` of ``p``, copied to ``p``'s device (asynchronously)."""
        self._wait_for_copies()  # cheap, and a step without finish_backward must not read a copy in flight
        held = _rows_of(self.host[id(p)], rows)
        piece = held.to(p.device, non_blocking=True)
        if piece is held:  # a CPU-only machine: scaling must not touch the host copy
            piece = piece.clone()
        if self.scale is not None:
            piece.mul_(self.scale)  # in the gradient's dtype, with the factor as torch's clip_grad_norm_ has it
        return piece

    def clear(self) -> None:
        """After the step: the next backward starts a new sum."""
        self.norms.clear()
        self.scale = None

    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.host.values())

    def remove(self) -> None:
        """Take the hooks off the parameters (their storage may be vLLM's, handed back) and give
        the host memory back to the system."""
        for hook in self._hooks:
            hook.remove()
        if self._registered:
            torch.cuda.synchronize(self.stream.device)  # no copy may still use the memory
            for flat in self._registered:
                torch.cuda.cudart().cudaHostUnregister(flat.data_ptr())
        self._hooks, self.host, self.params, self._registered = [], {}, [], []
        self.model_params, self._stepped = [], {}
