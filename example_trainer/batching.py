"""Turn the API's groups into padded tensors for the loss."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from api.models import ScoredData
from example_trainer.loss import group_advantages

logger = logging.getLogger("onecopy.trainer.batch")

IGNORE = -100  # mask value of prompt tokens, as in Atropos


@dataclass
class TrainBatch:
    """One optimizer batch; T = longest sequence. Targets are shifted: column t is token t+1."""

    tokens: torch.Tensor  # (B, T) long, padded with 0
    attention_mask: torch.Tensor  # (B, T) 1 for real tokens
    completion_mask: torch.Tensor  # (B, T-1) 1 where tokens[:, t+1] is a completion token
    old_logprobs: torch.Tensor  # (B, T-1) rollout (inference) logprobs of tokens[:, t+1]
    advantages: torch.Tensor  # (B, T-1) advantage of tokens[:, t+1] (one per sequence unless sent per token)
    has_old_logprobs: torch.Tensor  # (B,) bool: the row came with inference logprobs
    scores: list[float]

    def split(self, parts: int) -> list["TrainBatch"]:
        """``parts`` micro-batches along B that together hold every row, in order; sizes differ by
        at most one (the loss is normalised by the whole batch's tokens, so unequal parts are exact)."""
        rows = self.tokens.shape[0]
        if not 1 <= parts <= rows:
            raise ValueError(f"cannot split {rows} rows into {parts} micro-batches: each needs at least one row")
        bounds = [round(i * rows / parts) for i in range(parts + 1)]
        return [self.rows(start, end) for start, end in zip(bounds, bounds[1:])]

    def rows(self, start: int, end: int) -> "TrainBatch":
        """Rows ``start:end`` of every field."""
        return TrainBatch(**{f.name: getattr(self, f.name)[start:end] for f in dataclasses.fields(self)})


def build_batch(groups: list[ScoredData], seq_len: int) -> TrainBatch:
    """Pad sequences, mask prompts, and compute group-normalised advantages per group.

    ``groups`` come from ``TrajectoryClient.get_batch``, typed and shape-checked. A group's
    advantages come from its own scores (or its ``advantages`` field when the environment sent
    them). Sequences longer than ``seq_len`` are an error: the API was told
    ``max_token_len`` at registration and should never serve one.
    """
    rows: list[tuple[list[int], list[int], list[float] | None, list[float] | float]] = []
    scores: list[float] = []
    for g, group in enumerate(groups):
        given = group.advantages
        # Environments may send one advantage per token (used as sent); else GRPO's per group.
        per_sequence = None if given else group_advantages(torch.tensor(group.scores, dtype=torch.float32)).tolist()
        scores.extend(float(s) for s in group.scores)
        logprobs = group.inference_logprobs
        for i, (tokens, mask) in enumerate(zip(group.tokens, group.masks)):
            if len(tokens) > seq_len:
                raise ValueError(f"group {g} sequence {i} has {len(tokens)} tokens > --seq-len {seq_len}")
            rows.append((tokens, mask, logprobs[i] if logprobs else None, given[i] if given else per_sequence[i]))
    has_old = torch.tensor([r[2] is not None for r in rows])
    if 0 < int(has_old.sum()) < len(rows):
        logger.warning("[trainer] %d of %d sequences came without inference logprobs: their ratio is 1 "
                       "(on-policy); the others use their rollout logprobs", len(rows) - int(has_old.sum()), len(rows))
    longest = max(len(r[0]) for r in rows)
    B = len(rows)
    tokens = torch.zeros(B, longest, dtype=torch.long)
    attention = torch.zeros(B, longest, dtype=torch.long)
    completion = torch.zeros(B, longest - 1, dtype=torch.float32)
    old = torch.zeros(B, longest - 1, dtype=torch.float32)
    advantages = torch.zeros(B, longest - 1, dtype=torch.float32)
    for b, (toks, mask, lps, adv) in enumerate(rows):
        n = len(toks)
        tokens[b, :n] = torch.tensor(toks)
        attention[b, :n] = 1
        completion[b, : n - 1] = (torch.tensor(mask[1:]) != IGNORE).float()
        if lps is not None:
            old[b, : n - 1] = torch.tensor(lps[1:], dtype=torch.float32)
        advantages[b, : n - 1] = torch.tensor(adv[1:], dtype=torch.float32) if isinstance(adv, list) else adv
    return TrainBatch(tokens, attention, completion, old, advantages, has_old, scores)
