"""The bf16 rounding trap: tiny Adam steps vanish in bf16 but accumulate in fp32 masters."""

import torch

from example_trainer.bridges.master_weights import MasterWeights

STEPS, LR = 60, 1e-6


def run(steps: int, use_masters: bool) -> torch.Tensor:
    # 0.01 in bf16: neighbouring values are 2**-14 ≈ 6.1e-5 apart, so one Adam step (≈ lr) is
    # far below half a step and rounds away; 60 steps (≈ 6e-5) must move it in the master path.
    shared = torch.full((4,), 0.01, dtype=torch.bfloat16, requires_grad=True)
    masters = MasterWeights([shared]) if use_masters else None
    opt = torch.optim.AdamW(masters.params if masters else [shared], lr=LR, weight_decay=0.0)
    for _ in range(steps):
        (shared.float() * 1.0).sum().backward()  # gradient +1 everywhere: Adam steps -lr
        if masters:
            masters.pull_grads()
        opt.step()
        opt.zero_grad()
        if masters:
            masters.push()
    return shared.detach().clone()


def test_pure_bf16_steps_round_away():
    start = torch.full((4,), 0.01, dtype=torch.bfloat16)
    assert torch.equal(run(STEPS, use_masters=False), start)


def test_master_weights_still_change_the_bf16_weights():
    start = torch.full((4,), 0.01, dtype=torch.bfloat16)
    after = run(STEPS, use_masters=True)
    assert (after < start).all()


def test_push_writes_in_place():
    shared = torch.zeros(3, dtype=torch.bfloat16)
    ptr = shared.data_ptr()
    masters = MasterWeights([shared])
    with torch.no_grad():
        masters.params[0].fill_(1.5)
    masters.push()
    assert shared.data_ptr() == ptr and shared.tolist() == [1.5, 1.5, 1.5]
