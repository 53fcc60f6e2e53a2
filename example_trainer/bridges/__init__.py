"""Weight bridges, one class per ``--weight-bridge-mode``."""

from __future__ import annotations

from example_trainer.bridges.base import WeightBridge
from example_trainer.bridges.checkpoint_restart import CheckpointRestartBridge
from example_trainer.bridges.lora import LoraOnlyBridge, LoraRestartBridge
from example_trainer.bridges.shared_vllm import SharedVllmBridge

BRIDGES: dict[str, type[WeightBridge]] = {
    "none": CheckpointRestartBridge,
    "shared_vllm": SharedVllmBridge,
    "lora_only": LoraOnlyBridge,
    "lora_restart": LoraRestartBridge,
}


def bridge_class(mode: str) -> type[WeightBridge]:
    """The bridge class for ``mode``; unknown modes fail with the list of valid ones."""
    try:
        return BRIDGES[mode]
    except KeyError:
        raise ValueError(f"unknown --weight-bridge-mode {mode!r}; valid: {', '.join(BRIDGES)}") from None
