"""vLLM's scheduler, plus a prefix-cache salt per weights version (single-copy mode).

The trainer writes vLLM's weights in place, so a prefix block computed before a write holds KV of
older weights. vLLM hashes a request's ``cache_salt`` into its first block (hence into every
block), so the salt keeps versions apart. It is set here, in the engine, rather than in the HTTP
routes: every route that reaches the engine (``/generate``, ``/v1/completions``,
``/v1/chat/completions``, ``/v1/responses``, …) passes through ``add_request``, and requests that
wait in the queue across a write are salted anew before their blocks are looked up. The version is
read from the weights gate's shared record (vllm_patching.gate) with no HTTP call: the trainer
bumps it while vLLM runs no step. A salt the client sent is kept and combined with ours.

Requests already running when the weights change keep their KV, as any rollout in flight does.

Selected through vLLM's ``scheduler_cls`` door by the server. It is a function, not a class:
vLLM decides whether scheduling is asynchronous only after the flags are parsed, and the
scheduler class must match that decision (``AsyncScheduler`` or ``Scheduler``).
"""

from __future__ import annotations

import itertools
import logging

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_patching.bridge_file import bridge_directory, bridge_filename, read_bridge_file
from vllm_patching.compat import engine_index, waiting_queues
from vllm_patching.gate import GateFile, pid_alive
from vllm_patching.token_versions import TokenVersions

logger = logging.getLogger("vllm.onecopy.scheduler")  # under "vllm" to use its log handler

SALT_PREFIX = "onecopy-weights-"


def salted(client_salt: str | None, version: int) -> str:
    """The salt for weights ``version``, keeping the one the client sent (if any)."""
    ours = f"{SALT_PREFIX}{version}"
    return ours if not client_salt else f"{client_salt}|{ours}"


class WeightsVersionSalt:
    """Mixin over vLLM's scheduler: salts each request with the current weights version."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # The worker exported (and wrote this file) while the engine loaded the model, before the
        # scheduler is built; it may live in this process (GPU) or in a child (CPU).
        # Data parallel (mode server): each engine has its own scheduler, worker, gate and file.
        path = bridge_directory() / bridge_filename(0, engine_index(kwargs["vllm_config"]))
        bridge = read_bridge_file(path)
        if bridge.gate is None or not pid_alive(bridge.exporter_pid):
            raise RuntimeError(f"{path} names no live worker with a weights gate: was it written by this vLLM?")
        self._onecopy_gate = GateFile(bridge.gate.lock_path)
        if self._onecopy_gate.record.worker_pid != bridge.exporter_pid:
            raise RuntimeError(f"the gate in {path} belongs to another worker than the file's")
        self._onecopy_version = self._onecopy_gate.record.weights_version
        self._onecopy_client_salts: dict[str, str | None] = {}
        logger.info("[vLLM Patch] prefix cache salted per weights version (now %d)", self._onecopy_version)

    def add_request(self, request) -> None:
        if request.request_id not in self.requests:  # not a later chunk of a streaming request
            self._onecopy_client_salts[request.request_id] = request.cache_salt
            self._onecopy_salt(request, self._onecopy_version)
        super().add_request(request)

    def schedule(self, *args, **kwargs):
        version = self._onecopy_gate.record.weights_version
        if version != self._onecopy_version:
            self._onecopy_version = version
            resalted = 0
            for request in itertools.chain(*waiting_queues(self)):
                if request.num_computed_tokens == 0 and request.num_output_tokens == 0:
                    self._onecopy_salt(request, version)  # not started: its blocks come from the new weights
                    resalted += 1
            logger.debug("[vLLM Patch] weights version %d: %d waiting requests salted anew", version, resalted)
        return super().schedule(*args, **kwargs)

    def _onecopy_salt(self, request, version: int) -> None:
        request.cache_salt = salted(self._onecopy_client_salts.get(request.request_id), version)
        request.block_hashes = []  # the first block's hash carries the salt, and every later one chains on it
        request.update_block_hashes()

    def _free_request(self, request, *args, **kwargs):
        self._onecopy_client_salts.pop(request.request_id, None)
        return super()._free_request(request, *args, **kwargs)

    def shutdown(self) -> None:
        self._onecopy_gate.close()
        super().shutdown()


class SaltedScheduler(TokenVersions, WeightsVersionSalt, Scheduler):
    """vLLM's synchronous scheduler with the weights-version salt and each token's version."""


class SaltedAsyncScheduler(TokenVersions, WeightsVersionSalt, AsyncScheduler):
    """vLLM's asynchronous scheduler with the weights-version salt and each token's version."""


def salted_scheduler(vllm_config, *args, **kwargs):
    """What ``--scheduler-cls`` names: the salted variant of the scheduler vLLM would pick."""
    cls = SaltedAsyncScheduler if vllm_config.scheduler_config.async_scheduling else SaltedScheduler
    return cls(*args, vllm_config=vllm_config, **kwargs)
