"""vLLM's own OpenAI-compatible server, plus the routes onecopy needs.

    python -m example_trainer.vllm_api_server --model PATH [--port 9001] [any vLLM serve flag]

Adds to vLLM's app (so the official ``openai`` client keeps working):
  POST /generate          token ids (or text) in; completion token ids, per-token logprobs out
  GET  /bridge/info       what the single-copy exporter wrote (mode shared_vllm)
  POST /bridge/weights_updated   what the trainer says after each in-place weight write (the write
                          itself goes through the worker's weights gate, vllm_patching.gate, not HTTP):
                          later requests get a new prefix-cache salt
  POST /bridge/pause      stop scheduling (in-flight requests are kept, not aborted); starts the
                          prefix-cache reset in the background. For people and scripts: the
                          trainer does not use it (under load it waits on this busy process)
  POST /bridge/resume     wait for that reset, then schedule again
  GET  /bridge/is_paused
  POST /lora/load, POST /lora/unload, GET /lora/status   hot-swapped LoRA adapters (example_trainer/lora_routes.py);
                          a /generate without ``model`` is served by the current adapter
vLLM's own ``/health`` and ``/v1/*`` routes are unchanged. With ``VLLM_ENABLE_SHARED_WEIGHTS=1``
the worker class is swapped for onecopy's (``vllm_patching.worker``), which exports every
parameter after load. Flags are vLLM's; only the defaults of ``--host`` (127.0.0.1) and
``--port`` (9001) differ.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
import uuid
from typing import Literal

from fastapi import APIRouter, HTTPException, Request
from pydantic import BaseModel, Field, model_validator

from example_trainer.lora_routes import resolve_lora
from example_trainer.lora_routes import router as lora_router

logger = logging.getLogger("vllm.onecopy.server")  # under "vllm" to use its log handler

DEFAULT_PORT = 9001
GRACEFUL_SHUTDOWN_SECONDS = 3


class GenerateRequest(BaseModel):
    """Body of ``POST /generate``: one prompt, ``n`` sampled completions."""

    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    n: int = Field(1, ge=1, le=1024)
    max_tokens: int = Field(256, ge=0)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    stop: list[str] | None = None
    seed: int | None = None
    prompt_logprobs: bool = False
    model: str | None = Field(None, description="LoRA adapter (or the base model) to serve this request with; "
                              "none = the current adapter set by POST /lora/load, else the base model")

    @model_validator(mode="after")
    def _one_prompt(self) -> "GenerateRequest":
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise ValueError("give exactly one of 'prompt' or 'prompt_token_ids'")
        if self.prompt_token_ids is not None and not self.prompt_token_ids:
            raise ValueError("'prompt_token_ids' is empty")
        return self


class Choice(BaseModel):
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    text: str


class GenerateResponse(BaseModel):
    prompt_token_ids: list[int]
    choices: list[Choice]
    prompt_logprobs: list[float | None] | None = None


router = APIRouter()


def _engine(request: Request):
    return request.app.state.engine_client


@router.post("/generate", response_model=GenerateResponse)
async def generate(body: GenerateRequest, request: Request) -> GenerateResponse:
    """Sample ``n`` completions; logprobs are vLLM's raw ones (before temperature)."""
    from vllm import SamplingParams
    from vllm.inputs import TextPrompt, TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(
        n=body.n,
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        stop=body.stop,
        seed=body.seed,
        logprobs=0,  # 0 = only the sampled token's logprob
        prompt_logprobs=0 if body.prompt_logprobs else None,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    # After the weights changed in place, no prompt may reuse KV blocks computed with older ones.
    version = getattr(request.app.state, "onecopy_weights_version", 0)
    salt = {"cache_salt": f"onecopy-weights-{version}"} if version else {}
    if body.prompt_token_ids:
        prompt = TokensPrompt(prompt_token_ids=body.prompt_token_ids, **salt)
    else:
        prompt = TextPrompt(prompt=body.prompt, **salt)
    lora = await resolve_lora(request, body.model)
    final = None
    try:
        async for output in _engine(request).generate(prompt, params, f"gen-{uuid.uuid4().hex}", lora_request=lora):
            final = output
    except ValueError as err:  # vLLM's input validation, e.g. prompt longer than max_model_len
        raise HTTPException(status_code=400, detail=str(err)) from err
    if final is None:
        raise HTTPException(status_code=503, detail="generation was aborted (server pausing or shutting down)")
    choices = [
        Choice(
            token_ids=list(c.token_ids),
            logprobs=[step[token].logprob for token, step in zip(c.token_ids, c.logprobs or [])],
            finish_reason=c.finish_reason,
            text=c.text,
        )
        for c in final.outputs
    ]
    prompt_logprobs = None
    if body.prompt_logprobs and final.prompt_logprobs is not None:
        prompt_logprobs = [
            None if step is None else step[token].logprob
            for token, step in zip(final.prompt_token_ids, final.prompt_logprobs)
        ]
    return GenerateResponse(
        prompt_token_ids=list(final.prompt_token_ids), choices=choices, prompt_logprobs=prompt_logprobs
    )


@router.get("/bridge/info")
async def bridge_info(request: Request) -> dict:
    """The single-copy export of each worker: bridge file path, parameter count, transport."""
    if os.environ.get("VLLM_ENABLE_SHARED_WEIGHTS") != "1":
        raise HTTPException(status_code=409, detail="shared weights are off: start with VLLM_ENABLE_SHARED_WEIGHTS=1")
    infos = await _engine(request).collective_rpc("onecopy_bridge_info")
    return {"workers": infos}


@router.post("/bridge/pause")
async def bridge_pause(request: Request) -> dict:
    """Stop scheduling before weights are written. In-flight requests are frozen, not aborted.

    Returns once the engine core is idle (its last step's outputs are out, so no kernel still
    reads the weights). The prefix-cache reset starts right away in the background, so it
    overlaps the trainer's write; ``/bridge/resume`` waits for it.
    """
    engine = _engine(request)
    start = time.perf_counter()
    # The engine core's pause, not AsyncLLM.pause_generation: that adds a fixed 20 ms sleep
    # (vLLM 0.26) only to order in-flight outputs for its caller; frozen requests have none.
    await engine.engine_core.pause_scheduler_async(mode="keep", clear_cache=False)
    paused = time.perf_counter()
    await _finish_prefix_reset(request)  # from an earlier pause without resume
    # Safe before the write: a paused scheduler computes no KV blocks, so none can be cached
    # with the old weights between this reset and the resume.
    request.app.state.onecopy_prefix_reset = asyncio.create_task(engine.reset_prefix_cache())
    return {"paused": True, "server_pause_ms": 1e3 * (paused - start)}


async def _finish_prefix_reset(request: Request) -> bool | None:
    """Wait for the reset started by the last pause; None if there was none."""
    task = getattr(request.app.state, "onecopy_prefix_reset", None)
    request.app.state.onecopy_prefix_reset = None
    return None if task is None else await task


@router.post("/bridge/resume")
async def bridge_resume(request: Request) -> dict:
    """Drop prefix-cache entries computed with the old weights, then schedule again.

    ``prefix_cache_reset`` is false when vLLM refused (blocks of frozen requests still in use):
    those requests then finish with KV computed by the old weights, like any in-flight rollout.
    """
    engine = _engine(request)
    start = time.perf_counter()
    reset = await _finish_prefix_reset(request)
    if reset is None:  # resumed without a pause through /bridge/pause
        reset = await engine.reset_prefix_cache()
    reset_done = time.perf_counter()
    await engine.resume_generation()
    return {"paused": False, "prefix_cache_reset": reset, "server_reset_wait_ms": 1e3 * (reset_done - start),
            "server_resume_ms": 1e3 * (time.perf_counter() - reset_done)}


@router.post("/bridge/weights_updated")
async def bridge_weights_updated(request: Request) -> dict:
    """The trainer wrote new weights in place: later requests carry a new prefix-cache salt.

    vLLM hashes the salt into every prefix block, so no new request reuses a block computed with
    older weights (those age out of the cache). A reset would do the same only while nothing runs:
    vLLM refuses it while running requests hold cached blocks, which under load is most of the
    time. Requests already running keep their KV, as any rollout in flight does.
    """
    state = request.app.state
    state.onecopy_weights_version = getattr(state, "onecopy_weights_version", 0) + 1
    return {"weights_version": state.onecopy_weights_version}


@router.get("/bridge/is_paused")
async def bridge_is_paused(request: Request) -> dict:
    return {"paused": await _engine(request).is_paused()}


def shared_weights_worker_cls() -> str:
    """The onecopy worker class for this platform (vLLM's CPU and GPU workers differ)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "vllm_patching.cpu_worker.SharedWeightsCPUWorker"
    return "vllm_patching.worker.SharedWeightsGPUWorker"


def parse_args(argv: list[str] | None = None):
    """vLLM's own serve parser, with onecopy's defaults for host and port."""
    from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(description=__doc__.splitlines()[0]))
    parser.set_defaults(host="127.0.0.1", port=DEFAULT_PORT)
    args = parser.parse_args(argv)
    if args.model is None or args.model in ("default",):
        from example_trainer.default_model import default_model_path

        args.model = default_model_path()
    validate_parsed_serve_args(args)
    if os.environ.get("VLLM_ENABLE_SHARED_WEIGHTS") == "1":
        if args.worker_cls not in ("auto", None):
            raise SystemExit(f"--worker-cls {args.worker_cls} conflicts with VLLM_ENABLE_SHARED_WEIGHTS=1")
        if getattr(args, "enable_sleep_mode", False):
            raise SystemExit(
                "--enable-sleep-mode conflicts with VLLM_ENABLE_SHARED_WEIGHTS=1: weights in the "
                "sleep-mode (cuMem) pool cannot be exported with CUDA IPC"
            )
        args.worker_cls = shared_weights_worker_cls()
        # sgl-kernel (AMX CPUs) would also pack linear weights into a private copy.
        os.environ["VLLM_CPU_SGL_KERNEL"] = "0"
    return args


async def serve(args) -> None:
    """vLLM's run_server, with our router attached before the app starts."""
    import vllm.envs as envs
    from vllm.entrypoints.launcher import serve_http
    from vllm.entrypoints.openai.api_server import (
        build_app,
        build_async_engine_client,
        init_app_state,
        setup_server,
    )

    listen_address, sock = setup_server(args, reuse_port=False)
    async with build_async_engine_client(args) as engine_client:
        supported_tasks = await engine_client.get_supported_tasks()
        app = build_app(args, supported_tasks, engine_client.model_config)
        app.include_router(router)
        app.include_router(lora_router)
        app.state.onecopy_base_model = (args.served_model_name or [args.model])[0]
        await init_app_state(engine_client, app.state, args, supported_tasks)
        # A server (re)started with exactly one adapter serves it by default (mode lora_restart).
        lora_modules = getattr(args, "lora_modules", None) or []
        app.state.onecopy_current_lora = lora_modules[0].name if len(lora_modules) == 1 else None
        logger.info("[vLLM server] serving %s on %s", args.model, listen_address)
        shutdown_task = await serve_http(
            app,
            sock=sock,
            host=args.host,
            port=args.port,
            log_level=args.uvicorn_log_level,
            access_log=not args.disable_uvicorn_access_log,
            timeout_keep_alive=envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE,
            # On SIGTERM vLLM stops the engine first; a /generate still open then never gets
            # an output, and uvicorn would wait for it forever (a trainer restarting vLLM waited
            # 60 s, then killed it). Close such connections after a few seconds instead.
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
        )
    try:
        await shutdown_task
    finally:
        sock.close()


def main(argv: list[str] | None = None) -> None:
    import uvloop
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cli_env_setup()
    uvloop.run(serve(parse_args(argv if argv is not None else sys.argv[1:])))


if __name__ == "__main__":
    main()
