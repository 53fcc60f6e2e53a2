"""onecopy's vLLM worker: vLLM's own worker, plus an export of every parameter after load.

The CPU variant lives in ``vllm_patching.cpu_worker``: importing vLLM's CPU worker module in a
GPU process breaks torch.compile there, so each platform imports only its own.

Selected through vLLM's ``worker_cls`` door (the server sets it when
``VLLM_ENABLE_SHARED_WEIGHTS=1``); nothing in vLLM's installed package is changed. The hook is at
the Worker level because the GPU (Model Runner V2) and CPU (V1 runner) use different runners.
Extra RPC methods carry the ``onecopy_`` prefix and are reached with ``collective_rpc``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

import torch
from vllm.v1.worker.gpu_worker import Worker

from vllm_patching.bridge_file import BridgeFile, write_bridge_file
from vllm_patching.export import export_parameters, move_to_shared_memory, use_plain_cpu_linear
from vllm_patching.gate import WorkerGate

logger = logging.getLogger("vllm.onecopy.patch")  # under "vllm" to use its log handler in the worker


@contextlib.contextmanager
def plain_cpu_linear_during_load():
    """Keep vLLM's CPU backend from packing linear weights into oneDNN buffers during load.

    With oneDNN available, vLLM packs each linear weight into a private buffer and drops the
    original, so there is nothing left to share. This switch is read only while weights are
    processed after loading, in this worker process alone, and is restored right after; the
    layers then use torch's F.linear on ``layer.weight`` (slower on CPU, but shared).
    """
    import vllm._custom_ops as ops

    saved = ops._supports_onednn
    ops._supports_onednn = False
    try:
        yield
    finally:
        ops._supports_onednn = saved


class SharedWeightsMixin:
    """Exports handles to the model's parameters right after vLLM loads them, and runs every
    step through the weights gate (vllm_patching.gate), so none runs while the trainer writes."""

    _onecopy_gate: WorkerGate | None = None

    def execute_model(self, *args, **kwargs):
        with self._onecopy_step():
            return super().execute_model(*args, **kwargs)

    def sample_tokens(self, *args, **kwargs):
        with self._onecopy_step():
            return super().sample_tokens(*args, **kwargs)

    def _onecopy_step(self):
        return contextlib.nullcontext() if self._onecopy_gate is None else self._onecopy_gate.step()

    def load_model(self, *args, **kwargs) -> None:
        if self.device.type == "cpu":
            with plain_cpu_linear_during_load():
                super().load_model(*args, **kwargs)
        else:
            super().load_model(*args, **kwargs)
        model = self.model_runner.get_model()
        if self.device.type == "cpu":
            # Before warm-up and any compile: later steps may cache pointers to the old storage.
            move_to_shared_memory(model)
            n = use_plain_cpu_linear(model)
            logger.info("[vLLM Patch] CPU: %d linear layers read the shared weights directly", n)
        self._onecopy_bridge_path = self._onecopy_export(model)

    def _onecopy_export(self, model: torch.nn.Module) -> str | None:
        start = time.perf_counter()
        logdir = os.environ.get("LOGDIR", ".")
        self._onecopy_gate = WorkerGate(logdir, self.device)
        handles, mappings, transport = export_parameters(model.named_parameters())
        parallel = self.vllm_config.parallel_config
        if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
            raise RuntimeError("single-copy mode supports one GPU per model (tensor/pipeline parallel size 1)")
        import vllm

        model_config = self.vllm_config.model_config
        bridge = BridgeFile(
            model=model_config.model,
            architecture=(model_config.hf_config.architectures or ["unknown"])[0],
            vllm_version=vllm.__version__,
            transport=transport,
            exporter_pid=os.getpid(),
            created_at=time.time(),
            tp_degree=parallel.tensor_parallel_size,
            num_params=len(handles),
            param_names=list(handles),
            param_mappings=mappings,
            ipc_handles=handles,
            gate=self._onecopy_gate.info(),
        )
        path = write_bridge_file(logdir, bridge)
        logger.info(
            "[vLLM Patch] Exported %d IPC handles for single-copy mode (%s, %.1f ms) to %s",
            len(handles), transport, 1e3 * (time.perf_counter() - start), path,
        )
        return str(path)

    def onecopy_bridge_info(self) -> dict:
        """Where this worker wrote its bridge file, and for which process."""
        return {"bridge_path": self._onecopy_bridge_path, "pid": os.getpid()}


class SharedWeightsGPUWorker(SharedWeightsMixin, Worker):
    """vLLM's GPU worker with the single-copy export."""
