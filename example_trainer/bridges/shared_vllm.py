"""Mode ``shared_vllm``: the trainer's model IS vLLM's weights (CUDA IPC, or CPU shared memory).

Default: fp32 master weights and optimizer state live in the trainer; after each optimizer step
the bridge closes the weights gate (vLLM launches no step; the steps already launched finish),
writes the bf16 values into the shared tensors in place (one device copy, no bytes between
processes), and opens the gate. The gate's shared record marks the weights half-written for the
length of the write and bumps the weights version, which vLLM's scheduler hashes into every new
request's prefix blocks (vllm_patching.scheduler), so no request reuses KV of older weights.
``--bf16-inplace`` drops the master copy: the optimizer steps the shared bf16 tensors directly,
with the gate closed (less memory, but updates smaller than bf16's resolution, ~0.4% of a
weight, round away).

Each export has an id. Before every write, and while the loop waits for data, the bridge checks
that the worker it maps is alive and still the one the bridge file names. If it is gone, the old
mappings are dropped untouched; a vLLM the trainer launched is started again (told to run no step
until the trainer's weights are in), re-attached, and given the masters; any other case stops the
trainer with what happened and how to resume.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import requests
import torch

from example_trainer.bridges.attach import (AttachError, attach_model, attach_views, detach_views, find_bridge_file,
                                            load_bridge, replace_parameters)
from example_trainer.bridges.base import InferenceServerLost
from example_trainer.bridges.single_copy import SingleCopyBridge
from example_trainer.engine.vllm_process import vllm_auth_headers
from vllm_patching.bridge_file import BridgeFile, bridge_filename, read_bridge_file
from vllm_patching.gate import AWAIT_PUSH_ENV, ExporterGone, TrainerGate

logger = logging.getLogger("onecopy.trainer.bridge")


class SharedVllmBridge(SingleCopyBridge):
    """Attach to vLLM's parameters; write updates in place while the weights gate is closed."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.model: torch.nn.Module | None = None
        self.shared: list[torch.Tensor] = []
        self.gate: TrainerGate | None = None
        self.export: BridgeFile | None = None
        self.bridge_path: Path | None = None
        self._bridge_stat: tuple[int, int] | None = None
        self._gate_counters = (0, 0)  # vLLM's (waited steps, wait ns) at the last sync
        self.restarts = 0
        self._closed_at = 0.0  # --bf16-inplace: when writing() closed the gate
        self.pending: dict[str, float] = {}  # metrics of a recovery outside sync, reported with the next sync

    # -- attach -------------------------------------------------------------------------------

    @classmethod
    def vllm_env(cls, cfg, run_dir) -> dict[str, str]:
        # The worker exports its weights and writes the bridge file into LOGDIR.
        return {"VLLM_ENABLE_SHARED_WEIGHTS": "1", "LOGDIR": str(run_dir)}

    def serve_on(self) -> tuple[str, list[str]]:
        (self.run_dir / bridge_filename(0)).unlink(missing_ok=True)  # never attach to an earlier server's file
        return self.model_path, []

    def attach(self) -> torch.nn.Module:
        self._attach(resuming=self.cfg.resume)
        self.train_on(self.shared)
        return self.model

    def _attach(self, resuming: bool) -> None:
        """Attach ``self.model`` (built here the first time) to the export the bridge file names."""
        logdir = str(self.run_dir) if self.cfg.launch_vllm else None
        path = self._bridge_file(find_bridge_file(self.cfg.vllm_config_path, logdir))
        # A resumed run (or a restarted vLLM) gets the trainer's weights pushed right after this.
        bridge = self._load_bridge(path, resuming)
        if bridge.gate is None or not bridge.export_id:
            raise AttachError(f"bridge file {path} has no weights gate or export id: it was written by an older "
                              "onecopy; restart vLLM with this one")
        self._check_server_serves(bridge)
        if self.model is None:
            self.model = self._build_model(bridge)
        else:
            attach_views(self.model, bridge)
        served_on = next(self.model.parameters()).device
        if served_on.type != self.device.type:
            raise AttachError(f"vLLM holds the weights on {served_on.type} and the trainer runs on {self.device.type}: "
                              "one copy needs both on the same device. Pass --device "
                              f"{served_on.type}, or use --weight-bridge-mode none or lora_only, which keep "
                              "a separate copy")
        if served_on.type == "cuda" and served_on.index != _cuda_index(self.device):
            raise AttachError(f"vLLM holds the weights on this trainer's {served_on} and the trainer computes on "
                              f"{self.device}: one copy needs both on one GPU. Start vLLM on the trainer's GPU "
                              "(data parallel: rank r's server on the rank's GPU), or pass --device " + str(served_on))
        gate = self._open_gate(TrainerGate(bridge.gate, served_on, bridge.exporter_pid, timeout=self.cfg.gate_timeout))
        if gate.record.half_written and not resuming:
            writer = gate.record.writer_pid
            gate.close()
            raise AttachError(
                f"vLLM's weights are half-written: trainer pid {writer} started a write and never finished it, and "
                "vLLM refuses to step until complete weights arrive. Rerun this trainer with --resume (it pushes the "
                "last checkpoint's weights), or restart vLLM."
            )
        self.gate, self.export, self.bridge_path = gate, bridge, path
        self._bridge_stat = _file_identity(path)
        self._gate_counters = (gate.record.waited_steps, gate.record.wait_ns)
        self.shared = list(self.model.parameters())
        if self.masters is not None:
            self.masters.shared = self.shared

    # What the tensor-parallel variant (bridges/tensor_parallel.py) does differently in _attach.

    def _bridge_file(self, found: Path) -> Path:
        """The bridge file of the vLLM worker this rank attaches to."""
        return found

    def _load_bridge(self, path: Path, resuming: bool) -> BridgeFile:
        return load_bridge(path, self.model_path, other_model_ok=resuming)

    def _build_model(self, bridge: BridgeFile) -> torch.nn.Module:
        return attach_model(bridge, self.model_path)[0]

    def _open_gate(self, gate: TrainerGate):
        return gate

    def _check_server_serves(self, bridge: BridgeFile) -> None:
        """The server the environments call must be the one whose memory the trainer maps."""
        try:
            response = requests.get(self.inference_url + "/bridge/info", headers=vllm_auth_headers(), timeout=30)
            workers = response.json()["workers"]
        except (requests.RequestException, ValueError, KeyError) as err:
            raise AttachError(f"vLLM at {self.inference_url} did not answer /bridge/info ({err}): is it up, with "
                              "VLLM_ENABLE_SHARED_WEIGHTS=1, on --vllm-server-port?") from err
        served = [w.get("export_id") for w in workers]
        if served != [bridge.export_id]:
            raise AttachError(f"vLLM at {self.inference_url} serves export {served}, but the bridge file names "
                              f"{bridge.export_id}: point --vllm-config-path and --vllm-server-port at the same server")

    # -- per step -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def writing(self, model: torch.nn.Module) -> Iterator[dict[str, float]]:
        timings: dict[str, float] = {}
        if self.steps_in_place:  # the optimizer is about to write vLLM's tensors
            self._ensure_export()
            try:
                timings.update(self._close_gate())
            except ExporterGone as err:  # gone while the trainer waited at the gate: as sync does
                timings.update(self._recover(str(err)))  # the weights lived only in vLLM: InferenceServerLost
                timings.update(self._close_gate())
        yield timings

    def _close_gate(self) -> dict[str, float]:
        """Close the gate: vLLM launches no step from here on; the launched ones finish first."""
        start = time.perf_counter()
        self.gate.begin_write()
        self._closed_at = time.perf_counter()
        return {"sync/gate_wait_seconds": self._closed_at - start}

    @torch.no_grad()
    def sync(self, model: torch.nn.Module, step: int, final: bool) -> dict[str, float]:
        metrics: dict[str, float] = {"sync/synced": 1.0, "sync/bytes_moved": 0.0}
        if not self.steps_in_place:
            metrics.update(self._ensure_export())
        start = time.perf_counter()
        try:
            if not self.steps_in_place:  # the gate closes for the write (in place: it closed before the step)
                metrics.update(self._close_gate())
            closed = time.perf_counter()
            written = self.write_weights()  # in place: vLLM (and its CUDA graphs) read this memory
            if written:
                metrics["sync/write_bytes"] = float(written)
        except ExporterGone as err:
            # Gone between the check and the lock, or while the writes ran: redo it all on a new vLLM.
            metrics.update(self._recover(str(err)))
            return {**metrics, "sync/seconds": time.perf_counter() - start}
        # A write that raised leaves the gate closed and the weights marked half-written: close()
        # opens the gate, and vLLM refuses to step on them until a complete push.
        wrote = time.perf_counter()
        self.gate.end_write()
        done = time.perf_counter()
        metrics["sync/write_seconds"] = wrote - closed
        metrics["sync/open_seconds"] = done - wrote
        metrics["sync/seconds"] = done - start
        # vLLM runs no step while the gate is closed: from the write's start (in place: the optimizer
        # step's) to here.
        metrics["sync/gate_closed_seconds"] = done - self._closed_at
        metrics["sync/weights_version"] = float(self.gate.record.weights_version)  # what vLLM's tokens are tagged with
        metrics["sync/vllm_restarts"] = float(self.restarts)  # cumulative, on every sync
        metrics["sync/gate_stalls"] = float(self.gate.stalls)  # cumulative: writes that waited past the stall threshold
        metrics["sync/gate_stalled_seconds"] = self.gate.stalled_seconds
        metrics.update(self._vllm_gate_metrics())
        metrics.update(self.pending)
        self.pending = {}
        return metrics

    def weights_version(self) -> int | None:
        return None if self.gate is None else self.gate.record.weights_version

    def watch(self) -> None:
        if self.masters is not None:
            self.pending.update(self._ensure_export())

    def load_trainer_state(self, state: dict) -> None:
        if self.masters is not None and "masters" in state:
            self.masters.load_state(state["masters"])
            self._push_masters()  # a resumed run writes its masters into vLLM: through the gate, like a sync

    def _push_masters(self) -> None:
        self.gate.begin_write()
        self.write_weights()
        self.gate.end_write()

    def _vllm_gate_metrics(self) -> dict[str, float]:
        """How long vLLM's steps waited at the gate since the last sync (the cost of our writes to it)."""
        record = self.gate.record
        steps, wait_ns = record.waited_steps, record.wait_ns
        last_steps, last_ns = self._gate_counters
        self._gate_counters = (steps, wait_ns)
        return {"sync/vllm_waited_steps": float(steps - last_steps), "sync/vllm_gate_wait_seconds": (wait_ns - last_ns) / 1e9}

    # -- a vLLM that went away ----------------------------------------------------------------

    def _ensure_export(self) -> dict[str, float]:
        """Check that the attached export is alive and current; recover or stop if not."""
        reason = self._export_lost()
        return {} if reason is None else self._recover(reason)

    def _export_lost(self) -> str | None:
        if not self.gate.exporter_alive():
            return f"vLLM worker pid {self.export.exporter_pid} (export {self.export.export_id}) exited"
        identity = _file_identity(self.bridge_path)
        if identity != self._bridge_stat:
            self._bridge_stat = identity
            current = _export_id(self.bridge_path)
            if current != self.export.export_id:
                return (f"{self.bridge_path} now names export {current}: another vLLM wrote it over export "
                        f"{self.export.export_id}, which this trainer is attached to")
        return None

    def _recover(self, reason: str) -> dict[str, float]:
        """Drop the old mappings untouched; restart our vLLM and push the masters, or stop."""
        logger.error("[sync] %s", reason)
        start = time.perf_counter()
        old_gate = Path(self.export.gate.lock_path)
        self._detach()
        why = self._why_not_restarted()
        if why:
            if self.masters is not None:
                self._keep_masters_in(self.model)  # so the loop can save them as a checkpoint
            raise InferenceServerLost(f"{reason}; {why}. Start vLLM again (VLLM_ENABLE_SHARED_WEIGHTS=1) and rerun "
                                      "the trainer with --resume.", weights_kept=self.masters is not None)
        self.server.stop()
        old_gate.unlink(missing_ok=True)  # a killed worker leaves its gate file in /dev/shm (its weights: server.stop)
        self.bridge_path.unlink(missing_ok=True)
        logger.warning("[sync] restarting vLLM on %s; it runs no step until the trainer's weights are in", self.model_path)
        self.server.start(self.model_path, env={AWAIT_PUSH_ENV: "1"}, wait=False)
        self.server.wait_for(self.bridge_path.exists, "bridge file")
        self.server.wait_for(self._server_answers, "/bridge/info")
        self._attach(resuming=True)
        self._push_masters()
        self.server.wait_healthy()
        self.restarts += 1
        seconds = time.perf_counter() - start
        logger.warning("[sync] vLLM restarted and re-attached (export %s) in %.1f s; the trainer's weights are "
                       "pushed (restart %d of this run)", self.export.export_id, seconds, self.restarts)
        return {"sync/vllm_restarts": float(self.restarts), "sync/reattach_seconds": seconds}

    def _why_not_restarted(self) -> str | None:
        """Why this bridge cannot bring a lost vLLM back (None: it can)."""
        if self.server is None:
            return "the trainer did not start this vLLM (--launch-vllm false)"
        if self.masters is None:
            return "with --bf16-inplace the weights lived only in vLLM's memory"
        return None

    def _server_answers(self) -> bool:
        try:
            answer = requests.get(self.inference_url + "/bridge/info", headers=vllm_auth_headers(), timeout=5)
            return answer.status_code == 200
        except requests.RequestException:
            return False

    def _detach(self) -> None:
        """Forget every reference to the old export's memory, without reading or writing it."""
        if self.model is not None:
            detach_views(self.model)
        self.shared = []
        if self.masters is not None:
            self.masters.shared = []
        if self.staging is not None:
            self.staging.discard()  # views of the old export's weights
        if self.gate is not None:
            self.gate.close()
            self.gate = None
        gc.collect()

    def _keep_masters_in(self, model: torch.nn.Module) -> None:
        """Give the model trainer-owned bf16 weights from the masters (after a detach)."""
        replace_parameters(model, {name: master.detach().to(param.dtype) for (name, param), master
                                   in zip(list(model.named_parameters()), self.masters.params)})

    def close(self) -> None:
        # Let go of vLLM's memory before vLLM goes (the loop stops it after this).
        self._detach()
        self.masters = None


def _file_identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns


def _export_id(path: Path) -> str | None:
    try:
        return read_bridge_file(path).export_id
    except (OSError, ValueError):
        return None


def _cuda_index(device: torch.device) -> int:
    """The index of a CUDA device; "cuda" alone means the current one."""
    device = torch.device(device)
    return torch.cuda.current_device() if device.index is None else device.index
