"""Data parallel with parameters some ranks leave without a gradient: an MoE expert no token of a
rank's rows was routed to (or a tied/unused head) has ``grad is None`` there and a gradient on
another rank. Every rank must still reduce the same tensors, and step the same parameters."""

from __future__ import annotations

import datetime

import torch
import torch.multiprocessing as mp

from example_trainer.engine.ports import free_port
from example_trainer.parallel import Parallel

# Per rank, the gradient each of four parameters gets (None: this rank's rows never reached it).
GRADS = {0: [1.0, 2.0, 3.0, None], 1: [10.0, None, 30.0, None]}


def sparse_grads_rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))  # a mismatched collective fails, not hangs
    try:
        params = [torch.nn.Parameter(torch.zeros(3)) for _ in GRADS[rank]]
        for param, value in zip(params, GRADS[rank]):
            param.grad = None if value is None else torch.full((3,), value)
        Parallel("data", rank, 2).sum_gradients(params)
        torch.save([None if p.grad is None else p.grad.clone() for p in params], f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_a_parameter_without_a_gradient_on_one_rank_gets_the_others_sum_on_every_rank(tmp_path):
    mp.spawn(sparse_grads_rank, args=(free_port(), str(tmp_path)), nprocs=2)
    expected = [torch.full((3,), 11.0), torch.full((3,), 2.0), torch.full((3,), 33.0), None]
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for summed, want in zip(got, expected):
            if want is None:
                assert summed is None  # no rank trained it: the optimizer skips it on every rank
            else:
                torch.testing.assert_close(summed, want)
