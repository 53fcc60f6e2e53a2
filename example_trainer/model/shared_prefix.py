"""--share-group-prefix: the trainer's forward computes each group's common prompt once.

GRPO samples a group of completions from one prompt, and the padded batch repeats that prompt in
every row: at group size 16, a 59-token prompt and 128-token completions (the 8B head-to-head),
29% of the positions the forward and backward compute are copies of 4 prompts. Here each group
becomes one packed row, its shared prefix followed by every row's own tokens:

    packed row:  [ prefix 0..S-1 | row a: S..n_a-1 | row b: S..n_b-1 | ... | padding ]
    positions:     0 .. S-1        S .. n_a-1        S .. n_b-1

The projections and the MLP, nearly all of a layer's FLOPs, run on the packed rows. Attention runs
in the padded layout: each layer's queries, keys and values are gathered back into the padded
(B, T) rows, the model's own causal attention kernel runs on them, and each packed position takes
its output from one padded row (a prefix position from any row of its group: causal attention
makes them equal). So the attention costs what the padded forward's does plus the gathers, on
sdpa's causal (flash) kernel, instead of a dense (L, L) mask over the packed row, which at the 8B
shape costs 4.5x the padded attention (bench/packed_attention.py, docs/results.md). This computes
what the padded forward does (the same math on fewer positions; rounding differs as any change of
kernel shapes does). The decoder's output is gathered back to the padded layout, so the logprobs,
the loss and everything after them are unchanged.

The gathered attention is an attention function registered with transformers
(``AttentionInterface``) under ``onecopy_packed_<base>``: the model's own sdpa or eager attention,
around which it gathers and scatters when the decoder is called with the packing's indices, and
which it is unchanged without them. A layer with a sliding window (its ``sliding_window`` keyword,
which every family passes for FlashAttention's sake) gets a banded mask in the padded layout where a
row is longer than the window; a layer whose config has a window it does not pass raises there.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

# The attention implementations the gathered attention wraps (their causal forms are known here).
PACKABLE_ATTENTION = ("sdpa", "eager")
PACKED_PREFIX = "onecopy_packed_"  # the registered name: PACKED_PREFIX + the base implementation


@dataclass
class PackedRows:
    """A micro-batch with each group's shared prefix once: the decoder's inputs and the way back."""

    inputs: dict[str, torch.Tensor]  # input_ids, position_ids (G, L), a placeholder mask, the attention's indices
    index: torch.Tensor  # (B, T) flat position in the packed (G * L) of each padded (row, position)
    saved: float  # share of the padded batch's positions the packed forward does not compute

    def unpack(self, hidden: torch.Tensor) -> torch.Tensor:
        """(G, L, H) decoder output -> (B, T, H) in the padded layout (padding: some real position's,
        masked later as the padded forward's padding outputs are)."""
        return hidden.flatten(0, 1)[self.index]


def runs_of_equal(groups: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each run of consecutive rows with the same group id."""
    ids = groups.tolist()
    starts = [i for i in range(len(ids)) if i == 0 or ids[i] != ids[i - 1]]
    return list(zip(starts, starts[1:] + [len(ids)]))


def common_prefix_length(rows: list[list[int]]) -> int:
    """How many leading tokens all ``rows`` share."""
    shortest = min(len(r) for r in rows)
    for i in range(shortest):
        token = rows[0][i]
        if any(r[i] != token for r in rows):
            return i
    return shortest


# The gathers cost about what 3% of the padded positions' projections and MLP do (8B: 38 ms a step
# over the padded attention, bench/packed_attention.py, against 1.08 s of forward/backward).
MIN_SAVED = 0.05


def packing_pays(padded_rows: int, padded_length: int, packed_lengths: list[int]) -> bool:
    """Whether the packed rows hold at least MIN_SAVED fewer positions than the padded ones: the
    projections and the MLP cost per position, the attention is the padded forward's either way,
    and the gathers around it cost a few percent."""
    return len(packed_lengths) * max(packed_lengths) <= (1 - MIN_SAVED) * padded_rows * padded_length


def pack_shared_prefixes(tokens: torch.Tensor, attention_mask: torch.Tensor, groups: torch.Tensor,
                         device: torch.device | str = "cpu") -> PackedRows | None:
    """The packed form of a right-padded micro-batch (``tokens``, ``attention_mask``: (B, T), on
    the CPU), each run of rows of one group (``groups``: (B,) ids) packed around its common prefix,
    its tensors on ``device``; None where it would not pay (``packing_pays``)."""
    lengths = attention_mask.sum(1).tolist()
    rows = [tokens[b, :n].tolist() for b, n in enumerate(lengths)]
    packed: list[tuple[list[int], list[int]]] = []  # per packed row: tokens, positions
    where: list[tuple[int, list[int]]] = []  # per padded row: its packed row, the packed position of each real token
    for run, (run_start, run_end) in enumerate(runs_of_equal(groups)):
        members = rows[run_start:run_end]
        shared = common_prefix_length(members)
        ids, positions = members[0][:shared], list(range(shared))
        for row in members:
            where.append((run, list(range(shared)) + list(range(len(ids), len(ids) + len(row) - shared))))
            ids += row[shared:]
            positions += range(shared, len(row))
        packed.append((ids, positions))
    packed_lengths = [len(ids) for ids, _ in packed]
    if not packing_pays(len(rows), tokens.shape[1], packed_lengths):
        return None
    longest = max(packed_lengths)
    count = len(packed)
    input_ids = torch.zeros(count, longest, dtype=torch.long)
    position_ids = torch.zeros(count, longest, dtype=torch.long)
    for g, (ids, positions) in enumerate(packed):
        input_ids[g, :len(ids)] = torch.tensor(ids)
        position_ids[g, :len(ids)] = torch.tensor(positions)
    index = torch.zeros(tokens.shape, dtype=torch.long)
    # Each packed position's attention output comes from one padded (row, position): a prefix
    # position's from the last row of its group that holds it (all rows compute the same), padding's
    # from position 0.
    source = torch.zeros(count * longest, dtype=torch.long)
    width = tokens.shape[1]
    for b, (packed_row, positions) in enumerate(where):
        flat = packed_row * longest + torch.tensor(positions, dtype=torch.long)
        index[b, :len(positions)] = flat
        index[b, len(positions):] = packed_row * longest  # padding: a real position's output, masked later
        source[flat] = b * width + torch.arange(len(positions))
    saved = 1.0 - count * longest / (len(rows) * width)
    index = index.to(device)  # the attention's way to the padded rows is the decoder output's way back
    return PackedRows({"input_ids": input_ids.to(device), "attention_mask": placeholder_mask(count, device),
                       "position_ids": position_ids.to(device), "packed_gather": index,
                       "packed_scatter": source.to(device)}, index, saved)


def placeholder_mask(rows: int, device: torch.device | str) -> torch.Tensor:
    """The packed rows' attention mask: (G, 1, 1, 1), never read. transformers passes a 4D mask on as
    it is given, so it builds none of its own: from a 2D mask or none at all it would build a dense
    (G, 1, L, L) one for eager attention and sliding-window models (and read the positions' restarts
    as packed sequences), which the gathered attention would then throw away. A layer that gets it
    without the packing's indices raises (``gathered_attention``)."""
    return torch.ones(rows, 1, 1, 1, dtype=torch.bool, device=device)


def gathered_attention(base: str):
    """The attention function registered as ``PACKED_PREFIX + base``. Called by a decoder layer
    with the packing's indices (``packed_gather``, ``packed_scatter`` among its keyword arguments):
    (G, heads, L, D) packed queries, keys and values go to the padded (B, heads, T, D) rows, ``base``
    attends causally there, and each packed position takes its output back. Without them: ``base``
    as it is."""

    def attend(module, query, key, value, attention_mask, **kwargs):
        gather, scatter = kwargs.pop("packed_gather", None), kwargs.pop("packed_scatter", None)
        own = base_attention(module, base)
        if gather is None:
            if attention_mask is not None and attention_mask.shape[-2:] == (1, 1) and query.shape[2] > 1:
                # the packed rows' placeholder, their indices lost on the way: attending over the
                # packed row as it is would let each completion see its siblings
                raise RuntimeError(f"{type(module).__name__} got the packed rows without their indices (packed_gather, "
                                   "packed_scatter): this model's layers do not pass their keyword arguments on to "
                                   "the attention; run without --share-group-prefix")
            return own(module, query, key, value, attention_mask, **kwargs)
        rows, width = gather.shape
        configured = getattr(getattr(module, "config", None), "sliding_window", None)
        if "sliding_window" not in kwargs and configured is not None and width > configured:
            # a family that applies its window through the mask alone: the causal kernel here would
            # let each position see past it
            raise RuntimeError(f"{type(module).__name__} does not pass its sliding window to the attention, and the "
                               f"rows ({width}) are longer than the window: run without --share-group-prefix")
        padded = [x.transpose(1, 2).flatten(0, 1)[gather.flatten()].unflatten(0, (rows, width)).transpose(1, 2)
                  for x in (query, key, value)]
        mask = causal_mask(base, width, query, kwargs.get("sliding_window"))
        output, _ = own(module, *padded, mask, **kwargs)  # (B, T, heads, D)
        output = output.flatten(0, 1)[scatter]
        return output.unflatten(0, (query.shape[0], query.shape[2])), None

    return attend


EAGER_ATTENTION: dict[type, object] = {}  # attention module class -> its modeling file's eager_attention_forward


def base_attention(module: torch.nn.Module, base: str):
    """``base``'s attention function as ``module``'s family calls it: transformers' registered one,
    or for eager the function its modeling file defines (each family has its own; looked up by
    ``use_gathered_attention`` before any compiled layer runs, as an import inside one breaks its graph)."""
    if base == "eager":
        return EAGER_ATTENTION[type(module)]
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[base]


def causal_mask(base: str, width: int, like: torch.Tensor, window: int | None = None) -> torch.Tensor | None:
    """The causal mask ``base`` needs on (T, T) rows, within ``window`` (each position sees itself
    and the window - 1 before it, as transformers' sliding-window masks): none for sdpa without a
    window that cuts (its causal kernel), else a (1, 1, T, T) one, boolean for sdpa (True: attend),
    additive for eager."""
    cuts = window is not None and width > window
    if base == "sdpa" and not cuts:
        return None
    order = torch.arange(width, device=like.device)
    behind = order[:, None] - order[None, :]  # query position - key position
    blocked = (behind < 0) | (behind >= window) if cuts else behind < 0
    if base == "sdpa":
        return ~blocked[None, None]
    return torch.zeros(width, width, dtype=like.dtype, device=like.device).masked_fill(
        blocked, torch.finfo(like.dtype).min)[None, None]


def use_gathered_attention(model: torch.nn.Module) -> None:
    """Make ``model`` attend through ``gathered_attention`` around its own implementation (sdpa or
    eager): registered with transformers once per name, the model's config switched to it. Unchanged
    for calls without the packing's indices; a no-op when already switched."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    base = model.config._attn_implementation
    if base.startswith(PACKED_PREFIX):
        return
    for module in model.modules():
        own = getattr(importlib.import_module(type(module).__module__), "eager_attention_forward", None)
        if own is not None:
            EAGER_ATTENTION[type(module)] = own
    name = PACKED_PREFIX + base
    AttentionInterface.register(name, gathered_attention(base))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])  # the padded forward's masks
    model.config._attn_implementation = name


def packing_applies(model: torch.nn.Module) -> str | None:
    """Why this model's rows are never packed (an attention the gathered attention does not wrap), or None."""
    implementation = model.config._attn_implementation.removeprefix(PACKED_PREFIX)
    if implementation not in PACKABLE_ATTENTION:
        return (f"its attention implementation is {implementation!r}; packed rows need one of "
                f"{', '.join(PACKABLE_ATTENTION)}")
    return None


def pack_for_model(model: torch.nn.Module, tokens: torch.Tensor, attention_mask: torch.Tensor,
                   groups: torch.Tensor | None, device: torch.device) -> PackedRows | None:
    """``pack_shared_prefixes`` for ``model`` (CPU ``tokens`` and ``attention_mask``, the packed
    tensors on ``device``), the model switched to the gathered attention the packed rows need
    (``use_gathered_attention``); None without group ids (nothing is known to be shared) or for an
    attention it does not wrap."""
    if groups is None or packing_applies(model):
        return None
    packed = pack_shared_prefixes(tokens, attention_mask, groups, device)
    if packed is not None:
        use_gathered_attention(model)
    return packed
