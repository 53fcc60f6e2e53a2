"""Mode ``server``: vLLM on GPUs of its own (``--vllm-gpus``, ``--vllm-tensor-parallel-size``,
``--vllm-data-parallel-size``), the trainer on others, the new weights sent to every vLLM worker after
each step — TRL's server mode.

Two copies of the weights: vLLM's on its GPUs and the trainer's (bf16, with fp32 masters) on the
trainer's. After ``optimizer.step()`` the bridge writes the masters into the trainer's bf16 weights,
closes vLLM's weights gate (the same gate, version counter and prefix-cache salt as shared_vllm:
vllm_patching.gate), broadcasts the weights in buckets over a process group between the trainer and
the workers (gloo on CPU, NCCL on GPUs; vllm_patching.weight_transfer says why this route and not
vLLM's own weight-transfer engine), waits for every worker's ack, and opens the gate. With vLLM
data parallel every engine has a gate of its own: all are closed before the send and opened after
every worker of every engine acked (server_engines.py). vLLM runs no
step between the close and the open, and reports for each token the version it was sampled with,
so the staleness bound (--max-off-policy-steps) and the rollout correction work as in shared_vllm.

The trainer needs the server on its own machine: the gate is a file in /dev/shm.

Failure: a vLLM the trainer started that dies is started again, told to run no step until the
trainer's weights are in, joined to a new group and sent them (as shared_vllm does). A trainer that
dies mid-write leaves the weights marked half-written: vLLM refuses to step (``/health`` says why)
until a trainer writes complete weights (rerun it with --resume, or with --launch-vllm false to
attach and push); the workers' receive ends at the group's timeout (--gate-timeout) at the latest.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from pathlib import Path

import requests
import torch

from example_trainer.bridges.base import InferenceServerLost, WeightBridge
from example_trainer.bridges.master_weights import MasterWeights
from example_trainer.bridges.server_engines import EngineGates
from example_trainer.engine.ports import free_port
from example_trainer.engine.vllm_gpus import parse_gpus, visible_gpus
from example_trainer.engine.vllm_process import vllm_auth_headers
from vllm_patching.bridge_file import bridge_filename, read_bridge_file
from vllm_patching.gate import AWAIT_PUSH_ENV, ExporterGone, GateInfo, TrainerGate
from vllm_patching.weight_transfer import (DEFAULT_BUCKET_BYTES, WEIGHT_SERVER_ENV, JoinInfo, TensorSpec, WeightGroup,
                                           backend_for, join_path, plan_buckets, send_weights, write_join)

logger = logging.getLogger("onecopy.trainer.bridge")
# A write that failed on a broken group: how long the worker has to be seen dead before the error
# is taken as a live worker's (then raised) rather than a killed one's (then vLLM is restarted).
WORKER_EXIT_SECONDS = 5.0


class ServerError(RuntimeError):
    """The server cannot be used in mode server (not started in it, another machine, ...)."""


def check_tensor_parallel(model_path: str, tp: int) -> None:
    """vLLM splits the attention heads over its tensor-parallel workers: ``tp`` must divide them."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    heads = getattr(config, "num_attention_heads", None)
    if heads is None or heads % tp == 0:
        return
    fits = [d for d in range(1, heads + 1) if heads % d == 0 and d <= max(8, tp)]
    raise ValueError(f"--vllm-tensor-parallel-size {tp} does not divide the model's {heads} attention heads: pick one "
                     f"of {', '.join(map(str, fits))} (and as many --vllm-gpus)")


def check_data_parallel(model_path: str, dp: int) -> None:
    """vLLM runs an MoE model's data-parallel engines in lockstep, which the per-engine gates cannot
    hold (vllm_patching.weight_receiver refuses them too): refuse before vLLM starts."""
    if dp <= 1:  # one engine: nothing to check, no second read of the config at every start
        return
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    text = getattr(config, "text_config", None) or config
    experts = next((getattr(text, name) for name in ("num_experts", "num_local_experts") if getattr(text, name, None)),
                   None)
    if experts:
        raise ValueError(f"--vllm-data-parallel-size {dp}: the model has {experts} routed experts, and vLLM steps an "
                         "MoE model's data-parallel engines in lockstep, which server mode's per-engine weights gates "
                         "cannot hold; use --vllm-tensor-parallel-size (or one server per GPU set)")


def remove_worker_files(run_dir: Path, tp_degree: int, dp_degree: int = 1) -> None:
    """What a killed vLLM leaves: each worker's bridge file in ``run_dir`` (where the trainer's vLLM
    writes them), every engine's, and the gate it names in /dev/shm, with the join file beside it."""
    for engine, rank in ((engine, rank) for engine in range(dp_degree) for rank in range(tp_degree)):
        path = run_dir / bridge_filename(rank, engine)
        try:
            gate = read_bridge_file(path).gate
        except (OSError, ValueError):
            path.unlink(missing_ok=True)  # none, or unreadable: the gate it names cannot be found
            continue
        if gate is not None:
            Path(gate.lock_path).unlink(missing_ok=True)
            join_path(gate.lock_path).unlink(missing_ok=True)
        path.unlink(missing_ok=True)


class ServerBridge(WeightBridge):
    """The trainer's own weights, sent to vLLM's workers through the weights gate after each step.
    Its GPU flags are checked with the config (example_trainer/engine/vllm_gpus.py); the memory plan counts
    vLLM's copy on --vllm-gpus (its row in example_trainer/modes.py: ``own_gpus``)."""

    bucket_bytes = DEFAULT_BUCKET_BYTES

    @classmethod
    def vllm_args(cls, cfg) -> list[str]:
        dp = cfg.vllm_data_parallel_size  # left out at 1: a one-engine server starts as it always has
        return ["--tensor-parallel-size", str(cfg.vllm_tensor_parallel_size),
                *(["--data-parallel-size", str(dp)] if dp > 1 else [])]

    @classmethod
    def vllm_env(cls, cfg, run_dir: Path) -> dict[str, str]:
        env = {WEIGHT_SERVER_ENV: "1", "LOGDIR": str(run_dir)}
        gpus = parse_gpus(cfg.vllm_gpus)
        if gpus:
            visible = visible_gpus()
            env["CUDA_VISIBLE_DEVICES"] = ",".join(visible[g] for g in gpus)
        return env

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Refused here, before vLLM starts (a minute or more), not when vLLM fails to load.
        check_tensor_parallel(self.model_path, self.cfg.vllm_tensor_parallel_size)
        check_data_parallel(self.model_path, self.cfg.vllm_data_parallel_size)
        self.model: torch.nn.Module | None = None
        self.gates: EngineGates | None = None
        self.group: WeightGroup | None = None
        self.join_files: list[Path] = []
        self.specs: list[TensorSpec] = []
        self.buckets = []
        self.restarts = 0
        self.pending: dict[str, float] = {}  # metrics of a recovery outside sync, reported with the next sync

    def serve_on(self) -> tuple[str, list[str]]:
        for engine in range(self.cfg.vllm_data_parallel_size):  # never read an earlier server's file
            (self.run_dir / bridge_filename(0, engine)).unlink(missing_ok=True)
        return self.model_path, []

    # -- attach -------------------------------------------------------------------------------

    def attach(self) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.bfloat16).to(self.device)
        self.model = model
        self.masters = MasterWeights(list(model.parameters()))
        names = [name for name, _ in model.named_parameters()]  # tied weights once, as load_weights wants
        self.specs = [TensorSpec(name=name, shape=list(p.shape), dtype=str(p.dtype).removeprefix("torch."))
                      for name, p in zip(names, model.parameters())]
        self.buckets = plan_buckets(self.specs, self.bucket_bytes)
        self._connect()
        # vLLM serves the trainer's weights from the first step on, whatever it loaded (an attached
        # server may hold another run's): one write now. A resumed run writes again once its masters load.
        self._write()
        return model

    def _connect(self) -> None:
        """Close nothing, send nothing: find every vLLM engine's gate, and form one group with all
        their workers (engine d's are ranks 1 + d·TP ...: the trainer writes each engine a join)."""
        engines = self._bridge_info()
        bridges = [read_bridge_file(info["bridge_path"]) for info in engines]
        for bridge in bridges:
            if bridge.transport != "collective":
                raise ServerError(f"vLLM at {self.inference_url} shares its weights ({bridge.transport}): it was "
                                  f"started for mode shared_vllm; start it with {WEIGHT_SERVER_ENV}=1 for mode server")
        self.gates = EngineGates([TrainerGate(GateInfo(lock_path=info["gate_path"], export_id=info["export_id"]),
                                              torch.device("cpu"), int(info["pid"]), timeout=self.cfg.gate_timeout)
                                  for info in engines])
        workers = sum(bridge.tp_degree for bridge in bridges)
        join = JoinInfo(join_id=uuid.uuid4().hex, host="127.0.0.1", port=free_port(), world_size=1 + workers,
                        trainer_pid=os.getpid(), backend=backend_for(self.device),
                        timeout_seconds=self.cfg.gate_timeout, bucket_bytes=self.bucket_bytes, tensors=self.specs,
                        engines=len(engines))
        start = time.perf_counter()
        self.join_files, first_rank = [], 1
        for engine, (info, bridge) in enumerate(zip(engines, bridges)):
            self.join_files.append(join_path(info["gate_path"]))
            write_join(self.join_files[-1], join.model_copy(update={"engine": engine, "first_rank": first_rank}))
            first_rank += bridge.tp_degree
        try:
            self.group = WeightGroup(join, rank=0, device=self.device)  # returns once every worker joined
        except RuntimeError as err:  # torch's store or gloo/NCCL timeout: says nothing of where to look
            raise ServerError(
                f"vLLM's {workers} worker(s) did not join the trainer's weight group at 127.0.0.1:{join.port} "
                f"within --gate-timeout {self.cfg.gate_timeout:g} s ({type(err).__name__}: {err}). Look in vLLM's log "
                f"for '[vLLM Patch] could not join' (the reason) or for no 'joined trainer pid {os.getpid()}' at all "
                f"(the workers never saw the join file(s) {', '.join(map(str, self.join_files))}); the trainer and "
                "vLLM must run on one machine") from err
        logger.info("[setup] joined vLLM's %d worker(s) of %d engine(s) in a %s group in %.1f s; %d tensors in %d "
                    "bucket(s) of at most %d MiB", workers, len(engines), join.backend, time.perf_counter() - start,
                    len(self.specs), len(self.buckets), self.bucket_bytes // 2**20)

    def _bridge_info(self) -> list[dict]:
        """The leading worker of each of vLLM's engines (one per data-parallel rank), in engine order."""
        try:
            answer = requests.get(self.inference_url + "/bridge/info", headers=vllm_auth_headers(), timeout=30)
            engines = answer.json()["workers"]
            if not engines:
                raise ValueError("no workers")
        except (requests.RequestException, ValueError, KeyError, TypeError) as err:
            raise ServerError(f"vLLM at {self.inference_url} did not answer /bridge/info ({err}): is it up on "
                              f"--vllm-server-port, started with {WEIGHT_SERVER_ENV}=1?") from err
        for worker in engines:
            if not Path(worker["gate_path"]).exists():
                raise ServerError(f"vLLM's weights gate {worker['gate_path']} is not on this machine: mode server "
                                  "needs the trainer and the vLLM server on one machine")
        return engines

    # -- per step -----------------------------------------------------------------------------

    @torch.no_grad()
    def sync(self, model: torch.nn.Module, step: int, final: bool) -> dict[str, float]:
        self.masters.push()  # the trainer's bf16 weights follow the masters every step
        metrics = {"sync/synced": 1.0, **self.pending, **self._write()}
        self.pending = {}
        metrics["sync/weights_version"] = float(self.gates.weights_version)
        metrics["sync/vllm_restarts"] = float(self.restarts)  # cumulative, on every sync
        return metrics

    def _write(self) -> dict[str, float]:
        """Send the model's weights through the gate. A vLLM worker found dead, before or during the
        write, is restarted and sent them (``_recover``)."""
        if not self.gates.alive():
            return self._recover(self.gates.exited())
        try:
            return self._send()
        except (ExporterGone, RuntimeError) as err:
            logger.warning("[sync] the weight write failed (%s); waiting up to %.0f s to see whether a vLLM worker of "
                           "pid(s) %s exited (then vLLM is restarted) or they run (then the error stops the trainer)",
                           err, WORKER_EXIT_SECONDS, self.gates.pids)
            if not self._worker_exits(within=WORKER_EXIT_SECONDS):
                raise
            return self._recover(f"{self.gates.exited()} during the write ({err})")

    def _worker_exits(self, within: float) -> bool:
        """Whether the worker has exited, or does within ``within`` seconds: a killed worker's sockets
        close (the group's error reaches us) a moment before its process is seen to have exited."""
        deadline = time.monotonic() + within
        while self.gates.alive():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def _send(self) -> dict[str, float]:
        start = time.perf_counter()
        self.gates.begin_write()  # no engine launches a step from here on; the launched ones have finished
        closed = time.perf_counter()
        sent = send_weights(self.group, self.specs, self.buckets, [p for p in self.model.parameters()],
                            header=self.gates.header())
        sent_at = time.perf_counter()
        self.gates.end_write()  # every worker acked: the weights are whole on all of them
        done = time.perf_counter()
        return {"sync/seconds": done - start, "sync/gate_wait_seconds": closed - start,
                "sync/write_seconds": sent_at - closed, "sync/gate_closed_seconds": done - closed,
                "sync/bytes_moved": float(sent), "sync/send_gb_per_second": sent / max(sent_at - closed, 1e-9) / 1e9}

    def weights_version(self) -> int | None:
        return None if self.gates is None else self.gates.weights_version

    def watch(self) -> None:
        if self.gates is not None and not self.gates.alive():
            self.pending.update(self._recover(self.gates.exited()))

    def load_trainer_state(self, state: dict) -> None:
        super().load_trainer_state(state)  # the masters, pushed into the trainer's bf16 weights
        self._write()  # and to vLLM

    # -- a vLLM that went away ----------------------------------------------------------------

    def _recover(self, reason: str) -> dict[str, float]:
        """Restart the vLLM we started, have it wait for the trainer's weights, and send them; or stop."""
        logger.error("[sync] %s", reason)
        if self.server is None:
            raise InferenceServerLost(f"{reason}; the trainer did not start this vLLM (--launch-vllm false). Start "
                                      f"it again ({WEIGHT_SERVER_ENV}=1) and rerun the trainer with --resume.")
        start = time.perf_counter()
        old_gates = [Path(gate.file.path) for gate in self.gates.gates]
        self._disconnect()
        self.server.stop()
        remove_worker_files(self.run_dir, self.cfg.vllm_tensor_parallel_size, self.cfg.vllm_data_parallel_size)
        for old_gate in old_gates:  # each engine's rank 0's, even if its bridge file was unreadable
            old_gate.unlink(missing_ok=True)
            join_path(old_gate).unlink(missing_ok=True)
        logger.warning("[sync] restarting vLLM on %s; it runs no step until the trainer's weights are in", self.model_path)
        self.server.start(self.model_path, env={AWAIT_PUSH_ENV: "1"}, wait=False)
        self.server.wait_for(self._answers, "/bridge/info")
        self._connect()
        metrics = self._send()
        self.server.wait_healthy()
        self.restarts += 1
        seconds = time.perf_counter() - start
        logger.warning("[sync] vLLM restarted (worker pid(s) %s) and sent the trainer's weights in %.1f s (restart %d "
                       "of this run)", self.gates.pids, seconds, self.restarts)
        return {**metrics, "sync/vllm_restarts": float(self.restarts), "sync/reattach_seconds": seconds}

    def _answers(self) -> bool:
        try:
            return requests.get(self.inference_url + "/bridge/info", headers=vllm_auth_headers(), timeout=5).ok
        except requests.RequestException:
            return False

    def _disconnect(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
        if self.gates is not None:
            self.gates.close()
            self.gates = None

    def close(self) -> None:
        for join_file in self.join_files:
            join_file.unlink(missing_ok=True)
        self._disconnect()


class DataParallelServerBridge(ServerBridge):
    """``--parallel data`` in mode server: every rank trains its share of each batch against one
    vLLM on --vllm-gpus. The ranks' summed gradients and equal steps keep their weights equal
    (``parallel/replica_spread``), so rank 0 alone joins vLLM's weight group and sends them; every
    other rank steps its own masters and waits at each write until rank 0's has ended, so no rank
    starts a step while vLLM holds older weights than its own. Rank 0 alone watches and restarts vLLM."""

    def _connect(self) -> None:
        if self.parallel.is_main:
            super()._connect()

    def _write(self) -> dict[str, float]:
        metrics = super()._write() if self.parallel.is_main else {}
        self.parallel.barrier("rank 0 to send the weights to vLLM")  # every rank writes at the same points
        return metrics

    def sync(self, model: torch.nn.Module, step: int, final: bool) -> dict[str, float]:
        if self.parallel.is_main:
            return super().sync(model, step, final)
        self.masters.push()
        return {"sync/synced": 1.0, **self._write()}

    def watch(self) -> None:
        if self.parallel.is_main:
            super().watch()
