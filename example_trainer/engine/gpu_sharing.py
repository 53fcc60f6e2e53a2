"""Whether the trainer and a vLLM server in another process can run kernels on their GPU at once.

Without NVIDIA's Multi-Process Service (MPS) the GPU gives each process's CUDA context time slices
in turn: while vLLM generates the next batches beside training, the two take turns rather than
overlap. Under MPS both are clients of one server and their kernels share the GPU at once: at 8B on
an H100, memory-bound decoding beside compute-bound training raised shared_vllm's samples/s by
about a quarter (docs/results.md, docs/modes.md#sharing-the-gpu-with-vllm-nvidia-mps). Starting MPS
is the machine owner's choice (it changes how every process on the GPU is scheduled), so the
trainer only says whether it found it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger("onecopy.trainer.gpu")
DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"  # nvidia-cuda-mps-control's, unless CUDA_MPS_PIPE_DIRECTORY names another


def mps_running(environ: dict[str, str] | None = None) -> bool:
    """True where an MPS control daemon's pipe exists in the folder this process's CUDA would use."""
    environ = os.environ if environ is None else environ
    return (Path(environ.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_PIPE_DIRECTORY) / "control").exists()


def log_gpu_sharing(environ: dict[str, str] | None = None) -> bool:
    """Log whether vLLM's process and the trainer's will overlap their kernels (MPS) or take turns;
    returns ``mps_running``. For modes where vLLM is another process on the trainer's GPU."""
    running = mps_running(environ)
    if running:
        logger.info("[gpu] NVIDIA MPS control daemon found: vLLM's kernels and the trainer's can run at once")
    else:
        logger.info("[gpu] vLLM and the trainer take turns on the GPU (time slices); with NVIDIA MPS "
                    "(nvidia-cuda-mps-control -d) their kernels run at once: 8B on an H100 trained about a quarter "
                    "more samples/s (docs/modes.md#sharing-the-gpu-with-vllm-nvidia-mps)")
    return running
