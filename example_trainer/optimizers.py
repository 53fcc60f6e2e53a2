"""The optimizers ``--optimizer`` names, and what they hold per parameter.

AdamW keeps two fp32 moments (8 bytes per parameter); torchao's AdamW8bit keeps them block-wise
quantised to 8 bits (about 2 bytes), AdamW4bit to 4 bits (about 1 byte). When the optimizer steps
bf16 weights directly (no fp32 masters, ``--bf16-inplace``), an update below half a bf16 step would round away every time;
torchao's stochastic rounding rounds up or down with the probabilities that keep the expected
value exact, so small updates accumulate on average instead of vanishing (tests/unit/test_master_weights.py).
torchao is PyTorch's own library for low-precision training: one pinned dependency for both.
"""

from __future__ import annotations

import torch

OPTIMIZERS = ("adamw", "adamw8bit", "adamw4bit")
# The two moments; 8-bit adds an fp32 scale per 256 values, 4-bit one per 128 (+ a shared lookup table).
STATE_BYTES_PER_PARAM = {"adamw": 8.0, "adamw8bit": 2.0, "adamw4bit": 1.0}


def build_optimizer(name: str, params: list[torch.Tensor], lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """``name``'s optimizer over ``params``; bf16 parameters get stochastic rounding."""
    bf16 = any(p.dtype == torch.bfloat16 for p in params)
    if name == "adamw" and not bf16:
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    from torchao.optim import AdamW4bit, AdamW8bit, _AdamW

    if name == "adamw":
        return _AdamW(params, lr=lr, weight_decay=weight_decay, bf16_stochastic_round=True)
    if name == "adamw8bit":
        return AdamW8bit(params, lr=lr, weight_decay=weight_decay, bf16_stochastic_round=bf16)
    if name == "adamw4bit":
        return AdamW4bit(params, lr=lr, weight_decay=weight_decay, bf16_stochastic_round=bf16)
    raise ValueError(f"unknown --optimizer {name!r}; valid: {', '.join(OPTIMIZERS)}")
