"""Mode ``shared_vllm``: the trainer's model IS vLLM's weights (CUDA IPC, or CPU shared memory).

Default: fp32 master weights and optimizer state live in the trainer; after each optimizer step
the bridge closes the weights gate (vLLM launches no step; the steps already launched finish),
writes the bf16 values into the shared tensors in place (one device copy, no bytes between
processes), opens the gate, and tells vLLM's server that the weights changed (it salts the prefix
cache anew, so no later request reuses KV blocks of older weights). ``--bf16-inplace`` drops the
master copy: the optimizer steps the shared bf16 tensors directly, with the gate closed (less
memory, but updates smaller than bf16's resolution, ~0.4% of a weight, round away).

That notice goes over HTTP in the background: vLLM's API server answers slowly while it is busy
with running requests, and nothing needs to wait for it (requests sent between the write and the
notice may still reuse older blocks). Running requests keep their KV, as an in-flight rollout does
in any mode.
"""

from __future__ import annotations

import gc
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

import requests
import torch

from example_trainer.bridges.attach import AttachError, attach_model, find_bridge_file, load_bridge
from example_trainer.bridges.base import WeightBridge
from example_trainer.bridges.master_weights import MasterWeights
from example_trainer.vllm_process import VllmServerProcess, vllm_server_args
from vllm_patching.gate import TrainerGate

logger = logging.getLogger("onecopy.trainer.bridge")


class SharedVllmBridge(WeightBridge):
    """Attach to vLLM's parameters; write updates in place while the weights gate is closed."""

    def __init__(self, cfg, model_path, run_dir, device) -> None:
        super().__init__(cfg, model_path, run_dir, device)
        self.server: VllmServerProcess | None = None
        if cfg.launch_vllm:
            env = {"VLLM_ENABLE_SHARED_WEIGHTS": "1", "LOGDIR": str(self.run_dir)}
            self.server = VllmServerProcess(
                cfg.vllm_port, self.run_dir / "vllm.log", vllm_server_args(cfg), env=env,
                start_timeout=cfg.vllm_start_timeout,
            )
        self.shared: list[torch.Tensor] = []
        self.gate: TrainerGate | None = None
        self.http = requests.Session()  # keep-alive: a new TCP connection per sync costs ~1 ms
        self.background = ThreadPoolExecutor(1, thread_name_prefix="weights-notice")
        self.last_notice: Future | None = None

    def load_model(self) -> torch.nn.Module:
        logdir = None
        if self.server is not None:
            stale = self.run_dir / "vllm_bridge_config.json"
            stale.unlink(missing_ok=True)  # never attach to a file from an earlier server
            self.server.start(self.model_path)
            logdir = str(self.run_dir)
        path = find_bridge_file(self.cfg.vllm_config_path, logdir)
        bridge = load_bridge(path, self.model_path)
        if bridge.gate is None:
            raise AttachError(f"bridge file {path} has no weights gate: it was written by an older onecopy; "
                              "restart vLLM with this one")
        model, _ = attach_model(bridge, self.model_path)
        self.shared = [p for p in model.parameters()]
        self.gate = TrainerGate(bridge.gate, self.shared[0].device)
        if not self.cfg.bf16_inplace:
            self.masters = MasterWeights(self.shared)
        return model

    def before_optimizer_step(self, model: torch.nn.Module) -> dict[str, float]:
        if self.masters is None:
            # The optimizer is about to write vLLM's tensors: stop generation first.
            start = time.perf_counter()
            self.gate.close_gate()
            return {"sync/pause_seconds": time.perf_counter() - start}
        return super().before_optimizer_step(model)

    @torch.no_grad()
    def sync(self, model: torch.nn.Module, step: int, final: bool) -> dict[str, float]:
        metrics: dict[str, float] = {"sync/synced": 1.0, "sync/bytes_moved": 0.0}
        start = paused = time.perf_counter()
        try:
            if self.masters is not None:
                self.gate.close_gate()
                paused = time.perf_counter()
                self.masters.push()  # in place: vLLM (and its CUDA graphs) read this memory
                metrics["sync/pause_seconds"] = paused - start
                metrics["sync/write_bytes"] = float(self.masters.push_bytes)
            self._wait_for_writes()
        finally:
            wrote = time.perf_counter()
            if self.gate.closed:
                self.gate.open_gate()
        done = time.perf_counter()
        metrics["sync/write_seconds"] = wrote - paused
        metrics["sync/resume_seconds"] = done - wrote
        metrics["sync/seconds"] = done - start
        if self.last_notice is not None and self.last_notice.done():
            self._check_notice(self.last_notice)
        # one per write, in order (one thread): a notice handled before this write must not count for it
        self.last_notice = self.background.submit(self._post, "/bridge/weights_updated")
        return metrics

    def load_trainer_state(self, state: dict) -> None:
        # A resumed run writes its masters into vLLM's weights: through the gate, like a sync.
        self.gate.close_gate()
        try:
            super().load_trainer_state(state)
            self._wait_for_writes()
        finally:
            self.gate.open_gate()

    def _wait_for_writes(self) -> None:
        if self.shared and self.shared[0].is_cuda:
            torch.cuda.synchronize()  # vLLM's process must not read before the writes land

    @staticmethod
    def _check_notice(notice: Future) -> None:
        try:
            notice.result()
        except (RuntimeError, requests.RequestException) as err:
            logger.warning("[bridge] telling vLLM about new weights failed (prefix cache not re-salted): %s", err)

    def _post(self, path: str) -> dict:
        response = self.http.post(self.inference_url + path, timeout=60)
        if response.status_code != 200:
            raise RuntimeError(f"vLLM {path} answered {response.status_code}: {response.text[:300]}")
        return response.json()

    def close(self) -> None:
        # Let go of vLLM's memory before vLLM goes: a CPU shared-memory storage freed after its
        # exporter died aborts the process at exit ("Broken pipe" from torch's shm manager).
        for param in self.shared:
            param.data = torch.empty(0, dtype=param.dtype)
        self.shared = []
        self.masters = None
        gc.collect()
        if self.gate is not None:
            self.gate.close()  # first: a closed gate would hold up a notice still in flight
            self.gate = None
        self.background.shutdown(wait=True)
        self.http.close()
        if self.server is not None:
            self.server.stop()
