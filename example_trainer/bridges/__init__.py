"""Weight bridges, one class per ``--weight-bridge-mode``."""

from __future__ import annotations

from pathlib import Path

from example_trainer.bridges.base import WeightBridge
from example_trainer.bridges.checkpoint_restart import CheckpointRestartBridge
from example_trainer.bridges.colocate import ColocateBridge
from example_trainer.bridges.lora import LoraOnlyBridge, LoraRestartBridge
from example_trainer.bridges.shared_vllm import SharedVllmBridge
from example_trainer.config import TrainerConfig
from example_trainer.inprocess_engine import InProcessEngine
from example_trainer.parallel import Parallel
from example_trainer.vllm_process import VllmServerProcess, vllm_server_args

BRIDGES: dict[str, type[WeightBridge]] = {
    "none": CheckpointRestartBridge,
    "shared_vllm": SharedVllmBridge,
    "lora_only": LoraOnlyBridge,
    "lora_restart": LoraRestartBridge,
    "colocate": ColocateBridge,
}


def bridge_class(mode: str) -> type[WeightBridge]:
    """The bridge class for ``mode``; unknown modes fail with the list of valid ones."""
    try:
        return BRIDGES[mode]
    except KeyError:
        raise ValueError(f"unknown --weight-bridge-mode {mode!r}; valid: {', '.join(BRIDGES)}") from None


def launch_server(cfg: TrainerConfig, run_dir: Path, env: dict[str, str] | None = None,
                  parallel: Parallel = Parallel()) -> VllmServerProcess | InProcessEngine | None:
    """The vLLM server the loop owns in this mode, not started yet (None with --launch-vllm false:
    the trainer attaches to one running already), or in mode colocate the in-process engine. Its
    flags and environment come from the mode's bridge class; ``env`` adds to them. Data parallel:
    ``cfg`` and ``run_dir`` are the rank's (parallel.rank_view), and the server gets the rank's GPU;
    tensor parallel: rank 0 starts the one server, over all ranks' GPUs."""
    if not cfg.launch_vllm or (parallel.tensor and not parallel.is_main):
        return None
    bridge = bridge_class(cfg.weight_bridge_mode)
    args = vllm_server_args(cfg) + bridge.vllm_args(cfg)
    if bridge.in_process:
        return InProcessEngine(args)
    if parallel.tensor and "--tensor-parallel-size" not in args:
        args += ["--tensor-parallel-size", str(parallel.size)]
    return VllmServerProcess(cfg.vllm_port, Path(run_dir) / "vllm.log", args,
                             env={**bridge.vllm_env(cfg, Path(run_dir)), **parallel.server_env(), **(env or {})},
                             start_timeout=cfg.vllm_start_timeout)
