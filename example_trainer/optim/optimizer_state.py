"""Where the optimizer's state lives between steps: on the device (the default) or, with
``--offload-optimizer``, in pinned host memory.

The moments are read only by the optimizer step, yet on the device they are held through the
whole step: 14 GiB of 4-bit moments at 14B, 28 GiB of 8-bit ones. Offloaded, the step brings
them to the device a window at a time (parameters of at most ``--optimizer-chunk-elements``
values together; the row blocks of ``optimizers.RowBlockOptimizer`` keep each one that small),
steps that window's parameters and copies its state back. The device holds one window's state.

The copies are asynchronous from pinned memory and ordered on the current stream, so a window's
device memory can be reused as soon as its copy back is queued; the step waits for the last copy
before it returns. What it costs: the state's size over the host link, twice, each step (PCIe 5
moves ~50 GB/s: about 0.6 s at 14B with 4-bit moments); with --bf16-inplace the weights gate is
closed for it. torchao's ``CPUOffloadOptimizer`` steps on the CPU instead and keeps a host copy of
every parameter and gradient (2 + 2 bytes per parameter more in host memory, and a CPU AdamW
over 14B values per step): here only the state moves and the arithmetic stays the optimizer's own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

logger = logging.getLogger("onecopy.trainer.optimizer")


class StateOnDevice:
    """The optimizer's state stays where the optimizer makes it: beside the parameters."""

    def step(self, optimizer: torch.optim.Optimizer, tensors: list[torch.Tensor],
             attach_grads: Callable[[list[torch.Tensor]], None]) -> None:
        """Step ``tensors`` (those of ``optimizer``'s that have a gradient this step), their
        gradients given by ``attach_grads`` and dropped again after."""
        attach_grads(tensors)
        try:
            optimizer.step()
        finally:
            for t in tensors:
                t.grad = None  # a row block's gradient views its parameter's: it must not keep it alive

    def load(self, optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
        optimizer.load_state_dict(state_dict)

    def host_bytes(self) -> int:
        return 0


class StateInHost:
    """Keeps the optimizer's state in pinned host memory; ``step`` streams it through the device in
    windows of at most ``window_elements`` parameter values (0: all at once)."""

    def __init__(self, window_elements: int) -> None:
        self.window_elements = window_elements
        self.pin = torch.cuda.is_available()  # pinned memory needs a CUDA context
        # id(stepped tensor) -> state key -> its buffer in host memory, allocated once and reused
        self.host: dict[int, dict[str, torch.Tensor]] = {}

    def step(self, optimizer: torch.optim.Optimizer, tensors: list[torch.Tensor],
             attach_grads: Callable[[list[torch.Tensor]], None]) -> None:
        """Step ``tensors`` a window at a time: each window's gradients (``attach_grads``) and
        state come to the device, and its state goes back to host memory after."""
        groups = [group["params"] for group in optimizer.param_groups]
        held, start = len(self.host), time.perf_counter()
        if not held:
            self._announce_pinning("first step")
        try:
            for window in self._windows(tensors):
                chosen = {id(t) for t in window}
                for group, params in zip(optimizer.param_groups, groups):
                    group["params"] = [p for p in params if id(p) in chosen]
                attach_grads(window)
                for t in window:
                    self._to_device(optimizer.state, t)
                try:
                    optimizer.step()
                finally:
                    for t in window:
                        t.grad = None  # its device memory is the next window's
                for t in window:
                    self._to_host(optimizer.state, t)
        finally:
            for group, params in zip(optimizer.param_groups, groups):
                group["params"] = params
            self._wait()
        if len(self.host) > held:  # the first step (or a tensor's first gradient) pinned new buffers
            logger.info("[optimizer] %.2f GiB of optimizer state in %s host memory (step with allocation: %.1f s)",
                        self.host_bytes() / 2**30, "pinned" if self.pin else "plain", time.perf_counter() - start)

    def load(self, optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
        """Load a saved state (as ``Optimizer.load_state_dict`` takes it) one parameter at a time:
        each value goes where torch would put it (beside its parameter, cast as torch casts it) and
        on into host memory, so the device holds one parameter's state at a time, never all of it."""
        self.host.clear()
        self._announce_pinning("resume")
        optimizer.load_state_dict({**state_dict, "state": {}})  # the groups: torch checks they match
        saved, groups = state_dict["state"], state_dict["param_groups"]
        ids = [param_id for group in groups for param_id in group["params"]]
        params = [p for group in optimizer.param_groups for p in group["params"]]
        # torch's own placement rule (fused AdamW keeps its step on the device, torchao's stays on the CPU)
        place = torch.optim.Optimizer._process_value_according_to_param_policy
        for param_id, p in zip(ids, params):
            if param_id not in saved:
                continue
            optimizer.state[p] = {key: place(p, value, param_id, groups, key) if isinstance(value, torch.Tensor)
                                  else value for key, value in saved[param_id].items()}
            self._to_host(optimizer.state, p)
        self._wait()

    def host_bytes(self) -> int:
        """Bytes of optimizer state held in host memory."""
        return sum(_nbytes(buffer) for buffers in self.host.values() for buffer in buffers.values())

    def _announce_pinning(self, when: str) -> None:
        """Say so before pinning the state's host buffers: it takes long enough to look like a hang."""
        if self.pin:
            logger.info("[optimizer] %s: pinning host memory for the optimizer state, once (about a minute for "
                        "30-60 GiB)", when)

    def _windows(self, tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """``tensors``, in order, cut into windows of at most ``window_elements`` values (a larger
        tensor is a window alone)."""
        windows: list[list[torch.Tensor]] = [[]]
        size = 0
        for t in tensors:
            if windows[-1] and self.window_elements and size + t.numel() > self.window_elements:
                windows.append([])
                size = 0
            windows[-1].append(t)
            size += t.numel()
        return [w for w in windows if w]

    def _to_device(self, state: dict, t: torch.Tensor) -> None:
        for key, buffer in self.host.get(id(t), {}).items():
            state[t][key] = _on_device(buffer, t.device)

    def _to_host(self, state: dict, t: torch.Tensor) -> None:
        """Copy ``t``'s state on its device into the host buffers (made on first use) and leave
        the buffers in the optimizer's state, so the device copies are freed."""
        buffers = self.host.setdefault(id(t), {})
        for key, value in state[t].items():
            if not isinstance(value, torch.Tensor) or value.device != t.device:
                continue  # e.g. torchao's step counter, a CPU scalar already
            if key not in buffers:
                buffers[key] = _empty_like(value, self.pin)
            for to, source in zip(_inner_tensors(buffers[key]), _inner_tensors(value)):
                if to is not source:  # on a CPU-only machine the device copy is the buffer
                    to.copy_(source, non_blocking=self.pin)
            state[t][key] = buffers[key]

    def _wait(self) -> None:
        if self.pin:
            torch.cuda.synchronize()  # the host copies are complete before anyone reads them (a checkpoint)


def _inner_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold ``t``'s data (torchao's quantised moments are a subclass over
    codes, scales and a lookup table)."""
    if not is_traceable_wrapper_subclass(t):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [inner for name in names for inner in _inner_tensors(getattr(t, name))]


def _nbytes(t: torch.Tensor) -> int:
    return sum(inner.numel() * inner.element_size() for inner in _inner_tensors(t))


def _rebuilt(t: torch.Tensor, make) -> torch.Tensor:
    """``t`` with every plain tensor inside it replaced by ``make(inner)`` (a subclass is rebuilt
    around the new inner tensors)."""
    if not is_traceable_wrapper_subclass(t):
        return make(t)
    names, context = t.__tensor_flatten__()
    inner = {name: _rebuilt(getattr(t, name), make) for name in names}
    return type(t).__tensor_unflatten__(inner, context, t.size(), t.stride())


def _empty_like(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """A host buffer shaped as ``t`` (pinned if ``pin``), for its copies back."""
    return _rebuilt(t, lambda inner: torch.empty_like(inner, device="cpu", pin_memory=pin))


def _on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of host buffer ``t`` on ``device``, queued asynchronously (``t`` itself on a CPU-only machine)."""
    return _rebuilt(t, lambda inner: inner.to(device, non_blocking=True))
