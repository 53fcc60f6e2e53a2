"""Turn the API's groups into padded tensors for the loss."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from api.models import ScoredData
from example_trainer.model.routing_replay import SERVER_FLAG_HINT, decode_routes
from example_trainer.rl.advantages import batch_advantages

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
    truncated: torch.Tensor  # (B,) bool: left out of the loss by --mask-truncated-completions
    versions: torch.Tensor  # (B, T-1) long: weights version tokens[:, t+1] was sampled with; -1 = prompt or unknown
    scores: list[float]
    routes: torch.Tensor | None = None  # (B, T, layers, top_k) int16: --routing-replay, the experts vLLM routed each token to
    groups: torch.Tensor | None = None  # (B,) long: which of the batch's groups each row came from

    def split(self, parts: int) -> list["TrainBatch"]:
        """``parts`` micro-batches along B that together hold every row, in order; sizes differ by
        at most one (the loss is normalised by the whole batch's tokens, so unequal parts are exact).
        A batch of fewer rows than ``parts`` (the group filter serves one when it cannot fill
        --batch-size) leaves the last parts empty (0 rows)."""
        if parts < 1:
            raise ValueError(f"cannot split a batch into {parts} micro-batches: at least one")
        size, longer = divmod(self.tokens.shape[0], parts)  # the first ``longer`` parts hold one row more
        bounds = [i * size + min(i, longer) for i in range(parts + 1)]
        return [self.rows(start, end) for start, end in zip(bounds, bounds[1:])]

    def rows(self, start: int, end: int) -> "TrainBatch":
        """Rows ``start:end`` of every field."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return TrainBatch(**{name: None if value is None else value[start:end] for name, value in fields.items()})

    def untrained_row(self) -> "TrainBatch":
        """The first row with no completion token: its loss and gradient are exactly zero. A
        data-parallel rank left without rows by a short batch trains on it, so that it still
        gives every collective the same tensors as the ranks with rows (zero gradients, metrics
        of the same names)."""
        first = self.rows(0, 1)
        return dataclasses.replace(first, completion_mask=torch.zeros_like(first.completion_mask))


def is_truncated(tokens: list[int], end_tokens: set[int] | None) -> bool:
    """Whether --mask-truncated-completions leaves this sequence out of the loss: ``end_tokens`` are
    given and its last token is none of them."""
    return end_tokens is not None and tokens[-1] not in end_tokens


def build_batch(groups: list[ScoredData], seq_len: int, scale_rewards: str = "group",
                end_tokens: set[int] | None = None, routing_replay: bool = False) -> TrainBatch:
    """Pad sequences, mask prompts, and compute each group's advantages.

    ``groups`` come from ``TrajectoryClient.get_batch``, typed and shape-checked. A group's
    advantages come from its scores (``--scale-rewards``) or its ``advantages`` field when the
    environment sent them. ``end_tokens``: leave out of the loss every completion whose last token
    is not one of them (``--mask-truncated-completions``). ``routing_replay``: every group must
    carry ``routed_experts`` (``TrainBatch.routes``). Sequences longer than ``seq_len`` are an
    error: the API was told ``max_token_len`` at registration and should never serve one.
    """
    scored = [g for g in groups if not g.advantages]
    computed = dict(zip((id(g) for g in scored), batch_advantages(
        [torch.tensor(g.scores, dtype=torch.float32) for g in scored], scale_rewards))) if scored else {}
    rows: list[tuple[list[int], list[int], list[float] | None, list[float] | float]] = []
    row_versions: list[list[int] | None] = []
    scores: list[float] = []
    for g, group in enumerate(groups):
        given = group.advantages  # environments may send one advantage per token: used as sent
        per_sequence = None if given else computed[id(group)].tolist()
        scores.extend(float(s) for s in group.scores)
        logprobs = group.inference_logprobs
        for i, (tokens, mask) in enumerate(zip(group.tokens, group.masks)):
            if len(tokens) > seq_len:
                raise ValueError(f"group {g} sequence {i} has {len(tokens)} tokens > --seq-len {seq_len}")
            rows.append((tokens, mask, logprobs[i] if logprobs else None, given[i] if given else per_sequence[i]))
            row_versions.append(group.weight_versions[i] if group.weight_versions else None)
    has_old = torch.tensor([r[2] is not None for r in rows])
    if 0 < int(has_old.sum()) < len(rows):
        logger.warning("[trainer] %d of %d sequences came without inference logprobs: their ratio is 1 "
                       "(on-policy); the others use their rollout logprobs", len(rows) - int(has_old.sum()), len(rows))
    truncated = torch.tensor([is_truncated(r[0], end_tokens) for r in rows])
    longest = max(len(r[0]) for r in rows)
    B = len(rows)
    tokens = torch.zeros(B, longest, dtype=torch.long)
    attention = torch.zeros(B, longest, dtype=torch.long)
    completion = torch.zeros(B, longest - 1, dtype=torch.float32)
    old = torch.zeros(B, longest - 1, dtype=torch.float32)
    advantages = torch.zeros(B, longest - 1, dtype=torch.float32)
    versions = torch.full((B, longest - 1), -1, dtype=torch.long)
    for b, ((toks, mask, lps, adv), sampled_with) in enumerate(zip(rows, row_versions)):
        n = len(toks)
        tokens[b, :n] = torch.tensor(toks)
        attention[b, :n] = 1
        if not truncated[b]:
            completion[b, : n - 1] = (torch.tensor(mask[1:]) != IGNORE).float()
        if lps is not None:
            old[b, : n - 1] = torch.tensor(lps[1:], dtype=torch.float32)
        advantages[b, : n - 1] = torch.tensor(adv[1:], dtype=torch.float32) if isinstance(adv, list) else adv
        if sampled_with is not None:
            versions[b, : n - 1] = torch.tensor(sampled_with[1:], dtype=torch.long)
    routes = batch_routes(groups, longest) if routing_replay else None
    group_ids = torch.tensor([g for g, group in enumerate(groups) for _ in group.tokens], dtype=torch.long)
    return TrainBatch(tokens, attention, completion, old, advantages, has_old, truncated, versions, scores, routes,
                      group_ids)


def batch_routes(groups: list[ScoredData], longest: int) -> torch.Tensor:
    """(B, longest, layers, top_k) expert ids of every row (``routing_replay.decode_routes``); a
    row's last position and its padding route to experts 0..top_k-1."""
    missing = [g for g, group in enumerate(groups) if not group.routed_experts]
    if missing:
        raise ValueError(f"--routing-replay: group(s) {missing} of this batch came without routed_experts: {SERVER_FLAG_HINT}")
    rows = [decode_routes(r) for group in groups for r in group.routed_experts]  # (n - 1, layers, top_k) each
    shapes = {tuple(r.shape[1:]) for r in rows}
    if len(shapes) > 1:
        raise ValueError(f"--routing-replay: this batch's routes have several (layers, top_k) shapes {sorted(shapes)}: "
                         "its groups were sampled from different models")
    layers, top_k = shapes.pop()
    routes = torch.arange(top_k, dtype=torch.int16).expand(len(rows), longest, layers, top_k).clone()
    for b, row in enumerate(rows):
        routes[b, : row.shape[0]] = row
    return routes


def off_policy_metrics(batch: TrainBatch, current_version: int | None) -> dict[str, float]:
    """How many weight versions behind ``current_version`` the batch's completion tokens were
    sampled: mean and max over the tokens that carry a version, and their histogram (token count
    at 0, 1, 2 ... versions behind; none: nothing to report)."""
    known = (batch.versions >= 0) & (batch.completion_mask > 0)
    if current_version is None or not known.any():
        return {}
    # A restarted vLLM counts from 0 again: tokens of the one before are not "in the future".
    behind = (current_version - batch.versions[known]).clamp(min=0).float()
    return {"off_policy/mean": behind.mean().item(), "off_policy/max": behind.max().item(),
            "off_policy/tokens_by_lag": torch.bincount(behind.long()).tolist()}


def end_token_ids(tokenizer, model_path: str) -> set[int]:
    """The tokens a finished completion ends with: the tokenizer's end-of-sequence token and the
    model's generation config's (chat models often list their end-of-turn token there)."""
    from transformers import GenerationConfig

    ends = {tokenizer.eos_token_id} - {None}
    try:
        configured = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:  # no generation_config.json
        configured = None
    ends |= set(configured if isinstance(configured, list) else [configured]) - {None}
    if not ends:
        raise ValueError(f"--mask-truncated-completions: {model_path} names no end-of-sequence token, so a finished "
                         "completion cannot be told from a cut one")
    return ends


def refuse_truncated_sampling(groups: list[ScoredData]) -> None:
    """--vllm-importance-sampling-correction: refuse groups sampled from a truncated distribution.

    Both sides' logprobs are over the whole vocabulary (vLLM's raw logprobs, the trainer's full
    softmax), so their ratio measures the kernels' gap and nothing else. With top-p, top-k or min-p
    the tokens came from a renormalised part of the distribution, and each token's true weight is
    off by that part's mass, which neither side knows: no weight here would be right."""
    for g, group in enumerate(groups):
        params = group.generation_params or {}
        truncating = {name: params[name] for name, neutral in (("top_p", 1.0), ("top_k", 0), ("min_p", 0.0))
                      if params.get(name) not in (None, neutral, -1)}
        if truncating:
            raise ValueError(
                f"group {g} was sampled with {truncating}: the rollout correction compares vLLM's and the trainer's "
                "probabilities over the whole vocabulary, and truncated sampling breaks that (each token's weight "
                "would be off by the kept mass). Sample with --env.top_p 1 (no top-k / min-p), or train with "
                "--vllm-importance-sampling-correction false")
