"""Mode server's --vllm-gpus check names a fix a user can paste (example_trainer/engine/vllm_gpus.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from example_trainer.engine.vllm_gpus import check_server_gpus


@pytest.mark.parametrize("tp, dp, gpus, example", [(2, 1, 4, "1,2"), (1, 1, 4, "1"), (2, 1, 12, "1,2"),
                                                    (4, 1, 12, "1,2,3,4"), (2, 2, 12, "1,2,3,4"), (1, 3, 4, "1,2,3")])
def test_a_missing_vllm_gpus_is_refused_with_an_example_of_as_many_gpus_as_the_tensor_parallel_size(
        monkeypatch, tp, dp, gpus, example):
    """The example was cut from the joined string by characters: '1,' for TP 1 on 4 GPUs. With vLLM
    data parallel: tensor × data parallel size GPUs."""
    monkeypatch.setattr("torch.cuda.device_count", lambda: gpus)
    cfg = SimpleNamespace(vllm_gpus="", vllm_tensor_parallel_size=tp, vllm_data_parallel_size=dp, launch_vllm=True,
                          device="cuda:0", parallel="none")
    with pytest.raises(ValueError) as refused:
        check_server_gpus(cfg)
    assert str(refused.value).endswith(f"e.g. --vllm-gpus {example}")
