"""onecopy's vLLM worker: vLLM's own worker, plus an export of every parameter after load.

The CPU variant lives in ``vllm_patching.cpu_worker``: importing vLLM's CPU worker module in a
GPU process breaks torch.compile there, so each platform imports only its own.

Selected through vLLM's ``worker_cls`` door (the server sets it when
``VLLM_ENABLE_SHARED_WEIGHTS=1``); nothing in vLLM's installed package is changed. The hook is at
the Worker level because the GPU (Model Runner V2) and CPU (V1 runner) use different runners.
Extra RPC methods carry the ``onecopy_`` prefix and are reached with ``collective_rpc``.
"""

from __future__ import annotations

import logging
import os
import time
import uuid

import torch
from vllm.distributed import get_tp_group
from vllm.v1.worker.gpu_worker import Worker

from vllm_patching.bridge_file import BridgeFile, bridge_directory, write_bridge_file
from vllm_patching.compat import engine_index, no_cpu_weight_packing
from vllm_patching.cpu_matmul import bf16_matmul_is_slow
from vllm_patching.export import (export_parameters, moe_layout, move_to_shared_memory, unlink_shared_memory,
                                  use_plain_cpu_linear)
from vllm_patching.gate import WorkerGate, weights_version
from vllm_patching.token_versions import tag_step_output

logger = logging.getLogger("vllm.onecopy.patch")  # under "vllm" to use its log handler in the worker


class SharedWeightsMixin:
    """Exports handles to the model's parameters right after vLLM loads them, and runs every
    step through the weights gate (vllm_patching.gate): none runs while the trainer writes, and
    one step (``execute_model`` through its ``sample_tokens``) sees one weight version."""

    _onecopy_gate: WorkerGate | None = None
    _onecopy_serving = False  # vLLM's own warm-up steps (dummy batches, before serving) are not gated

    def compile_or_warm_up_model(self, *args, **kwargs):
        # On GPU the warm-up runs dummy steps through execute_model/sample_tokens. They must not
        # wait for the trainer: a restarted vLLM refuses to step until the trainer pushes, and the
        # trainer can only push once the server is up. No trainer writes before the server is up.
        result = super().compile_or_warm_up_model(*args, **kwargs)
        self._onecopy_serving = True
        return result

    def execute_model(self, *args, **kwargs):
        gate = self._onecopy_gate
        if gate is None or not self._onecopy_serving:
            return super().execute_model(*args, **kwargs)
        gate.begin_step()
        self._onecopy_step_seq = gate.file.record.write_seq  # the weights this step started on
        try:
            output = super().execute_model(*args, **kwargs)
        except BaseException:
            gate.end_step()
            raise
        if output is not None:
            gate.end_step()  # the step is complete; vLLM calls sample_tokens only after a None
        return tag_step_output(output, weights_version(self._onecopy_step_seq))

    def sample_tokens(self, *args, **kwargs):
        gate = self._onecopy_gate
        if gate is None or not self._onecopy_serving:
            return super().sample_tokens(*args, **kwargs)
        if not gate.held:  # not after our execute_model (vLLM never does this today): gate it alone
            gate.begin_step()
        try:
            return tag_step_output(super().sample_tokens(*args, **kwargs), weights_version(self._onecopy_step_seq))
        finally:
            if gate.file.record.write_seq != getattr(self, "_onecopy_step_seq", None):
                gate.file.record.mixed_steps += 1  # a write landed inside this step: must never happen
            gate.end_step()

    def load_model(self, *args, **kwargs) -> None:
        self._onecopy_refuse_unsupported()
        if self.device.type == "cpu":
            with no_cpu_weight_packing():
                super().load_model(*args, **kwargs)
        else:
            super().load_model(*args, **kwargs)
        model = self.model_runner.get_model()
        if self.device.type == "cpu":
            # Before warm-up and any compile: later steps may cache pointers to the old storage.
            move_to_shared_memory(model)
            n = use_plain_cpu_linear(model)
            logger.info("[vLLM Patch] CPU: %d linear layers read the shared weights directly%s", n,
                        " and compute in fp32 (no fast bf16 matmul here)" if bf16_matmul_is_slow(self.device) else "")
        self._onecopy_bridge_path = self._onecopy_export(model)

    def _onecopy_refuse_unsupported(self) -> None:
        parallel = self.vllm_config.parallel_config
        if parallel.pipeline_parallel_size > 1:  # tensor parallel is fine: each TP worker exports its shard
            raise RuntimeError("single-copy mode does not support pipeline parallelism (pipeline parallel size 1; "
                               "tensor parallelism is supported)")
        if parallel.data_parallel_size > 1:
            raise RuntimeError("single-copy mode supports data-parallel size 1: run one vLLM server per GPU instead")
        if self.vllm_config.model_config.enable_sleep_mode:
            raise RuntimeError("single-copy mode cannot share weights held by the sleep-mode (cuMem) allocator: "
                               "drop --enable-sleep-mode")

    def _onecopy_export(self, model: torch.nn.Module) -> str | None:
        start = time.perf_counter()
        export_id = uuid.uuid4().hex
        tp_group = get_tp_group()
        self._onecopy_gate = WorkerGate(export_id, self.device, tp_rank=tp_group.rank_in_group,
                                        tp_barrier=tp_group.barrier if tp_group.world_size > 1 else None)
        handles, mappings, transport = export_parameters(model.named_parameters())
        self._onecopy_handles = handles  # CPU: files in /dev/shm, removed at shutdown
        parallel = self.vllm_config.parallel_config
        import vllm

        model_config = self.vllm_config.model_config
        bridge = BridgeFile(
            model=model_config.model,
            architecture=(model_config.hf_config.architectures or ["unknown"])[0],
            vllm_version=vllm.__version__,
            transport=transport,
            exporter_pid=os.getpid(),
            export_id=export_id,
            created_at=time.time(),
            tp_degree=parallel.tensor_parallel_size,
            tp_rank=tp_group.rank_in_group,
            num_params=len(handles),
            param_names=list(handles),
            param_mappings=mappings,
            ipc_handles=handles,
            gate=self._onecopy_gate.info(),
            moe=moe_layout(model),  # the trainer refuses experts it cannot view
        )
        path = write_bridge_file(bridge_directory(), bridge)
        logger.info(
            "[vLLM Patch] Exported %d IPC handles for single-copy mode (%s, export %s, %.1f ms) to %s; gate %s",
            len(handles), transport, export_id, 1e3 * (time.perf_counter() - start), path, bridge.gate.lock_path,
        )
        if bridge.moe is not None:
            logger.log(logging.INFO if bridge.moe.viewable else logging.WARNING,
                       "[vLLM Patch] MoE experts run on %s: %s", bridge.moe.backend,
                       "HF's layout, shareable" if bridge.moe.viewable else "a kernel layout the trainer cannot view")
        return str(path)

    def onecopy_bridge_info(self) -> dict:
        """Where this worker wrote its bridge file and its gate (whose record has the live counters)."""
        gate = self._onecopy_gate
        return {"bridge_path": self._onecopy_bridge_path, "pid": os.getpid(),
                "gate_path": None if gate is None else str(gate.file.path),
                "engine": engine_index(self.vllm_config)}

    def shutdown(self) -> None:
        if self._onecopy_gate is not None:
            self._onecopy_gate.close()
        unlink_shared_memory(getattr(self, "_onecopy_handles", {}).values())
        super().shutdown()


class SharedWeightsGPUWorker(SharedWeightsMixin, Worker):
    """vLLM's GPU worker with the single-copy export."""
