"""Single copy on a real GPU with vLLM 0.26.0 (CUDA IPC): parity, in-place update, attach and sync
time, and peak GPU memory against mode none's layout. Skipped without CUDA.

On the device (after the bundle loads, docs/gpu.md):
    SMOLLM2_DIR=... python3 -m pytest tests/gpu -q -s      # results: $OUT/gpu_results.json
"""

from __future__ import annotations

import gc
import json
import os
import signal
import statistics
import time
from pathlib import Path

import pytest
import requests
import torch

from bench.common import gpu_used_mib, random_qwen2
from tests.gpu.results import results_folder
from tests.weight_checks import (MAX_ABS_TOL, MEAN_ABS_TOL, assert_staged_step_lands_the_in_place_values,
                                 assert_vllm_tracks_update, chat_prompts, hf_logprobs, reference_with, vllm_logprobs)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

RESULTS: dict[str, dict] = {}


def smollm2() -> str:
    from example_trainer.model.default_model import default_model_path

    return os.environ.get("SMOLLM2_DIR") or default_model_path()


def smollm2_or_random(path: Path) -> str:
    """SmolLM2 where it is installed, else random weights of its shapes from its config and tokenizer
    (the device has those after the bundle's first two loads; the weights need two more)."""
    smol = os.environ.get("SMOLLM2_DIR")
    if smol and (Path(smol) / "config.json").exists() or not os.environ.get("SMOLLM2_CONFIG_DIR"):
        return smollm2()
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    source = os.environ["SMOLLM2_CONFIG_DIR"]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source), dtype=torch.bfloat16).save_pretrained(path)
    AutoTokenizer.from_pretrained(source).save_pretrained(path)
    return str(path)


def models(tmp_root: Path) -> dict[str, str]:
    return {"smollm2-135m": smollm2(), "qwen2-random-1.4b": random_qwen2(tmp_root / "qwen2-random", smollm2())}


def save_results(fallback: Path) -> None:
    out = results_folder(fallback)
    (out / "gpu_results.json").write_text(json.dumps(RESULTS, indent=2))


def settled_gpu_mib() -> dict[int, int]:
    """The GPU memory of this process and of those it started (vLLM), by the driver, after this one
    freed what nothing refers to any more. Other processes on the GPU are left out: the suite may
    share the GPU with other work."""
    gc.collect()
    torch.cuda.empty_cache()
    return gpu_used_mib(tree_of=os.getpid())


def process_mib() -> int:
    return settled_gpu_mib().get(os.getpid(), 0)


def trainer_and_total_mib(start_mib: int) -> tuple[int, int]:
    """(what this process added since ``start_mib``, that plus every other process: vLLM), from one reading."""
    used = settled_gpu_mib()
    mine = used.pop(os.getpid(), 0) - start_mib
    return mine, mine + sum(used.values())


def server_for(model: str, logdir: Path, shared: bool):
    """The server the loop would launch for ``model`` in mode shared_vllm (or none), with a 4 GiB KV cache.
    The model is in the config because the launch reads its architecture (the family's vLLM flags)."""
    from example_trainer.bridges import bridge_class
    from example_trainer.config import TrainerConfig
    from example_trainer.inference import launch_inference

    from tests.conftest import free_port

    cfg = TrainerConfig(model_name=model, weight_bridge_mode="shared_vllm" if shared else "none", seq_len=1024,
                        vllm_server_port=free_port(),
                        vllm_kv_cache_bytes=4 * 2**30, vllm_server_timeout=600)
    env = None if shared else {"VLLM_ENABLE_SHARED_WEIGHTS": "0"}
    return launch_inference(cfg, logdir, bridge_class(cfg.weight_bridge_mode), env=env)


def start_server(model: str, logdir: Path, shared: bool):
    server = server_for(model, logdir, shared)
    server.logdir = logdir
    server.start(model)
    return server


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2-random-1.4b"])
def test_single_copy_on_gpu(name, tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from example_trainer.bridges.shared_vllm import SharedVllmBridge
    from example_trainer.config import TrainerConfig
    from example_trainer.rl.loss import token_logprobs

    root = tmp_path_factory.getbasetemp()
    model_path = models(root)[name]
    # The trainer's share is what this process holds beyond its state at the start: earlier tests
    # in the same pytest process (colocate's engine, LoRA) leave memory behind, and its release
    # mid-test once moved the 135M numbers by more than the one bf16 copy the check looks for.
    start_mib = process_mib()
    tok = AutoTokenizer.from_pretrained(model_path)
    prompts = chat_prompts(tok)
    result: dict = {"model": name}
    logdir = tmp_path_factory.mktemp(f"{name}-shared")
    server = start_server(model_path, logdir, shared=True)
    try:
        cfg = TrainerConfig(weight_bridge_mode="shared_vllm", launch_vllm=False, vllm_server_port=server.port,
                            vllm_config_path=str(logdir / "vllm_bridge_config.json"))
        bridge = SharedVllmBridge(cfg, model_path, logdir, torch.device("cuda"))
        t0 = time.perf_counter()
        model = bridge.attach()
        result["attach_seconds"] = time.perf_counter() - t0
        n_params = sum(p.numel() for p in bridge.shared)
        result["params"] = n_params

        before = [vllm_logprobs(server.url, ids) for ids in prompts]
        parity = [(hf_logprobs(model, ids) - v).abs() for ids, v in zip(prompts, before)]
        result["parity_max"] = max(d.max().item() for d in parity)
        result["parity_mean"] = statistics.fmean(d.mean().item() for d in parity)
        assert result["parity_max"] < MAX_ABS_TOL and result["parity_mean"] < MEAN_ABS_TOL, result

        opt = torch.optim.AdamW(bridge.optimizer_parameters(model), lr=1e-3, weight_decay=0.0)
        tokens = torch.tensor([prompts[0]], device="cuda")
        loss = -token_logprobs(model(input_ids=tokens).logits, tokens).mean()
        loss.backward()
        bridge.gradients_ready(model)  # as the loop calls them: the masters take the gradients
        with bridge.writing(model):
            opt.step()
        pointers = [p.data_ptr() for p in bridge.shared]
        syncs = [bridge.sync(model, step=i, final=False) for i in range(1, 12)]
        assert [p.data_ptr() for p in bridge.shared] == pointers
        torch.cuda.synchronize()
        for key in ("sync/seconds", "sync/gate_wait_seconds", "sync/write_seconds", "sync/open_seconds"):
            result[key + "_median"] = statistics.median(s[key] for s in syncs[1:])
        result["sync/bytes_moved"] = max(s["sync/bytes_moved"] for s in syncs)
        result["write_bytes"] = n_params * (4 + 2)  # each fp32 master read once, each bf16 weight written once
        result["write_GBps"] = result["write_bytes"] / result["sync/write_seconds_median"] / 1e9

        reference = reference_with(model_path, bridge.masters, "cuda")
        assert_vllm_tracks_update(server.url, reference, prompts, before)
        del reference
        gate = requests.get(f"{server.url}/bridge/info", timeout=60).json()["workers"][0]
        result["gate"] = gate
        assert gate["steps"] > 0 and gate["mixed_steps"] == 0 and not gate["half_written"], gate
        result["shared_trainer_mib"], result["shared_total_mib"] = trainer_and_total_mib(start_mib)
    finally:
        bridge.close()  # lets go of vLLM's memory before vLLM stops
        server.stop()
        del model
        torch.cuda.empty_cache()

    # Mode none's layout on the same model: vLLM's own copy + the trainer's bf16 model + masters.
    logdir = tmp_path_factory.mktemp(f"{name}-none")
    server = start_server(model_path, logdir, shared=False)
    try:
        from example_trainer.bridges.master_weights import MasterWeights

        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).cuda()
        masters = MasterWeights(list(model.parameters()))
        opt = torch.optim.AdamW(masters.params, lr=1e-3, weight_decay=0.0)
        tokens = torch.tensor([prompts[0]], device="cuda")
        (-token_logprobs(model(input_ids=tokens).logits, tokens).mean()).backward()
        masters.pull_grads()
        opt.step()
        masters.push()
        torch.cuda.synchronize()
        result["none_trainer_mib"], result["none_total_mib"] = trainer_and_total_mib(start_mib)
    finally:
        server.stop()
    result["bf16_copy_mib"] = n_params * 2 / 2**20
    result["saved_mib"] = result["none_total_mib"] - result["shared_total_mib"]
    RESULTS[name] = result
    save_results(tmp_path_factory.getbasetemp())
    print(json.dumps(result, indent=2))
    # single copy must not hold a second bf16 copy of the weights
    assert result["saved_mib"] > 0.9 * result["bf16_copy_mib"], result


def test_a_killed_vllm_is_restarted_and_given_the_trainers_weights(tmp_path):
    """SIGKILL of the worker that exports the weights: the next sync drops the dead CUDA IPC
    mappings untouched, restarts vLLM, re-attaches and pushes the masters before vLLM steps."""
    from transformers import AutoTokenizer

    from example_trainer.bridges import bridge_class
    from example_trainer.bridges.shared_vllm import SharedVllmBridge
    from example_trainer.config import TrainerConfig
    from example_trainer.inference import launch_inference
    from example_trainer.rl.loss import token_logprobs
    from tests.conftest import free_port

    model_path = smollm2_or_random(tmp_path / "model")
    prompts = chat_prompts(AutoTokenizer.from_pretrained(model_path))
    cfg = TrainerConfig(model_name=model_path, weight_bridge_mode="shared_vllm", vllm_server_port=free_port(), seq_len=1024,
                        vllm_server_timeout=600)
    # as the loop does: the bridge restarts it, the test stops it
    server = launch_inference(cfg, tmp_path, bridge_class(cfg.weight_bridge_mode))
    bridge = SharedVllmBridge(cfg, model_path, tmp_path, torch.device("cuda"), server)
    try:
        server.start(*bridge.serve_on())
        model = bridge.attach()
        before = [vllm_logprobs(bridge.inference_url, ids) for ids in prompts]
        opt = torch.optim.AdamW(bridge.optimizer_parameters(model), lr=1e-3, weight_decay=0.0)
        tokens = torch.tensor([prompts[0]], device="cuda")
        (-token_logprobs(model(input_ids=tokens).logits, tokens).mean()).backward()
        bridge.gradients_ready(model)  # as the loop calls them: the masters take the gradients
        with bridge.writing(model):
            opt.step()
        bridge.sync(model, step=1, final=False)
        killed = bridge.export.exporter_pid
        os.kill(killed, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while bridge.gate.exporter_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        metrics = bridge.sync(model, step=2, final=False)
        assert metrics["sync/vllm_restarts"] == 1.0 and bridge.export.exporter_pid != killed
        RESULTS["restart"] = {"reattach_seconds": metrics["sync/reattach_seconds"]}
        save_results(tmp_path)
        reference = reference_with(model_path, bridge.masters, "cuda")
        assert_vllm_tracks_update(bridge.inference_url, reference, prompts, before)  # not the weights on disk
    finally:
        bridge.close()
        server.stop()


def test_a_staged_step_writes_the_in_place_values_and_vllm_generates_meanwhile(tmp_path):
    """--bf16-inplace --staged-step on CUDA, with torchao's compiled AdamW8bit and the trainer's row
    blocks: ``optimizer.step()`` leaves vLLM's tensors and answers as they were; ``sync`` writes, in
    one gate-closed copy, bit for bit what the same step taken in place on copies gives. The gate's
    closed time goes to the results (the speed is bench/vs_trl.py's to show)."""
    from example_trainer.bridges.shared_vllm import SharedVllmBridge
    from example_trainer.config import TrainerConfig
    from transformers import AutoTokenizer

    model_path = smollm2()
    ids = chat_prompts(AutoTokenizer.from_pretrained(model_path))[0]
    server = start_server(model_path, tmp_path, shared=True)
    bridge = None
    try:
        cfg = TrainerConfig(weight_bridge_mode="shared_vllm", launch_vllm=False, vllm_server_port=server.port,
                            vllm_config_path=str(tmp_path / "vllm_bridge_config.json"), bf16_inplace=True,
                            staged_step=True)
        bridge = SharedVllmBridge(cfg, model_path, tmp_path, torch.device("cuda"))
        model = bridge.attach()
        original = [p.detach().clone() for p in bridge.shared]
        metrics = assert_staged_step_lands_the_in_place_values(bridge, model, server.url, ids, original,
                                                               list(range(len(original))), "adamw8bit", lr=1e-3,
                                                               chunk_elements=2**22)
        RESULTS["staged_step"] = {"gate_closed_seconds": metrics["sync/gate_closed_seconds"],
                                  "write_bytes": metrics["sync/write_bytes"]}
        save_results(tmp_path)
    finally:
        if bridge is not None:
            bridge.close()
        server.stop()
