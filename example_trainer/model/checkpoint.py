"""Checkpoints: HF folders vLLM and transformers load, plus the trainer state needed to resume."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch

logger = logging.getLogger("onecopy.trainer.checkpoint")

TRAINER_STATE = "trainer_state.pt"
ADAPTER_CONFIG = "adapter_config.json"  # a LoRA checkpoint: the adapter, naming its base model inside


def base_model_folder(model_path: str) -> str:
    """The folder whose config.json describes the model: ``model_path`` itself, or for a LoRA
    checkpoint (an adapter, no config.json) the base model its adapter names."""
    adapter_config = Path(model_path) / ADAPTER_CONFIG
    if adapter_config.exists():
        return json.loads(adapter_config.read_text())["base_model_name_or_path"]
    return model_path


def save_hf_checkpoint(model: torch.nn.Module, tokenizer, folder: Path, state: dict | None = None) -> Path:
    """Safetensors (bf16) + config + tokenizer: loadable by ``from_pretrained`` and ``vllm serve``.
    ``state``: the tensors to write (default: the model's own)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16) for k, v in (model.state_dict() if state is None else state).items()}
    model.save_pretrained(folder, state_dict=state, safe_serialization=True)
    # save_pretrained writes the parameters' dtype into the config (fp32 masters, a meta model's);
    # the tensors written are bf16, so the config says bf16, written again through its own API.
    for config in (model.config, *(getattr(model.config, key) for key in getattr(model.config, "sub_configs", {}))):
        if config is not None:
            config.dtype = torch.bfloat16
    model.config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def trainer_state_name(rank: int = 0) -> str:
    """Rank 0's trainer state is ``trainer_state.pt``; a tensor-parallel rank r > 0 keeps its
    shard's masters and optimizer state in ``trainer_state.rank<r>.pt`` beside it."""
    return TRAINER_STATE if rank == 0 else f"trainer_state.rank{rank}.pt"


def save_trainer_state(folder: Path, step: int, optimizer: torch.optim.Optimizer, extra: dict, rank: int = 0) -> None:
    """Optimizer state and step, written beside an HF checkpoint (temp file + rename)."""
    folder = Path(folder)
    name = trainer_state_name(rank)
    tmp = folder / (name + ".tmp")
    torch.save({"step": step, "optimizer": optimizer.state_dict(), **extra}, tmp)
    tmp.replace(folder / name)
    logger.info("[checkpoint] step %d saved to %s", step, folder)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The resumable checkpoint with the highest step under ``run_dir/checkpoints``."""
    found = []
    for folder in (Path(run_dir) / "checkpoints").glob("step_*"):
        if (folder / TRAINER_STATE).exists() and folder.name[5:].isdigit():
            found.append((int(folder.name[5:]), folder))
    return max(found)[1] if found else None


def prune_checkpoints(run_dir: Path, save_total_limit: int, in_use: list[Path] = ()) -> list[Path]:
    """Delete the ``run_dir/checkpoints/step_*`` folders older than the ``save_total_limit`` newest,
    never the newest resumable one nor one ``in_use`` (0 = keep all). Returns the deleted folders."""
    if save_total_limit <= 0:
        return []
    folders = sorted(((int(f.name[5:]), f) for f in (Path(run_dir) / "checkpoints").glob("step_*")
                      if f.name[5:].isdigit()), reverse=True)
    keep = {f for _, f in folders[:save_total_limit]}
    resumable = [f for _, f in folders if (f / TRAINER_STATE).exists()]
    keep.update(resumable[:1])
    keep.update(f for _, f in folders if any(f.resolve() == Path(p).resolve() for p in in_use))
    removed = [f for _, f in folders if f not in keep]
    for folder in removed:
        shutil.rmtree(folder)
        logger.info("[checkpoint] deleted %s (--save-total-limit %d)", folder, save_total_limit)
    return removed
