"""Tensor parallel, a vLLM worker lost: before every rank stops, each rank's fp32 masters become
its model's weights again, as DTensor shards where the plan shards a tensor and plain tensors where
it leaves one whole (norms). On 2 H200s each rank raised AttributeError ('Parameter' object has no
attribute 'device_mesh') there instead of stopping with the tensor-parallel message."""

from __future__ import annotations

import datetime
from types import SimpleNamespace

import torch
import torch.distributed as dist

from example_trainer.bridges.attach import detach_views
from example_trainer.bridges.tensor_parallel import TensorParallelBridge, sharded_meta_model
from example_trainer.engine.ports import free_port
from example_trainer.parallel import is_dtensor, local


def test_the_masters_become_the_models_weights_again_after_the_detach(default_model):
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        model = sharded_meta_model(default_model, torch.bfloat16, init_device_mesh("cpu", (1,)))
        params = dict(model.named_parameters())
        layouts = {name: (p.device_mesh, p.placements) for name, p in params.items() if is_dtensor(p)}
        assert layouts and len(layouts) < len(params)  # the case: some tensors sharded, some whole
        bridge = object.__new__(TensorParallelBridge)  # only the state this path reads
        bridge.layouts = layouts
        masters = [torch.randn(local(p).shape) for p in params.values()]
        bridge.masters = SimpleNamespace(params=masters)
        detach_views(model)  # what _recover does first: every parameter on the meta device
        bridge._keep_masters_in(model)
        for (name, param), master in zip(model.named_parameters(), masters):
            assert is_dtensor(param) == (name in layouts), name
            if name in layouts:
                assert param.placements == layouts[name][1] and param.shape == params[name].shape, name
            assert torch.equal(local(param), master.to(torch.bfloat16)), name
    finally:
        dist.destroy_process_group()
