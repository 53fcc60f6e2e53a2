"""--staged-step (example_trainer/optim/staged_writes.py): the optimizer leaves the weights alone and
stages their new values; one push writes exactly what stepping them in place writes."""

from __future__ import annotations

import pytest
import torch

from example_trainer.config import TrainerConfig
from example_trainer.optim.optimizers import OPTIMIZERS, build_optimizer
from example_trainer.optim.staged_writes import StagedWrites


def weights() -> list[torch.Tensor]:
    torch.manual_seed(0)
    # 128 x 256 is stepped as row blocks of 32 rows below (--optimizer-chunk-elements 8192); 10 x 10
    # is below torchao's 4096-value floor for quantised moments
    return [torch.randn(128, 256, dtype=torch.bfloat16), torch.randn(10, 10, dtype=torch.bfloat16)]


def train(name: str, staging: StagedWrites | None, steps: int = 2) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """``steps`` steps of ``name`` on fresh weights; returns them and, for each step, the weights as
    they stood right after ``optimizer.step()`` (before a staged push)."""
    params = [torch.nn.Parameter(w) for w in weights()]
    opt = build_optimizer(name, params, lr=1e-2, weight_decay=0.1, chunk_elements=8192, staging=staging)
    after_step = []
    for step in range(steps):
        torch.manual_seed(100 + step)  # the same gradients, and the same random bits for stochastic rounding
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
        after_step.append([p.detach().clone() for p in params])
        if staging is not None:
            assert staging.push() == 2 * sum(p.numel() * 2 for p in params)  # each bf16 value read and written once
            assert staging.pairs == []
    return params, after_step


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_staged_step_leaves_the_weights_and_its_push_writes_what_the_in_place_step_writes(name):
    in_place, _ = train(name, None)
    staged, after_step = train(name, StagedWrites())
    start = weights()
    assert all(torch.equal(w, s) for w, s in zip(after_step[0], start))  # untouched until the push
    for a, b, s in zip(in_place, staged, start):
        assert not torch.equal(a, s)  # they moved
        assert torch.equal(a, b)


def test_a_staged_step_is_refused_where_the_gradients_cannot_hold_the_new_weights():
    params = [torch.nn.Parameter(torch.randn(16, 16))]
    with pytest.raises(ValueError, match="bf16 weights"):
        build_optimizer("adamw8bit", params, lr=1e-3, weight_decay=0.0, staging=StagedWrites())
    bf16 = [torch.nn.Parameter(torch.randn(16, 16, dtype=torch.bfloat16))]
    with pytest.raises(ValueError, match="--offload-gradients"):
        build_optimizer("adamw8bit", bf16, lr=1e-3, weight_decay=0.0, chunk_elements=256, offload=True,
                        offload_gradients=True, staging=StagedWrites())


@pytest.mark.parametrize("flags, message", [
    ({}, "add --bf16-inplace"),
    ({"bf16_inplace": True, "offload_optimizer": True, "offload_gradients": True}, "drop one"),
    ({"bf16_inplace": True, "weight_bridge_mode": "colocate"}, "only --weight-bridge-mode shared_vllm"),
])
def test_the_flag_is_refused_where_it_cannot_work(flags, message):
    with pytest.raises(ValueError, match=message):
        TrainerConfig(staged_step=True, **flags)


def test_the_flag_is_taken_by_shared_vllm_with_bf16_inplace():
    assert TrainerConfig(staged_step=True, bf16_inplace=True, weight_bridge_mode="shared_vllm").staged_step


def test_a_push_after_a_step_that_staged_nothing_is_refused():
    """An optimizer built without the bridge's staging wrote vLLM's tensors with the gate open."""
    params = [torch.nn.Parameter(torch.randn(16, 16, dtype=torch.bfloat16))]
    params[0].grad = torch.randn_like(params[0])
    build_optimizer("adamw8bit", params, lr=1e-3, weight_decay=0.0).step()  # no staging given
    with pytest.raises(RuntimeError, match="staged no weights"):
        StagedWrites().push()
