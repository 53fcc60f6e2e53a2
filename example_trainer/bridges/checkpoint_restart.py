"""Mode ``none``: the trainer owns its weights; every N steps it saves a checkpoint and restarts
the vLLM server it launched on that checkpoint. Simple and slow: a restart costs an engine start."""

from __future__ import annotations

import torch

from example_trainer.bridges.base import WeightBridge, sync_by_restart
from example_trainer.bridges.master_weights import MasterWeights
from example_trainer.model.checkpoint import save_hf_checkpoint


class CheckpointRestartBridge(WeightBridge):
    """Save → stop vLLM (by its PID) → start vLLM on the checkpoint → wait for /health."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)

    def attach(self) -> torch.nn.Module:
        # The trainer's own bf16 copy (plus fp32 masters); vLLM holds a second bf16 copy.
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.bfloat16).to(self.device)
        self.masters = MasterWeights(list(model.parameters()))
        return model

    def sync(self, model: torch.nn.Module, step: int, final: bool) -> dict[str, float]:
        self.masters.push()  # the trainer's bf16 weights follow the masters every step

        def save() -> tuple[str, None, int]:
            ckpt = save_hf_checkpoint(model, self.tokenizer, self.run_dir / "checkpoints" / f"step_{step}")
            return str(ckpt), None, sum(p.numel() * p.element_size() for p in model.parameters())

        return sync_by_restart(self.cfg, self.server, step, final, save)
