"""The training rows of one multi-turn episode, and a group made of several episodes' rows.

An episode alternates sampled turns with context the model did not sample (the first prompt,
tool results, environment messages). `EpisodeLedger` keeps the row being built:

    position kind   tokens    masks      inference_logprobs   weight_versions
    context         the id    -100       1.0                  -1
    sampled         the id    the id     vLLM's logprob       vLLM's version (when it sends them)

and, when vLLM returns them (MoE, routing replay), the experts each position was routed to, each
taken from the call that sampled its turn (routes.RowRoutes).

Each turn's prompt is the row so far (`prompt_ids`); `check_echo` compares it with the prompt
ids the server says it used. Context is appended with `add_context` when the caller already has
the bridging ids, or with `continue_with(history_ids)` when it re-rendered the whole history:
if that history does not start with the row (a template that strips earlier thinking, an
environment that compacts its history), the row is closed and a new one starts from the history,
all of it context. A sampled token therefore lands in exactly one row, as a trained position;
in later rows it is context. A closed row ends at its last sampled token (trailing context
trains nothing, and the trainer's --mask-truncated-completions reads a row's last token).

The rows of one episode share its score. `episodes_group` builds the ScoredDataGroup of a
group of episodes: when every episode is one row, it is an ordinary GRPO group (scores only; the
trainer takes score - mean over rows = over episodes); an episode scored None is left out. When
an episode has several rows, a score-only group would weigh that episode once per row in the
group's mean and std, so the group also carries per-token `advantages` computed over episodes,
which the trainer uses as sent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from environments.multiturn.routes import RowRoutes
from environments.schemas import PROMPT_LOGPROB, PROMPT_MASK, PROMPT_VERSION, RoutedExperts, ScoredDataGroup

ADVANTAGE_SCALES = ("group", "none")


class PromptMismatch(RuntimeError):
    """The server generated from other prompt ids than the row so far: the row would not be what
    vLLM sampled from, and training on it would be wrong."""


@dataclass
class Row:
    """One training row: parallel lists, one entry per token (see the module docstring)."""

    tokens: list[int] = field(default_factory=list)
    masks: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: Optional[list[int]] = field(default_factory=list)  # None once a turn came without versions
    routes: Optional[RowRoutes] = field(default_factory=RowRoutes)  # None once a turn came without routes

    @property
    def sampled(self) -> int:
        """How many positions are trained (sampled by the model)."""
        return sum(m != PROMPT_MASK for m in self.masks)

    def trimmed(self) -> "Row":
        """This row up to and including its last sampled token."""
        end = max((i + 1 for i, m in enumerate(self.masks) if m != PROMPT_MASK), default=0)
        versions = None if self.versions is None else self.versions[:end]
        return Row(self.tokens[:end], self.masks[:end], self.logprobs[:end], versions, self.routes)

    def routed_experts(self) -> Optional[RoutedExperts]:
        """The row's routes as the API takes them (one position per token but the last); None when
        a turn came without them."""
        return None if self.routes is None else self.routes.wire(len(self.tokens))


def _context_row(ids: list[int]) -> Row:
    ids = [int(i) for i in ids]
    return Row(ids, [PROMPT_MASK] * len(ids), [PROMPT_LOGPROB] * len(ids), [PROMPT_VERSION] * len(ids))


class EpisodeLedger:
    """The rows of one episode, built turn by turn (see the module docstring).

    Per turn: send `prompt_ids`, `check_echo` the server's prompt ids, `add_sampled` the choice,
    then `add_context` (bridging ids) or `continue_with` (a re-rendered history). `finish()`
    returns the rows, each with at least one sampled token.
    """

    def __init__(self, prompt_ids: list[int]):
        if not prompt_ids:
            raise ValueError("an episode needs a non-empty first prompt")
        self._closed: list[Row] = []
        self._row = _context_row(prompt_ids)
        self.restarts = 0  # rows closed because a history did not extend them

    @property
    def prompt_ids(self) -> list[int]:
        """The row so far: the prompt to send for the next turn."""
        return list(self._row.tokens)

    def check_echo(self, echoed: Optional[list[int]]) -> None:
        """Raise PromptMismatch unless the server's echoed prompt ids equal the row so far."""
        if echoed is None or list(echoed) == self._row.tokens:
            return
        sent = self._row.tokens
        at = next((i for i, (a, b) in enumerate(zip(sent, echoed)) if a != b), min(len(sent), len(echoed)))
        raise PromptMismatch(
            f"the server generated from other prompt ids than the row so far: sent {len(sent)} ids, it "
            f"echoed {len(echoed)}, first difference at position {at} (sent {sent[at:at + 5]}, echoed "
            f"{list(echoed[at:at + 5])}). The server must take prompt_token_ids as they are (no "
            "re-tokenisation, no added BOS)."
        )

    def add_sampled(self, token_ids: list[int], logprobs: list[float], versions: Optional[list[int]] = None,
                    routes: Optional[RoutedExperts] = None) -> None:
        """Append one turn's sampled ids with vLLM's logprobs (and weights versions and routes, if
        sent: `routes` are the call's, its prompt (the row so far) included)."""
        if len(logprobs) != len(token_ids) or (versions is not None and len(versions) != len(token_ids)):
            raise ValueError(f"{len(token_ids)} sampled ids need as many logprobs ({len(logprobs)}) and versions "
                             f"({None if versions is None else len(versions)})")
        row = self._row
        if routes is None:
            row.routes = None
        elif row.routes is not None:
            row.routes.add_call(routes, len(row.tokens) + len(token_ids))
        row.tokens += [int(i) for i in token_ids]
        row.masks += [int(i) for i in token_ids]
        row.logprobs += [float(x) for x in logprobs]
        row.versions = None if versions is None or row.versions is None else row.versions + [int(v) for v in versions]

    def add_context(self, token_ids: list[int]) -> None:
        """Append ids the model did not sample (a tool result, an environment message, a generation
        prompt): masked, logprob 1.0, version -1."""
        extra = _context_row(token_ids)
        row = self._row
        row.tokens += extra.tokens
        row.masks += extra.masks
        row.logprobs += extra.logprobs
        if row.versions is not None:
            row.versions += extra.versions

    def continue_with(self, history_ids: list[int]) -> bool:
        """Make `history_ids` (a whole re-rendered history) the next prompt. True if it extends the
        row (its new ids become context); False if not: the row is closed and a new one starts with
        `history_ids`, all context."""
        history_ids = [int(i) for i in history_ids]
        n = len(self._row.tokens)
        if history_ids[:n] == self._row.tokens:
            self.add_context(history_ids[n:])
            return True
        self._close()
        self._row = _context_row(history_ids)
        self.restarts += 1
        return False

    def _close(self) -> None:
        if self._row.sampled:
            self._closed.append(self._row.trimmed())

    def finish(self) -> list[Row]:
        """Close the current row; the episode's rows in order, each with a sampled token."""
        self._close()
        self._row = Row()  # a finished ledger holds nothing more
        rows, self._closed = self._closed, []
        return rows


@dataclass
class Episode:
    """A played episode: its rows, its score, and the chat messages (for logs and the API)."""

    rows: list[Row]
    score: Optional[float]  # None: no reward applies; the episode leaves the group (and its baseline)
    messages: Optional[list[dict[str, Any]]] = None
    info: dict[str, Any] = field(default_factory=dict)  # turns, tool calls, why it ended


def episode_advantages(scores: list[float], scale: str = "group", eps: float = 1e-6) -> list[float]:
    """One advantage per episode: its score minus the mean over episodes, divided by their
    population std (``group``, GRPO) or by nothing (``none``); all zero when the scores are equal.
    The trainer's own arithmetic for one group (example_trainer/rl/advantages.py), over episodes."""
    if scale not in ADVANTAGE_SCALES:
        raise ValueError(f"advantage scale {scale!r} is unknown; valid: {', '.join(ADVANTAGE_SCALES)}")
    if all(s == scores[0] for s in scores):
        return [0.0] * len(scores)
    mean = sum(scores) / len(scores)
    centred = [s - mean for s in scores]
    if scale == "none":
        return centred
    std = math.sqrt(sum(c * c for c in centred) / len(centred))
    return [c / (std + eps) for c in centred]


def episodes_group(episodes: list[Episode], scale: str = "group",
                   generation_params: Optional[dict[str, Any]] = None) -> Optional[ScoredDataGroup]:
    """The ScoredDataGroup of a group of episodes (one row per ledger row), or None if no episode
    has a row and a score. Every row carries its episode's score; when some episode has several
    rows, every row also carries per-token `advantages` over episodes (`episode_advantages`, `scale`).

    An episode scored None (no reward applies to it, e.g. every TRL reward function returned None)
    is left out: it neither trains nor moves the baseline, where counting it as 0 would shift every
    other episode's advantage."""
    played = [e for e in episodes if e.rows and e.score is not None]
    if not played:
        return None
    rows = [(e, row) for e in played for row in e.rows]
    advantages = None
    if any(len(e.rows) > 1 for e in played):
        per_episode = dict(zip(map(id, played), episode_advantages([e.score for e in played], scale)))
        advantages = [[per_episode[id(e)]] * len(row.tokens) for e, row in rows]
    versions = [row.versions for _, row in rows]
    routes = [row.routed_experts() for _, row in rows]
    return ScoredDataGroup(
        tokens=[row.tokens for _, row in rows],
        masks=[row.masks for _, row in rows],
        scores=[float(e.score) for e, _ in rows],
        inference_logprobs=[row.logprobs for _, row in rows],
        advantages=advantages,
        messages=[e.messages for e, _ in rows] if all(e.messages for e in played) else None,
        weight_versions=versions if all(v is not None for v in versions) else None,
        routed_experts=routes if all(r is not None for r in routes) else None,
        generation_params=generation_params,
    )
