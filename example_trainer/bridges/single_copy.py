"""What the two single-copy modes share (shared_vllm in a vLLM server, colocate in this process):
the model's parameters ARE vLLM's bf16 tensors, and after each optimizer step vLLM computes with
what the step wrote.

The one choice they share is how the step reaches those tensors:
- default: fp32 master weights in the trainer; the optimizer steps the masters and
  ``write_weights`` copies their rounded values into vLLM's tensors in place (one device copy);
- ``--bf16-inplace``: no masters; the optimizer steps vLLM's bf16 tensors directly (4 bytes/param
  less; updates below bf16's resolution survive only on average, through the optimizer's
  stochastic rounding). With ``--staged-step`` it computes their new values into the gradients'
  memory instead, and ``write_weights`` copies them in (example_trainer/optim/staged_writes.py).
"""

from __future__ import annotations

import torch

from example_trainer.bridges.base import WeightBridge
from example_trainer.bridges.master_weights import MasterWeights
from example_trainer.model.families import family
from example_trainer.model.model_files import architecture
from example_trainer.optim.staged_writes import StagedWrites


class SingleCopyBridge(WeightBridge):
    """Base of the modes whose model is a set of views of vLLM's own weights."""

    def __init__(self, cfg, model_path: str, *args, **kwargs) -> None:
        super().__init__(cfg, model_path, *args, **kwargs)
        # Refused here, before vLLM starts (a minute or more), not at attach once it has loaded the model.
        family(architecture(model_path))

    def train_on(self, weights: list[torch.Tensor]) -> None:
        """Choose what the optimizer steps for ``weights`` (vLLM's tensors): fp32 masters of them,
        or with --bf16-inplace the tensors themselves (--staged-step: their values, staged)."""
        self.masters = None if self.cfg.bf16_inplace else MasterWeights(weights)
        self.staging = StagedWrites() if self.cfg.staged_step else None

    @property
    def steps_in_place(self) -> bool:
        """Whether the optimizer step itself writes vLLM's tensors (--bf16-inplace, not staged)."""
        return self.masters is None and self.staging is None

    def write_weights(self) -> int:
        """After ``optimizer.step()``: put the step into vLLM's tensors (in place, so CUDA graphs see
        it) and wait until the device has written them; return the bytes the copy moved (0 when the
        step wrote them itself)."""
        if self.masters is not None:
            self.masters.push()
            written = self.masters.push_bytes
        elif self.staging is not None:
            written = self.staging.push()
        else:
            written = 0
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # the other process (or the engine's stream) must not read before
        return written
