"""Request and response bodies of the trajectory API.

Paths and field names follow Atropos's API (atroposlib/api/server.py) so that an Atropos
environment or trainer talks to this server unchanged. Every float must be finite: JSON has no
NaN or Infinity, and a stored NaN would make every later /batch response unserialisable.
"""

from __future__ import annotations

import base64
import binascii
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, ValidationInfo, field_validator


class _Body(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)


def first_non_finite(value: Any) -> str | None:
    """Path (like `['temperature']` or `[2][0]`) of the first NaN/inf float inside `value`, or None."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return path
        if isinstance(item, dict):
            stack.extend((f"{path}[{key!r}]", child) for key, child in reversed(item.items()))
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", child) for i, child in reversed(list(enumerate(item))))
    return None


class Registration(_Body):
    """POST /register: the trainer announces its batch shape. A new one replaces the old."""

    wandb_group: str = "onecopy"
    wandb_project: str = "onecopy"
    batch_size: int = Field(ge=1, description="Sequences per batch; /batch serves exactly this many.")
    max_token_len: int = Field(ge=1, description="Longest sequence (in tokens) the trainer accepts.")
    checkpoint_dir: str = ""
    save_checkpoint_interval: int = Field(default=-1, description="Steps between checkpoints; <= 0: never.")
    starting_step: int = Field(default=0, ge=0, description="Step the trainer resumes from.")
    num_steps: int = Field(ge=1, description="Total training steps, passed on to environments.")


class RegisterResponse(BaseModel):
    uuid: str


class RegisterEnv(_Body):
    """POST /register-env: an environment asks for an id once the trainer is registered."""

    max_token_length: int = Field(ge=1)
    desired_name: str | None = Field(default=None, description="Base of the wandb name; 'env' if unset.")
    weight: float = Field(default=1.0, description="Share of inference this environment should get.")
    group_size: int | None = Field(default=None, ge=1)
    min_batch_allocation: float | None = Field(default=None, ge=0.0, le=1.0)


class RegisterEnvResponse(BaseModel):
    """Either status='success' with every field, or status='wait for trainer to start' alone."""

    status: str
    env_id: int | None = None
    wandb_name: str | None = None
    checkpoint_dir: str | None = None
    starting_step: int | None = None
    checkpoint_interval: int | None = None
    num_steps: int | None = None


class EnvIdentifier(_Body):
    env_id: int


class EnvDropped(_Body):
    """POST /env-dropped: how many groups this environment dropped so far, by reason (e.g.
    ``dropped_equal_scores``). A trainer that waits for a batch reads the totals in GET /status."""

    env_id: int
    counts: dict[str, NonNegativeInt]


class StatusMessage(BaseModel):
    status: str


class Hello(BaseModel):
    message: str


class Info(BaseModel):
    batch_size: int = -1
    max_token_len: int = -1


class WandbInfo(BaseModel):
    group: str | None = None
    project: str | None = None


class Status(BaseModel):
    current_step: int
    queue_size: int


class TrainerStatus(Status):
    """GET /status; onecopy adds ``dropped``: the groups the environments dropped so far, by
    reason, summed over the environments (absent until one reports); ``queued_sequences``: the
    sequences (rows) in the queued groups, which need not be ``group_size`` each; and
    ``batch_ready``: whether GET /batch would serve a batch now (absent before a trainer registers).
    An environment bounds its lead in rows with the first and, with the second, never waits on a
    queue whose groups add up to no batch."""

    dropped: dict[str, int] | None = None
    queued_sequences: int | None = None
    batch_ready: bool | None = None


class EnvStatus(Status):
    """GET|POST /status-env: `queue_size` and `self_queue_size` count groups of this env's size."""

    self_queue_size: int
    max_group_size: int
    unallocated_fraction: float
    env_weight: float


ROUTE_DTYPES = {"uint8": 1, "uint16": 2}  # RoutedExperts.dtype -> bytes per expert id


class RoutedExperts(_Body):
    """The experts an MoE model routed each position of one sequence to when vLLM sampled it (a
    server started with --enable-return-routed-experts): `data` is base64 of a little-endian
    `dtype` array [positions, layers, top_k] in C order, one position per token but the last (the
    last sampled token is never fed forward). The trainer's --routing-replay computes with them."""

    layers: int = Field(ge=1)
    top_k: int = Field(ge=1)
    dtype: Literal["uint8", "uint16"]
    data: str

    @field_validator("data")
    @classmethod
    def _base64(cls, value: str) -> str:
        try:
            base64.b64decode(value, validate=True)
        except binascii.Error as err:
            raise ValueError(f"is not base64 ({err})") from None
        return value

    def positions(self) -> float:
        """How many positions `data` holds (a fraction when its length is no whole number of them)."""
        return len(base64.b64decode(self.data)) / (self.layers * self.top_k * ROUTE_DTYPES[self.dtype])


class ScoredData(_Body):
    """One group of sequences for the same prompt, scored by an environment.

    Required: `tokens`, `masks` (one entry per token; -100 marks prompt tokens) and `scores`,
    one per sequence. The per-sequence lists, when given and non-empty, hold one entry per
    sequence too. `distill_token_ids` / `distill_logprobs` are a teacher's top-k for on-policy
    distillation, shaped [sequence][position][top_k] and sent together. Every field of
    atroposlib 0.4.0's ScoredData is here, with its name and shape, so a group comes back from
    /batch as it was posted. Our additions, all optional: `group_uuid`, an idempotency key (a
    retried post with the same key is answered `{"status": "duplicate"}` and stored once),
    `weight_versions`, per sequence and token the weights version a single-copy vLLM sampled the
    token with (-1 at prompt positions), from which the trainer knows how stale each token is; and
    `routed_experts`, per sequence the experts vLLM routed each token to (MoE models; `RoutedExperts`).
    """

    tokens: list[list[NonNegativeInt]]
    masks: list[list[int]]
    scores: list[float]
    advantages: list[list[float]] | None = None
    ref_logprobs: list[list[float]] | None = None
    inference_logprobs: list[list[float]] | None = None
    messages: list[list[dict[str, Any]]] | None = None
    generation_params: dict[str, Any] | None = None
    overrides: list[dict[str, Any]] | None = None
    group_overrides: dict[str, Any] | None = None
    images: Any = None
    env_id: int | None = None
    distill_token_ids: list[list[list[NonNegativeInt]]] | None = None
    distill_logprobs: list[list[list[float]]] | None = None
    weight_versions: list[list[int]] | None = None
    routed_experts: list[RoutedExperts] | None = None
    group_uuid: str | None = Field(default=None, min_length=1, max_length=256)

    @field_validator("messages", "generation_params", "overrides", "group_overrides", "images")
    @classmethod
    def _only_finite_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        path = first_non_finite(value)
        if path is not None:
            raise ValueError(
                f"holds NaN or infinity at {info.field_name}{path}; send a finite number or null"
            )
        return value


class ScoredDataAck(BaseModel):
    """`status` is 'received' or, for a single group whose group_uuid was seen, 'duplicate'."""

    status: str
    groups_processed: int | None = None
    duplicates: int | None = None


class Batch(BaseModel):
    """GET /batch: groups adding up to exactly batch_size sequences, or null when too few wait.

    The trainer parses the answer with this model (example_trainer/data/api_client.py), so both sides
    of the boundary read one schema."""

    batch: list[ScoredData] | None
