"""Mode ``colocate``: vLLM's engine runs inside the trainer's process, and the HF model's
parameters are views of the engine's own parameter tensors (the mapping table of shared_vllm;
no handles, no second process).

The loop alternates: generate a batch → score → loss → optimizer step → generate with the new
weights. Nothing generates while the optimizer writes (one thread), so there is no gate; after
each write the engine's prefix cache is dropped, so no request reuses KV of older weights.
Numerics are shared_vllm's: fp32 masters pushed into the bf16 weights after each step, or
``--bf16-inplace`` (the optimizer steps the bf16 weights with stochastic rounding).
"""

from __future__ import annotations

import logging
import time

import torch

from example_trainer.bridges.attach import AttachError, meta_model, view_parameters
from example_trainer.bridges.base import PROBE_TOP_K
from example_trainer.bridges.single_copy import SingleCopyBridge
from vllm_patching.export import use_plain_cpu_linear

logger = logging.getLogger("onecopy.trainer.bridge")


class ColocateBridge(SingleCopyBridge):
    """Attach to the in-process engine's parameters; after each step drop its prefix cache."""

    @classmethod
    def vllm_args(cls, cfg) -> list[str]:
        # The weights and the KV cache in vLLM's cuMem pool, tagged, so the KV cache alone can be unmapped.
        return ["--enable-cumem-allocator"] if cfg.release_kv_cache else []

    def serve_on(self) -> tuple[str, list[str]]:
        if self.cfg.release_kv_cache and self.device.type != "cuda":
            raise AttachError("--release-kv-cache needs a GPU (vLLM's cuMem pool); drop it on CPU")
        return super().serve_on()

    def attach(self) -> torch.nn.Module:
        served = self.server.model()
        tensors = {name: p.detach() for name, p in served.named_parameters()}  # plain tensors on the same memory
        device = next(iter(tensors.values())).device
        if device.type != self.device.type:
            raise AttachError(f"vLLM holds the weights on {device.type} and the trainer runs on {self.device.type}: "
                              f"pass --device {device.type}")
        if device.type == "cpu":
            use_plain_cpu_linear(served)  # packed CPU weights would not see the trainer's writes
        model = meta_model(self.model_path, next(iter(tensors.values())).dtype)
        view_parameters(model, tensors, type(served).__name__, "in-process engine")
        self.train_on(list(model.parameters()))
        return model

    def probe_logprob(self, prompt: str) -> float | None:
        """The probe of the other modes (top-20 next-token logprobs after ``prompt``, summed), from the engine."""
        if not prompt:
            return None
        from vllm import SamplingParams

        tokens = self.server.llm.get_tokenizer().encode(prompt)
        out = self.server.generate([tokens], [SamplingParams(max_tokens=1, temperature=0.0, logprobs=PROBE_TOP_K)])
        return float(sum(entry.logprob for entry in out[0].outputs[0].logprobs[0].values()))

    def sync(self, model: torch.nn.Module, step: int, final: bool) -> dict[str, float]:
        start = time.perf_counter()
        self.write_weights()  # in place: the engine's weights are these tensors
        self.server.weights_changed()
        return {"sync/synced": 1.0, "sync/seconds": time.perf_counter() - start, "sync/bytes_moved": 0.0}

    def load_trainer_state(self, state: dict) -> None:
        super().load_trainer_state(state)  # pushes the masters; the engine started on the checkpoint anyway
        self.server.weights_changed()
