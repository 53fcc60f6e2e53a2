"""The trainer says whether an NVIDIA MPS daemon lets vLLM's kernels and its own run at once, and
--mps-vllm-first lowers the trainer's MPS priority for its own CUDA only."""

from __future__ import annotations

import logging

import pytest

from example_trainer.gpu_sharing import (PRIORITY_VARIABLE, log_gpu_sharing, mps_running,
                                          vllm_first_while_cuda_starts)


def test_mps_is_found_by_its_control_pipe_in_the_folder_cuda_would_use(tmp_path, caplog):
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}
    caplog.set_level(logging.INFO, logger="onecopy.trainer.gpu")
    assert not mps_running(env)
    assert not log_gpu_sharing(env)
    assert "nvidia-cuda-mps-control -d" in caplog.text

    (tmp_path / "control").touch()  # the daemon's named pipe; a file is enough to be found
    caplog.clear()
    assert mps_running(env) and log_gpu_sharing(env)
    assert "MPS control daemon found" in caplog.text
    assert not mps_running({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "other")})


def test_the_priority_is_in_the_environment_only_while_the_trainers_cuda_starts(tmp_path, caplog):
    """Set for the trainer's CUDA alone: a vLLM server it starts later must keep the normal priority."""
    (tmp_path / "control").touch()
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}
    caplog.set_level(logging.INFO, logger="onecopy.trainer.gpu")
    with vllm_first_while_cuda_starts(True, vllm_in_process=False, cuda_started=False, environ=env) as lowered:
        assert lowered and env[PRIORITY_VARIABLE] == "1"
    assert PRIORITY_VARIABLE not in env
    assert "priority below normal" in caplog.text

    env[PRIORITY_VARIABLE] = "0"  # the user's own setting comes back afterwards, even after an error
    with pytest.raises(SystemExit):
        with vllm_first_while_cuda_starts(True, vllm_in_process=False, cuda_started=False, environ=env):
            assert env[PRIORITY_VARIABLE] == "1"
            raise SystemExit("no such device")
    assert env[PRIORITY_VARIABLE] == "0"


@pytest.mark.parametrize("mps, in_process, started, why", [
    (False, False, False, "no NVIDIA MPS daemon runs"),
    (True, True, False, "vLLM runs in the trainer's process"),
    (True, False, True, "CUDA has started already")])
def test_a_priority_that_cannot_apply_is_named_in_a_warning(tmp_path, caplog, mps, in_process, started, why):
    if mps:
        (tmp_path / "control").touch()
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}
    with vllm_first_while_cuda_starts(True, vllm_in_process=in_process, cuda_started=started, environ=env) as lowered:
        assert not lowered and PRIORITY_VARIABLE not in env
    assert "--mps-vllm-first ignored" in caplog.text and why in caplog.text


def test_not_asked_sets_nothing_and_says_nothing(tmp_path, caplog):
    (tmp_path / "control").touch()
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}
    caplog.set_level(logging.INFO, logger="onecopy.trainer.gpu")
    with vllm_first_while_cuda_starts(False, vllm_in_process=False, cuda_started=False, environ=env) as lowered:
        assert not lowered and PRIORITY_VARIABLE not in env
    assert not caplog.text


def test_the_trainer_starts_cuda_by_finding_its_device_inside_the_priority_block(monkeypatch):
    """start_run's first CUDA call is finding the device: it must come while the variable is set."""
    import contextlib

    from example_trainer import grpo
    from example_trainer.config import TrainerConfig

    events = []

    @contextlib.contextmanager
    def recording(wanted, vllm_in_process, cuda_started, environ=None):
        events.append(("set", wanted, vllm_in_process))
        try:
            yield True
        finally:
            events.append("unset")

    def finding_the_device(self, requested):
        events.append("device")
        raise ValueError("stop the run here")

    monkeypatch.setattr(grpo, "vllm_first_while_cuda_starts", recording)
    monkeypatch.setattr(grpo.Parallel, "device", finding_the_device)
    with pytest.raises(SystemExit, match="stop the run here"):
        grpo.start_run(TrainerConfig(mps_vllm_first=True))
    assert events == [("set", True, False), "device", "unset"]
