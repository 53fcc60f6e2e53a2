"""Several trainer ranks (example_trainer/parallel.py) with gloo on CPU, and the weights gate of
tensor-parallel vLLM workers (rank 0 leads, the others follow) with threads for workers."""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from api.models import ScoredData
from example_trainer.config import TrainerConfig
from example_trainer.data.batching import build_batch
from example_trainer.engine.ports import free_port
from example_trainer.optim.optimizers import OPTIMIZERS
from example_trainer.parallel import Parallel, _buckets
from example_trainer.rl.loss import BatchShape
from vllm_patching.gate import TrainerGate, WorkerGate


def test_the_environment_decides_the_ranks_and_a_mode_that_does_not_fit_is_refused():
    assert Parallel.from_environment("none", {}) == Parallel()
    with pytest.raises(ValueError, match="WORLD_SIZE.*--parallel data"):
        Parallel.from_environment("none", {"WORLD_SIZE": "2", "RANK": "0"})
    with pytest.raises(ValueError, match="torchrun --nproc-per-node N"):
        Parallel.from_environment("data", {})
    ranks = Parallel.from_environment("tensor", {"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1"})
    assert (ranks.rank, ranks.size, ranks.local_rank, ranks.tensor, ranks.is_main) == (3, 4, 1, True, False)


def test_parallel_modes_are_refused_outside_shared_vllm_and_with_what_they_do_not_support():
    with pytest.raises(ValueError, match="shared_vllm"):
        TrainerConfig(parallel="data", weight_bridge_mode="lora_only")
    with pytest.raises(ValueError, match="drop --launch-vllm false"):
        TrainerConfig(parallel="data", launch_vllm=False)


def test_tensor_parallel_takes_the_lean_settings_and_still_refuses_what_it_cannot_do():
    lean = dict(parallel="tensor", bf16_inplace=True, offload_optimizer=True, offload_gradients=True)
    for optimizer in OPTIMIZERS:
        TrainerConfig(**lean, optimizer=optimizer)
    TrainerConfig(parallel="tensor", bf16_inplace=True, optimizer="adamw8bit", staged_step=True)
    with pytest.raises(ValueError, match="--beta keeps a frozen whole-model copy .* drop --beta or use --parallel data"):
        TrainerConfig(**lean, beta=0.1)
    with pytest.raises(ValueError, match="--offload-gradients .* add --offload-optimizer and --bf16-inplace"):
        TrainerConfig(parallel="tensor", offload_optimizer=True, offload_gradients=True)  # fp32 masters
    with pytest.raises(ValueError, match="--staged-step .* --offload-gradients keeps the gradients in host memory: drop one"):
        TrainerConfig(**lean, staged_step=True)
    with pytest.raises(ValueError, match="--torch-compile is not built for --parallel tensor"):
        TrainerConfig(**lean, torch_compile=True)
    with pytest.raises(ValueError, match="--offload-gradients is not built for --parallel data"):
        TrainerConfig(**{**lean, "parallel": "data"})


def test_a_batch_that_does_not_fill_every_ranks_micro_batches_is_refused_at_start():
    # --batch-size 12 over 2 ranks with 4 micro-batches each: 6 rows per rank do not split in 4.
    cfg = TrainerConfig(batch_size=12, gradient_accumulation_steps=4)
    with pytest.raises(ValueError, match="--batch-size 12 .* 2 data-parallel ranks .* --gradient-accumulation-steps 4"):
        Parallel("data", 0, 2).check_batch(cfg.batch_size, cfg.gradient_accumulation_steps)
    Parallel("data", 0, 2).check_batch(16, 4)  # 8 rows per rank, 4 micro-batches of 2
    Parallel("tensor", 0, 2).check_batch(12, 4)  # every tensor-parallel rank trains the whole batch
    Parallel().check_batch(12, 4)


def test_more_ranks_than_gpus_is_refused_with_the_count(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="local rank 1 has no GPU .*shows 1"):
        Parallel("data", 1, 2, 1).device("auto")


def test_data_parallel_ranks_get_their_own_server_port_and_folder(tmp_path):
    cfg = TrainerConfig(vllm_server_port=9001)
    server_cfg, folder = Parallel("data", 2, 4).rank_view(cfg, tmp_path)
    assert (server_cfg.vllm_server_port, folder) == (9003, tmp_path / "rank2")
    assert Parallel("tensor", 1, 2).rank_view(cfg, tmp_path) == (cfg, tmp_path)


def test_gradient_buckets_keep_order_dtype_and_size():
    tensors = [torch.zeros(3), torch.zeros(4), torch.zeros(10), torch.zeros(2, dtype=torch.float64), torch.zeros(1)]
    assert [[t.numel() for t in b] for b in _buckets(tensors, 8)] == [[3, 4], [10], [2], [1]]


def groups() -> list[ScoredData]:
    """Two groups of two sequences of different lengths, with rollout logprobs."""
    g = torch.Generator().manual_seed(1)
    out = []
    for scores in ([1.0, 0.0], [0.5, 0.2]):
        tokens = [torch.randint(0, 100, (n,), generator=g).tolist() for n in (9, 12)]
        masks = [[-100] * 4 + t[4:] for t in tokens]
        logprobs = [[0.0] * 4 + (-torch.rand(len(t) - 4, generator=g)).tolist() for t in tokens]
        out.append(ScoredData(tokens=tokens, masks=masks, scores=scores, inference_logprobs=logprobs))
    return out


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def batch_gradients(ranks: Parallel) -> list[torch.Tensor]:
    """What the loop does for one batch on this rank: its rows, the whole batch's token count, the sum."""
    from example_trainer.grpo import micro_batch_loss

    model = tiny_model()
    batch = build_batch(groups(), seq_len=64)
    shape = BatchShape(tokens=batch.completion_mask.sum().item(), sequences=len(batch.scores),
                       parts=ranks.size if ranks.data else 1, max_completion_length=512)
    # token_truncate: the random rollout logprobs are far from the model's, and a mask would zero every row
    cfg = TrainerConfig(vllm_importance_sampling_mode="token_truncate")
    loss, _ = micro_batch_loss(model, None, ranks.my_rows(batch), cfg, shape, torch.device("cpu"))
    loss.backward()
    params = list(model.parameters())
    ranks.sum_gradients(params)
    return [p.grad for p in params]


def data_parallel_rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.save(batch_gradients(Parallel("data", rank, 2)), f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_data_parallel_ranks_with_half_the_rows_each_get_the_gradient_of_the_whole_batch(tmp_path):
    whole = batch_gradients(Parallel())
    mp.spawn(data_parallel_rank, args=(free_port(), str(tmp_path)), nprocs=2)
    for rank in range(2):
        for summed, expected in zip(torch.load(tmp_path / f"rank{rank}.pt"), whole):
            torch.testing.assert_close(summed, expected, atol=1e-6, rtol=1e-5)


# (rows, --gradient-accumulation-steps): batches the group filter served short of --batch-size 8
# (it trains on what it kept after --max-batches-per-step fetches): fewer rows than micro-batches,
# than ranks, rows that do not divide over the ranks.
SHORT_SPLITS = [(rows, accumulation) for rows in (1, 3) for accumulation in (1, 2, 4, 8)]


def short_batch_gradients(ranks: Parallel, rows: int, accumulation: int) -> tuple[float, list[torch.Tensor]]:
    """The loop's forward and backward over this rank's share of the first ``rows`` rows of the
    batch, the gradients summed over the ranks: (the batch's loss, the gradients)."""
    from example_trainer.grpo import forward_backward

    model = tiny_model()
    batch = build_batch(groups(), seq_len=64).rows(0, rows)
    cfg = TrainerConfig(batch_size=8, gradient_accumulation_steps=accumulation,
                        vllm_importance_sampling_mode="token_truncate")
    metrics = forward_backward(model, None, batch, cfg, torch.device("cpu"), parallel=ranks)
    params = list(model.parameters())
    ranks.sum_gradients(params)
    return metrics["train/loss"], [p.grad for p in params]


def short_batch_rank(rank: int, port: int, out: str) -> None:
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))  # a rank left out of a collective fails, not hangs
    try:
        torch.save({split: short_batch_gradients(Parallel("data", rank, 2), *split) for split in SHORT_SPLITS},
                   f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_a_short_batch_trains_every_row_once_however_it_is_split_over_micro_batches_and_ranks(tmp_path):
    # One row over two ranks leaves rank 1 none: it must still join the gradients' all-reduce.
    mp.spawn(short_batch_rank, args=(free_port(), str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    for rows, accumulation in SHORT_SPLITS:
        whole_loss, whole = short_batch_gradients(Parallel(), rows, 1)
        assert any(g.abs().sum() > 0 for g in whole), rows
        splits = {"one process": short_batch_gradients(Parallel(), rows, accumulation),
                  **{f"rank {r}": ranks[r][(rows, accumulation)] for r in range(2)}}
        for where, (loss, grads) in splits.items():
            assert loss == pytest.approx(whole_loss, rel=1e-5, abs=1e-7), (rows, accumulation, where)
            for got, expected in zip(grads, whole):
                torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5,
                                           msg=lambda m: f"{rows} rows, {accumulation} micro-batches, {where}: {m}")


def batch_metrics(ranks: Parallel, accumulation: int, loss_type: str = "dapo", correction: bool = True
                  ) -> dict[str, float]:
    """The loop's forward and backward over this rank's rows; the metrics it logs for the batch.
    ``correction``: --vllm-importance-sampling-correction (without it the loss's ratio is to vLLM's
    logprobs, random here: far from 1, and the clip acts)."""
    from example_trainer.grpo import forward_backward

    batch = build_batch(groups(), seq_len=64)
    cfg = TrainerConfig(batch_size=4, gradient_accumulation_steps=accumulation, epsilon=0.05, loss_type=loss_type,
                        epsilon_high=5.0 if loss_type == "cispo" else None,
                        vllm_importance_sampling_correction=correction,
                        vllm_importance_sampling_mode="token_truncate")
    return forward_backward(tiny_model(), None, batch, cfg, torch.device("cpu"), parallel=ranks)


def metrics_rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.save(batch_metrics(Parallel("data", rank, 2), accumulation=2, correction=False), f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "cispo"])
def test_every_loss_but_bnpo_is_the_whole_batchs_however_it_is_split_into_micro_batches(loss_type):
    whole = batch_metrics(Parallel(), accumulation=1, loss_type=loss_type)
    for name, value in batch_metrics(Parallel(), accumulation=4, loss_type=loss_type).items():
        assert value == pytest.approx(whole[name], rel=1e-5, abs=1e-7), name


def test_step_metrics_are_the_whole_batchs_however_it_is_split_over_micro_batches_and_ranks(tmp_path):
    # Rows of 5 and 8 completion tokens: micro-batches of one row each once counted equally, and a
    # data-parallel run logged rank 0's share of the loss only.
    whole = batch_metrics(Parallel(), accumulation=1, correction=False)
    assert set(whole) >= {"train/loss", "train/ratio_mean", "train/clip_fraction", "train/kl",
                          "sampling/logp_difference/max", "sampling/importance_ratio/min"}
    assert 0 < whole["train/clip_fraction"] < 1  # a sum that means something
    for name, value in batch_metrics(Parallel(), accumulation=4, correction=False).items():
        assert value == pytest.approx(whole[name], rel=1e-5, abs=1e-7), name
    mp.spawn(metrics_rank, args=(free_port(), str(tmp_path)), nprocs=2)
    for rank in range(2):
        for name, value in torch.load(tmp_path / f"rank{rank}.pt").items():
            assert value == pytest.approx(whole[name], rel=1e-5, abs=1e-7), (rank, name)


def test_the_policy_ratio_is_logged_where_the_clip_can_act_on_it_and_the_ratio_to_vllm_always():
    # With the rollout correction (the default) the loss's ratio is to the trainer's own logprobs of
    # this step: train/ratio_mean read 1 and train/clip_fraction 0 whatever vLLM sampled.
    corrected = batch_metrics(Parallel(), accumulation=1)
    assert "train/ratio_mean" not in corrected and "train/clip_fraction" not in corrected, corrected
    assert abs(corrected["sampling/importance_ratio/mean"] - 1) > 0.5  # policy / vLLM: random logprobs here
    direct = batch_metrics(Parallel(), accumulation=1, correction=False)  # the loss's ratio is to vLLM's
    assert direct["train/ratio_mean"] == pytest.approx(direct["sampling/importance_ratio/mean"], rel=1e-5)
    assert 0 < direct["train/clip_fraction"] < 1


def clipping_rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        shard = torch.zeros(3, requires_grad=True)  # rank r holds rows r of a (2, 3) tensor
        shard.grad = torch.tensor([1.0, 2.0, 3.0]) * (rank + 1)
        replicated = torch.zeros(2, requires_grad=True)  # a norm: the same whole tensor on every rank
        replicated.grad = torch.tensor([4.0, 5.0])
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Replicate, Shard

        mesh = init_device_mesh("cpu", (2,))  # the model's parameters say which master is a shard
        model_params = [DTensor.from_local(torch.zeros(1, 3), mesh, [Shard(0)]),
                        DTensor.from_local(torch.zeros(2), mesh, [Replicate()])]
        total = Parallel("tensor", rank, 2).clip_grad_norm([shard, replicated], 1.0, model_params)
        torch.save({"total": total, "shard": shard.grad, "replicated": replicated.grad}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_clipping_uses_the_whole_models_norm_counting_replicated_tensors_once(tmp_path):
    mp.spawn(clipping_rank, args=(free_port(), str(tmp_path)), nprocs=2)
    whole = torch.cat([torch.tensor([1.0, 2.0, 3.0]), torch.tensor([2.0, 4.0, 6.0]), torch.tensor([4.0, 5.0])])
    expected = float(whole.norm())
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert result["total"] == pytest.approx(expected)
        scale = 1.0 / (expected + 1e-6)
        torch.testing.assert_close(result["shard"], torch.tensor([1.0, 2.0, 3.0]) * (rank + 1) * scale)
        torch.testing.assert_close(result["replicated"], torch.tensor([4.0, 5.0]) * scale)


# One tensor-parallel step with the lean settings (TensorParallelBridge on fake exports of two
# vLLM TP workers, gloo ranks) against the same step of one process on the whole model, given the
# same whole-model gradient (injected, so the optimizer's arithmetic is compared alone: the sharded
# forward and backward are checked against the unsharded ones in tests/unit/test_attach.py).
# Every weight's shard holds >= 4,096 values, so torchao quantises its moments (k/v: 32 rows of 128).
LEAN_MODEL = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
LEAN_STEP = dict(learning_rate=1e-2, weight_decay=0.1, max_grad_norm=0.0, optimizer_chunk_elements=4096)  # row blocks, windows
OFFLOADED = dict(bf16_inplace=True, optimizer="adamw4bit", offload_optimizer=True, offload_gradients=True)
LEAN_SETTINGS = {  # name -> the flags the step runs with
    "masters, adamw8bit": dict(optimizer="adamw8bit"),
    "bf16-inplace": dict(bf16_inplace=True),
    "bf16-inplace, adamw8bit": dict(bf16_inplace=True, optimizer="adamw8bit"),
    "bf16-inplace, adamw8bit, staged": dict(bf16_inplace=True, optimizer="adamw8bit", staged_step=True),
    "bf16-inplace, adamw4bit, offloaded": OFFLOADED,
    # clipped: the factor comes from the norm, which the ranks sum in float64 and one process in bf16
    "bf16-inplace, adamw8bit, clipped": dict(bf16_inplace=True, optimizer="adamw8bit", max_grad_norm=0.5),
    "bf16-inplace, adamw4bit, offloaded, clipped": dict(OFFLOADED, max_grad_norm=0.5),
}
CLIPPED_PROBE = "model.layers.0.mlp.down_proj.weight"  # split by columns (RowwiseParallel)


def lean_config(flags: dict, **more) -> TrainerConfig:
    return TrainerConfig(weight_bridge_mode="shared_vllm", **{**LEAN_STEP, **flags}, **more)


def export_shard(hf, rank: int, folder, tp_size: int = 2):
    """What vLLM's TP worker ``rank`` does: its shards in shared memory, a weights gate, its bridge
    file. Returns (the exported tensors, the worker's gate)."""
    from test_attach import vllm_layout

    from vllm_patching.bridge_file import BridgeFile, write_bridge_file
    from vllm_patching.export import export_parameters, move_to_shared_memory
    from vllm_patching.gate import WorkerGate

    module = torch.nn.Module()
    for name, t in vllm_layout(hf, hf.config, tp_size, rank).items():
        module.register_parameter(name.replace(".", "__"), torch.nn.Parameter(t, requires_grad=False))
    move_to_shared_memory(module)
    shared = {n.replace("__", "."): p.data for n, p in module.named_parameters()}
    gate = WorkerGate(f"lean{rank}{os.getpid()}", torch.device("cpu"), folder / "shm", tp_rank=rank)
    handles, mappings, transport = export_parameters(shared.items())
    write_bridge_file(folder / "logs", BridgeFile(
        model=hf.name_or_path, architecture=hf.config.architectures[0], vllm_version="fake", transport=transport,
        exporter_pid=os.getpid(), created_at=time.time(), export_id=gate.export_id, num_params=len(handles),
        param_names=list(handles), param_mappings=mappings, ipc_handles=handles, gate=gate.info(), tp_degree=tp_size,
        tp_rank=rank))
    return shared, gate


def lean_step_rank(rank: int, port: int, root: str, out: str) -> None:
    """Trainer rank ``rank``: for each of LEAN_SETTINGS, attach TensorParallelBridge to worker
    ``rank``'s fake export and run one step as grpo.train_step does; save the exported shards."""
    from pathlib import Path

    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor

    from example_trainer.bridges.tensor_parallel import TensorParallelBridge
    from example_trainer.optim.optimizers import build_optimizer
    from example_trainer.parallel import is_dtensor, local
    from vllm_patching.bridge_file import BRIDGE_FILENAME

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    TensorParallelBridge._check_server_serves = lambda self, bridge: None  # no vLLM server here
    try:
        root = Path(root)
        hf = AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.bfloat16)
        gradients = torch.load(root / "gradients.pt")  # the whole model's, by parameter name
        parallel = Parallel("tensor", rank, 2)
        results = {}
        for setting, flags in LEAN_SETTINGS.items():
            folder = root / setting.replace(", ", "_")
            shards, worker_gate = export_shard(hf, rank, folder)
            dist.barrier()  # rank 0's bridge file (the one --vllm-config-path names) is written
            cfg = lean_config(flags, parallel="tensor", launch_vllm=False,
                              vllm_config_path=str(folder / "logs" / BRIDGE_FILENAME))
            bridge = TensorParallelBridge(cfg, str(root / "model"), folder, torch.device("cpu"), parallel=parallel)
            model = bridge.attach()
            optimizer = build_optimizer(cfg.optimizer, bridge.optimizer_parameters(model), cfg.learning_rate, cfg.weight_decay,
                                        cfg.optimizer_chunk_elements, cfg.offload_optimizer, cfg.offload_gradients,
                                        bridge.staging, model_params=list(model.parameters()))
            torch.manual_seed(1)  # stochastic rounding's draws: the same in the in-place and the staged step
            for name, p in model.named_parameters():  # backward delivers the whole model's gradient, sharded
                p.backward(distribute_tensor(gradients[name], p.device_mesh, p.placements) if is_dtensor(p) else
                           gradients[name])  # the norms are plain replicated tensors
            bridge.gradients_ready(model)
            norm = optimizer.clip_grad_norm(parallel, cfg.max_grad_norm, list(model.parameters()))
            probe = dict(zip((n for n, _ in model.named_parameters()), optimizer.params))[CLIPPED_PROBE]
            clipped = optimizer.gradients.grad(probe).clone()  # what the optimizer will step with
            with bridge.writing(model):
                closed_for_the_step = bool(worker_gate.file.record.half_written)
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            bridge.sync(model, step=1, final=False)
            results[setting] = {"norm": norm, "clipped": clipped, "shards": {n: t.clone() for n, t in shards.items()},
                                "closed_for_the_step": closed_for_the_step,
                                "open_after": not worker_gate.file.record.half_written,
                                "weights_version": int(worker_gate.file.record.weights_version),
                                "steps_shards": [s.untyped_storage().data_ptr() for s in bridge.optimizer_parameters(model)]
                                == [local(p).untyped_storage().data_ptr() for p in model.parameters()]}
            optimizer.release()
            bridge.close()
            dist.barrier()  # every rank has let go before the gates go
            worker_gate.close()
        torch.save(results, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def whole_model_step(model_path, gradients: dict[str, torch.Tensor], flags: dict) -> tuple[float, torch.nn.Module]:
    """The same step on one process and the whole model, as the one-GPU single-copy bridge steps it
    (fp32 masters written back after the step, or the bf16 weights in place, or staged)."""
    from example_trainer.bridges.master_weights import MasterWeights
    from example_trainer.optim.optimizers import build_optimizer
    from example_trainer.optim.staged_writes import StagedWrites

    cfg = lean_config(flags)
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16)
    params = list(hf.parameters())
    masters = None if cfg.bf16_inplace else MasterWeights(params)
    staging = StagedWrites() if cfg.staged_step else None
    optimizer = build_optimizer(cfg.optimizer, params if masters is None else masters.params, cfg.learning_rate, cfg.weight_decay,
                                cfg.optimizer_chunk_elements, cfg.offload_optimizer, cfg.offload_gradients, staging,
                                model_params=params)
    for name, p in hf.named_parameters():
        p.backward(gradients[name])
    if masters is not None:
        masters.pull_grads()
    norm = optimizer.clip_grad_norm(Parallel(), cfg.max_grad_norm, params)
    optimizer.step()
    for written in (masters, staging):
        if written is not None:
            written.push()
    return norm, hf


def bf16_neighbours(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Where bf16 tensors ``a`` and ``b`` are equal or adjacent values (one rounding step apart)."""
    bits_a, bits_b = a.view(torch.int16).int(), b.view(torch.int16).int()
    return (a == b) | ((bits_a - bits_b).abs() == 1) & (a.sign() == b.sign())


def test_a_tensor_parallel_step_with_the_lean_settings_is_the_whole_models_step(tmp_path):
    """TP=2 over fake exports against one process on the whole model, the same gradient given to
    both. Unclipped and with fp32 masters, bit for bit (adamw8bit: the first step's update is
    computed from the fp32 moments, before they are quantised, so the shards' other quantisation
    blocks do not show). With --bf16-inplace the optimizer rounds stochastically, and a shard draws
    other random bits than the whole tensor: each value is the whole model's or the bf16 value next
    to it, which is what either rounding of the same fp32 update gives; the staged step writes
    exactly what the in-place step writes with the same seed. Clipped, the factor comes from norms
    taken with other arithmetic (float64 over the ranks; one process in the gradients' dtype, bf16
    here), so the updates may differ a little: within two bf16 steps (or 1e-4 of the update's size
    where the update cancels the weight), and the gradient the optimizer steps with is the whole
    model's times max_norm / the whole model's norm."""
    from test_attach import vllm_layout

    torch.manual_seed(0)
    cfg = Qwen2Config(**LEAN_MODEL, architectures=["Qwen2ForCausalLM"])
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    hf.save_pretrained(tmp_path / "model")
    gradients = {n: torch.randn_like(p) * 1e-2 for n, p in hf.named_parameters()}
    torch.save(gradients, tmp_path / "gradients.pt")
    mp.spawn(lean_step_rank, args=(free_port(), str(tmp_path), str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for setting, flags in LEAN_SETTINGS.items():
        norm, whole = whole_model_step(tmp_path / "model", gradients, flags)
        max_norm = flags.get("max_grad_norm", LEAN_STEP["max_grad_norm"])
        for rank, results in enumerate(ranks):
            result = results[setting]
            # The whole model's norm on every rank. One process takes it as torch's clip_grad_norm_ does: in the
            # gradients' dtype (bf16 with --bf16-inplace, fp32 on the masters); the ranks add squares in float64.
            assert result["norm"] == pytest.approx(norm, rel=4e-3 if flags.get("bf16_inplace") else 1e-5), setting
            factor = min(1.0, max_norm / (result["norm"] + 1e-6)) if max_norm else 1.0
            assert factor < 0.2 if max_norm else True  # the clip acts
            probe = gradients[CLIPPED_PROBE].chunk(2, dim=1)[rank]
            torch.testing.assert_close(result["clipped"].float(), probe.float() * factor, rtol=8e-3, atol=0, msg=setting)
            # --bf16-inplace steps the memory the model's shards view (vLLM's), not a copy of it
            assert result["steps_shards"] == bool(flags.get("bf16_inplace")), setting
            staged = flags.get("staged_step", False)
            if flags.get("bf16_inplace"):  # in place, the gate is closed on every rank for the whole step
                assert result["closed_for_the_step"] != staged, setting
            assert result["open_after"], setting
            if rank == 0:
                assert result["weights_version"] == 1, setting
            expected = vllm_layout(whole, cfg, 2, rank)
            for name, shard in result["shards"].items():
                changed = shard != vllm_layout(hf, cfg, 2, rank)[name]
                assert changed.float().mean() > 0.5, (setting, name)  # the step moved the exported memory
                if max_norm:  # two bf16 steps, or far below the update's size (lr) where the update cancels the weight
                    torch.testing.assert_close(shard.float(), expected[name].float(), rtol=2**-7, atol=1e-4 * LEAN_STEP["learning_rate"],
                                               msg=f"{setting}: {name}")
                elif flags.get("bf16_inplace"):
                    assert bf16_neighbours(shard, expected[name]).all(), (setting, name)
                else:
                    assert torch.equal(shard, expected[name]), (setting, name)
    for rank, results in enumerate(ranks):
        for name, shard in results["bf16-inplace, adamw8bit, staged"]["shards"].items():
            assert torch.equal(shard, results["bf16-inplace, adamw8bit"]["shards"][name]), name


class SteppingWorker(threading.Thread):
    """A vLLM TP worker: steps through its gate until told to stop; each step reads the weights
    value at its start and at its end (they must agree)."""

    def __init__(self, gate: WorkerGate, weights: list[float], mixed: list[int]) -> None:
        super().__init__(daemon=True)
        self.gate, self.weights, self.mixed, self.stop = gate, weights, mixed, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.gate.begin_step()
            except threading.BrokenBarrierError:  # the test is over and the other worker gone
                return
            seen = self.weights[0]
            time.sleep(0.002)
            if self.weights[0] != seen:
                self.mixed.append(1)
            self.gate.end_step()


def test_tensor_parallel_workers_stop_together_at_rank_0s_gate_and_no_step_sees_a_write(tmp_path):
    barrier = threading.Barrier(2)
    gates = [WorkerGate(f"tp{r}{os.getpid()}", torch.device("cpu"), tmp_path, tp_rank=r, tp_barrier=barrier.wait)
             for r in range(2)]
    weights, mixed = [[0.0], [0.0]], []
    workers = [SteppingWorker(gate, w, mixed) for gate, w in zip(gates, weights)]
    trainers = [TrainerGate(gate.info(), torch.device("cpu"), os.getpid()) for gate in gates]
    for w in workers:
        w.start()
    try:
        for write in range(20):
            time.sleep(0.005)
            trainers[0].begin_write()  # rank 0: no worker enters another step
            entered = trainers[0].record.steps
            trainers[1].begin_follower_write(entered)  # rank 1: its worker ended as many
            assert not gates[1].held and gates[1].file.record.ended_steps == entered
            for w in weights:
                w[0] = write + 1.0
            trainers[1].end_write()
            trainers[0].end_write()
    finally:
        for w in workers:
            w.stop.set()
        barrier.abort()
        for t in trainers:
            t.close()
        for w in workers:
            w.join(timeout=5)
    assert gates[0].file.record.steps > 20 and not mixed
    assert gates[0].file.record.weights_version == gates[1].file.record.weights_version == 20
    for gate in gates:
        gate.close()


def test_a_rank_waiting_on_rank_0_says_what_it_waits_for_while_it_waits():
    """No silent wait: a rank other than 0 blocked in a collective logs what it waits for."""
    said, messages = threading.Event(), []

    class Heard(logging.Handler):
        def emit(self, record):
            if "has waited" in record.getMessage():
                messages.append(record.getMessage())
                said.set()

    parallel_log = logging.getLogger("onecopy.trainer.parallel")
    heard, level = Heard(), parallel_log.level
    parallel_log.addHandler(heard)
    parallel_log.setLevel(logging.WARNING)  # other ranks log warnings only, as the trainer sets up
    try:
        with Parallel("data", rank=1, size=2).saying_while_waiting("rank 0's next batch", every_seconds=0.01):
            assert said.wait(60), "nothing was logged while the rank waited"
        assert messages[0].startswith("[parallel] rank 1 has waited") and "for rank 0's next batch" in messages[0]
        # Rank 0 says what it waits for itself (the API, vLLM): it reports nothing here.
        said.clear()
        with Parallel("data", rank=0, size=2).saying_while_waiting("nothing", every_seconds=0.01):
            assert not said.wait(0.2)
    finally:
        parallel_log.removeHandler(heard)
        parallel_log.setLevel(level)
