"""vLLM's engine inside the trainer's process (mode colocate): no server, no handles, no IPC.

With ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` vLLM (0.26 and 0.32) runs its engine core and its one worker
(TP=1) in the process that builds ``LLM``, so the worker's model is an ordinary module here and
its parameters are the tensors the colocate bridge makes the HF model's parameters view. The
loop alternates generation and training in one thread: vLLM runs no step while the optimizer
writes, so no gate is needed, and after every write the prefix cache is dropped, so no request
reuses KV computed with older weights.

On CUDA with ``--release-kv-cache`` the KV cache's memory goes to training after each batch is
generated and comes back before the next generation: through the engine's own
``release_kv_cache_memory`` / ``wake_up(tags=["kv_cache"])`` on vLLM 0.32, by hand on 0.26
(vllm_patching/kv_release.py).

The loop owns the engine as it owns a server process: ``start(model, extra_args)`` and ``stop()``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

import torch

from vllm_patching.compat import has_native_kv_release, no_cpu_weight_packing, routes_by_aux_output
from vllm_patching.routed_experts import capture_monolithic_routes

logger = logging.getLogger("onecopy.trainer.engine")


class InProcessEngine:
    """One vLLM ``LLM`` in this process, built from the same flags a server would get."""

    def __init__(self, args: list[str]) -> None:
        self.args = list(args)
        self.llm = None
        self.kv_released = False

    def start(self, model: str, extra_args: list[str] | None = None) -> float:
        """Build the engine on ``model``; return the seconds it took."""
        from vllm import LLM
        from vllm.engine.arg_utils import EngineArgs
        from vllm.platforms import current_platform
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        if self.llm is not None:
            raise RuntimeError("the in-process vLLM engine is running already: stop it first")
        # The worker must live in this process: its parameters become the trainer's.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
        argv = ["--model", model, *self.args, *(extra_args or [])]
        engine_args = EngineArgs.from_cli_args(parser.parse_args(argv))
        if engine_args.tensor_parallel_size != 1 or engine_args.pipeline_parallel_size != 1:
            raise ValueError("--weight-bridge-mode colocate runs one in-process worker: tensor and pipeline "
                             "parallel size must be 1")
        start = time.perf_counter()
        logger.info("[vLLM] building the in-process engine: %s", " ".join(argv))
        with no_cpu_weight_packing() if current_platform.is_cpu() else contextlib.nullcontext():
            self.llm = LLM.from_engine_args(engine_args)  # on CPU the trainer's writes must reach every layer
        if engine_args.enable_return_routed_experts and not routes_by_aux_output():
            self.llm.apply_model(capture_monolithic_routes)  # vLLM 0.26 skips the routes of some MoE kernels
        seconds = time.perf_counter() - start
        logger.info("[vLLM] in-process engine ready after %.1f s", seconds)
        return seconds

    def model(self) -> torch.nn.Module:
        """vLLM's model module (its parameters are the weights generation reads); refused
        (AttachError) when vLLM holds its MoE experts in a layout the trainer cannot view."""
        from example_trainer.bridges.attach import check_moe_layout
        from vllm_patching.export import moe_layout

        models = self._engine().apply_model(lambda m: m)
        if len(models) != 1 or not isinstance(models[0], torch.nn.Module):
            raise RuntimeError("vLLM's worker is not in this process (was VLLM_ENABLE_V1_MULTIPROCESSING "
                               "changed after the engine started?)")
        check_moe_layout(moe_layout(models[0]))  # experts in a kernel's own layout cannot be viewed
        return models[0]

    def generate(self, prompts: list[list[int]], params: list) -> list:
        """vLLM ``RequestOutput`` per tokenised prompt, with ``params[i]`` (SamplingParams) each."""
        from vllm.inputs import TokensPrompt

        self._restore_kv_cache()
        return self._engine().generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)

    def weights_changed(self) -> None:
        """Drop every cached prefix block: they hold KV computed with the old weights."""
        if not self._engine().reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache with requests still running")

    def release_kv_cache(self) -> int:
        """Give the KV cache's memory back to the driver until the next ``generate``; return its bytes."""
        from vllm_patching.kv_release import release_kv_cache

        if self.kv_released:
            return 0
        engine = self._engine()
        if has_native_kv_release():  # the engine's own KV-only release: pause scheduling, then discard
            free_before = torch.cuda.mem_get_info()[0]
            engine.sleep(level=0)
            engine.release_kv_cache_memory()
            freed = torch.cuda.mem_get_info()[0] - free_before
        else:
            freed = sum(engine.collective_rpc(release_kv_cache))
        self.kv_released = True
        return freed

    def _restore_kv_cache(self) -> None:
        from vllm_patching.kv_release import restore_kv_cache

        if not self.kv_released:
            return
        torch.cuda.empty_cache()  # what training freed must go back to the driver before vLLM maps it
        if has_native_kv_release():
            self._engine().wake_up(tags=["kv_cache"])  # maps the cache and resumes scheduling
        else:
            self._engine().collective_rpc(restore_kv_cache)
        self.kv_released = False

    def stop(self) -> None:
        """Let go of the engine (its memory goes with the last reference). Safe to call twice."""
        if self.llm is None:
            return
        engine, self.llm = self.llm, None
        engine.llm_engine.engine_core.shutdown()
        del engine
        logger.info("[vLLM] in-process engine stopped")

    def _engine(self):
        if self.llm is None:
            raise RuntimeError("the in-process vLLM engine is not started")
        return self.llm
