"""Time one optimizer step over a real model's tensors: torchao's own step against onecopy's
(example_trainer/optim/low_bit_adam.py), the same state, gradients and row blocks as the trainer's.

The weights are random bf16 tensors of the model's shapes (bench/shapes.py), stepped in place as
with ``--bf16-inplace``; gradients are random. Runs go A B B A ... with a fresh optimizer
each, after warm-up steps (the first compiles the update, and its time is in the table: dynamo's
cache is reset before each run, inductor's on-disk cache is not). Prints one markdown row per run
and a summary.

    python bench/optimizer_step.py --shape llama3.1-8b --optimizer adamw8bit --out runs/optimizer_step
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch

from bench.shapes import SHAPES
from example_trainer.optim.optimizers import OPTIMIZERS

VARIANTS = ("torchao", "onecopy")


def model_tensors(shape: str, device: str, layers: int | None) -> list[torch.Tensor]:
    """Random bf16 tensors with the shapes of ``shape``'s parameters (``layers`` layers if given)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    _, model_type, values = SHAPES[shape]
    if layers is not None:
        values = {**values, "num_hidden_layers": layers}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **values), dtype=torch.bfloat16)
    generator = torch.Generator(device).manual_seed(0)
    return [torch.nn.Parameter(torch.randn(p.shape, dtype=torch.bfloat16, device=device, generator=generator))
            for p in model.parameters()]


def build(variant: str, optimizer: str, params: list[torch.Tensor], chunk_elements: int):
    """The trainer's RowBlockOptimizer over ``params``, its inner optimizer torchao's class or onecopy's."""
    from example_trainer.optim import low_bit_adam
    from example_trainer.optim.optimizers import RowBlockOptimizer

    kind = low_bit_adam.BY_NAME[optimizer]
    if variant == "torchao":
        kind = low_bit_adam.torchao_class(kind)
    return RowBlockOptimizer(lambda tensors: kind(tensors, lr=1e-6, weight_decay=0.0, bf16_stochastic_round=True),
                             params, chunk_elements)


def time_steps(opt, params: list[torch.Tensor], warmup: int, steps: int, sync) -> tuple[list[float], list[float]]:
    """Seconds of each warm-up step (the first compiles) and of each timed step (gradients attached
    before each, outside the timing)."""
    seconds = []
    for i in range(warmup + steps):
        for p in params:
            p.grad = torch.randn_like(p).mul_(1e-3)
        sync()
        start = time.perf_counter()
        opt.step()
        sync()
        seconds.append(time.perf_counter() - start)
        opt.zero_grad()
    return seconds[:warmup], seconds[warmup:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama3.1-8b", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=None, help="this many layers instead of the model's")
    p.add_argument("--optimizer", default="adamw8bit", choices=OPTIMIZERS)
    p.add_argument("--optimizer-chunk-elements", type=int, default=2**26, help="as the trainer's flag")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--rounds", type=int, default=2, help="passes over the variants, every other one reversed "
                                                         "(A B B A for two variants)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5, help="timed steps per run")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="runs/optimizer_step")
    args = p.parse_args()
    for name in ("rounds", "warmup", "steps"):  # warm-up: the first step compiles, and is not timed with the rest
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")

    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    params = model_tensors(args.shape, args.device, args.layers)
    order = [v for r in range(args.rounds) for v in (args.variants if r % 2 == 0 else args.variants[::-1])]
    print(f"{args.shape}: {len(params)} tensors, {sum(t.numel() for t in params) / 1e9:.2f}B values, "
          f"{args.optimizer}, device {torch.cuda.get_device_name() if args.device.startswith('cuda') else args.device}")
    print("| run | variant | stepped tensors | first step s | median ms | min ms | max ms |\n"
          "|---|---|---|---|---|---|---|")
    rows = []
    for run, variant in enumerate(order, 1):
        # Both variants run one compiled function: without a reset only the first run would compile it
        # (inductor's on-disk cache still serves the later runs' compiles).
        torch._dynamo.reset()
        opt = build(variant, args.optimizer, params, args.optimizer_chunk_elements)
        warmup, seconds = time_steps(opt, params, args.warmup, args.steps, sync)
        rows.append({"run": run, "variant": variant, "stepped_tensors": len(opt.stepped), "seconds": seconds,
                     "warmup_seconds": warmup})
        ms = [s * 1e3 for s in seconds]
        first = f"{warmup[0]:.1f}" if warmup else ""
        print(f"| {run} | {variant} | {len(opt.stepped)} | {first} | {statistics.median(ms):.1f} | {min(ms):.1f} "
              f"| {max(ms):.1f} |", flush=True)
        opt.release()
        del opt
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    for variant in args.variants:
        all_ms = [s * 1e3 for r in rows if r["variant"] == variant for s in r["seconds"]]
        print(f"{variant}: median {statistics.median(all_ms):.1f} ms over {len(all_ms)} steps")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"optimizer_step_{args.shape}_{args.optimizer}.json").write_text(json.dumps({"args": vars(args), "rows": rows},
                                                                                       indent=1))


if __name__ == "__main__":
    main()
