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

import contextlib
import logging
import os
from collections.abc import Iterator
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


PRIORITY_VARIABLE = "CUDA_MPS_CLIENT_PRIORITY"  # read by an MPS client as its CUDA starts: 0 normal, 1 below normal
BELOW_NORMAL = "1"


@contextlib.contextmanager
def vllm_first_while_cuda_starts(wanted: bool, vllm_in_process: bool, cuda_started: bool,
                                 environ: dict[str, str] | None = None) -> Iterator[bool]:
    """--mps-vllm-first: under MPS, start this process's CUDA at client priority below normal, so
    that when an SM frees up the GPU gives it to vLLM's decode kernels before the trainer's. The
    variable is set only while CUDA starts inside the block (the first call and the context), so a
    vLLM server this process starts later keeps the normal priority. Yields whether it was set; a
    request that cannot apply is named in a warning."""
    environ = os.environ if environ is None else environ
    why_not = ("" if not wanted else
               "no NVIDIA MPS daemon runs" if not mps_running(environ) else
               "vLLM runs in the trainer's process (colocate) and would share its priority" if vllm_in_process else
               "this process's CUDA has started already" if cuda_started else "")
    if not wanted or why_not:
        if why_not:
            logger.warning("[gpu] --mps-vllm-first ignored: %s (docs/modes.md#sharing-the-gpu-with-vllm-nvidia-mps)",
                           why_not)
        yield False
        return
    before = environ.get(PRIORITY_VARIABLE)
    environ[PRIORITY_VARIABLE] = BELOW_NORMAL
    try:
        yield True
    finally:
        if before is None:
            environ.pop(PRIORITY_VARIABLE, None)
        else:
            environ[PRIORITY_VARIABLE] = before
    logger.info("[gpu] the trainer's CUDA runs at MPS client priority below normal: vLLM's kernels go first")
