"""--share-group-prefix: the trainer's forward computes each group's common prompt once.

GRPO samples a group of completions from one prompt, and the padded batch repeats that prompt in
every row: at group size 16, a 59-token prompt and 128-token completions (the 8B head-to-head),
29% of the positions the forward and backward compute are copies of 4 prompts. Here each group
becomes one packed row, its shared prefix followed by every row's own tokens, and an attention
mask in which each row's tokens see the prefix and themselves (causally), never another row's:

    packed row:  [ prefix 0..S-1 | row a: S..n_a-1 | row b: S..n_b-1 | ... | padding ]
    positions:     0 .. S-1        S .. n_a-1        S .. n_b-1

Causal attention makes the prefix's hidden states the same in every row, so this computes what
the padded forward does (the same math on fewer positions; rounding differs as any change of
kernel shapes does). The decoder's output is gathered back to the padded (B, T) layout, so the
logprobs, the loss and everything after them are unchanged.

The price is attention over the whole packed row: the mask is dense (G, 1, L, L), and the
attention kernels compute every pair of it (sdpa also makes a float copy of the mask in each
layer, which the memory plan does not count: 35 MB a layer at the 8B head-to-head's shape, at most
MAX_MASK_ELEMENTS x 2 bytes). Packing is used only where the cost estimate (``packing_pays``) says
the positions saved outweigh that, so long completions stay padded. A model with a sliding window
is packed only while no row is longer than the window: the mask built here has no window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from example_trainer.memory_plan import ModelShape

# The attention implementations whose 4D masks this builds (transformers returns a 4D mask as it
# is given): sdpa takes booleans (True = attend), eager adds a float mask to its scores.
MASK_FORMATS = ("sdpa", "eager")
MAX_MASK_ELEMENTS = 2**25  # 32 MiB of booleans (the 8B head-to-head: 17.8 M): beyond it, padded rows


@dataclass
class PackedRows:
    """A micro-batch with each group's shared prefix once: the decoder's inputs and the way back."""

    inputs: dict[str, torch.Tensor]  # input_ids (G, L), attention_mask (G, 1, L, L), position_ids (G, L)
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


def packing_pays(padded_rows: int, padded_length: int, packed_lengths: list[int], layer: ModelShape) -> bool:
    """Whether the packed forward costs fewer FLOPs than the padded one, per layer: each position
    goes through the projections (q, k, v, o and the MLP's three: 2 FLOPs a weight), each pair of
    positions the attention kernel computes through QK^T and PV (4 x the query width). The kernels
    compute every pair of the dense (L, L) mask, padding included, as of the padded (T, T) rows."""
    h = layer.hidden
    query, key_value = layer.query or h, layer.key_value or h
    per_position = 2 * (2 * h * query + 2 * h * key_value + 3 * h * layer.intermediate)
    per_pair = 4 * query
    longest = max(packed_lengths)
    padded = padded_rows * padded_length * (per_position + padded_length * per_pair)
    packed = len(packed_lengths) * longest * (per_position + longest * per_pair)
    return packed < padded and len(packed_lengths) * longest * longest <= MAX_MASK_ELEMENTS


def pack_shared_prefixes(tokens: torch.Tensor, attention_mask: torch.Tensor, groups: torch.Tensor,
                         attn_implementation: str, dtype: torch.dtype, layer: ModelShape,
                         device: torch.device | str = "cpu") -> PackedRows | None:
    """The packed form of a right-padded micro-batch (``tokens``, ``attention_mask``: (B, T), on
    the CPU), each run of rows of one group (``groups``: (B,) ids) packed around its common prefix,
    its tensors on ``device``; None where it would not pay (``packing_pays``) or the model's
    attention takes no 4D mask."""
    if attn_implementation not in MASK_FORMATS:
        return None
    lengths = attention_mask.sum(1).tolist()
    rows = [tokens[b, :n].tolist() for b, n in enumerate(lengths)]
    packed: list[tuple[list[int], list[int], list[int]]] = []  # per packed row: tokens, positions, segment ids
    where: list[tuple[int, list[int]]] = []  # per padded row: its packed row, the packed position of each real token
    for run, (run_start, run_end) in enumerate(runs_of_equal(groups)):
        members = rows[run_start:run_end]
        shared = common_prefix_length(members)
        ids, positions, segments = members[0][:shared], list(range(shared)), [-1] * shared
        for segment, row in enumerate(members):
            own = len(row) - shared
            where.append((run, list(range(shared)) + list(range(len(ids), len(ids) + own))))
            ids += row[shared:]
            positions += range(shared, len(row))
            segments += [segment] * own
        packed.append((ids, positions, segments))
    packed_lengths = [len(p[0]) for p in packed]
    if not packing_pays(len(rows), tokens.shape[1], packed_lengths, layer):
        return None
    longest = max(packed_lengths)
    count = len(packed)
    input_ids = torch.zeros(count, longest, dtype=torch.long)
    position_ids = torch.zeros(count, longest, dtype=torch.long)
    segment_ids = torch.full((count, longest), -2, dtype=torch.long)  # -2 = padding, -1 = the shared prefix
    for g, (ids, positions, segments) in enumerate(packed):
        input_ids[g, :len(ids)] = torch.tensor(ids)
        position_ids[g, :len(ids)] = torch.tensor(positions)
        segment_ids[g, :len(ids)] = torch.tensor(segments)
    index = torch.zeros(tokens.shape, dtype=torch.long)
    for b, (packed_row, positions) in enumerate(where):
        index[b, :len(positions)] = packed_row * longest + torch.tensor(positions, dtype=torch.long)
        index[b, len(positions):] = packed_row * longest  # padding: a real position's output, masked later
    mask = attention_mask_4d(segment_ids.to(device), attn_implementation, dtype)
    saved = 1.0 - count * longest / (len(rows) * tokens.shape[1])
    return PackedRows({"input_ids": input_ids.to(device), "attention_mask": mask,
                       "position_ids": position_ids.to(device)}, index.to(device), saved)


def attention_mask_4d(segment_ids: torch.Tensor, attn_implementation: str, dtype: torch.dtype) -> torch.Tensor:
    """(G, 1, L, L) mask from each packed position's segment (-1 the shared prefix, -2 padding, else
    the row): a query sees earlier keys of the prefix and of its own row. A padding query sees only
    itself: a query that sees nothing makes softmax's NaN, which backward would spread."""
    length = segment_ids.shape[1]
    order = torch.arange(length, device=segment_ids.device)
    query, key = segment_ids[:, :, None], segment_ids[:, None, :]
    causal = order[None, :] <= order[:, None]
    allowed = causal & ((key == -1) | (key == query)) & (query != -2) & (key != -2)
    allowed |= torch.eye(length, dtype=torch.bool, device=segment_ids.device) & (query == -2)
    allowed = allowed[:, None]
    if attn_implementation == "sdpa":
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


def packing_applies(model: torch.nn.Module) -> str | None:
    """Why this model's rows are never packed (its attention takes no 4D mask), or None."""
    implementation = model.config._attn_implementation
    if implementation not in MASK_FORMATS:
        return f"its attention implementation is {implementation!r}; packed rows need one of {', '.join(MASK_FORMATS)}"
    return None


def pack_for_model(model: torch.nn.Module, tokens: torch.Tensor, attention_mask: torch.Tensor,
                   groups: torch.Tensor | None, device: torch.device) -> PackedRows | None:
    """``pack_shared_prefixes`` for ``model`` (CPU ``tokens`` and ``attention_mask``, the packed
    tensors on ``device``); None without group ids (nothing is known to be shared) or where a row
    is longer than the model's sliding window."""
    window = getattr(model.config, "sliding_window", None)  # Qwen2/3 set it to None where unused
    if groups is None or (window is not None and tokens.shape[1] > window):
        return None
    return pack_shared_prefixes(tokens, attention_mask, groups, model.config._attn_implementation,
                                next(model.parameters()).dtype, ModelShape.from_config(model.config), device)
