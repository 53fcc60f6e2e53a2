"""The optimizers ``--optimizer`` names, and what they hold per parameter.

AdamW keeps two fp32 moments (8 bytes per parameter); torchao's AdamW8bit keeps them block-wise
quantised to 8 bits (about 2 bytes), AdamW4bit to 4 bits (about 1 byte). When the optimizer steps
bf16 weights directly (no fp32 masters, ``--bf16-inplace``), an update below half a bf16 step would round away every time;
torchao's stochastic rounding rounds up or down with the probabilities that keep the expected
value exact, so small updates accumulate on average instead of vanishing (tests/unit/test_master_weights.py).
torchao is PyTorch's own library for low-precision training: one pinned dependency for both.

An optimizer updates one tensor at a time with temporaries of that tensor's size (torchao
dequantises its moments to fp32; the fp32 AdamW's foreach path even copies all of them at once).
At Llama-3.1-8B the embedding alone has 525M values, so one fp32 temporary is 2 GiB: tensors above
``--optimizer-chunk-elements`` are stepped as row blocks that share their storage.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

OPTIMIZERS = ("adamw", "adamw8bit", "adamw4bit")
# The two moments; 8-bit adds an fp32 scale per 256 values, 4-bit one per 128 (+ a shared lookup table).
STATE_BYTES_PER_PARAM = {"adamw": 8.0, "adamw8bit": 2.0, "adamw4bit": 1.0}


def build_optimizer(name: str, params: list[torch.Tensor], lr: float, weight_decay: float,
                    chunk_elements: int = 0) -> torch.optim.Optimizer | RowBlockOptimizer:
    """``name``'s optimizer over ``params``; bf16 parameters get stochastic rounding; tensors above
    ``chunk_elements`` values are stepped in row blocks (0: whole tensors)."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown --optimizer {name!r}; valid: {', '.join(OPTIMIZERS)}")
    bf16 = any(p.dtype == torch.bfloat16 for p in params)

    def make(tensors: list[torch.Tensor]) -> torch.optim.Optimizer:
        if name == "adamw" and not bf16:
            # fused: one kernel per tensor list, without the foreach path's copy of every moment
            fused = all(t.is_cuda for t in tensors)
            return torch.optim.AdamW(tensors, lr=lr, weight_decay=weight_decay, fused=fused or None)
        from torchao.optim import AdamW4bit, AdamW8bit, _AdamW

        kind = {"adamw": _AdamW, "adamw8bit": AdamW8bit, "adamw4bit": AdamW4bit}[name]
        return kind(tensors, lr=lr, weight_decay=weight_decay, bf16_stochastic_round=bf16)

    if chunk_elements <= 0:
        return make(params)
    return RowBlockOptimizer(make, params, chunk_elements)


class RowBlockOptimizer:
    """An optimizer that steps each parameter above ``max_elements`` values as blocks of rows:
    views of its storage (updated in place) whose gradients are the matching rows of its gradient.
    The arithmetic of stepping the whole tensor: AdamW is elementwise, and the quantised moments are
    scaled per 128 or 256 consecutive values, which whole rows of a multiple of that never split
    (stochastic rounding draws other random bits, so bf16 results agree in expectation)."""

    def __init__(self, make: Callable[[list[torch.Tensor]], torch.optim.Optimizer], params: list[torch.Tensor],
                 max_elements: int) -> None:
        self.params = list(params)
        self.blocks: list[tuple[torch.Tensor, int, list[torch.Tensor]]] = []  # (param, rows per block, views)
        stepped: list[torch.Tensor] = []
        for p in self.params:
            rows = max_elements // max(p[0].numel(), 1) if p.dim() > 1 else 0
            if p.numel() <= max_elements or rows < 1:
                stepped.append(p)
                continue
            views = list(p.detach().split(rows))
            self.blocks.append((p, rows, views))
            stepped.extend(views)
        self.optimizer = make(stepped)

    def step(self) -> None:
        for p, rows, views in self.blocks:
            grads = p.grad.split(rows) if p.grad is not None else [None] * len(views)
            for view, grad in zip(views, grads):
                view.grad = grad
        try:
            self.optimizer.step()
        finally:
            for _, _, views in self.blocks:
                for view in views:
                    view.grad = None  # the views must not keep the gradient alive after zero_grad

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)
