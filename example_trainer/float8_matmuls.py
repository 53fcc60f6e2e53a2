"""--float8-matmuls: the decoder's projections multiply on the GPU's float8 tensor cores.

torchao.float8 swaps each chosen ``nn.Linear`` for a ``Float8Linear`` that casts its operands to
float8 with a dynamic scale just before each matmul and keeps everything else (weights, gradients,
outputs) in the model's dtype. The swap keeps the module's ``weight`` Parameter object, so in mode
shared_vllm the converted layers still compute with the views of vLLM's storage and the optimizer
still steps those.

Each projection does three matmuls a step: the output in forward (twice with gradient
checkpointing), and the input's and the weight's gradients in backward. A recipe (a RECIPES entry)
says which of them run in float8. The one there, ``backward``, takes only the two gradient matmuls:
the forward, and so the logprobs, the policy ratio and the loss, is computed in bf16 as without the
flag (and as vLLM computes its logprobs); only the gradient carries float8 rounding.

Not offered: torchao's tensorwise recipe with the forward in float8 too. On a tiny Llama under
torchao's emulation its logprobs moved 0.38 nats on average from bf16's (bf16 from fp32: 0.03) and
one projection's gradient kept a cosine of 0.75 to fp32's (``backward``: 0.98, bf16: 0.998); RL
compares the trainer's logprobs with vLLM's, so the forward stays bf16.

Only the attention and MLP projections are converted: the LM head and embeddings stay in bf16 (the
logprobs' last matmul), and so do MoE routers (a float8 router could send a token elsewhere).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch

logger = logging.getLogger("onecopy.trainer.float8")

# The attention and dense-MLP projections of the Llama, Qwen2 and Qwen3 families (and Qwen3-MoE's
# attention): module names as transformers gives them.
PROJECTIONS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})
# torch._scaled_mm needs an H100/H200 (sm_90), an L40S/RTX 4090 (sm_89) or newer.
MIN_CAPABILITY = (8, 9)


def _gradients_only():
    """Forward in the model's dtype; both gradient matmuls in float8, one scale per tensor (the
    input's gradient from e5m2 gradients and e4m3 weights, the weight's from e4m3 inputs and e5m2
    gradients: torchao's tensorwise defaults)."""
    from torchao.float8.config import CastConfig, Float8LinearConfig, ScalingType

    dynamic = CastConfig()
    kept = CastConfig(scaling_type=ScalingType.DISABLED)
    return Float8LinearConfig(cast_config_input=kept, cast_config_weight=kept,
                              cast_config_input_for_grad_weight=dynamic, cast_config_weight_for_grad_input=dynamic)


RECIPES: dict[str, Callable] = {"backward": _gradients_only}
FLOAT8_MATMULS = ("off", *RECIPES)


def check_device(device: torch.device) -> None:
    """A clear error where float8 matmuls cannot run, before anything is converted."""
    if device.type != "cuda":
        raise ValueError(f"--float8-matmuls needs a CUDA GPU with float8 tensor cores (H100, H200, L40S, RTX 4090 "
                         f"or newer); the trainer runs on {device.type}: drop the flag")
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise ValueError(f"--float8-matmuls needs float8 tensor cores (compute capability 8.9+: H100, H200, L40S, "
                         f"RTX 4090); {torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}: drop the flag")


def convert_projections(model: torch.nn.Module, recipe: str, device: torch.device, emulate: bool = False) -> int:
    """Swap the decoder's projections for torchao ``Float8Linear`` modules under ``recipe`` (a key
    of RECIPES); returns how many. ``emulate``: torchao's float8 emulation, for tests on a CPU."""
    if recipe not in RECIPES:
        raise ValueError(f"--float8-matmuls {recipe!r} is unknown; valid: {', '.join(FLOAT8_MATMULS)}")
    if not emulate:
        check_device(device)
    from torchao.float8 import convert_to_float8_training

    # pad_inner_dim: the weight's gradient sums over the batch's tokens, whose count _scaled_mm
    # needs to be a multiple of 16; padding makes any batch shape work.
    config = dataclasses.replace(RECIPES[recipe](), emulate=emulate, pad_inner_dim=True)
    before = {id(p) for p in model.parameters()}
    converted: list[str] = []

    def chosen(module: torch.nn.Module, name: str) -> bool:
        keep = name.rsplit(".", 1)[-1] in PROJECTIONS
        if keep:
            converted.append(name)
        return keep

    convert_to_float8_training(model, module_filter_fn=chosen, config=config)
    if {id(p) for p in model.parameters()} != before:  # the bridge's views must be what the model trains
        raise RuntimeError("float8 conversion replaced parameters of the model; the shared weights would be lost")
    logger.info("[float8] --float8-matmuls %s: %d projections compute their gradients' matmuls in float8; the "
                "forward, LM head, embeddings and routers stay %s", recipe, len(converted),
                next(model.parameters()).dtype)
    return len(converted)
