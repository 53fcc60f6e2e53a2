"""Server mode's check of what vLLM serves: a checksum of every tensor vLLM holds, read from its
memory (GET /weights/digest), against the same tensors built from the trainer's weights."""

from __future__ import annotations

import hashlib

import requests
import torch

from example_trainer.bridges.hf_mapping import map_hf_parameter


def workers(url: str) -> list[dict]:
    """Every worker's digest, engine by engine: {weights_version, tp_rank, engine, tensors}."""
    answer = requests.get(f"{url}/weights/digest", timeout=300)
    answer.raise_for_status()
    return answer.json()["workers"]


def served(url: str) -> tuple[int, dict[str, dict]]:
    """(weights version, {vLLM name: {sha256, shape, dtype}}) of the one worker (tensor parallel 1)."""
    (worker,) = workers(url)
    return worker["weights_version"], worker["tensors"]


def sha256(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def expected(hf_weights: dict[str, torch.Tensor], architecture: str, config, layout: dict[str, dict]) -> dict[str, str]:
    """The checksum each vLLM tensor of ``layout`` (names, shapes, dtypes) has if it holds
    ``hf_weights``: fused tensors assembled from their HF row blocks, tied weights once."""
    built = {name: torch.zeros(spec["shape"], dtype=getattr(torch, spec["dtype"])) for name, spec in layout.items()}
    filled = {name: 0 for name in layout}
    for hf_name, value in hf_weights.items():
        if hf_name == "lm_head.weight" and getattr(config, "tie_word_embeddings", False):
            continue  # a checkpoint may hold the tied head; vLLM holds it once, as the embedding
        where = map_hf_parameter(architecture, hf_name, config)
        assert where is not None and where.vllm_name in built, f"{hf_name} has no place in vLLM's tensors"
        target = built[where.vllm_name]
        if where.rows == -1:
            target.copy_(value)
            filled[where.vllm_name] += target.shape[0]
        else:
            target[where.start:where.start + where.rows].copy_(value)
            filled[where.vllm_name] += where.rows
    unfilled = [name for name, rows in filled.items() if rows < layout[name]["shape"][0]]
    assert not unfilled, f"vLLM tensors no trainer weight fills: {unfilled[:3]}"
    return {name: sha256(tensor) for name, tensor in built.items()}


def differing(url: str, hf_weights: dict[str, torch.Tensor], architecture: str, config) -> tuple[int, list[str]]:
    """(vLLM's weights version, the vLLM tensors whose bytes differ from ``hf_weights``')."""
    version, layout = served(url)
    want = expected(hf_weights, architecture, config, layout)
    return version, [name for name, spec in layout.items() if spec["sha256"] != want[name]]


def differing_per_engine(url: str, hf_weights: dict[str, torch.Tensor], architecture: str, config
                         ) -> list[tuple[int, int, list[str]]]:
    """(engine, its weights version, its tensors whose bytes differ from ``hf_weights``') for each
    engine of a data-parallel vLLM (tensor parallel 1: one worker per engine)."""
    out = []
    for worker in workers(url):
        want = expected(hf_weights, architecture, config, worker["tensors"])
        out.append((worker["engine"], worker["weights_version"],
                    [name for name, spec in worker["tensors"].items() if spec["sha256"] != want[name]]))
    return out
