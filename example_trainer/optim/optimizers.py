"""The optimizers ``--optimizer`` names, and what they hold per parameter.

AdamW keeps two fp32 moments (8 bytes per parameter); torchao's AdamW8bit keeps them block-wise
quantised to 8 bits (about 2 bytes), AdamWFp8 as float8 e4m3 with a scale per block (about 2 bytes;
a cast where 8-bit searches a 256-entry table for each value), AdamW4bit to 4 bits (about 1 byte). When the optimizer steps
bf16 weights directly (no fp32 masters, ``--bf16-inplace``), an update below half a bf16 step would round away every time;
torchao's stochastic rounding rounds up or down with the probabilities that keep the expected
value exact, so small updates accumulate on average instead of vanishing (tests/unit/test_master_weights.py).
torchao is PyTorch's own library for low-precision training: one pinned dependency for both
(example_trainer/optim/low_bit_adam.py steps its optimizers with less Python per tensor).

An optimizer updates one tensor at a time with temporaries of that tensor's size (torchao
dequantises its moments to fp32; the fp32 AdamW's foreach path even copies all of them at once).
At Llama-3.1-8B the embedding alone has 525M values, so one fp32 temporary is 2 GiB: tensors above
``--optimizer-chunk-elements`` are stepped as row blocks that share their storage. A row is the
last dimension: an MoE layer's experts [E, 2I, H] are E * 2I rows of H values, so a block may end
inside an expert (one expert can exceed the limit alone: 2 x 16384 x 6144 values in Mixtral-8x22B).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from example_trainer.optim.gradients import GradientsInHost, GradientsOnDevice, Rows, as_rows
from example_trainer.optim.optimizer_state import StateInHost, StateOnDevice
from example_trainer.optim.staged_writes import StagedWrites

OPTIMIZERS = ("adamw", "adamw8bit", "adamwfp8", "adamw4bit")
# The two moments; 8-bit and fp8 add an fp32 scale per 256 values, 4-bit one per 128 (+ a shared lookup table).
STATE_BYTES_PER_PARAM = {"adamw": 8.0, "adamw8bit": 2.0, "adamwfp8": 2.0, "adamw4bit": 1.0}


def build_optimizer(name: str, params: list[torch.Tensor], lr: float, weight_decay: float,
                    chunk_elements: int = 0, offload: bool = False,
                    offload_gradients: bool = False, staging: StagedWrites | None = None,
                    model_params: list[torch.Tensor] | None = None) -> RowBlockOptimizer:
    """``name``'s optimizer over ``params``; bf16 parameters get stochastic rounding; tensors above
    ``chunk_elements`` values are stepped in row blocks (0: whole tensors). With ``offload`` its
    state lives in host memory between steps and streams through the device in windows of
    ``chunk_elements`` values (example_trainer/optim/optimizer_state.py); with ``offload_gradients`` the
    gradients too, from the moment backward produces them (example_trainer/optim/gradients.py). With
    ``staging`` a step leaves the parameters as they are and stages their new values there
    (example_trainer/optim/staged_writes.py). ``model_params``: the model's parameters, one per tensor of
    ``params`` and in its order, where backward accumulates into them and not into ``params``
    (tensor parallel: the DTensors whose local shards ``params`` are); offloaded gradients are taken
    from them."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown --optimizer {name!r}; valid: {', '.join(OPTIMIZERS)}")
    bf16 = any(p.dtype == torch.bfloat16 for p in params)
    if staging is not None and (offload_gradients or not bf16):
        raise ValueError("a staged step writes each new bf16 weight into its gradient's memory on the device: it "
                         "takes bf16 weights (--bf16-inplace) and gradients on the GPU (no --offload-gradients)")

    def make(tensors: list[torch.Tensor]) -> torch.optim.Optimizer:
        if name == "adamw" and not bf16:
            # fused: one kernel per tensor list, without the foreach path's copy of every moment
            fused = all(t.is_cuda for t in tensors)
            return torch.optim.AdamW(tensors, lr=lr, weight_decay=weight_decay, fused=fused or None)
        from example_trainer.optim import low_bit_adam

        kind = low_bit_adam.BY_NAME[name]
        optimizer = kind(tensors, lr=lr, weight_decay=weight_decay, bf16_stochastic_round=bf16)
        optimizer.staging = staging
        return optimizer

    if offload_gradients and not offload:
        raise ValueError("offloaded gradients come back a window at a time with the offloaded state: offload both")
    placement = StateInHost(chunk_elements) if offload else StateOnDevice()
    gradients = GradientsInHost(params, model_params) if offload_gradients else GradientsOnDevice()
    return RowBlockOptimizer(make, params, chunk_elements, placement, gradients)


# torchao scales its quantised moments per run of 256 (8-bit) or 128 (4-bit) consecutive values, and
# keeps a tensor's moments in fp32 unless its size is a multiple of that: a block's size must be one.
QUANT_BLOCK_VALUES = 256


class RowBlockOptimizer:
    """An optimizer that steps each parameter above ``max_elements`` values (0: none) as blocks of
    rows: views of its storage (updated in place) whose gradients are the matching rows of its
    gradient. The arithmetic of stepping the whole tensor: AdamW is elementwise, and every block is a
    whole number of torchao's scaling runs (stochastic rounding draws other random bits, so bf16
    results agree in expectation). ``placement`` says where the state lives between steps,
    ``gradients`` where the gradients wait for the step."""

    def __init__(self, make: Callable[[list[torch.Tensor]], torch.optim.Optimizer], params: list[torch.Tensor],
                 max_elements: int, placement: StateOnDevice | StateInHost | None = None,
                 gradients: GradientsOnDevice | GradientsInHost | None = None) -> None:
        self.params, self.max_elements = list(params), max_elements
        self.placement = placement or StateOnDevice()
        self.gradients = gradients or GradientsOnDevice()
        self.blocks: list[tuple[int, int, list[torch.Tensor]]] = []  # (index in params, rows per block, views)
        self.stepped: list[torch.Tensor] = []  # what the inner optimizer steps: whole parameters and row blocks
        self.sources: dict[int, tuple[torch.Tensor, Rows]] = {}  # id(stepped tensor) -> (its parameter, its rows)
        for index, p in enumerate(self.params):
            rows = _rows_per_block(p, max_elements)
            if rows == 0:
                self.stepped.append(p)
                self.sources[id(p)] = (p, None)
                continue
            views = list(as_rows(p.detach()).split(rows))
            self.blocks.append((index, rows, views))
            for first, view in zip(range(0, len(as_rows(p)), rows), views):
                self.sources[id(view)] = (p, (first, len(view)))
            self.stepped.extend(views)
        self.optimizer = make(self.stepped)

    def clip_grad_norm(self, parallel, max_norm: float, model_params: list[torch.Tensor] | None = None) -> float:
        """After the last micro-batch: the gradient summed over ``parallel``'s data-parallel ranks and
        clipped to ``max_norm`` (0: not clipped); returns its norm before clipping."""
        return self.gradients.finish_backward(parallel, self.params, max_norm, model_params)

    def step(self) -> None:
        with_grad = [t for t in self.stepped if self.gradients.has(self.sources[id(t)][0])]
        self.placement.step(self.optimizer, with_grad, self._attach_grads)

    def _attach_grads(self, tensors: list[torch.Tensor]) -> None:
        """Give each stepped tensor its gradient (a row block the matching rows of its parameter's)."""
        for t in tensors:
            p, rows = self.sources[id(t)]
            t.grad = self.gradients.grad(p, rows)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.gradients.clear()
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def state_dict(self) -> dict:
        # The inner state is indexed by the tensors it steps: the block layout says what they were.
        return {"row_blocks": self._layout(), "optimizer_chunk_elements": self.max_elements,
                "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Load a state this layout can use; a plain torch state dict is one of whole tensors."""
        if "optimizer" not in state:  # saved before the row blocks
            state = {"row_blocks": [], "optimizer_chunk_elements": 0, "optimizer": state}
        if state["row_blocks"] != self._layout():
            raise ValueError(f"the optimizer state was saved with its tensors in other row blocks (--optimizer-chunk-"
                             f"elements {state['optimizer_chunk_elements']}); resume with that value, not {self.max_elements}")
        self.placement.load(self.optimizer, state["optimizer"])

    def release(self) -> None:
        """Drop every tensor that views the parameters' storage. With --bf16-inplace that storage is
        vLLM's, and the views must not keep it mapped once the bridge lets go of it."""
        self.gradients.remove()  # its hooks hold the parameters
        self.blocks, self.params, self.stepped, self.sources = [], [], [], {}
        self.optimizer.state.clear()
        self.optimizer.param_groups.clear()
        self.placement = StateOnDevice()  # and the host buffers with the old one
        self.gradients = GradientsOnDevice()

    def _layout(self) -> list[list[int]]:
        return [[index, rows] for index, rows, _ in self.blocks]


def _rows_per_block(p: torch.Tensor, max_elements: int) -> int:
    """Rows (of ``as_rows(p)``) per block for ``p`` (0: step it whole): a multiple of
    QUANT_BLOCK_VALUES values, at most ``max_elements`` unless one such block is bigger already."""
    if max_elements <= 0 or p.dim() < 2 or p.numel() <= max_elements:
        return 0
    row = p.shape[-1]
    step = QUANT_BLOCK_VALUES // math.gcd(row, QUANT_BLOCK_VALUES)  # rows that make whole scaling runs
    return max(step, (max_elements // row) // step * step)
