"""A batch whose loss is NaN stops the trainer before its optimizer step (example_trainer/grpo.py).
On a GPU the NaN weights of one step once ran on: vLLM generated from them, its logprobs came back
as null and the environment stopped with a validation error that named none of this."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from example_trainer.config import TrainerConfig
from example_trainer.grpo import NonFiniteLoss, Run, train_step
from example_trainer.parallel import Parallel
from tests.unit.test_parallel import groups, tiny_model


class Recorder:
    """The bridge, optimizer and batch source of one step; records what of theirs the step called."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.watch = None

    def get_batch(self, timeout, while_waiting=None):
        return groups()

    def step_metrics(self):
        return {}

    def weights_version(self):
        return None

    def forward_parameters(self, model):
        return None

    def before_optimizer_step(self, model):
        self.calls.append("gate closed")
        return {}

    def clip_grad_norm(self, parallel, max_norm, params):
        self.calls.append("clip")
        return 0.0

    def step(self):
        self.calls.append("optimizer step")

    def zero_grad(self, set_to_none=True):
        pass

    def sync(self, model, step, final):
        self.calls.append("sync")
        return {}


def run_of(model: torch.nn.Module, parts: Recorder, tmp_path: Path) -> Run:
    return Run(cfg=TrainerConfig(batch_size=4, vllm_importance_sampling_mode="token_truncate"), parallel=Parallel(),
               device=torch.device("cpu"), run_dir=tmp_path, model_path="", resume_from=None, server=None,
               bridge=parts, model=model, optimizer=parts, batches=parts)


def test_a_nan_loss_stops_the_step_before_the_gate_closes_or_the_optimizer_steps(tmp_path):
    model = tiny_model()
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")  # as an earlier step's update left it
    parts = Recorder()
    run = run_of(model, parts, tmp_path)
    with pytest.raises(NonFiniteLoss, match="step 3's loss is nan.*--resume"):
        train_step(run, 3, final=False)
    assert parts.calls == []


def test_a_finite_loss_goes_on_to_the_optimizer_and_the_sync(tmp_path):
    parts = Recorder()
    run = run_of(tiny_model(), parts, tmp_path)
    metrics = train_step(run, 3, final=False)
    assert parts.calls == ["gate closed", "clip", "optimizer step", "sync"]
    assert torch.isfinite(torch.tensor(metrics["train/loss"]))


def test_an_infinite_gradient_norm_stops_the_step_before_the_optimizer_steps(tmp_path):
    """A finite loss whose backward overflowed: clipping by inf would write NaN into the weights."""
    parts = Recorder()
    parts.clip_grad_norm = lambda parallel, max_norm, params: (parts.calls.append("clip"), float("inf"))[1]
    with pytest.raises(NonFiniteLoss, match="step 3's gradient norm is inf"):
        train_step(run_of(tiny_model(), parts, tmp_path), 3, final=False)
    assert parts.calls == ["gate closed", "clip"]


def test_the_trainer_exits_with_the_reason_not_a_traceback(monkeypatch):
    from example_trainer import grpo

    finished = []

    def train(run):
        raise NonFiniteLoss("step 2's loss is nan: ...")

    monkeypatch.setattr(grpo, "start_run", lambda cfg: "run")
    monkeypatch.setattr(grpo, "prepare", lambda run: None)
    monkeypatch.setattr(grpo, "train", train)
    monkeypatch.setattr(grpo, "finish", lambda run, failed: finished.append(failed))
    with pytest.raises(SystemExit, match=r"^\[trainer\] stopped: step 2's loss is nan"):
        grpo.main([])
    assert finished == [True]
