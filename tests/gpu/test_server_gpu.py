"""Mode server on GPUs (NCCL): the trainer on GPU 0, vLLM on the others. Needs 2 GPUs (NCCL joins
no two processes on one GPU); the tensor-parallel check needs 4 (SmolLM2's 9 heads: TP 3).
Skipped elsewhere.

    SMOLLM2_DIR=... python3 -m pytest tests/gpu/test_server_gpu.py -q -s

Results: $OUT/gpu_server_<label>.json (per-step samples/s, sync seconds, achieved GB/s).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from tests.gpu.results import results_folder

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]


def smollm2() -> str:
    from example_trainer.model.default_model import default_model_path

    return os.environ.get("SMOLLM2_DIR") or default_model_path()


def test_each_sync_lands_every_tensor_on_vllms_gpu(tmp_path):
    """vLLM on GPU 1 holds, byte for byte, what the trainer on GPU 0 sent, after every sync."""
    sync_twice(tmp_path, vllm_gpus="1")


@pytest.mark.skipif(torch.cuda.device_count() < 3, reason="needs 3 CUDA GPUs")
def test_each_sync_lands_every_tensor_on_both_data_parallel_engines(tmp_path):
    """vLLM --data-parallel-size 2 on GPUs 1 and 2 (an engine each, a gate each): after every sync
    both hold, byte for byte, what the trainer on GPU 0 sent, at its version."""
    sync_twice(tmp_path, vllm_gpus="1,2", vllm_data_parallel_size=2)


def sync_twice(tmp_path, **flags):
    """Two syncs of randomly moved weights to a vLLM the bridge's way; every engine checked after each."""
    from transformers import AutoConfig

    from example_trainer.bridges.server import ServerBridge
    from example_trainer.config import TrainerConfig
    from example_trainer.engine.ports import free_port
    from example_trainer.inference import launch_inference
    from example_trainer.model.model_files import architecture
    from tests.server_checks import differing_per_engine

    model = smollm2()
    cfg = TrainerConfig(weight_bridge_mode="server", device="cuda:0", vllm_server_port=free_port(),
                        vllm_gpu_memory_utilization=0.3, **flags)
    server = launch_inference(cfg, tmp_path, ServerBridge)
    server.start(model)
    bridge = ServerBridge(cfg, model, tmp_path, torch.device("cuda:0"), server)
    try:
        bridge.attach()
        for step in (1, 2):
            with torch.no_grad():
                for master in bridge.masters.params:
                    master.add_(torch.randn_like(master) * 0.02 * master.abs().mean())
            metrics = bridge.sync(bridge.model, step=step, final=False)
            weights = {name: p.detach().cpu() for name, p in bridge.model.named_parameters()}
            engines = differing_per_engine(server.url, weights, architecture(model), AutoConfig.from_pretrained(model))
            assert [engine for engine, _, _ in engines] == list(range(cfg.vllm_data_parallel_size))
            assert all(not differ and version == metrics["sync/weights_version"] for _, version, differ in engines)
            print(f"\n[server] sync {step}: {metrics['sync/seconds']:.4f} s, {metrics['sync/send_gb_per_second']:.1f} GB/s")
    finally:
        bridge.close()
        server.stop()


def run(tmp_path, vllm_gpus: str, tp: int, label: str, steps: int = 4):
    from example_trainer import launcher

    from example_trainer.config import TrainerConfig

    # vLLM's GPUs in the config itself: the launcher checks them before it starts anything.
    trainer = TrainerConfig(weight_bridge_mode="server", max_steps=steps, model_name=smollm2(), batch_size=16,
                            seq_len=320, learning_rate=2e-5, batch_wait_timeout=600, device="cuda:0",
                            vllm_gpus=vllm_gpus, vllm_tensor_parallel_size=tp, vllm_gpu_memory_utilization=0.5,
                            benchmark=True)
    result = launcher.run_loop(launcher.LoopConfig(run_dir=str(tmp_path), timeout=900, trainer=trainer))
    assert result.returncode == 0, result.failure_report()
    logged = [m for m in result.metrics if "train/loss" in m]
    assert [m["step"] for m in logged] == list(range(1, steps + 1))
    assert all("off_policy/mean" in m for m in logged)  # every batch's tokens carried their weights version
    summary = {"vllm_gpus": vllm_gpus, "tp": tp, "samples_per_s": [16 / m["time/step"] for m in logged[1:]],
               "sync_seconds": [m["sync/seconds"] for m in logged],
               "send_gb_per_second": [m["sync/send_gb_per_second"] for m in logged]}
    out = results_folder(tmp_path)
    out.joinpath(f"gpu_server_{label}.json").write_text(json.dumps(summary, indent=2))
    print(f"\n[server {label}] {json.dumps(summary)}")


def test_loop_with_vllm_on_the_second_gpu(tmp_path):
    run(tmp_path, "1", 1, "1+1")


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA GPUs")
def test_loop_with_vllm_tensor_parallel_over_three_gpus(tmp_path):
    run(tmp_path, "1,2,3", 3, "1+3tp")
