"""Typed bodies the environment sends and receives: the scored group posted to the trajectory API
(Atropos's ScoredDataGroup fields, plus `group_uuid`), the inference server's /generate answer
and its /v1/models list.

These are the environment's own models: `environments/` is first on the data path and imports
nothing from `api/`; the API validates the same JSON with its models.
"""

from __future__ import annotations

import uuid
from typing import Any, Optional

from pydantic import BaseModel, Field, model_validator

PROMPT_MASK = -100  # mask value at prompt positions (the trainer ignores these tokens)
PROMPT_LOGPROB = 1.0  # inference_logprobs value at prompt positions (Atropos convention)
PROMPT_VERSION = -1  # weight_versions value at prompt positions (sampled by no weights)


class RoutedExperts(BaseModel):
    """The experts an MoE model routed each position of one sequence to, as vLLM sampled it (a
    server started with --enable-return-routed-experts): base64 of a little-endian `dtype` array
    [positions, layers, top_k], one row per token but the last. Passed on to the API as it came."""

    layers: int
    top_k: int
    dtype: str
    data: str


class ScoredDataGroup(BaseModel):
    """One group: `group_size` completions of one prompt, with their scores.

    Row i: `tokens[i]` = prompt + completion ids; `masks[i]` = -100 at prompt positions and the
    token id at completion positions; `inference_logprobs[i]` = 1.0 at prompt positions and vLLM's
    logprob of each generated token; `weight_versions[i]` (single-copy vLLM only) = -1 at prompt
    positions and the weights version each generated token was sampled with; `routed_experts[i]`
    (MoE models, routing replay) the experts vLLM routed each token of row i to. `group_uuid` is
    the API's idempotency key: a re-post after a timeout carries the same one and is answered
    `{"status": "duplicate"}`.
    """

    tokens: list[list[int]]
    masks: list[list[int]]
    scores: list[float]
    inference_logprobs: Optional[list[list[float]]] = None
    messages: Optional[list[list[dict[str, Any]]]] = None
    advantages: Optional[list[list[float]]] = None
    ref_logprobs: Optional[list[list[float]]] = None
    overrides: Optional[list[dict[str, Any]]] = None
    group_overrides: Optional[dict[str, Any]] = None
    images: Optional[Any] = None
    generation_params: Optional[dict[str, Any]] = None
    env_id: Optional[int] = None
    weight_versions: Optional[list[list[int]]] = None
    routed_experts: Optional[list[RoutedExperts]] = None
    group_uuid: str = Field(default_factory=lambda: str(uuid.uuid4()))

    @model_validator(mode="after")
    def _rows_align(self) -> "ScoredDataGroup":
        n = len(self.tokens)
        if n == 0:
            raise ValueError("a group needs at least one sequence")
        if len(self.masks) != n or len(self.scores) != n:
            raise ValueError(
                f"tokens/masks/scores must have one row per sequence: "
                f"{n}/{len(self.masks)}/{len(self.scores)}"
            )
        for name in ("masks", "inference_logprobs", "advantages", "ref_logprobs", "weight_versions"):
            rows = getattr(self, name)
            if rows is None:
                continue
            if len(rows) != n:
                raise ValueError(f"{name} has {len(rows)} rows, tokens has {n}")
            for i, (row, toks) in enumerate(zip(rows, self.tokens, strict=True)):
                if len(row) != len(toks):
                    raise ValueError(f"{name}[{i}] has {len(row)} entries, tokens[{i}] has {len(toks)}")
        if self.routed_experts is not None and len(self.routed_experts) != n:
            raise ValueError(f"routed_experts has {len(self.routed_experts)} rows, tokens has {n}")
        return self


class Choice(BaseModel):
    """One sampled completion from POST /generate."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Optional[str] = None  # "stop" | "length"; "abort" means: generate again
    text: Optional[str] = None
    weight_versions: Optional[list[int]] = None  # single-copy vLLM: the weights version of each token
    routed_experts: Optional[RoutedExperts] = None  # MoE, --enable-return-routed-experts: prompt + completion

    @model_validator(mode="after")
    def _one_logprob_per_token(self) -> "Choice":
        if len(self.logprobs) != len(self.token_ids):
            raise ValueError(
                f"/generate returned {len(self.token_ids)} tokens but {len(self.logprobs)} logprobs"
            )
        return self


class GenerateResponse(BaseModel):
    """The answer of POST /generate: the prompt ids it used and n choices."""

    prompt_token_ids: list[int]
    choices: list[Choice]


class ServedModel(BaseModel):
    """One entry of the inference server's GET /v1/models (vLLM's ModelCard, the fields we read).

    A base model has no `parent`, and `root` is the path vLLM loaded it from; a LoRA adapter has
    `parent` = the name of its base model, and `root` = the adapter's folder.
    """

    id: str
    root: Optional[str] = None
    parent: Optional[str] = None


class ServedModels(BaseModel):
    """The answer of GET /v1/models."""

    data: list[ServedModel]
