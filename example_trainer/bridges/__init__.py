"""Weight bridges, one class per ``--weight-bridge-mode`` (and one for shared_vllm's tensor-parallel
variant), picked from the table below."""

from __future__ import annotations

from example_trainer.bridges.base import WeightBridge
from example_trainer.bridges.checkpoint_restart import CheckpointRestartBridge
from example_trainer.bridges.colocate import ColocateBridge
from example_trainer.bridges.lora import LoraOnlyBridge, LoraRestartBridge
from example_trainer.bridges.server import ServerBridge
from example_trainer.bridges.shared_vllm import SharedVllmBridge
from example_trainer.bridges.tensor_parallel import TensorParallelBridge

BRIDGES: dict[str, type[WeightBridge]] = {
    "none": CheckpointRestartBridge,
    "shared_vllm": SharedVllmBridge,
    "lora_only": LoraOnlyBridge,
    "lora_restart": LoraRestartBridge,
    "colocate": ColocateBridge,
    "server": ServerBridge,
}
# A --parallel value that needs its own class in a mode: (mode, parallel) -> class.
PARALLEL_VARIANTS: dict[tuple[str, str], type[WeightBridge]] = {("shared_vllm", "tensor"): TensorParallelBridge}


def bridge_class(mode: str, parallel: str = "none") -> type[WeightBridge]:
    """The bridge class for ``mode`` (under ``--parallel``); unknown modes fail with the list of valid ones."""
    if mode not in BRIDGES:
        raise ValueError(f"unknown --weight-bridge-mode {mode!r}; valid: {', '.join(BRIDGES)}")
    return PARALLEL_VARIANTS.get((mode, parallel), BRIDGES[mode])
