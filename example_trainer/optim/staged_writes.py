"""--staged-step: the optimizer computes vLLM's new bf16 weights beside them, in their gradients'
memory, while vLLM keeps generating; the weights gate then closes only for one copy.

With --bf16-inplace the optimizer writes vLLM's tensors itself, so the gate must stay closed for
the whole step (0.13-0.18 s of an 8B step on an H100, during which vLLM launches nothing). Each
gradient is spent once the step has read it and has the weight's shape and dtype, so it can hold
the stepped value instead: no extra memory beyond one temporary of the tensor being stepped, and
the values written are those the in-place step writes (the same update on the same inputs).
"""

from __future__ import annotations

import torch

from example_trainer.parallel import local


class StagedWrites:
    """The new weights the last optimizer step left in the gradients' memory, until ``push``."""

    def __init__(self) -> None:
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (weight, its stepped value)

    def target(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For the optimizer, about to step ``weight`` with ``weight.grad``: the tensor to step in
        its place (the gradient's memory, now holding the weight's value) and the gradient to step
        it with (a temporary copy)."""
        staged = weight.grad
        gradient = staged.clone()
        staged.copy_(weight.detach())
        self.pairs.append((weight.detach(), staged))
        return staged, gradient

    @torch.no_grad()
    def push(self) -> int:
        """Copy the stepped values into the weights (in place; the caller holds the gate closed and
        waits for the device) and let go of them; returns the bytes the copy moved. Raises if the
        step staged nothing: an optimizer built without this staging writes the weights itself, with
        the gate open while vLLM steps."""
        if not self.pairs:
            raise RuntimeError("--staged-step: the optimizer step staged no weights. It was built without the "
                               "bridge's staging (build_optimizer(..., staging=bridge.staging)), so it wrote vLLM's "
                               "tensors itself with the weights gate open")
        weights, staged = zip(*self.pairs)
        torch._foreach_copy_([local(w) for w in weights], [local(s) for s in staged])
        moved = sum(2 * w.numel() * w.element_size() for w in weights)
        self.pairs = []
        return moved

    def discard(self) -> None:
        """Drop what a step staged without writing it (the run stops)."""
        self.pairs = []
