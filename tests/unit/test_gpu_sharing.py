"""The trainer says whether an NVIDIA MPS daemon lets vLLM's kernels and its own run at once."""

from __future__ import annotations

import logging

from example_trainer.engine.gpu_sharing import log_gpu_sharing, mps_running


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
