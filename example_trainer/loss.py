"""The GRPO loss: plain functions on tensors, tested against hand-computed values."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def group_advantages(scores: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(score - mean) / (std + eps) within one group of completions of the same prompt.

    Uses the population std (divide by G), so a group of two with scores 0 and 1 gets -1 and +1.
    A group whose scores are all equal gets zeros: it carries no learning signal.
    """
    scores = scores.to(torch.float32)
    return (scores - scores.mean()) / (scores.std(unbiased=False) + eps)


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
    logits = torch.nn.functional.linear(hidden, head_weight).float()  # what lm_head computes, then fp32
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    num_tokens: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped-ratio GRPO loss, summed over completion tokens and divided by their number.

    Shapes: logprobs, old_logprobs, mask, ref_logprobs (B, T); advantages (B,) or per token (B, T).
    Per token: -min(r * A, clip(r, 1 - eps, 1 + eps) * A) with r = exp(logprobs - old_logprobs),
    the same rule for both signs of A. ``num_tokens`` is the normaliser: pass the completion-token
    count of the whole optimizer batch when the batch is split into micro-batches.
    KL to a frozen reference uses the k3 estimator exp(ref - lp) - (ref - lp) - 1 (always >= 0).
    """
    mask = mask.to(logprobs.dtype)
    if num_tokens is None:
        num_tokens = mask.sum().clamp(min=1.0).item()
    adv = advantages.to(logprobs.dtype)
    adv = adv.unsqueeze(-1) if adv.dim() == 1 else adv  # (B, 1) or (B, T)
    ratio = torch.exp(logprobs - old_logprobs)  # (B, T)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    per_token = -torch.minimum(unclipped, clipped)  # (B, T)
    kl = torch.zeros_like(per_token)
    if ref_logprobs is not None and kl_coef > 0.0:
        delta = ref_logprobs - logprobs
        kl = torch.exp(delta) - delta - 1.0
        per_token = per_token + kl_coef * kl
    loss = (per_token * mask).sum() / num_tokens
    with torch.no_grad():
        n = mask.sum().clamp(min=1.0)
        was_clipped = ((ratio - 1.0).abs() > clip_eps).to(mask.dtype)
        metrics = {
            "train/ratio_mean": ((ratio * mask).sum() / n).item(),
            "train/clip_fraction": ((was_clipped * mask).sum() / n).item(),
            "train/kl": ((kl * mask).sum() / n).item(),
        }
    return loss, metrics
