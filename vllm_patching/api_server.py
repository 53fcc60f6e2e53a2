"""vLLM's own OpenAI-compatible server, plus the routes onecopy needs.

    python -m vllm_patching.api_server --model PATH [--port 9001] [any vLLM serve flag]

It runs in vLLM's API-server process; this is what the trainer launches. People type
``onecopy-vllm`` or ``python -u example_trainer/vllm_api_server.py``, which also take ``--model
default`` (the trainer side's default model, handed in: this package imports nothing of the trainer's).

Adds to vLLM's app (so the official ``openai`` client keeps working):
  POST /generate          token ids (or text) in; completion token ids, per-token logprobs out, in
                          onecopy's and atroposlib's (server_type vllm) shapes (generate_route.py)
  GET  /bridge/info       the single-copy export (mode shared_vllm), or the weights gate alone (mode
                          server): bridge file, export id, gate counters (steps, waits, weights
                          version, half-written, refusing); mode server with --data-parallel-size D:
                          one entry per engine (each its own gate and bridge file), in engine order
  GET  /weights/digest    mode server (``ONECOPY_WEIGHT_SERVER=1``): a checksum of every parameter
                          vLLM holds (weight_server_routes.py)
  POST /lora/load, POST /lora/unload, GET /lora/status   hot-swapped LoRA adapters (lora_routes.py);
                          a /generate without ``model`` is served by the current adapter
vLLM's own ``/health`` and ``/v1/*`` routes are unchanged, except that with
``VLLM_ENABLE_SHARED_WEIGHTS=1`` ``/health`` answers 503 (with the reason) while the weights are
half-written or a step has waited at the weights gate too long, and ``/metrics`` adds the gate's
``onecopy:*`` counters. In that mode the worker class is onecopy's (``vllm_patching.worker``: it
exports every parameter after load and gates every step) and so is the scheduler
(``vllm_patching.scheduler``: it salts the prefix cache of every route with the weights version).
With ``--enable-return-routed-experts`` /generate returns the experts each token was routed to
(vllm_patching.routed_experts; on vLLM 0.26 through a worker extension that also captures the MoE
kernels vLLM's own capture skips).
With ``--api-key`` or ``VLLM_API_KEY`` every route above needs the same bearer token as vLLM's
``/v1/*`` (vllm_patching/auth.py); ``/health`` and ``/metrics`` stay open.
Flags are vLLM's, plus ``--lora-root`` (the folder ``/lora/load`` may read adapters from; default
``$LOGDIR``, the trainer's run folder, else the working directory); only the defaults of
``--host`` (127.0.0.1) and ``--port`` (9001) differ.
"""

from __future__ import annotations

if __name__ == "__main__":  # the server process: before vLLM and transformers load (engine_fork.py says why)
    from vllm_patching.engine_fork import prepare_fork

    prepare_fork()

import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import JSONResponse

from vllm_patching.auth import api_key_dependencies, warn_if_open
from vllm_patching.compat import (collective_rpc_per_engine, routes_by_aux_output, serve_parser_functions,
                                  server_entry_points, warn_if_untested)
from vllm_patching.engine_fork import close_in_forked_children
from vllm_patching.gate import GateFile, health_problem, waiting_seconds
from vllm_patching.generate_route import router as generate_router
from vllm_patching.lora_routes import router as lora_router
from vllm_patching.weight_server_routes import router as weights_router
from vllm_patching.weight_transfer import WEIGHT_SERVER_ENV

logger = logging.getLogger("vllm.onecopy.server")  # under "vllm" to use its log handler

DEFAULT_PORT = 9001
ROUTES_EXTENSION = "vllm_patching.routed_experts.RoutedExpertsExtension"
GRACEFUL_SHUTDOWN_SECONDS = 3


router = APIRouter()


@router.get("/bridge/info")
async def bridge_info(request: Request) -> dict:
    """Each engine's leading worker (one engine unless mode server's data parallel): bridge file,
    export id, pid, the gate's counters."""
    engines = getattr(request.app.state, "onecopy_engines", None)
    if engines is None:
        raise HTTPException(status_code=409, detail="shared weights are off: start with VLLM_ENABLE_SHARED_WEIGHTS=1")
    # From the mapped gate records, not an RPC: the engine threads may be waiting at their gates.
    return {"workers": [{**worker, **gate.status()} for worker, gate in engines]}


async def health_gate(request: Request, call_next):
    """``/health`` is 503 with the reason while an engine's weights gate says it must not be trusted."""
    engines = getattr(request.app.state, "onecopy_engines", None)
    if engines is not None and request.url.path == "/health":
        for worker, gate in engines:
            problem = health_problem(gate.record)
            if problem is not None:
                where = f"engine {worker['engine']}: " if len(engines) > 1 else ""
                return JSONResponse(status_code=503, content={"detail": where + problem})
    return await call_next(request)


class GateCollector:
    """Prometheus collector: the weights gates' counters on vLLM's ``/metrics``, over the server's
    engines (one unless mode server's data parallel): waits summed, the oldest version, the worst state."""

    def __init__(self, gates: list[GateFile]) -> None:
        self.gates = gates

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        records = [gate.record for gate in self.gates]
        yield CounterMetricFamily("onecopy:gate_wait_seconds", "time vLLM steps waited at the weights gate",
                                  value=sum(r.wait_ns for r in records) / 1e9)
        yield CounterMetricFamily("onecopy:gate_waited_steps", "vLLM steps that found the weights gate closed",
                                  value=sum(r.waited_steps for r in records))
        yield GaugeMetricFamily("onecopy:gate_waiting_seconds", "how long the step now waiting has waited",
                                value=max(waiting_seconds(r) for r in records))
        yield GaugeMetricFamily("onecopy:weights_version", "weights version (bumped by every trainer write)",
                                value=min(r.weights_version for r in records))
        yield GaugeMetricFamily("onecopy:weights_half_written", "1 while a write has started and not ended",
                                value=max(int(r.half_written) for r in records))
        yield GaugeMetricFamily("onecopy:gate_refusing", "1 while the worker refuses to step on half-written weights",
                                value=max(r.refusing for r in records))


async def open_gate_record(engine_client, app) -> None:
    """Map each engine's leading gate record in this (the API server's) process, for /bridge/info,
    /health and /metrics (tensor-parallel rank 0's: the trainer closes that one)."""
    from prometheus_client import REGISTRY

    leaders = sorted((workers[0] for workers in await collective_rpc_per_engine(engine_client, "onecopy_bridge_info")),
                     key=lambda worker: worker["engine"])
    app.state.onecopy_engines = [(worker, GateFile(worker["gate_path"])) for worker in leaders]
    REGISTRY.register(GateCollector([gate for _, gate in app.state.onecopy_engines]))
    logger.info("[vLLM server] weights gate(s) %s: /health and /metrics follow them",
                ", ".join(worker["gate_path"] for worker in leaders))


def fp32_linear_worker_cls() -> str | None:
    """The worker for a server that shares no weights: vLLM's own, except on a CPU whose bf16
    matmul is slow, where ours computes the linear layers in fp32 (vllm_patching/cpu_matmul.py)."""
    import torch
    from vllm.platforms import current_platform

    from vllm_patching.cpu_matmul import bf16_matmul_is_slow

    if current_platform.is_cpu() and bf16_matmul_is_slow(torch.device("cpu")):
        return "vllm_patching.cpu_worker.Fp32LinearCPUWorker"
    return None


def shared_weights_worker_cls() -> str:
    """The onecopy worker class for this platform (vLLM's CPU and GPU workers differ)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "vllm_patching.cpu_worker.SharedWeightsCPUWorker"
    return "vllm_patching.worker.SharedWeightsGPUWorker"


def weight_receiver_worker_cls() -> str:
    """The server-mode worker class for this platform (vllm_patching/weight_receiver.py)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "vllm_patching.receiver_cpu_worker.WeightReceiverCPUWorker"
    return "vllm_patching.weight_receiver.WeightReceiverGPUWorker"


def gate_weights(args, why: str, worker_cls: str) -> None:
    """Server mode: onecopy's worker (gated steps, weights received from the trainer), its scheduler
    (the prefix cache salted by weights version, each token's version) and /health's gate check."""
    for flag, value, default in (("--worker-cls", args.worker_cls, ("auto", None)),
                                 ("--scheduler-cls", args.scheduler_cls, (None,))):
        if value not in default:
            raise SystemExit(f"{flag} {value} conflicts with {why}: onecopy picks its own")
    if getattr(args, "pipeline_parallel_size", 1) > 1:  # data parallel: one gate per engine, all closed per write
        raise SystemExit(f"{why} supports --tensor-parallel-size and --data-parallel-size (pipeline parallel size 1)")
    args.worker_cls = worker_cls
    args.scheduler_cls = "vllm_patching.scheduler.salted_scheduler"
    args.middleware = [*args.middleware, "vllm_patching.api_server.health_gate"]


def parse_args(argv: list[str] | None = None, default_model: Callable[[], str] | None = None):
    """vLLM's own serve parser, with onecopy's defaults for host and port; ``--model default`` is
    ``default_model()`` (the entry points pass the trainer side's, which this package does not import)."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    make_arg_parser, validate_parsed_serve_args = serve_parser_functions()
    parser = make_arg_parser(FlexibleArgumentParser(description=__doc__.splitlines()[0]))
    parser.set_defaults(host="127.0.0.1", port=DEFAULT_PORT)
    parser.add_argument("--lora-root", default=None,
                        help="POST /lora/load reads adapter folders under this folder only (default: $LOGDIR, the "
                             "trainer's run folder, else the working directory)")
    args = parser.parse_args(argv)
    args.lora_root = str(Path(args.lora_root or os.environ.get("LOGDIR") or ".").resolve())
    if args.model is None or args.model in ("default",):
        if default_model is None:
            raise SystemExit("--model default: this entry point knows no default model; pass --model PATH, "
                             "or start the server with onecopy-vllm")
        args.model = default_model()
    validate_parsed_serve_args(args)
    if getattr(args, "enable_return_routed_experts", False) and not routes_by_aux_output():
        if args.worker_extension_cls not in ("", ROUTES_EXTENSION):
            raise SystemExit(f"--worker-extension-cls {args.worker_extension_cls} conflicts with "
                             "--enable-return-routed-experts on this vLLM (onecopy's extension captures the routes of "
                             "MoE kernels that vLLM 0.26 does not)")
        args.worker_extension_cls = ROUTES_EXTENSION
    if os.environ.get(WEIGHT_SERVER_ENV) == "1":
        gate_weights(args, f"{WEIGHT_SERVER_ENV}=1", weight_receiver_worker_cls())
    elif os.environ.get("VLLM_ENABLE_SHARED_WEIGHTS") == "1":
        if args.worker_cls not in ("auto", None):
            raise SystemExit(f"--worker-cls {args.worker_cls} conflicts with VLLM_ENABLE_SHARED_WEIGHTS=1")
        if getattr(args, "enable_sleep_mode", False):
            raise SystemExit(
                "--enable-sleep-mode conflicts with VLLM_ENABLE_SHARED_WEIGHTS=1: weights in the "
                "sleep-mode (cuMem) pool cannot be exported with CUDA IPC"
            )
        if getattr(args, "data_parallel_size", 1) > 1:
            raise SystemExit("--data-parallel-size > 1 conflicts with VLLM_ENABLE_SHARED_WEIGHTS=1: single copy "
                             "shares one GPU's weights with one trainer; run one server per GPU instead")
        if getattr(args, "pipeline_parallel_size", 1) > 1:
            raise SystemExit("--pipeline-parallel-size > 1 conflicts with VLLM_ENABLE_SHARED_WEIGHTS=1: single copy "
                             "shares whole layers' shards; use --tensor-parallel-size to spread a model over GPUs")
        if args.scheduler_cls is not None:
            raise SystemExit(f"--scheduler-cls {args.scheduler_cls} conflicts with VLLM_ENABLE_SHARED_WEIGHTS=1 "
                             "(onecopy's scheduler salts the prefix cache per weights version)")
        args.worker_cls = shared_weights_worker_cls()
        args.scheduler_cls = "vllm_patching.scheduler.salted_scheduler"
        args.middleware = [*args.middleware, "vllm_patching.api_server.health_gate"]  # vLLM's own door for middleware
    elif args.worker_cls in ("auto", None):
        args.worker_cls = fp32_linear_worker_cls() or args.worker_cls
    return args


async def serve(args) -> None:
    """vLLM's run_server, with our router attached before the app starts."""
    import vllm.envs as envs

    vllm_server = server_entry_points()
    listen_address, sock = vllm_server.setup_server(args, reuse_port=False)
    close_in_forked_children(sock)  # bound before the engine core is forked (engine_fork.py)
    async with vllm_server.build_async_engine_client(args) as engine_client:
        supported_tasks = await engine_client.get_supported_tasks()
        app = vllm_server.build_app(args, supported_tasks, engine_client.model_config)
        guard = api_key_dependencies(args)  # vLLM's key guards only /v1, /v2, /inference (auth.py)
        app.include_router(router, dependencies=guard)
        app.include_router(generate_router, dependencies=guard)
        app.include_router(lora_router, dependencies=guard)
        app.state.onecopy_lora_root = Path(args.lora_root)
        if getattr(args, "enable_lora", False):
            logger.info("[vLLM server] POST /lora/load reads adapters under %s (--lora-root)", args.lora_root)
        if os.environ.get("VLLM_ENABLE_SHARED_WEIGHTS") == "1" or os.environ.get(WEIGHT_SERVER_ENV) == "1":
            await open_gate_record(engine_client, app)
        if os.environ.get(WEIGHT_SERVER_ENV) == "1":
            app.include_router(weights_router, dependencies=guard)
        if args.worker_extension_cls == ROUTES_EXTENSION:  # before the first request
            await engine_client.collective_rpc("onecopy_capture_monolithic_routes")
        app.state.onecopy_base_model = (args.served_model_name or [args.model])[0]
        await vllm_server.init_app_state(engine_client, app.state, args, supported_tasks)
        # A server (re)started with exactly one adapter serves it by default (mode lora_restart).
        lora_modules = getattr(args, "lora_modules", None) or []
        app.state.onecopy_current_lora = lora_modules[0].name if len(lora_modules) == 1 else None
        logger.info("[vLLM server] serving %s on %s", args.model, listen_address)
        shutdown_task = await vllm_server.serve_http(
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


def main(argv: list[str] | None = None, default_model: Callable[[], str] | None = None) -> None:
    """Parse vLLM's serve flags (``default_model`` resolves ``--model default``) and serve until stopped."""
    import uvloop
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cli_env_setup()
    warn_if_untested()
    args = parse_args(argv if argv is not None else sys.argv[1:], default_model)
    warn_if_open(args)
    uvloop.run(serve(args))


if __name__ == "__main__":
    main()
