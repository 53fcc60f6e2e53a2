"""--offload-gradients: each gradient leaves the parameters as backward finishes it, accumulates
in host memory over micro-batches as backward would have on the device, and comes back clipped,
a window at a time, for the optimizer step (checked against the same run with the gradients left
in place). On this CPU-only machine host and device are one memory: what the GPU saves is
measured there (tests/gpu/test_optimizer_offload_gpu.py)."""

import pytest
import torch

from example_trainer.optim.gradients import GradientsInHost
from example_trainer.optim.optimizers import build_optimizer
from example_trainer.parallel import Parallel

CHUNK = 16 * 256  # the first weight steps as four row blocks; windows of at most 4,096 values


def make_params(dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    """A 64x256 weight (row blocks at CHUNK), a 64x64 one used twice in the forward pass (as a
    tied embedding is), a 96x64 head, and a 512-value vector that only some steps use."""
    torch.manual_seed(seed)
    shapes = [(64, 256), (64, 64), (96, 64), (512,)]
    return [(torch.randn(shape) / shape[-1] ** 0.5).to(dtype).requires_grad_(True) for shape in shapes]


def micro_batch_loss(params: list[torch.Tensor], x: torch.Tensor, use_vector: bool) -> torch.Tensor:
    first, twice, head, vector = params
    h = torch.relu(x @ first.T)
    h = torch.tanh(h @ twice.T) @ twice  # the same weight twice: its gradient arrives in two parts
    out = h @ head.T
    if use_vector:
        out = out + vector[:96]
    return out.float().square().mean()


def backward_micro_batches(params, inputs: list[torch.Tensor], use_vector: bool) -> None:
    for x in inputs:
        (micro_batch_loss(params, x.to(params[0].dtype), use_vector) / len(inputs)).backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_leaves_no_gradient_on_the_parameters_and_the_host_sums_the_micro_batches_exactly(dtype):
    in_place, offloaded = make_params(dtype), make_params(dtype)
    gradients = GradientsInHost(offloaded)
    inputs = list(torch.randn(3, 8, 256).unbind())  # three micro-batches
    backward_micro_batches(in_place, inputs, use_vector=False)
    for x in inputs:
        (micro_batch_loss(offloaded, x.to(dtype), use_vector=False) / 3).backward()
        assert all(p.grad is None for p in offloaded)  # nothing waits on the parameters between micro-batches
    for a, b in zip(in_place[:3], offloaded[:3]):
        assert torch.equal(gradients.host[id(b)], a.grad)  # backward's own accumulation, bit for bit
    assert in_place[3].grad is None and not gradients.has(offloaded[3])  # unused: no gradient either way
    norm = gradients.finish_backward(Parallel(), offloaded, max_norm=0.0)
    assert norm == pytest.approx(float(torch.nn.utils.clip_grad_norm_(in_place, float("inf"))), rel=1e-6)
    gradients.clear()
    assert not any(gradients.has(p) for p in offloaded)  # the next step's backward starts a new sum


@pytest.mark.parametrize("name,dtype,max_norm", [("adamw", torch.float32, 1e-3), ("adamw", torch.float32, 0.0),
                                                 ("adamw8bit", torch.float32, 1e-3),
                                                 ("adamw4bit", torch.bfloat16, 1e-3)])
def test_training_with_offloaded_gradients_steps_exactly_as_with_gradients_in_place(name, dtype, max_norm):
    """Three steps of two micro-batches each, clipped (max_norm 1e-3 clips every step) or not; the
    vector has a gradient in every other step only."""
    params_a, params_b = make_params(dtype), make_params(dtype)
    in_place = build_optimizer(name, params_a, lr=1e-2, weight_decay=0.1, chunk_elements=CHUNK, offload=True)
    offloaded = build_optimizer(name, params_b, lr=1e-2, weight_decay=0.1, chunk_elements=CHUNK, offload=True,
                                offload_gradients=True)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        inputs = list(torch.randn(2, 8, 256, generator=gen).unbind())
        norms = []
        for params, optimizer in ((params_a, in_place), (params_b, offloaded)):
            backward_micro_batches(params, inputs, use_vector=step % 2 == 0)
            norms.append(optimizer.clip_grad_norm(Parallel(), max_norm))
            torch.manual_seed(100 + step)  # bf16 weights round stochastically: the same random bits on both sides
            optimizer.step()
            optimizer.zero_grad()
        assert norms[0] == norms[1]
        if max_norm:
            assert norms[0] > max_norm  # the clipping acted
    for a, b in zip(params_a, params_b):
        assert torch.equal(a, b)
    assert not torch.equal(params_b[0], make_params(dtype)[0])  # they did train
    assert offloaded.gradients.host_bytes() == sum(p.numel() * p.element_size() for p in params_b)


def test_release_takes_the_hooks_off_the_parameters():
    params = make_params(torch.float32)
    optimizer = build_optimizer("adamw", params, lr=1e-2, weight_decay=0.0, chunk_elements=CHUNK, offload=True,
                                offload_gradients=True)
    optimizer.release()
    backward_micro_batches(params, [torch.randn(8, 256)], use_vector=True)
    assert all(p.grad is not None for p in params)  # backward leaves them where it always does


def test_offloaded_gradients_need_the_offloaded_state_the_weights_stepped_in_place_and_no_data_parallel():
    from example_trainer.config import TrainerConfig

    with pytest.raises(ValueError, match="add --offload-optimizer and --bf16-inplace"):
        TrainerConfig(offload_gradients=True, bf16_inplace=True)
    with pytest.raises(ValueError, match="add --offload-optimizer and --bf16-inplace"):
        TrainerConfig(offload_gradients=True, offload_optimizer=True)
    with pytest.raises(ValueError, match="not built for --parallel data .* use --parallel tensor"):
        TrainerConfig(offload_gradients=True, offload_optimizer=True, bf16_inplace=True, parallel="data")
    TrainerConfig(offload_gradients=True, offload_optimizer=True, bf16_inplace=True)
    TrainerConfig(offload_gradients=True, offload_optimizer=True, bf16_inplace=True, parallel="tensor")
    with pytest.raises(ValueError, match="offload both"):
        build_optimizer("adamw", make_params(torch.float32), lr=1e-2, weight_decay=0.0, offload_gradients=True)


def test_the_norm_of_mixed_dtypes_and_of_a_non_finite_gradient_is_clip_grad_norms():
    """torch groups the norms by dtype in its own order before summing them (the bits of the sum
    depend on it); and without a max norm a non-finite gradient still makes the factor NaN, as there."""
    for seed in range(20):
        torch.manual_seed(seed)
        dtypes = [torch.bfloat16, torch.float32, torch.bfloat16, torch.float32, torch.bfloat16]
        in_place = [torch.randn(7, 33).to(d).requires_grad_(True) for d in dtypes]
        offloaded = [p.detach().clone().requires_grad_(True) for p in in_place]
        gradients = GradientsInHost(offloaded)
        for params in (in_place, offloaded):
            sum((p.float() * (i + 1)).sin().sum() for i, p in enumerate(params)).backward()
        assert gradients.finish_backward(Parallel(), offloaded, 0.5) == float(torch.nn.utils.clip_grad_norm_(in_place, 0.5))
    params = [torch.ones(4, requires_grad=True)]
    gradients = GradientsInHost(params)
    (params[0] * float("inf")).sum().backward()
    assert gradients.finish_backward(Parallel(), params, max_norm=0.0) == float("inf")
    assert torch.isnan(gradients.grad(params[0])).all()  # clip_grad_norm_(params, inf) scales by inf/inf too
