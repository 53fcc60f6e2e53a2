"""Tensor-parallel single copy: trainer rank r computes with the shard that vLLM's TP worker r holds.

vLLM with ``--tensor-parallel-size N`` splits each layer Megatron-style: q/k/v and gate/up by
output rows (column-parallel), o_proj and down_proj by input columns (row-parallel), the padded
vocabulary of the embedding and LM head by rows, norms replicated. The trainer builds its HF model
on the meta device, shards it with PyTorch's tensor-parallel styles on the same split
(``tensor_parallel_plan``), and makes each DTensor's local shard a view of rank r's vLLM tensor
(attach.view_parameters). Forward and backward then run PyTorch's collectives (all-reduce after
row-parallel layers, an all-gather of the logits); each rank's step writes its shard in place
(fp32 masters of the shard copied in after the step, or with --bf16-inplace the step on the shard
itself: ``LocalShards``) — still one copy of the weights, now across N devices.

What vLLM can shard and this split cannot mirror is refused before anything is attached
(``check_tensor_parallel``): KV heads fewer than N (vLLM replicates them), sizes N does not
divide, a vocabulary padding whose per-rank rows differ from an even split, and a trainer TP size
that is not vLLM's.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from example_trainer.bridges.attach import (AttachError, load_bridge, meta_model, open_tensors, replace_parameters,
                                            view_parameters)
from example_trainer.bridges.base import InferenceServerLost
from example_trainer.bridges.shared_vllm import SharedVllmBridge
from example_trainer.model.checkpoint import save_hf_checkpoint
from example_trainer.model.families import FAMILIES
from example_trainer.parallel import collective_device, is_dtensor, local, local_grad
from vllm_patching.bridge_file import BridgeFile, bridge_filename
from vllm_patching.gate import ExporterGone, GateTimeout, TrainerGate

if TYPE_CHECKING:  # imported where used: the trainer starts vLLM before it loads torch's tensor-parallel modules
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle

_GATE_FAILURES = (ExporterGone, GateTimeout)  # the order is the collective's code: MIN picks the first


def tensor_parallel_plan() -> dict[str, ParallelStyle]:
    """PyTorch TP styles for the Llama/Qwen2 decoder that match vLLM's sharding."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    layer = "model.layers.*."
    return {
        # vLLM's VocabParallelEmbedding: rows of the vocabulary per rank; tokens outside a rank's
        # rows read zeros there and the all-reduce sums the one rank that has them.
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        **{layer + f"self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")},
        layer + "self_attn.o_proj": RowwiseParallel(),
        **{layer + f"mlp.{p}": ColwiseParallel() for p in ("gate_proj", "up_proj")},
        layer + "mlp.down_proj": RowwiseParallel(),
        # The whole logits on every rank: the loss and logprob code stay as they are.
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }


def check_tensor_parallel(config, tp_size: int, vllm_tp_size: int, vocab_rows_per_rank: int | None = None) -> None:
    """Refuse, with what to change, a split the trainer cannot mirror (before any attach)."""
    architecture = (config.architectures or ["unknown"])[0]
    if architecture in FAMILIES and not FAMILIES[architecture].tensor_parallel:
        sharded = ", ".join(name for name, known in FAMILIES.items() if known.tensor_parallel)
        raise AttachError(
            f"{architecture} is not sharded by vLLM the way --parallel tensor's plan shards the trainer (supported: "
            f"{sharded}): train it on one GPU per vLLM (--parallel data) or on one GPU"
        )
    if tp_size != vllm_tp_size:
        raise AttachError(
            f"the trainer runs tensor-parallel size {tp_size} but vLLM serves with {vllm_tp_size}: each trainer rank "
            "attaches to one vLLM rank's shard, so start both with the same size "
            "(torchrun --nproc-per-node N and vLLM --tensor-parallel-size N)"
        )
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    for what, size in (("attention heads", heads), ("KV heads", kv_heads), ("intermediate size", config.intermediate_size)):
        if size % tp_size:
            raise AttachError(
                f"tensor-parallel size {tp_size} does not divide the model's {what} ({size}); vLLM replicates "
                "KV heads when there are fewer than ranks, which single copy cannot mirror: use a size that divides it"
            )
    even_rows = -(-config.vocab_size // tp_size)
    if vocab_rows_per_rank is not None and vocab_rows_per_rank != even_rows:
        raise AttachError(
            f"vLLM's vocabulary shard has {vocab_rows_per_rank} rows per rank (the vocabulary of {config.vocab_size} "
            f"padded to {vocab_rows_per_rank * tp_size}), but an even split over {tp_size} ranks has {even_rows}: "
            "rank r's rows would not line up; this tensor-parallel size cannot share this model's embedding"
        )


def sharded_meta_model(model_path: str, dtype: torch.dtype, mesh: DeviceMesh) -> torch.nn.Module:
    """The HF model on the meta device, sharded over ``mesh`` with ``tensor_parallel_plan``."""
    from torch.distributed.tensor.parallel import parallelize_module

    model = parallelize_module(meta_model(model_path, dtype), mesh, tensor_parallel_plan())
    if model.config.tie_word_embeddings:  # sharding gave the LM head its own parameter: one again
        model.tie_weights()
    return model


def attach_tensor_parallel(model_path: str, vllm_tensors: dict[str, torch.Tensor], architecture: str,
                           vllm_tp_size: int, mesh: DeviceMesh, source: str) -> torch.nn.Module:
    """The HF model whose every parameter's local shard is a view of this rank's vLLM tensors."""
    from transformers import AutoConfig

    embed = vllm_tensors.get("model.embed_tokens.weight")
    check_tensor_parallel(AutoConfig.from_pretrained(model_path), mesh.size(), vllm_tp_size,
                          None if embed is None else embed.shape[0])
    model = sharded_meta_model(model_path, next(iter(vllm_tensors.values())).dtype, mesh)
    view_parameters(model, vllm_tensors, architecture, f"{source}, tensor-parallel rank {mesh.get_local_rank()} "
                    f"of {mesh.size()}", mesh=mesh)
    return model


def sharded_layouts(model: torch.nn.Module) -> dict[str, tuple]:
    """Each DTensor parameter's mesh and placements, by name (norms and the like are plain tensors)."""
    return {name: (param.device_mesh, param.placements) for name, param in model.named_parameters()
            if is_dtensor(param)}


class LocalShards:
    """--bf16-inplace under --parallel tensor: the optimizer steps each parameter's local shard, a
    plain tensor that is this rank's vLLM tensor (the DTensor's own storage, no copy), with the
    local part of the DTensor's gradient. The optimizer, the offloaded state and gradients and the
    staged writes then run on plain tensors exactly as with one GPU."""

    def __init__(self, model_params: list[torch.Tensor]) -> None:
        self.model_params = model_params
        self.params = [local(p).detach() for p in model_params]  # views of vLLM's memory, in the model's order

    def pull_grads(self) -> None:
        """Move each DTensor's gradient (its local part, no copy) onto its shard. Gradients that
        --offload-gradients took to host memory during backward are not on the DTensors any more."""
        for shard, param in zip(self.params, self.model_params):
            if param.grad is not None:
                shard.grad = local_grad(param)
                param.grad = None


class TensorParallelBridge(SharedVllmBridge):
    """Mode shared_vllm under ``--parallel tensor``: rank r's model is a set of DTensors whose
    local shards view vLLM TP worker r's tensors. The optimizer steps fp32 masters of each rank's
    shards, or with --bf16-inplace the shards themselves (``LocalShards``), then with the same
    low-bit moments, offloads and staging as one GPU; the gradient norm is the whole model's
    (``Parallel.clip_grad_norm``). No --beta; a lost vLLM stops every rank with a checkpoint
    (not restarted)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.shards: LocalShards | None = None  # --bf16-inplace: what the optimizer steps
        self.layouts: dict[str, tuple] = {}  # sharded_layouts of the model, kept at attach

    def train_on(self, weights: list[torch.Tensor]) -> None:
        super().train_on(weights)
        self.shards = LocalShards(weights) if self.masters is None else None

    def optimizer_parameters(self, model: torch.nn.Module) -> list[torch.Tensor]:
        """The fp32 masters of this rank's shards, or with --bf16-inplace the shards themselves, in
        the order of ``model.parameters()`` (the clipping norm and offloaded gradients pair them)."""
        return self.shards.params if self.shards is not None else super().optimizer_parameters(model)

    def gradients_ready(self, model: torch.nn.Module) -> dict[str, float]:
        if self.shards is not None:
            self.shards.pull_grads()
        return super().gradients_ready(model)

    def serve_on(self) -> tuple[str, list[str]]:
        for rank in range(self.parallel.size):
            (self.run_dir / bridge_filename(rank)).unlink(missing_ok=True)  # never attach to an earlier server's file
        return self.model_path, []

    def _bridge_file(self, found: Path) -> Path:
        return found.with_name(bridge_filename(self.parallel.rank))  # worker r's file lies beside rank 0's

    def _load_bridge(self, path: Path, resuming: bool) -> BridgeFile:
        return load_bridge(path, self.model_path, other_model_ok=resuming, tp_size=self.parallel.size)

    def _check_server_serves(self, bridge: BridgeFile) -> None:
        if self.parallel.is_main:  # /bridge/info names TP rank 0's export
            super()._check_server_serves(bridge)

    def _build_model(self, bridge: BridgeFile) -> torch.nn.Module:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(self.device.type, (self.parallel.size,))
        model = attach_tensor_parallel(self.model_path, open_tensors(bridge), bridge.architecture, bridge.tp_degree,
                                       mesh, f"{bridge.transport}, export {bridge.export_id}")
        self.layouts = sharded_layouts(model)
        return model

    def _open_gate(self, gate: TrainerGate):
        return TensorParallelGate(gate)

    def forward_parameters(self, model: torch.nn.Module) -> None:
        return None  # the masters are plain local shards, the model's parameters DTensors

    def watch(self) -> None:
        """Rank 0 waits for the batch alone (the other ranks wait for it in a broadcast), so it looks
        without a collective: at its own worker and at the server the workers belong to (vLLM ends
        the server when any worker dies). A lost vLLM then stops every rank within seconds instead
        of a wait for batches no environment can make. Nothing is saved here: a checkpoint gathers
        every rank's shards, and the other ranks are not at that collective."""
        if not self.parallel.is_main or self.gate is None:
            return
        lost = None
        if not self.gate.own_exporter_alive():
            lost = f"vLLM's tensor-parallel worker for rank 0 (pid {self.gate.exporter_pid}) exited"
        elif self.server is not None and self.server.exit_code() is not None:
            lost = f"the tensor-parallel vLLM server (pid {self.server.pid}) exited with {self.server.exit_code()}"
        if lost is not None:
            raise InferenceServerLost(f"{lost} while the trainer waited for a batch; {self._why_not_restarted()}. "
                                      "Start the run again with --resume.", weights_kept=False,
                                      not_saved_because="a checkpoint gathers every rank's shards, and the other "
                                      "ranks were waiting for this batch")

    def _why_not_restarted(self) -> str:
        return "a tensor-parallel vLLM is not restarted by the trainer"

    def _detach(self) -> None:
        self.shards = None  # views of the old export's memory
        super()._detach()

    def _keep_masters_in(self, model: torch.nn.Module) -> None:
        """Each rank's masters become its DTensor shards (the tensors the plan leaves whole, plain
        tensors), so the checkpoint gathers the whole model. Which is which, and each shard's mesh
        and placements, come from the layouts kept at attach, not from the detached parameters."""
        from torch.distributed.tensor import DTensor

        weights = {}
        for (name, param), master in zip(list(model.named_parameters()), self.masters.params):
            weights[name] = master.detach().to(param.dtype)
            if name in self.layouts:
                weights[name] = DTensor.from_local(weights[name], *self.layouts[name], shape=param.shape,
                                                   stride=param.stride())
        replace_parameters(model, weights)

    def save_checkpoint(self, model: torch.nn.Module, tokenizer, folder: Path) -> Path:
        # Every rank gathers each sharded tensor (a collective); rank 0 writes the whole model.
        state = {name: t.full_tensor() if is_dtensor(t) else t for name, t in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # the embedding's, gathered a second time
        if self.parallel.is_main:
            save_hf_checkpoint(model, tokenizer, folder, state)
        self.parallel.barrier("rank 0 to write the checkpoint")  # the folder exists before any rank writes its trainer state into it
        return Path(folder)


class TensorParallelGate:
    """Every TP rank's weights gate as one, with ``TrainerGate``'s interface (the bridge's sync is
    the same code with one GPU or N): rank 0 closes the leading gate, which stops every vLLM TP
    worker at its next step (vllm_patching.gate); rank r > 0 waits until its worker has ended the
    steps rank 0's entered; only then does any rank write, and the leading gate opens after every
    rank's writes have landed. A worker gone on any rank is ExporterGone on all of them, so the
    ranks stay in step; a ``begin_write`` that raises on any rank has written nothing on every rank,
    and the ranks that had marked their weights half-written end that write unwritten first."""

    def __init__(self, gate: TrainerGate) -> None:
        self.gate = gate
        self.rank = dist.get_rank()

    @property
    def record(self):
        return self.gate.record

    @property
    def exporter_pid(self) -> int:
        return self.gate.exporter_pid

    def own_exporter_alive(self) -> bool:
        """Whether this rank's worker runs (no collective: one rank may ask alone)."""
        return self.gate.exporter_alive()

    def exporter_alive(self) -> bool:
        """False on every rank once any rank's worker has exited."""
        alive = torch.tensor([int(self.own_exporter_alive())], device=collective_device())
        dist.all_reduce(alive, op=dist.ReduceOp.MIN)
        return bool(alive.item())

    @property
    def stalls(self) -> int:
        return self.gate.stalls

    @property
    def stalled_seconds(self) -> float:
        return self.gate.stalled_seconds

    def begin_write(self) -> None:
        if not self.exporter_alive():  # a collective: also every rank is here before rank 0 closes
            raise ExporterGone(f"a vLLM tensor-parallel worker exited (this rank's: pid {self.gate.exporter_pid})")
        entered = torch.full((1,), -1, dtype=torch.int64, device=collective_device())  # -1: rank 0 failed
        failed, began = None, False
        try:
            if self.rank == 0:
                self.gate.begin_write()
                began = True
                entered.fill_(self.gate.record.steps)
            dist.broadcast(entered, src=0)
            if self.rank != 0 and entered.item() >= 0:
                self.gate.begin_follower_write(int(entered.item()))
                began = True
        except _GATE_FAILURES as err:  # the other ranks must not wait for this one in a collective
            failed = err
            if self.rank == 0:
                dist.broadcast(entered, src=0)
        # Every worker is stopped before any rank writes; a rank that could not stop its worker
        # (deadline, worker gone) stops every rank with the same kind of error.
        state = torch.tensor([len(_GATE_FAILURES) if failed is None else _GATE_FAILURES.index(type(failed))],
                             device=entered.device)
        dist.all_reduce(state, op=dist.ReduceOp.MIN)
        if began and state.item() < len(_GATE_FAILURES):
            # This rank marked its weights half-written, another stopped first: no rank writes, so
            # end the write unwritten (else vLLM refuses to step on weights nobody touched).
            self.gate.end_unwritten()
        if failed is not None:
            raise failed
        if state.item() < len(_GATE_FAILURES):
            raise _GATE_FAILURES[state.item()]("another tensor-parallel rank could not close its weights gate (its "
                                               "log says why): every rank stops")

    def end_write(self) -> None:
        dist.barrier()  # every rank's writes have landed (each synchronized its device first)
        self.gate.end_write()

    def close(self) -> None:
        self.gate.close()
