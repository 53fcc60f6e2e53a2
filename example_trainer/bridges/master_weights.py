"""fp32 master copies of bf16 weights that live elsewhere (here: inside vLLM).

bf16 keeps 8 bits of mantissa: an update smaller than half a step between neighbouring bf16
values (about 0.2% of the weight) rounds away. The optimizer steps the fp32 masters instead, and
``push`` writes their rounded values into the bf16 tensors in place. Tensor-parallel parameters
(DTensors) get masters of their local shard: each rank steps and writes only what its GPU holds.
"""

from __future__ import annotations

import torch

from example_trainer.parallel import local, local_grad


class MasterWeights:
    """One fp32 master per shared low-precision parameter."""

    def __init__(self, shared: list[torch.Tensor]) -> None:
        self.shared = shared
        self.params = [local(p).detach().float().clone().requires_grad_(True) for p in shared]
        # Bytes one ``push`` moves through device memory: each master read, each shared tensor written.
        self.push_bytes = sum(p.numel() * (4 + p.element_size()) for p in shared)

    def pull_grads(self) -> None:
        """Move the gradients of the shared tensors onto the masters (as fp32). A master whose
        gradient was computed on it directly (a forward pass on the masters) keeps it."""
        for master, shared in zip(self.params, self.shared):
            if shared.grad is not None:
                master.grad = local_grad(shared).float()
                shared.grad = None

    @torch.no_grad()
    def push(self) -> None:
        """Write the masters into the shared tensors in place (their storage never changes)."""
        # One multi-tensor launch instead of one copy kernel per tensor (~270 at 135M).
        torch._foreach_copy_([local(s) for s in self.shared], self.params)

    def state(self) -> list[torch.Tensor]:
        return [m.detach().cpu() for m in self.params]

    @torch.no_grad()
    def load_state(self, saved: list[torch.Tensor]) -> None:
        if len(saved) != len(self.params):
            raise ValueError(f"checkpoint has {len(saved)} master tensors, the model has {len(self.params)}")
        for master, value in zip(self.params, saved):
            master.copy_(value)
