"""The frozen reference policy of ``--beta``: the initial model's logprobs, at the least memory
each mode allows.

- Full-parameter modes: the initial weights must live somewhere once the optimizer moves the
  model's, so a frozen copy of them is kept on the trainer's device (2 bytes/param in bf16; on CPU
  the fp32 tensors the forward pass uses, 4 bytes/param of RAM) and the model is run with them in
  place of its own (``torch.func.functional_call``). Not a ``deepcopy`` of the model: in
  shared_vllm and colocate that would clone vLLM's shared tensors and the module tree around them.
- LoRA modes: the frozen base IS the reference; the model with its adapter disabled gives it for
  free (no bytes).

The memory plan counts what each costs (``memory_plan.memory_kinds``).
"""

from __future__ import annotations

import torch

from example_trainer.model.shared_prefix import PackedRows
from example_trainer.rl.logprobs import sequence_logprobs


class FrozenWeightsReference:
    """A copy of the weights as they are now, run in place of the model's own."""

    bytes_per_param = 2.0  # bf16 on a GPU (the memory plan's figure)

    def __init__(self, model: torch.nn.Module, weights: dict[str, torch.Tensor] | None = None) -> None:
        source = weights if weights is not None else dict(model.named_parameters())
        self.weights = {name: t.detach().clone() for name, t in source.items()}

    @torch.no_grad()
    def logprobs(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor], chunk_tokens: int,
                 packed: PackedRows | None = None) -> torch.Tensor:
        """(B, T-1) logprobs of the reference policy (``packed``: as ``sequence_logprobs``)."""
        return sequence_logprobs(model, inputs, chunk_tokens, self.weights, packed)


class DisabledAdapterReference:
    """The LoRA model with its adapter switched off: the frozen base, no copy."""

    bytes_per_param = 0.0

    @torch.no_grad()
    def logprobs(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor], chunk_tokens: int,
                 packed: PackedRows | None = None) -> torch.Tensor:
        """(B, T-1) logprobs of the base model (``packed``: as ``sequence_logprobs``)."""
        with model.disable_adapter():
            return sequence_logprobs(model, inputs, chunk_tokens, packed=packed)
