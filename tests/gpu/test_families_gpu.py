"""Each supported family at a real model's shapes and vocabulary on a GPU (random weights that vLLM
draws itself, ``--load-format dummy``): HF logprobs from the attached views against vLLM's, the
sync time of a full-parameter write, and the memory single copy saves against mode none's layout
(vLLM's own weights + the trainer's bf16 model; fp32 masters in both). Skipped without CUDA.

On the device (after the bundle loads, docs/gpu.md):
    ONECOPY_FAMILY_SHAPES="qwen3-8b qwen3-30b-a3b-8l" python3 -m pytest tests/gpu/test_families_gpu.py -q -s
Results: $OUT/families_gpu.json (one entry per shape, written as each finishes).
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import time
from pathlib import Path

import pytest
import torch

from bench.common import gpu_used_mib
from bench.shapes import SHAPES, shape_folder
from example_trainer.model.families import FAMILIES
from tests.weight_checks import MAX_ABS_TOL, MEAN_ABS_TOL, chat_prompts, hf_logprobs, vllm_logprobs
from tests.gpu.results import results_folder

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# (shape in bench/shapes.py, layers or None for all): every supported family at a real
# checkpoint's shapes; Qwen3-30B-A3B with 8 of its 48 layers, to fit beside its none layout.
RUNS: dict[str, tuple[str, int | None]] = {
    "qwen3-8b": ("qwen3-8b", None),
    "qwen3-30b-a3b-8l": ("qwen3-30b-a3b", 8),
    "mistral-7b": ("mistral-7b", None),
    "phi3-mini": ("phi3-mini", None),
    "olmo2-7b": ("olmo2-7b", None),
    "olmo3-7b": ("olmo3-7b", None),
    "gemma3-1b": ("gemma3-1b", None),
}
RESULTS: dict[str, dict] = {}


def selected() -> list[str]:
    """The runs to make ($ONECOPY_FAMILY_SHAPES, default all) whose family single copy supports."""
    names = os.environ.get("ONECOPY_FAMILY_SHAPES", "").split() or list(RUNS)
    return [n for n in names if SHAPES[RUNS[n][0]][0] in FAMILIES]


def total_gpu_mib() -> int:
    """This process's GPU memory and that of the vLLM it started (other work may share the GPU)."""
    gc.collect()
    torch.cuda.empty_cache()
    return sum(gpu_used_mib(tree_of=os.getpid()).values())


def server(model: str, logdir: Path, shared: bool):
    from example_trainer.bridges import bridge_class
    from example_trainer.config import TrainerConfig
    from example_trainer.inference import launch_inference
    from tests.conftest import free_port

    cfg = TrainerConfig(weight_bridge_mode="shared_vllm" if shared else "none", model_name=model, seq_len=1024,
                        vllm_server_port=free_port(),
                        vllm_kv_cache_bytes=2 * 2**30, vllm_server_timeout=900,
                        vllm_extra_args="--load-format dummy --enforce-eager")
    env = None if shared else {"VLLM_ENABLE_SHARED_WEIGHTS": "0"}
    running = launch_inference(cfg, logdir, bridge_class(cfg.weight_bridge_mode), env=env)
    t0 = time.perf_counter()
    running.start(model)
    running.start_seconds = time.perf_counter() - t0
    return running, cfg


@pytest.mark.parametrize("name", selected())
def test_family_at_real_shape_on_gpu(name, tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from example_trainer.bridges.shared_vllm import SharedVllmBridge

    from example_trainer.model.default_model import default_model_path

    root = tmp_path_factory.getbasetemp()
    shape, layers = RUNS[name]
    # The first tokenizer folder there is (SMOLLM2_DIR may be named before its weights arrive).
    tokenizer = next((d for d in (os.environ.get("SMOLLM2_DIR"), os.environ.get("SMOLLM2_CONFIG_DIR"))
                      if d and any((Path(d) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))),
                     None) or default_model_path()
    model_path, _ = shape_folder(shape, tokenizer, root, layers)
    architecture, _, values = SHAPES[shape]
    vocab = values["vocab_size"]
    tok = AutoTokenizer.from_pretrained(model_path)
    prompts = [[t % vocab for t in ids] for ids in chat_prompts(tok)]
    result: dict = {"shape": name, "architecture": architecture}
    before_mib = total_gpu_mib()
    logdir = tmp_path_factory.mktemp(f"{name}-shared")
    running, cfg = server(model_path, logdir, shared=True)
    bridge = None
    try:
        result["vllm_start_seconds"] = running.start_seconds
        cfg.launch_vllm, cfg.vllm_config_path = False, str(logdir / "vllm_bridge_config.json")
        bridge = SharedVllmBridge(cfg, model_path, logdir, torch.device("cuda"))
        t0 = time.perf_counter()
        model = bridge.attach()
        result["attach_seconds"] = time.perf_counter() - t0
        result["params"] = sum(p.numel() for p in bridge.shared)
        served = [vllm_logprobs(running.url, ids) for ids in prompts]
        diffs = [(hf_logprobs(model, ids) - v).abs() for ids, v in zip(prompts, served)]
        result["parity_max"] = max(d.max().item() for d in diffs)
        result["parity_mean"] = statistics.fmean(d.mean().item() for d in diffs)
        result["shared_total_mib"] = total_gpu_mib() - before_mib
        syncs = [bridge.sync(model, step=i, final=False) for i in range(1, 7)]
        for key in ("sync/seconds", "sync/write_seconds", "sync/gate_wait_seconds"):
            result[key + "_median"] = statistics.median(s[key] for s in syncs[1:])
        result["sync/bytes_moved"] = max(s["sync/bytes_moved"] for s in syncs)
    finally:
        if bridge is not None:
            bridge.close()
        running.stop()
        model = None
    # Mode none's layout: vLLM's own copy + the trainer's bf16 model and its fp32 masters (single
    # copy keeps the masters too: the difference is the bf16 copy).
    from example_trainer.bridges.master_weights import MasterWeights

    logdir = tmp_path_factory.mktemp(f"{name}-none")
    running, _ = server(model_path, logdir, shared=False)
    try:
        with torch.device("cuda"):
            plain = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path), dtype=torch.bfloat16)
        masters = MasterWeights(list(plain.parameters()))
        result["none_total_mib"] = total_gpu_mib() - before_mib
        del plain, masters
    finally:
        running.stop()
    result["bf16_copy_mib"] = result["params"] * 2 / 2**20
    result["saved_mib"] = result["none_total_mib"] - result["shared_total_mib"]
    RESULTS[name] = result
    out = results_folder(root)
    (out / "families_gpu.json").write_text(json.dumps(RESULTS, indent=2))
    print(json.dumps(result, indent=2))
    assert result["parity_max"] < MAX_ABS_TOL and result["parity_mean"] < MEAN_ABS_TOL, result
    # Single copy holds no second bf16 copy.
    assert result["saved_mib"] > 0.9 * result["bf16_copy_mib"], result
