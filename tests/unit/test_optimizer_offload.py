"""--offload-optimizer: the state lives in host memory between steps and streams through the
device in windows; the arithmetic is the optimizer's own (checked against the same optimizer
with its state left in place). On this CPU-only machine host and device are one memory: what the
device saves is measured on a GPU (tests/gpu/test_optimizer_offload_gpu.py)."""

import io

import pytest
import torch

from example_trainer.optim import optimizer_state
from example_trainer.optim.optimizers import build_optimizer


@pytest.fixture(autouse=True)
def device_memory_apart(monkeypatch):
    """On a CPU-only machine the state brought to the "device" would be the host buffer itself,
    and a missing or misordered copy back could not show: here each window steps a copy of it."""
    monkeypatch.setattr(optimizer_state, "_on_device",
                        lambda t, device: optimizer_state._rebuilt(t, lambda inner: inner.clone()))


def twins(dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Two identical parameter sets: a 64x256 weight (row blocks at the chunk below), a 96x128 one,
    a 512-value vector that gets no gradient in some steps, and three 8x128 weights that share windows."""
    torch.manual_seed(0)
    shapes = [(64, 256), (96, 128), (512,), (8, 128), (8, 128), (8, 128)]
    first = [torch.randn(shape).to(dtype).requires_grad_(True) for shape in shapes]
    return first, [p.detach().clone().requires_grad_(True) for p in first]


def step_both(in_place, offloaded, params_a, params_b, steps: int, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        for index, (a, b) in enumerate(zip(params_a, params_b)):
            if index == 2 and step % 2:  # no gradient this step: its state must wait, untouched
                a.grad = b.grad = None
                continue
            grad = torch.randn(a.shape, generator=gen).to(a.dtype)
            a.grad, b.grad = grad, grad.clone()
        # bf16 weights round stochastically: both draw the same random bits in the same order
        torch.manual_seed(100 + step)
        in_place.step()
        torch.manual_seed(100 + step)
        offloaded.step()
        in_place.zero_grad()
        offloaded.zero_grad()


@pytest.mark.parametrize("name,dtype", [("adamw", torch.float32), ("adamw8bit", torch.float32),
                                        ("adamwfp8", torch.float32), ("adamw4bit", torch.float32),
                                        ("adamw4bit", torch.bfloat16)])
def test_offloaded_state_steps_exactly_as_the_state_left_in_place(name, dtype):
    params_a, params_b = twins(dtype)
    chunk = 16 * 256  # four row blocks of the first weight; windows of at most 4,096 values
    in_place = build_optimizer(name, params_a, lr=1e-2, weight_decay=0.1, chunk_elements=chunk)
    offloaded = build_optimizer(name, params_b, lr=1e-2, weight_decay=0.1, chunk_elements=chunk, offload=True)
    step_both(in_place, offloaded, params_a, params_b, steps=4)
    for a, b in zip(params_a, params_b):
        assert torch.equal(a, b)
    moved = params_a[0].detach().clone()
    assert not torch.equal(moved, twins(dtype)[0][0])  # they did train
    # host memory holds what the optimizer left in place holds beside the parameters
    assert offloaded.placement.host_bytes() == state_bytes(in_place.optimizer)
    assert all(v.device.type == "cpu" for s in offloaded.optimizer.state.values() for v in s.values())


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's state tensors on the parameters' device (torchao's quantised
    moments: their codes, scales and lookup table)."""
    total = 0
    for param, state in optimizer.state.items():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.device == param.device:
                parts = [getattr(value, n) for n in value.__tensor_flatten__()[0]] if hasattr(value, "codes") else [value]
                total += sum(t.numel() * t.element_size() for t in parts)
    return total


@pytest.mark.parametrize("name", ["adamw", "adamw8bit"])
def test_an_offloaded_state_saved_and_loaded_resumes_the_same_run(name):
    """A checkpoint of the offloaded optimizer resumes into an offloaded optimizer (and into one
    without offload: the saved state is the same state dict) and continues the uninterrupted run."""
    params_a, params_b = twins(torch.float32)
    chunk = 16 * 256
    uninterrupted = build_optimizer(name, params_a, lr=1e-2, weight_decay=0.1, chunk_elements=chunk)
    offloaded = build_optimizer(name, params_b, lr=1e-2, weight_decay=0.1, chunk_elements=chunk, offload=True)
    step_both(uninterrupted, offloaded, params_a, params_b, steps=3)
    saved = offloaded.state_dict()
    for offload in (True, False):
        resumed_params = [p.detach().clone().requires_grad_(True) for p in params_b]
        reference = [p.detach().clone().requires_grad_(True) for p in params_a]
        reference_opt = build_optimizer(name, reference, lr=1e-2, weight_decay=0.1, chunk_elements=chunk)
        reference_opt.load_state_dict(through_a_file(uninterrupted.state_dict()))
        resumed = build_optimizer(name, resumed_params, lr=1e-2, weight_decay=0.1, chunk_elements=chunk,
                                  offload=offload)
        resumed.load_state_dict(through_a_file(saved))
        step_both(reference_opt, resumed, reference, resumed_params, steps=2, seed=7)
        for a, b in zip(reference, resumed_params):
            assert torch.equal(a, b), offload


def through_a_file(state: dict) -> dict:
    """``state`` saved and loaded as a checkpoint is (torch loads a state dict by reference)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def test_offload_needs_windows():
    from example_trainer.config import TrainerConfig

    with pytest.raises(ValueError, match="--offload-optimizer needs --optimizer-chunk-elements > 0"):
        TrainerConfig(offload_optimizer=True, optimizer_chunk_elements=0)
