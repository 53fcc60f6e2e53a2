"""A batch source that trains only on groups worth training on, refilling the batch from further fetches.

Two rules, each on when its flag asks for it:

- **signal** (``--dynamic-sampling``, DAPO's dynamic sampling): a group whose completions all scored
  the same has zero advantage everywhere (as has one whose environment sent advantages, all zero
  on completion tokens). It costs a forward and backward and moves nothing (and under per-token
  averaging shrinks every other group's step). So does a group whose completions with a non-zero
  advantage are all truncated, under ``--mask-truncated-completions``. Counted in
  ``train/groups_dropped``.
- **staleness** (``--max-off-policy-steps N``): a token sampled more than N weight versions before
  the weights vLLM serves now (single copy: the versions travel with each token,
  vllm_patching.token_versions) is too far off-policy. Judged per token, not per group: such a token
  is masked (it stays in the row as context, as a prompt token is), counted in
  ``off_policy/masked_tokens``, and only a group left with no token to train is dropped, counted in
  ``off_policy/dropped``. A multi-turn episode's versions grow along its row: its first turns may be
  past the bound while its last ones are fresh, and dropping the group for its oldest token threw the
  fresh turns away with it (docs/losses.md, "Staleness", says why masking and not pacing).

The staleness rule runs first, so the signal rule judges the tokens that are left. Kept groups
beyond the batch wait for the next step (checked again then: they age, and more of their tokens
may be masked). The trainer is never starved: after ``max_batches`` fetches for one step it gets
what it has (a smaller batch, logged), and only when nothing at all was kept does the run stop,
with the cause.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

from api.models import ScoredData
from environments.schemas import PROMPT_VERSION  # weight_versions at prompt positions
from example_trainer.data.batching import IGNORE, is_truncated
from example_trainer.rl.advantages import centred

logger = logging.getLogger("onecopy.trainer.group_filters")


@dataclass(frozen=True)
class Rule:
    """Keep a group when ``keeps(group)``; count the others under ``metric``. ``trim``, when set, runs
    first: it returns the group with the positions that must not train masked, and how many it
    masked (counted under ``trimmed_metric`` for the groups kept)."""

    metric: str
    keeps: Callable[[ScoredData], bool]
    why: str  # for the error when nothing is kept
    trim: Callable[[ScoredData], tuple[ScoredData, int]] | None = None
    trimmed_metric: str = ""


def has_signal(group: ScoredData, end_tokens: set[int] | None = None) -> bool:
    """True when the group can teach something: a completion the loss trains on has a non-zero
    advantage. The loss trains on every completion, or with ``end_tokens``
    (``--mask-truncated-completions``) on those whose last token is one of them. The advantage is
    the environment's (one per token: those of completion tokens count, as the loss sees them), or
    the score minus the group's mean (``example_trainer.rl.advantages``)."""
    # A row with no position left to train (every sampled token masked as too old) carries no signal either.
    trained = [i for i, (tokens, mask) in enumerate(zip(group.tokens, group.masks))
               if not is_truncated(tokens, end_tokens) and row_trains(mask)]
    if group.advantages:
        # Token 0 is no target; float32, as build_batch reads them (a 1e-50 is no signal there).
        return any(bool(torch.tensor(group.advantages[i][1:], dtype=torch.float32)[
            torch.tensor(group.masks[i][1:]) != IGNORE].any()) for i in trained)
    # The advantages' own arithmetic (float32): a float64 mean of [0.1] * 3 is not 0.1, theirs is.
    # Their scaling (--scale-rewards) zeroes nothing more.
    return bool(centred(torch.tensor(group.scores))[trained].any())


def mask_stale_tokens(group: ScoredData, now: int | None, max_steps: int) -> tuple[ScoredData, int]:
    """``group`` with every trained token sampled more than ``max_steps`` weight versions before
    ``now`` masked (kept in its row as context), and how many were. A group without versions, or a
    trainer that counts none (``now`` None), comes back as it is."""
    if now is None or not group.weight_versions:
        return group, 0
    masks, masked = [], 0
    for mask, versions in zip(group.masks, group.weight_versions):
        # A version of -1 (PROMPT_VERSION) at a trained position is unknown, not old: it stays.
        stale = [m != IGNORE and v != PROMPT_VERSION and now - v > max_steps for m, v in zip(mask, versions)]
        masked += sum(stale)
        masks.append([IGNORE if old else m for m, old in zip(mask, stale)])
    return (group.model_copy(update={"masks": masks}) if masked else group), masked


def row_trains(mask: list[int]) -> bool:
    """True when the row has a position the loss trains (token 0 is no target)."""
    return any(m != IGNORE for m in mask[1:])


def has_trained_tokens(group: ScoredData) -> bool:
    """True when some row of ``group`` has a position the loss trains."""
    return any(row_trains(mask) for mask in group.masks)


def signal_rule(end_tokens: set[int] | None = None) -> Rule:
    """Keep groups with a signal (``has_signal``); ``end_tokens``: those of --mask-truncated-completions."""
    why = ("no group whose scores differ (or whose sent advantages are not all zero): every completion of every "
           "prompt scored the same. The task is too easy or too hard for the model now; change it, or train "
           "without --dynamic-sampling")
    if end_tokens is not None:
        why += (", or every completion whose score differed was truncated and so masked "
                "(--mask-truncated-completions): raise the environment's completion length")
    return Rule("train/groups_dropped", lambda group: has_signal(group, end_tokens), why)


def staleness_rule(current_version: Callable[[], int | None], max_steps: int) -> Rule:
    """Mask every token more than ``max_steps`` versions behind ``current_version()``
    (``mask_stale_tokens``); keep the groups left with a token to train (groups without versions,
    or a trainer that counts none, pass as they are)."""
    return Rule("off_policy/dropped", has_trained_tokens,
                f"every token of every group was more than {max_steps} weight versions old "
                "(--max-off-policy-steps): the environments fall behind the trainer; run them with a smaller "
                "--env.max_batches_offpolicy or raise the bound",
                trim=lambda group: mask_stale_tokens(group, current_version(), max_steps),
                trimmed_metric="off_policy/masked_tokens")


class FilteredBatches:
    """Wraps a batch source (``example_trainer.data.rollouts.BatchSource``) and serves only groups every rule keeps."""

    def __init__(self, source, batch_size: int, max_batches: int, rules: list[Rule]) -> None:
        self.source, self.batch_size, self.max_batches, self.rules = source, batch_size, max_batches, rules
        self.waiting: list[ScoredData] = []  # kept groups beyond the last batch
        self.dropped = {rule.metric: 0 for rule in rules}
        self.trimmed = {rule.trimmed_metric: 0 for rule in rules if rule.trim is not None}
        self.fetched = 0
        self.settled_scores: list[float] = []  # of the groups this step dropped or trained on

    def register(self, *args, **kwargs) -> dict:
        return self.source.register(*args, **kwargs)

    def count_step(self) -> None:
        self.source.count_step()

    def get_batch(self, timeout: float, while_waiting: Callable[[], None] = lambda: None,
                  count_step: bool = True) -> list[ScoredData]:
        """``batch_size`` sequences of whole kept groups (fewer only after ``max_batches`` fetches),
        counted as one step at the source once they are taken (unless ``count_step`` is false)."""
        self.dropped = {rule.metric: 0 for rule in self.rules}
        self.trimmed = {rule.trimmed_metric: 0 for rule in self.rules if rule.trim is not None}
        self.fetched = 0
        self.settled_scores = []
        self.waiting = self._kept(self.waiting)
        while self._sequences() < self.batch_size and self.fetched < self.max_batches:
            # A step may take several fetches, or none (kept groups waiting): the step is counted once,
            # below, so the API's step (which environments stop at) stays the trainer's.
            self.waiting += self._kept(self.source.get_batch(timeout, while_waiting=while_waiting,
                                                             count_step=False))
            self.fetched += 1
        if not self.waiting:
            whys = "; ".join(rule.why for rule in self.rules if self.dropped[rule.metric])
            raise RuntimeError(f"{self.fetched} batches in a row left nothing to train on ({self.dropped}): {whys}")
        batch, taken = [], 0
        while self.waiting and taken + len(self.waiting[0].scores) <= self.batch_size:
            group = self.waiting.pop(0)
            batch.append(group)
            taken += len(group.scores)
        if not batch:  # a group larger than the batch: the API never serves one, but say so rather than loop
            raise RuntimeError(f"a group of {len(self.waiting[0].scores)} sequences does not fit --batch-size "
                               f"{self.batch_size}")
        self.settled_scores += [score for group in batch for score in group.scores]
        if count_step:
            self.source.count_step()
        if taken < self.batch_size:
            logger.warning("[trainer] %d batches fetched, only %d of %d sequences kept (%s); training on them "
                           "(--max-batches-per-step %d)", self.fetched, taken, self.batch_size,
                           self.dropped, self.max_batches)
        return batch

    def _kept(self, groups: list[ScoredData]) -> list[ScoredData]:
        kept = []
        for group in groups:
            trimmed = {}
            for rule in self.rules:
                if rule.trim is not None:
                    group, trimmed[rule.trimmed_metric] = rule.trim(group)
                if not rule.keeps(group):
                    self.dropped[rule.metric] += 1
                    self.settled_scores += group.scores
                    break
            else:
                kept.append(group)
                for metric, count in trimmed.items():
                    self.trimmed[metric] += count
        return kept

    def _sequences(self) -> int:
        return sum(len(g.scores) for g in self.waiting)

    def step_metrics(self) -> dict[str, float]:
        """The last batch's drops and fetches, and ``train/reward_mean``: the mean score of every
        group received, dropped ones too (each counted once: in the step that trained or dropped it;
        one still waiting counts later). The kept ones' mean alone reads 0.5 on a solved task
        under --dynamic-sampling, its flat groups of 1s all dropped."""
        reward = {"train/reward_mean": statistics.fmean(self.settled_scores)} if self.settled_scores else {}
        return {**self.dropped, **self.trimmed, "train/batches_fetched": self.fetched, **reward}
