"""torchao's AdamW (fp32, 8-bit, fp8 and 4-bit moments) with its compiled update made once, not per tensor.

torchao 0.18's ``_AdamBase.step`` calls ``torch.compile(single_param_adam, ...)`` anew for every
tensor of every step (pytorch/ao#2500). The compiled code is reused, since dynamo caches it on the
function's code object, but building the wrapper costs about 0.6 ms of Python each time (dynamo
checks the function's file against its skip rules). An 8B Llama has 291 tensors, so that is about
0.18 s a step, all of it while the weights gate is closed and vLLM waits. An 8B Llama's AdamW8bit
step on an H100 took 245-305 ms with torchao's step and 145-152 ms with these classes
(``bench/optimizer_step.py``, docs/results.md); ``tests/unit/test_low_bit_adam.py`` checks the
results are the same.

These classes keep torchao's state, its layout and its arithmetic (``single_param_adam`` itself),
so checkpoints load either way. Only the loop around the update is this module's.
"""

from __future__ import annotations

import functools

import torch
from torchao.optim import AdamW4bit as _TorchaoAdamW4bit
from torchao.optim import AdamW8bit as _TorchaoAdamW8bit
from torchao.optim import AdamWFp8 as _TorchaoAdamWFp8
from torchao.optim import _AdamW as _TorchaoAdamW
from torchao.optim.adam import single_param_adam


@functools.cache
def compiled_update():
    """torchao's one-tensor AdamW update, compiled as torchao compiles it; built once per process."""
    return torch.compile(single_param_adam, fullgraph=True, dynamic=False)


class CompiledOnceStep:
    """Mixin for torchao's Adam classes: ``step`` as torchao's, through ``compiled_update()``.
    With ``staging`` set (example_trainer/optim/staged_writes.py), each new value goes to the staging
    target the parameter is given instead of the parameter itself."""

    staging = None  # a StagedWrites, or None: step the parameters in place

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        update = compiled_update()
        # one compiled variant per tensor shape: a fixed number for a given model
        with torch._dynamo.utils.disable_cache_limit():
            for group in self.param_groups:
                if not isinstance(group["lr"], torch.Tensor):
                    raise RuntimeError("set the learning rate with param_groups[i]['lr'].fill_(value): "
                                       "it must stay a tensor, or every new value compiles the update again")
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    if p.grad.is_sparse:
                        raise RuntimeError("torchao's AdamW takes dense gradients only")
                    state = self._state_of(p, group["amsgrad"])
                    state["step"] += 1
                    target, grad = (p.detach(), p.grad) if self.staging is None else self.staging.target(p)
                    update(target, grad, state["step"], state["exp_avg"], state["exp_avg_sq"],
                           state.get("max_exp_avg_sq"), group["lr"], group["betas"][0], group["betas"][1],
                           group["weight_decay"], group["eps"], self.is_adamw,
                           self.bf16_stochastic_round and p.dtype is torch.bfloat16)
                    del target, grad  # a staged step's temporary goes before the next tensor's is made
        return loss

    def _state_of(self, p: torch.Tensor, amsgrad: bool) -> dict:
        """``p``'s state, made as torchao makes it on its first step (its own buffer kinds)."""
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = self._new_buffer(p, True)
            state["exp_avg_sq"] = self._new_buffer(p, False)
            if amsgrad:
                state["max_exp_avg_sq"] = self._new_buffer(p, False)
        return state


class AdamW(CompiledOnceStep, _TorchaoAdamW):
    """torchao's AdamW (fp32 moments; stochastic rounding for bf16 weights)."""


class AdamW8bit(CompiledOnceStep, _TorchaoAdamW8bit):
    """torchao's AdamW8bit: moments block-wise quantised to 8 bits."""


class AdamW4bit(CompiledOnceStep, _TorchaoAdamW4bit):
    """torchao's AdamW4bit: moments block-wise quantised to 4 bits."""


class AdamWFp8(CompiledOnceStep, _TorchaoAdamWFp8):
    """torchao's AdamWFp8: moments as float8 e4m3 with a scale per block of 256 values."""


# --optimizer's names (example_trainer/optim/optimizers.py) -> the class; each one's torchao class is its
# other base (bench/optimizer_step.py times the two against each other).
BY_NAME = {"adamw": AdamW, "adamw8bit": AdamW8bit, "adamwfp8": AdamWFp8, "adamw4bit": AdamW4bit}


def torchao_class(kind: type) -> type:
    """The torchao optimizer class ``kind`` steps for."""
    return next(base for base in kind.__bases__ if base is not CompiledOnceStep)
