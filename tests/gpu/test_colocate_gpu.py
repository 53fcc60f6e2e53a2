"""Mode colocate on a real GPU (vLLM 0.26.0 in this process): the KV cache's memory goes back to
the driver and returns at the same addresses (CUDA graphs valid, the weights untouched), and the
whole loop trains with the release on. Skipped without CUDA.

    SMOLLM2_DIR=... python3 -m pytest tests/gpu/test_colocate_gpu.py -q -s
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

KV_BYTES = 2 * 2**30


def used_bytes() -> int:
    """What the driver counts for this process and those it started: other work may share the GPU
    (free memory, ``torch.cuda.mem_get_info``, would count theirs too)."""
    from bench.common import gpu_used_mib

    return sum(gpu_used_mib(tree_of=os.getpid()).values()) * 2**20


def smollm2() -> str:
    from example_trainer.model.default_model import default_model_path

    return os.environ.get("SMOLLM2_DIR") or default_model_path()


def test_the_kv_cache_is_released_and_restored_without_touching_the_weights():
    from vllm import SamplingParams

    from example_trainer.bridges.inprocess_engine import InProcessEngine

    engine = InProcessEngine(["--dtype", "bfloat16", "--max-model-len", "512", "--gpu-memory-utilization", "0.5",
                              "--kv-cache-memory-bytes", str(KV_BYTES), "--enable-cumem-allocator"])
    engine.start(smollm2())
    try:
        tokenizer = engine.llm.get_tokenizer()
        prompt = tokenizer.encode("What is 15 times 7?")
        greedy = [SamplingParams(max_tokens=24, temperature=0.0)]
        before = engine.generate([prompt], greedy)[0].outputs[0].token_ids
        weights = {n: p.detach().clone() for n, p in engine.model().named_parameters()}
        used_before = used_bytes()
        freed = engine.release_kv_cache()
        used_released = used_bytes()
        assert freed >= KV_BYTES and used_before - used_released >= 0.95 * KV_BYTES
        # What training would do with that memory: take it, then give it back.
        scratch = torch.empty(int(0.9 * KV_BYTES), dtype=torch.uint8, device="cuda")
        del scratch
        after = engine.generate([prompt], greedy)[0].outputs[0].token_ids  # restores the cache first
        assert list(after) == list(before)  # CUDA graphs replayed on the remapped cache
        assert all(torch.equal(p, weights[n]) for n, p in engine.model().named_parameters())
        used_restored = used_bytes()
        print(f"\n[colocate] KV cache released: {freed / 2**30:.2f} GiB; used by this process before "
              f"{used_before / 2**30:.2f}, released {used_released / 2**30:.2f}, restored {used_restored / 2**30:.2f} GiB")
    finally:
        engine.stop()


def test_the_loop_trains_in_colocate_with_the_kv_cache_released(tmp_path):
    from example_trainer import launcher
    from example_trainer.config import TrainerConfig

    cfg = launcher.LoopConfig(run_dir=str(tmp_path), timeout=900,
                              env_args="--env.max_tokens 64 --env.difficulty 1 --env.operations + --env.seed 1",
                              trainer=TrainerConfig(weight_bridge_mode="colocate", max_steps=3, model_name=smollm2(),
                                                    seq_len=320, learning_rate=2e-5))
    result = launcher.run_loop(cfg, ["--release-kv-cache", "--vllm-kv-cache-bytes", str(KV_BYTES), "--benchmark"])
    assert result.returncode == 0, result.failure_report()
    steps = [m for m in result.metrics if "train/loss" in m]
    assert [m["step"] for m in steps] == [1, 2, 3]
    probes = [m["gen/probe_logprob"] for m in result.metrics if m.get("gen/probe_logprob") is not None]
    assert probes[-1] != pytest.approx(probes[0], abs=1e-4)
