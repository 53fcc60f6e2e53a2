"""A batch whose loss is NaN stops the trainer before its optimizer step (example_trainer/grpo.py).
On a GPU the NaN weights of one step once ran on: vLLM generated from them, its logprobs came back
as null and the environment stopped with a validation error that named none of this."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

from example_trainer.config import TrainerConfig
from example_trainer.data.rollouts import TrainBatches
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

    def gradients_ready(self, model):
        self.calls.append("gradients ready")
        return {}

    @contextlib.contextmanager
    def writing(self, model):
        self.calls.append("gate closed")
        yield {}

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
    cfg = TrainerConfig(batch_size=4, vllm_importance_sampling_mode="token_truncate")
    return Run(cfg=cfg, parallel=Parallel(), device=torch.device("cpu"), run_dir=tmp_path, model_path="",
               resume_from=None, server=None, bridge=parts, model=model, optimizer=parts,
               batches=TrainBatches(parts, cfg, Parallel()))


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
    assert parts.calls == ["gradients ready", "clip", "gate closed", "optimizer step", "sync"]
    assert torch.isfinite(torch.tensor(metrics["train/loss"]))


def test_an_infinite_gradient_norm_stops_the_step_before_the_gate_closes_or_the_optimizer_steps(tmp_path):
    """A finite loss whose backward overflowed: clipping by inf would write NaN into the weights."""
    parts = Recorder()
    parts.clip_grad_norm = lambda parallel, max_norm, params: (parts.calls.append("clip"), float("inf"))[1]
    with pytest.raises(NonFiniteLoss, match="step 3's gradient norm is inf"):
        train_step(run_of(tiny_model(), parts, tmp_path), 3, final=False)
    assert parts.calls == ["gradients ready", "clip"]


class OverflowingNorm:
    """A real optimizer whose gradient norm came out inf (a backward that overflowed)."""

    def __init__(self, optimizer) -> None:
        self.optimizer = optimizer

    def clip_grad_norm(self, parallel, max_norm, params):
        return float("inf")

    def step(self):
        self.optimizer.step()

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none)


def test_an_infinite_gradient_norm_in_place_leaves_vllm_serving_its_intact_weights(tmp_path, monkeypatch):
    """--bf16-inplace closes the weights gate for the optimizer step. A step stopped on its gradient
    norm must not close it: a closed gate stays marked half-written after the trainer exits, and
    vLLM then refuses to step on weights nobody wrote, and a new trainer refuses to attach."""
    from example_trainer.bridges.attach import AttachError
    from example_trainer.bridges.shared_vllm import SharedVllmBridge
    from example_trainer.optim.optimizers import build_optimizer
    from tests.unit.test_attach import bridge_on_a_fake_export

    worker_gate, fake, bridge = bridge_on_a_fake_export(tmp_path, monkeypatch, bf16_inplace=True, batch_size=4,
                                                        vllm_importance_sampling_mode="token_truncate")
    try:
        weights_before = {name: t.clone() for name, t in fake.shared.items()}
        try:
            model = bridge.attach()
            optimizer = OverflowingNorm(build_optimizer("adamw", bridge.optimizer_parameters(model), lr=1e-2,
                                                        weight_decay=0.0))
            run = Run(cfg=bridge.cfg, parallel=Parallel(), device=torch.device("cpu"), run_dir=tmp_path, model_path="",
                      resume_from=None, server=None, bridge=bridge, model=model, optimizer=optimizer,
                      batches=TrainBatches(Recorder(), bridge.cfg, Parallel()))
            with pytest.raises(NonFiniteLoss, match="step 1's gradient norm is inf"):
                train_step(run, 1, final=False)
        finally:
            bridge.close()  # what the loop's finish() does on the way out
        assert not worker_gate.file.record.half_written  # vLLM steps on, on the weights it had
        assert worker_gate.file.record.weights_version == 0
        assert all(torch.equal(fake.shared[name], t) for name, t in weights_before.items())
        again = SharedVllmBridge(bridge.cfg, fake.model_path, tmp_path / "again", torch.device("cpu"))
        try:
            again.attach()  # a new trainer (no --resume) attaches to the same vLLM
        except AttachError as err:
            pytest.fail(f"a second trainer could not attach after the stopped step: {err}")
        finally:
            again.close()
    finally:
        worker_gate.close()


def test_the_trainer_exits_with_the_reason_not_a_traceback(monkeypatch):
    from example_trainer import grpo

    finished = []

    def train(run):
        raise NonFiniteLoss("step 2's loss is nan: ...")

    from types import SimpleNamespace

    from example_trainer.parallel import Parallel

    monkeypatch.setattr(grpo, "start_run", lambda cfg: SimpleNamespace(parallel=Parallel()))
    monkeypatch.setattr(grpo, "prepare", lambda run: None)
    monkeypatch.setattr(grpo, "train", train)
    monkeypatch.setattr(grpo, "finish", lambda run, failed=False: finished.append(failed))
    with pytest.raises(SystemExit, match=r"^\[trainer\] stopped: step 2's loss is nan"):
        grpo.main([])
    assert finished == [True]
