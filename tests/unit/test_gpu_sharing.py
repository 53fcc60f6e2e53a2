"""The trainer says whether an NVIDIA MPS daemon lets vLLM's kernels and its own run at once."""

from __future__ import annotations

import logging

import pytest

from example_trainer.gpu_sharing import SM_SHARE_VARIABLE, limit_sm_share, log_gpu_sharing, mps_running


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


def test_the_sm_limit_is_in_the_environment_only_while_the_trainers_context_is_made(tmp_path, caplog):
    """Set for the trainer's CUDA context alone: a vLLM server it starts later must not inherit it."""
    (tmp_path / "control").touch()
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}
    seen = []
    caplog.set_level(logging.INFO, logger="onecopy.trainer.gpu")
    assert limit_sm_share(70, lambda: seen.append(env.get(SM_SHARE_VARIABLE)), environ=env)
    assert seen == ["70"] and SM_SHARE_VARIABLE not in env
    assert "at most 70% of the GPU's SMs" in caplog.text

    env[SM_SHARE_VARIABLE] = "100"  # the user's own setting comes back afterwards
    assert limit_sm_share(50, lambda: seen.append(env.get(SM_SHARE_VARIABLE)), environ=env)
    assert seen[-1] == "50" and env[SM_SHARE_VARIABLE] == "100"


@pytest.mark.parametrize("mps, context_exists, why", [(False, False, "no NVIDIA MPS daemon runs"),
                                                       (True, True, "CUDA context exists already")])
def test_an_sm_limit_that_cannot_apply_is_named_in_a_warning(tmp_path, caplog, mps, context_exists, why):
    if mps:
        (tmp_path / "control").touch()
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}
    made = []
    assert not limit_sm_share(70, lambda: made.append(1), context_exists=context_exists, environ=env)
    assert not made and SM_SHARE_VARIABLE not in env
    assert "--mps-active-thread-percentage 70 ignored" in caplog.text and why in caplog.text


def test_no_limit_asked_makes_nothing(tmp_path):
    (tmp_path / "control").touch()
    made = []
    assert not limit_sm_share(0, lambda: made.append(1), environ={"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)})
    assert not made


def test_a_percentage_outside_0_to_100_is_refused_by_name():
    from example_trainer.config import TrainerConfig

    with pytest.raises(ValueError, match="--mps-active-thread-percentage must be 0"):
        TrainerConfig(mps_active_thread_percentage=120)
