"""example_trainer/optim/low_bit_adam.py: torchao's optimizers, their compiled update built once."""

import pytest
import torch

from example_trainer.optim import low_bit_adam

KINDS = {"adamw": "_AdamW", "adamw8bit": "AdamW8bit", "adamwfp8": "AdamWFp8", "adamw4bit": "AdamW4bit"}
OURS = {"adamw": low_bit_adam.AdamW, "adamw8bit": low_bit_adam.AdamW8bit, "adamwfp8": low_bit_adam.AdamWFp8,
        "adamw4bit": low_bit_adam.AdamW4bit}


def _params(dtype):
    torch.manual_seed(0)
    # 64 x 128 values are quantised block-wise; 10 x 10 is below torchao's 4096-value floor (plain moments)
    return [torch.randn(64, 128, dtype=dtype), torch.randn(10, 10, dtype=dtype), torch.randn(32, 256, dtype=dtype)]


def _run(kind, dtype, steps=3):
    params = [torch.nn.Parameter(p) for p in _params(dtype)]
    opt = kind(params, lr=1e-2, weight_decay=0.1, bf16_stochastic_round=dtype is torch.bfloat16)
    for step in range(steps):
        torch.manual_seed(100 + step)  # the same gradients, and the same random bits for stochastic rounding
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    return params, opt


@pytest.mark.parametrize("name", list(KINDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_same_weights_and_state_as_torchaos_own_step(name, dtype):
    import torchao.optim

    theirs, their_opt = _run(getattr(torchao.optim, KINDS[name]), dtype)
    ours, our_opt = _run(OURS[name], dtype)
    for a, b, start in zip(theirs, ours, _params(dtype)):
        assert not torch.equal(a, start)  # they moved
        assert torch.equal(a, b)
    assert len(their_opt.state_dict()["state"]) == len(our_opt.state_dict()["state"]) == len(ours)
    for a, b in zip(their_opt.state_dict()["state"].values(), our_opt.state_dict()["state"].values()):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key].dequantize() if hasattr(a[key], "dequantize") else a[key],
                               b[key].dequantize() if hasattr(b[key], "dequantize") else b[key]), key


def test_the_update_is_compiled_once_not_for_every_tensor_of_every_step(monkeypatch):
    """torchao 0.18 builds a torch.compile wrapper per tensor per step (0.6 ms of Python each)."""
    import torchao.optim

    calls = []
    real_compile = torch.compile

    def counting_compile(*args, **kwargs):
        calls.append(args)
        return real_compile(*args, **kwargs)

    monkeypatch.setattr(torch, "compile", counting_compile)
    _run(torchao.optim.AdamW8bit, torch.float32, steps=2)
    assert len(calls) == 2 * 3  # torchao's own step: once per tensor per step
    calls.clear()
    low_bit_adam.compiled_update.cache_clear()
    _run(low_bit_adam.AdamW8bit, torch.float32, steps=2)
    assert len(calls) == 1


def test_a_learning_rate_set_as_a_number_is_refused_with_the_way_to_set_it():
    params, opt = _run(low_bit_adam.AdamW8bit, torch.float32, steps=1)
    opt.param_groups[0]["lr"] = 1e-3
    with pytest.raises(RuntimeError, match=r"fill_"):
        opt.step()


def test_low_bit_moments_fit_a_regression_about_as_well_as_fp32_moments():
    """Numerics beside speed: 300 full-batch steps on a least-squares fit, each kind from one start."""
    from example_trainer.optim.optimizers import build_optimizer

    torch.manual_seed(0)
    inputs, truth = torch.randn(512, 256), torch.randn(256, 64)
    targets = inputs @ truth + 0.1 * torch.randn(512, 64)
    start = torch.zeros(256, 64)

    def final_loss(name):
        weights = start.clone().requires_grad_(True)
        opt = build_optimizer(name, [weights], lr=3e-2, weight_decay=0.0)
        for _ in range(300):
            loss = ((inputs @ weights - targets) ** 2).mean()
            weights.grad, = torch.autograd.grad(loss, weights)
            opt.step()
        return ((inputs @ weights - targets) ** 2).mean().item()

    first = ((inputs @ start - targets) ** 2).mean().item()  # about 250; the noise floor is 0.01
    losses = {name: final_loss(name) for name in ("adamw", "adamw8bit", "adamwfp8", "adamw4bit")}
    assert losses["adamw"] < 0.02, losses
    for name in ("adamw8bit", "adamwfp8"):  # 0.0224 and 0.0226 against 0.0158 when written
        assert losses[name] < 1.6 * losses["adamw"], (name, losses)
    # 4-bit moments stall far above the others near the optimum (0.59 when written): still 400x down
    assert losses["adamw4bit"] < 0.005 * first, losses
