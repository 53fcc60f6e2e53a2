"""What attention costs the trainer on --share-group-prefix's packed rows, by kernel.

The packed rows (example_trainer/model/shared_prefix.py) hold a group's prompt once, then each of its
completions; a dense (L, L) mask lets each completion see the prompt and itself. sdpa computes every
pair of that mask, though at the 8B head-to-head's shape (59-token prompts, 16 completions of 128)
only about 6% are allowed. This times one layer's attention forward and backward (queries, keys and
values in, their gradients out) on the shapes of one training step, four ways:

  padded      the padded rows, causal (sdpa's flash kernel): what the trainer runs without packing
  sdpa-mask   the packed rows with their boolean mask (sdpa): what --share-group-prefix ran first
  flex        the packed rows through torch's FlexAttention with a block mask: blocks that the mask
              leaves empty are skipped
  gathered    the packed rows' queries, keys and values gathered into the padded rows, transformers'
              causal sdpa there, the outputs taken back (example_trainer/model/shared_prefix.py's
              ``gathered_attention``): what --share-group-prefix runs now

and prints a table: milliseconds per layer, and per step at the model's layer count with gradient
checkpointing (each layer's forward twice, its backward once).

    python bench/packed_attention.py                  # Llama-3.1-8B's attention shape, on CUDA
    python bench/packed_attention.py --tiny --device cpu   # a small shape, to check the script
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from example_trainer.model.shared_prefix import gathered_attention, pack_shared_prefixes  # noqa: E402


@dataclass
class Shape:
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    layers: int = 32
    groups: int = 4  # groups in one step's batch
    group_size: int = 16
    prompt: int = 59
    completion: int = 128


TINY = Shape(heads=4, kv_heads=2, head_dim=16, layers=2, groups=2, group_size=4, prompt=5, completion=8)


def segments(shape: Shape) -> torch.Tensor:
    """(L,) segment id per packed position: -1 for the prompt, then each completion's index."""
    return torch.tensor([-1] * shape.prompt + [i for i in range(shape.group_size) for _ in range(shape.completion)])


def packed_mask(shape: Shape, device) -> torch.Tensor:
    """(L, L) boolean: position q sees kv when kv is not after it and is the prompt or q's own completion."""
    seg = segments(shape).to(device)
    pos = torch.arange(len(seg), device=device)
    return (pos[None, :] <= pos[:, None]) & ((seg[None, :] == -1) | (seg[None, :] == seg[:, None]))


def qkv(rows: int, length: int, shape: Shape, device, dtype):
    make = lambda heads: torch.randn(rows, heads, length, shape.head_dim, device=device, dtype=dtype,  # noqa: E731
                                     requires_grad=True)
    return make(shape.heads), make(shape.kv_heads), make(shape.kv_heads)


def expand(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped-query keys/values repeated to every query head, as transformers' sdpa path does."""
    return kv.repeat_interleave(heads // kv.shape[1], dim=1)


def timed(fn, device, warmup: int, repeats: int) -> float:
    """Median milliseconds of ``fn`` (forward and backward) over ``repeats`` calls after ``warmup``."""
    times = []
    for i in range(warmup + repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            elapsed = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            fn()
            elapsed = (time.perf_counter() - t0) * 1000
        if i >= warmup:
            times.append(elapsed)
    return sorted(times)[len(times) // 2]


def forward_backward(attend, q, k, v):
    def run():
        out = attend(q, k, v)
        out.backward(torch.ones_like(out))
        q.grad = k.grad = v.grad = None
    return run


def gathered(shape: Shape, device):
    """The trainer's gathered attention on one step's packed rows, its indices from the packing of a
    batch of that shape (``groups`` groups of ``group_size`` rows, each a shared prompt and its own
    completion)."""
    width = shape.prompt + shape.completion
    rows = shape.groups * shape.group_size
    tokens = torch.randint(5, 1000, (rows, width))
    for g in range(shape.groups):  # each group's rows start with one prompt
        tokens[g * shape.group_size:(g + 1) * shape.group_size, :shape.prompt] = torch.randint(5, 1000, (shape.prompt,))
    groups = torch.arange(shape.groups).repeat_interleave(shape.group_size)
    packed = pack_shared_prefixes(tokens, torch.ones_like(tokens), groups, device)
    attend = gathered_attention("sdpa")
    module = torch.nn.Module()  # what transformers' sdpa reads of an attention layer
    module.is_causal, module.num_key_value_groups = True, shape.heads // shape.kv_heads
    indices = {key: packed.inputs[key] for key in ("packed_gather", "packed_scatter")}
    return lambda q, k, v: attend(module, q, k, v, None, scaling=shape.head_dim ** -0.5, dropout=0.0, **indices)[0]


def variants(shape: Shape, mask: torch.Tensor, device, dtype):
    """name -> forward-and-backward callable of each variant on one step's shapes (``mask``: the
    packed rows' (L, L) ``packed_mask``); the flex block mask; and a function that gives each packed
    variant's largest difference from the masked sdpa output."""
    length = shape.prompt + shape.group_size * shape.completion
    out = {}
    q, k, v = qkv(shape.groups * shape.group_size, shape.prompt + shape.completion, shape, device, dtype)
    out["padded"] = forward_backward(lambda q, k, v: F.scaled_dot_product_attention(
        q, expand(k, shape.heads), expand(v, shape.heads), is_causal=True), q, k, v)
    q, k, v = qkv(shape.groups, length, shape, device, dtype)
    out["sdpa-mask"] = forward_backward(lambda q, k, v: F.scaled_dot_product_attention(
        q, expand(k, shape.heads), expand(v, shape.heads), attn_mask=mask[None, None]), q, k, v)
    attend_gathered = gathered(shape, device)
    out["gathered"] = forward_backward(attend_gathered, q, k, v)
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    seg = segments(shape).to(device)

    def allowed(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & ((seg[kv_idx] == -1) | (seg[kv_idx] == seg[q_idx]))

    block_mask = create_block_mask(allowed, None, None, length, length, device=device.type)
    compiled = torch.compile(flex_attention, dynamic=False)
    flex = lambda q, k, v: compiled(q, k, v, block_mask=block_mask, enable_gqa=True)  # noqa: E731
    out["flex"] = forward_backward(flex, q, k, v)

    def difference() -> dict[str, float]:
        """Largest difference of the flex and the gathered outputs from the masked sdpa one, on the same
        packed rows (the gathered one is (G, L, heads, D), as transformers' attention functions return)."""
        with torch.no_grad():
            q_, k_, v_ = q.detach(), k.detach(), v.detach()
            reference = F.scaled_dot_product_attention(q_, expand(k_, shape.heads), expand(v_, shape.heads),
                                                       attn_mask=mask[None, None])
            result = {"gathered": (attend_gathered(q_, k_, v_).transpose(1, 2) - reference).abs().max().item()}
            try:
                result["flex"] = (flex(q_, k_, v_) - reference).abs().max().item()
            except Exception as err:  # FlexAttention has no CPU backward, and some versions no CPU forward
                result["flex"] = f"{type(err).__name__}"
            return result
    return out, block_mask, difference


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a small shape, to check the script on a CPU")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json", help="also write the results here")
    a = p.parse_args(argv)
    shape = TINY if a.tiny else Shape()
    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    mask = packed_mask(shape, device)
    runs, block_mask, difference = variants(shape, mask, device, dtype)
    diff = difference()
    rows = []
    for name, fn in runs.items():
        try:
            ms = timed(fn, device, a.warmup, a.repeats)
            rows.append({"variant": name, "ms_per_layer": ms, "ms_per_step": ms * shape.layers * 4 / 3})
        except Exception as err:  # one kernel's failure leaves the others' numbers
            rows.append({"variant": name, "error": f"{type(err).__name__}: {err}"[:300]})
    allowed_share = mask.float().mean().item()
    print(f"shape: {asdict(shape)}; packed row {mask.shape[0]} positions, {allowed_share:.1%} of its pairs "
          f"allowed; flex block mask: {block_mask.sparsity():.1f}% of blocks skipped; device "
          f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}; "
          f"largest difference from sdpa-mask: {diff}")
    print("| variant | ms per layer (forward + backward) | ms per step (x layers, checkpointing) |\n|---|---|---|")
    for row in rows:
        if "error" in row:
            print(f"| {row['variant']} | {row['error']} | |")
        else:
            print(f"| {row['variant']} | {row['ms_per_layer']:.3f} | {row['ms_per_step']:.1f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"shape": asdict(shape), "allowed_share": allowed_share, "differences": diff, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
