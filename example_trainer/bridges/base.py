"""The one interface every ``--weight-bridge-mode`` implements.

Call order, from the training loop (example_trainer/grpo.py):
  bridge = BRIDGES[mode](cfg, model_path, run_dir)
  model = bridge.load_model()              once; vLLM is serving the same weights afterwards
  opt = AdamW(bridge.optimizer_parameters(model))
  per step: backward → bridge.before_optimizer_step(model) → opt.step() → bridge.sync(model, step)
  bridge.close()                           always (try/finally)
"""

from __future__ import annotations

import abc
from pathlib import Path

import torch

from example_trainer.config import TrainerConfig


class WeightBridge(abc.ABC):
    """How the trainer's weights reach the vLLM server that generates rollouts."""

    def __init__(self, cfg: TrainerConfig, model_path: str, run_dir: Path, device: torch.device) -> None:
        self.cfg = cfg
        self.model_path = model_path
        self.run_dir = Path(run_dir)
        self.device = device

    @property
    @abc.abstractmethod
    def inference_url(self) -> str:
        """Base URL of the vLLM server that serves the current policy."""

    @abc.abstractmethod
    def load_model(self) -> torch.nn.Module:
        """Return the model to train, with vLLM up and serving the same weights."""

    def optimizer_parameters(self, model: torch.nn.Module) -> list[torch.Tensor]:
        """The tensors the optimizer steps (default: the model's own parameters)."""
        return [p for p in model.parameters() if p.requires_grad]

    def before_optimizer_step(self, model: torch.nn.Module) -> dict[str, float]:
        """Called after backward, before ``optimizer.step()``; returns ``sync/*`` timings."""
        return {}

    @abc.abstractmethod
    def sync(self, model: torch.nn.Module, step: int, final: bool) -> dict[str, float]:
        """Called after ``optimizer.step()``: make vLLM serve the new weights (now or at its own
        interval). Returns ``sync/*`` metrics; ``sync/synced`` is 1.0 when vLLM changed weights."""

    def trainer_state(self) -> dict:
        """Extra state to put in a resumable checkpoint (e.g. fp32 master weights)."""
        return {}

    def load_trainer_state(self, state: dict) -> None:
        """Restore what ``trainer_state`` returned."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop what this bridge started. Safe to call twice."""
