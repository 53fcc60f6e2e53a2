"""Rewards → advantages: each group's scores minus the group's mean, scaled by ``--scale-rewards``."""

from __future__ import annotations

import torch

SCALE_REWARDS = ("group", "batch", "none")


def centred(scores: torch.Tensor) -> torch.Tensor:
    """Each score minus its group's mean, in float32; exactly zero for a group whose scores are all
    equal. Their float32 mean can miss them by a rounding step (nine scores of 0.9: 6e-8), which the
    std scaling then turned into an advantage of -0.056 for every completion of a group with no signal."""
    scores = scores.to(torch.float32)
    if bool((scores == scores[0]).all()):
        return torch.zeros_like(scores)
    return scores - scores.mean()


def group_advantages(scores: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(score - mean) / (std + eps) within one group of completions of the same prompt.

    Uses the population std (divide by G), so a group of two with scores 0 and 1 gets -1 and +1.
    A group whose scores are all equal gets zeros: it carries no learning signal.
    """
    scores = scores.to(torch.float32)
    return centred(scores) / (scores.std(unbiased=False) + eps)


def batch_advantages(groups: list[torch.Tensor], scale: str, eps: float = 1e-6) -> list[torch.Tensor]:
    """One advantage per completion of each group: score minus its group's mean, divided by

    - ``group``: the group's std (GRPO; today's default),
    - ``batch``: the std of every score in the batch (more robust when groups are small),
    - ``none``: nothing (Dr. GRPO: the std scaling over-weights groups that are almost all right or all wrong).

    Population std everywhere (TRL takes the sample std, so its ``group`` advantages are smaller
    by sqrt((G-1)/G))."""
    if scale == "group":
        return [group_advantages(scores, eps) for scores in groups]
    differences = [centred(scores) for scores in groups]
    if scale == "none":
        return differences
    if scale == "batch":
        std = torch.cat([scores.to(torch.float32) for scores in groups]).std(unbiased=False)
        return [c / (std + eps) for c in differences]
    raise ValueError(f"--scale-rewards {scale!r} is unknown; valid: {', '.join(SCALE_REWARDS)}")
