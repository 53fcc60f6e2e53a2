"""The trainer says whether an NVIDIA MPS daemon lets vLLM's kernels and its own run at once."""

from __future__ import annotations

import logging

import pytest

from example_trainer.gpu_sharing import SM_SHARE_VARIABLE, log_gpu_sharing, mps_running, sm_share_while_cuda_starts


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


def test_the_sm_cap_is_in_the_environment_only_while_the_trainers_cuda_starts(tmp_path, caplog):
    """Set for the trainer's CUDA alone: a vLLM server it starts later must not inherit it."""
    (tmp_path / "control").touch()
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}
    caplog.set_level(logging.INFO, logger="onecopy.trainer.gpu")
    with sm_share_while_cuda_starts(70, vllm_in_process=False, cuda_started=False, environ=env) as capped:
        assert capped and env[SM_SHARE_VARIABLE] == "70"
    assert SM_SHARE_VARIABLE not in env
    assert "at most 70% of the GPU's SMs" in caplog.text

    env[SM_SHARE_VARIABLE] = "100"  # the user's own setting comes back afterwards, even after an error
    with pytest.raises(SystemExit):
        with sm_share_while_cuda_starts(50, vllm_in_process=False, cuda_started=False, environ=env):
            assert env[SM_SHARE_VARIABLE] == "50"
            raise SystemExit("no such device")
    assert env[SM_SHARE_VARIABLE] == "100"


@pytest.mark.parametrize("mps, in_process, started, why", [
    (False, False, False, "no NVIDIA MPS daemon runs"),
    (True, True, False, "vLLM runs in the trainer's process"),
    (True, False, True, "CUDA has started already")])
def test_an_sm_cap_that_cannot_apply_is_named_in_a_warning(tmp_path, caplog, mps, in_process, started, why):
    if mps:
        (tmp_path / "control").touch()
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}
    with sm_share_while_cuda_starts(70, vllm_in_process=in_process, cuda_started=started, environ=env) as capped:
        assert not capped and SM_SHARE_VARIABLE not in env
    assert "--mps-active-thread-percentage 70 ignored" in caplog.text and why in caplog.text


def test_no_cap_asked_sets_nothing_and_says_nothing(tmp_path, caplog):
    (tmp_path / "control").touch()
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}
    caplog.set_level(logging.INFO, logger="onecopy.trainer.gpu")
    with sm_share_while_cuda_starts(0, vllm_in_process=False, cuda_started=False, environ=env) as capped:
        assert not capped and SM_SHARE_VARIABLE not in env
    assert not caplog.text


def test_a_percentage_outside_0_to_100_is_refused_by_name():
    from example_trainer.config import TrainerConfig

    with pytest.raises(ValueError, match="--mps-active-thread-percentage must be 0"):
        TrainerConfig(mps_active_thread_percentage=120)


def test_the_trainer_starts_cuda_by_finding_its_device_inside_the_sm_cap(monkeypatch):
    """start_run's first CUDA call is finding the device: it must come while the cap is set."""
    import contextlib

    from example_trainer import grpo
    from example_trainer.config import TrainerConfig

    events = []

    @contextlib.contextmanager
    def recording_cap(percent, vllm_in_process, cuda_started, environ=None):
        events.append(("cap", percent, vllm_in_process))
        try:
            yield True
        finally:
            events.append("cap removed")

    def finding_the_device(self, requested):
        events.append("device")
        raise ValueError("stop the run here")

    monkeypatch.setattr(grpo, "sm_share_while_cuda_starts", recording_cap)
    monkeypatch.setattr(grpo.Parallel, "device", finding_the_device)
    with pytest.raises(SystemExit, match="stop the run here"):
        grpo.start_run(TrainerConfig(mps_active_thread_percentage=80, weight_bridge_mode="colocate"))
    assert events == [("cap", 80, True), "device", "cap removed"]
