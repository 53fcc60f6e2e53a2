"""The GRPO family of losses as small pure functions on tensors, tested against hand-computed values.

One loss = importance weights (token or sequence level, GSPO) → a surrogate per token (PPO's
clipped one, or CISPO's) → times the rollout correction's weights (vLLM's and the trainer's
logprobs differ, even on one copy of the weights) → plus the KL penalty → a reduction to one
number (``--loss-type``: whose tokens or sequences it averages over). Names, defaults and formulas
as TRL's ``GRPOConfig`` where the concept is the same (docs/losses.md has the table).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

from vllm_patching.cpu_matmul import linear


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Log-probability of each next token: (B, T, V) logits, (B, T) tokens -> (B, T-1).

    Position t of the result is log p(tokens[t+1] | tokens[:t+1]), taken before any temperature,
    which is what vLLM returns with ``--logprobs-mode raw_logprobs`` (its default).
    """
    logits = logits[:, :-1].float()  # (B, T-1, V)
    targets = tokens[:, 1:].unsqueeze(-1)  # (B, T-1, 1)
    return torch.gather(logits.log_softmax(-1), -1, targets).squeeze(-1)


def chunked_token_logprobs(hidden: torch.Tensor, head_weight: torch.Tensor, tokens: torch.Tensor,
                           chunk_tokens: int) -> torch.Tensor:
    """``token_logprobs(hidden @ head_weight.T, tokens)`` without ever holding the (B, T, V) logits.

    ``hidden`` (B, T, H) is the decoder's output (after its final norm), ``head_weight`` (V, H) the
    output projection. Positions go through in chunks of ``chunk_tokens``; each chunk's logits
    exist only inside its own call and are recomputed in backward (activation checkpointing), so
    the logits' peak is chunk_tokens x V in fp32 whatever the batch and sequence length.
    """
    batch, length, width = hidden.shape
    flat_hidden = hidden[:, :-1].reshape(-1, width)  # ((B*(T-1)), H)
    targets = tokens[:, 1:].reshape(-1)
    pieces = [
        checkpoint(_chunk_logprobs, flat_hidden[i:i + chunk_tokens], head_weight, targets[i:i + chunk_tokens],
                   use_reentrant=False)
        for i in range(0, flat_hidden.shape[0], chunk_tokens)
    ]
    return torch.cat(pieces).view(batch, length - 1)


def _chunk_logprobs(hidden: torch.Tensor, head_weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = linear(hidden, head_weight).float()  # what lm_head computes, then fp32
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)


IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
ROLLOUT_CORRECTION_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def importance_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """exp of the log ratio per token (B, T), or of its mean over each sequence's completion tokens
    (B, 1): GSPO's sequence-level ratio, one weight for every token of the sequence."""
    if level == "token":
        return torch.exp(log_ratio)
    if level == "sequence":
        return torch.exp((log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0))
    raise ValueError(f"importance sampling level {level!r} is unknown; valid: {', '.join(IMPORTANCE_SAMPLING_LEVELS)}")


def clipped_surrogate(coef: torch.Tensor, advantages: torch.Tensor, logprobs: torch.Tensor, epsilon: float,
                      epsilon_high: float) -> torch.Tensor:
    """PPO's clipped objective per token, negated: -min(r A, clip(r, 1 - eps, 1 + eps_high) A).
    ``epsilon_high`` > ``epsilon`` is DAPO's clip-higher. (``logprobs`` unused: r carries the gradient.)"""
    return -torch.minimum(coef * advantages, torch.clamp(coef, 1.0 - epsilon, 1.0 + epsilon_high) * advantages)


def cispo_surrogate(coef: torch.Tensor, advantages: torch.Tensor, logprobs: torch.Tensor, epsilon: float,
                    epsilon_high: float) -> torch.Tensor:
    """CISPO per token, negated: -sg(min(r, eps_high)) A log p. The weight is capped and detached,
    so every token keeps a gradient (PPO's clip zeroes the clipped ones). TRL's meaning of
    ``epsilon_high`` here: the cap on r itself, not 1 + eps."""
    return -torch.clamp(coef, max=epsilon_high).detach() * advantages * logprobs


@dataclass(frozen=True)
class BatchShape:
    """What a reduction needs of the whole optimizer batch, however it is split into micro-batches
    and data-parallel ranks (each part's loss is its share: the parts' gradients sum to the batch's)."""

    tokens: float  # completion tokens in the whole batch
    sequences: int  # rows in the whole batch
    parts: int  # micro-batches over all ranks
    max_completion_length: int  # dr_grpo's constant


class BatchMetrics:
    """The whole batch's ``train/*`` and ``sampling/*`` metrics from its micro-batches', however it
    was split over micro-batches and data-parallel ranks: per-token means weighted by each part's
    completion tokens and summed over the ranks, ``*/min`` and ``*/max`` taken over the parts and
    ranks, the loss summed (each part's loss is already its share of the batch's)."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {"train/loss": 0.0}
        self.extremes: dict[str, float] = {}

    def add(self, loss: float, token_means: dict[str, float], tokens: float) -> None:
        """One micro-batch: its loss, its per-token means (and extremes) over its ``tokens``."""
        self.sums["train/loss"] += loss
        for name, value in token_means.items():
            if name.endswith(("/min", "/max")):
                pick = min if name.endswith("/min") else max
                self.extremes[name] = pick(self.extremes.get(name, value), value)
            else:
                self.sums[name] = self.sums.get(name, 0.0) + value * tokens

    def over_ranks(self, parallel, tokens: float) -> dict[str, float]:
        """The batch's metrics, ``tokens`` its completion tokens; ``parallel`` sums and compares
        over the ranks (a collective: every rank calls it)."""
        totals = parallel.sum_over_ranks(self.sums)
        metrics = {name: total / tokens for name, total in totals.items()}
        metrics["train/loss"] = totals["train/loss"]
        metrics["train/completion_tokens"] = tokens
        # no part had a token with vLLM's logprobs: no extremes to report
        metrics.update({k: v for k, v in parallel.extremes_over_ranks(self.extremes).items() if math.isfinite(v)})
        return metrics


def _by_batch_tokens(per_token: torch.Tensor, mask: torch.Tensor, batch: BatchShape) -> torch.Tensor:
    return (per_token * mask).sum() / batch.tokens


def _by_sequence_means(per_token: torch.Tensor, mask: torch.Tensor, batch: BatchShape) -> torch.Tensor:
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / batch.sequences


def _by_part_tokens(per_token: torch.Tensor, mask: torch.Tensor, batch: BatchShape) -> torch.Tensor:
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0) / batch.parts


def _by_constant(per_token: torch.Tensor, mask: torch.Tensor, batch: BatchShape) -> torch.Tensor:
    return (per_token * mask).sum() / (batch.sequences * batch.max_completion_length)


@dataclass(frozen=True)
class LossType:
    """One ``--loss-type``: its per-token surrogate and how the batch is averaged."""

    surrogate: Callable[..., torch.Tensor]
    reduce: Callable[[torch.Tensor, torch.Tensor, BatchShape], torch.Tensor]
    about: str


LOSS_TYPES: dict[str, LossType] = {
    "grpo": LossType(clipped_surrogate, _by_sequence_means,
                     "each sequence's token mean, averaged over sequences (GRPO paper; long answers weigh less per token)"),
    "dapo": LossType(clipped_surrogate, _by_batch_tokens,
                     "sum over the batch's completion tokens / their number (DAPO; TRL's default)"),
    "bnpo": LossType(clipped_surrogate, _by_part_tokens,
                     "token mean of each micro-batch, averaged over micro-batches"),
    "dr_grpo": LossType(clipped_surrogate, _by_constant,
                        "sum / (sequences x --max-completion-length): no length bias (Dr. GRPO; pair with --scale-rewards none)"),
    "cispo": LossType(cispo_surrogate, _by_batch_tokens,
                      "capped, detached weight x A x log p, over the batch's tokens (MiniMax-M1's CISPO)"),
}


def rollout_correction(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                       mode: str, clip_min: float | None, clip_max: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ratios): importance weights for the gap between the trainer's and vLLM's
    logprobs of the sampled tokens, and the ratios before truncation (for the metrics).

    ratio = exp(trainer - rollout) per token (token_*) or exp of its sum over the completion
    (sequence_*, (B, 1)). *_truncate clamps it to [clip_min, clip_max]; *_mask sets the weight to 0
    outside that range (a bound of None is no bound). TRL's four modes."""
    if mode not in ROLLOUT_CORRECTION_MODES:
        raise ValueError(f"rollout correction mode {mode!r} is unknown; valid: {', '.join(ROLLOUT_CORRECTION_MODES)}")
    diff = (trainer_logprobs - rollout_logprobs) * mask
    ratio = torch.exp(diff.sum(-1, keepdim=True) if mode.startswith("sequence") else diff)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    if mode.endswith("truncate"):
        return ratio.clamp(min=low, max=high), ratio
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0), ratio


def masked_share(weights: torch.Tensor, mask: torch.Tensor) -> float:
    """The share of completion tokens whose correction weight is 0 (a *_mask mode dropped them):
    how much of the batch the correction kept from the gradient. ``weights`` (B, T) or (B, 1)."""
    tokens = mask.bool()
    if not tokens.any():
        return 0.0
    return (weights.expand_as(mask)[tokens] == 0).float().mean().item()


def rollout_gap_metrics(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                        ratios: torch.Tensor) -> dict[str, float]:
    """How far vLLM's logprobs of the sampled tokens are from the trainer's, before any truncation:
    |difference| per completion token (mean, max) and the correction's ratios (min, token-weighted
    mean, max; per sequence in the sequence_* modes). A part with no token gives neutral values
    (0 means, inf extremes) so that every part and rank reports the same names."""
    tokens = mask.bool()
    if not tokens.any():
        return {"sampling/logp_difference/mean": 0.0, "sampling/logp_difference/max": -math.inf,
                "sampling/importance_ratio/min": math.inf, "sampling/importance_ratio/mean": 0.0,
                "sampling/importance_ratio/max": -math.inf}
    gap = (trainer_logprobs - rollout_logprobs).abs()[tokens]
    rows = tokens.any(-1)
    seen = ratios[rows] if ratios.shape[-1] == 1 else ratios[tokens]
    weights = mask.sum(-1, keepdim=True).expand_as(ratios)[rows] if ratios.shape[-1] == 1 else torch.ones_like(seen)
    return {
        "sampling/logp_difference/mean": gap.mean().item(),
        "sampling/logp_difference/max": gap.max().item(),
        "sampling/importance_ratio/min": seen.min().item(),
        "sampling/importance_ratio/mean": ((seen * weights).sum() / weights.sum()).item(),
        "sampling/importance_ratio/max": seen.max().item(),
    }


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """KL to the reference per token, k3 estimator exp(ref - lp) - (ref - lp) - 1 (always >= 0)."""
    delta = ref_logprobs - logprobs
    return torch.exp(delta) - delta - 1.0


@dataclass(frozen=True)
class PolicyLoss:
    """The loss settings of one run (``TrainerConfig`` fields of the same names)."""

    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    epsilon: float = 0.2
    epsilon_high: float | None = None  # None: = epsilon
    beta: float = 0.0

    @classmethod
    def from_config(cls, cfg) -> "PolicyLoss":
        return cls(cfg.loss_type, cfg.importance_sampling_level, cfg.epsilon, cfg.epsilon_high, cfg.beta)

    def __call__(self, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                 mask: torch.Tensor, batch: BatchShape, rollout_weights: torch.Tensor | None = None,
                 ref_logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """(this part's loss, per-token-mean metrics). Shapes: logprobs, old_logprobs, mask,
        ref_logprobs (B, T); advantages (B,) or (B, T); rollout_weights (B, T) or (B, 1)."""
        kind = LOSS_TYPES[self.loss_type]
        mask = mask.to(logprobs.dtype)
        adv = advantages.to(logprobs.dtype)
        adv = adv.unsqueeze(-1) if adv.dim() == 1 else adv
        epsilon_high = self.epsilon if self.epsilon_high is None else self.epsilon_high
        coef = importance_weights(logprobs - old_logprobs, mask, self.importance_sampling_level)
        per_token = kind.surrogate(coef, adv, logprobs, self.epsilon, epsilon_high)
        if rollout_weights is not None:
            per_token = per_token * rollout_weights
        kl = torch.zeros_like(per_token)
        if ref_logprobs is not None and self.beta > 0.0:
            kl = k3_kl(logprobs, ref_logprobs)
            per_token = per_token + self.beta * kl
        loss = kind.reduce(per_token, mask, batch)
        with torch.no_grad():
            n = mask.sum().clamp(min=1.0)
            coef_tokens = coef.expand_as(mask)
            if self.loss_type == "cispo":
                clipped = (coef_tokens > epsilon_high) & (adv > 0)
            else:  # the tokens the clip takes the gradient from (TRL's clip_ratio): out of the range on A's side
                clipped = (((coef_tokens > 1.0 + epsilon_high) & (adv > 0))
                           | ((coef_tokens < 1.0 - self.epsilon) & (adv < 0)))
            metrics = {
                "train/ratio_mean": ((coef_tokens * mask).sum() / n).item(),
                "train/clip_fraction": ((clipped.to(mask.dtype) * mask).sum() / n).item(),
                "train/kl": ((kl * mask).sum() / n).item(),
            }
        return loss, metrics
