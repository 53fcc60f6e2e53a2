"""Process and measurement functions shared by the benchmark scripts."""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import statistics
import threading
from pathlib import Path
from typing import Optional

import torch


class Poller:
    """Calls ``poll()`` every ``every`` seconds in a thread, inside a ``with`` block."""

    def __init__(self, every: float) -> None:
        self.every = every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def poll(self) -> bool:
        """One sample; return False to stop polling."""
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.wait(self.every) and self.poll():
            pass

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def visible_gpus() -> list[str]:
    """``nvidia-smi`` arguments that select the GPUs this process may use (all when unrestricted).

    The lanes of bench/lanes.py pin each benchmark to one GPU with CUDA_VISIBLE_DEVICES (and
    CUDA_DEVICE_ORDER=PCI_BUS_ID, so that its indices are nvidia-smi's).
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    return ["--id=" + visible] if visible.replace(",", "").isdigit() else []


def gpu_used_mib_per_gpu() -> dict[tuple[str, int], int]:
    """Memory per (GPU bus id, process) on the visible GPUs as the driver reports it (not only
    PyTorch's allocator); a process on several GPUs has a row per GPU. Rows without a number
    ("[N/A]") are left out. Raises FileNotFoundError without an NVIDIA driver, CalledProcessError
    when the query fails."""
    out = subprocess.run(["nvidia-smi", *visible_gpus(), "--query-compute-apps=gpu_bus_id,pid,used_memory",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True, check=True).stdout
    used: dict[tuple[str, int], int] = {}
    for line in out.strip().splitlines():
        try:
            bus, pid, mib = (x.strip() for x in line.split(","))
            used[(bus, int(pid))] = used.get((bus, int(pid)), 0) + int(mib)
        except ValueError:
            continue
    return used


def gpu_used_mib(tree_of: Optional[int] = None) -> dict[int, int]:
    """Memory per process on the visible GPUs (summed over the GPUs it uses), as
    ``gpu_used_mib_per_gpu`` reads it; with ``tree_of``, only that process and its descendants
    (a test's own trainer and the vLLM it started, whatever else shares the GPU)."""
    mine = process_tree(tree_of) if tree_of is not None else None
    used: dict[int, int] = {}
    for (_, pid), mib in gpu_used_mib_per_gpu().items():
        if mine is None or pid in mine:
            used[pid] = used.get(pid, 0) + mib
    return used


def process_tree(root: int) -> set[int]:
    """``root`` and every live process descended from it (Linux /proc)."""
    return descendants(root, parent_pids()) | {root}


def parent_pids() -> dict[int, int]:
    """Each live process's parent, read from /proc now."""
    parent = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):  # a process that ended while being read
                continue
    return parent


def descendants(root: int, parent: dict[int, int]) -> set[int]:
    """The processes below ``root`` in ``parent`` (pid -> parent pid), ``root`` left out."""
    tree, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, ppid in parent.items() if ppid in frontier and pid not in tree}
        tree |= frontier
    return tree


def host_used_mib() -> int:
    """The machine's host memory in use now (MemTotal - MemAvailable, MiB): every process of a run
    together, whatever its process tree."""
    info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return (int(info["MemTotal"].split()[0]) - int(info["MemAvailable"].split()[0])) // 1024


class GpuMemoryPeak(Poller):
    """Samples the driver's used memory of the visible GPUs (all processes) every 0.2 s; ``peak_mib``
    (the sum over the GPUs), ``per_gpu_peak_mib`` (each GPU's own peak)."""

    def __init__(self) -> None:
        super().__init__(every=0.2)
        self.peak_mib = 0
        self.per_gpu_peak_mib: list[int] = []
        self.command = ["nvidia-smi", *visible_gpus(), "--query-gpu=memory.used", "--format=csv,noheader,nounits"]

    def poll(self) -> bool:
        try:
            out = subprocess.run(self.command, capture_output=True, text=True)
        except FileNotFoundError:
            return False  # no NVIDIA driver (a CPU smoke run): the peak stays 0
        if out.returncode == 0:
            used = [int(x) for x in out.stdout.split()]
            self.peak_mib = max(self.peak_mib, sum(used))
            self.per_gpu_peak_mib = [max(a, b) for a, b in zip(self.per_gpu_peak_mib, used)] or used
        return True


def add_model_source(parser) -> None:
    """The benchmarks' shared flags: which model (a folder, or a random 1.5B built here), or only the
    table of earlier runs; and the model's label."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="model folder (HF format)")
    source.add_argument("--random-qwen2", metavar="TOKENIZER_DIR", help="build a random ~1.4B Qwen2-style model")
    source.add_argument("--random-shape", nargs=2, metavar=("SHAPE", "TOKENIZER_DIR"),
                        help="random bf16 weights of a real model's shape and vocabulary (bench/shapes.py), written "
                             "under --out once")
    source.add_argument("--table", nargs="+", metavar="JSON", help="print the tables of earlier runs and exit")
    parser.add_argument("--name", default="model", help="label of the model in the tables and the file name")


def model_from_source(args, out: Path) -> str:
    """The model folder ``add_model_source``'s flags name, built under ``out`` when random."""
    if args.model:
        return args.model
    if args.random_qwen2:
        return random_qwen2(out / "random-qwen2-1.5b", args.random_qwen2)
    from bench.shapes import random_weights_folder

    return random_weights_folder(args.random_shape[0], args.random_shape[1], out / "shapes")


def random_qwen2(path: Path, tokenizer_dir: str) -> str:
    """A random-weight Qwen2-style model of ~1.4B parameters (Qwen2-1.5B's shapes, SmolLM2's tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    if (path / "config.json").exists():
        return str(path)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                      num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    cfg.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def device_copy_GBps(size_bytes: int = 2**31, repeats: int = 20) -> float:
    """The device's copy bandwidth: a large device-to-device copy, bytes read + written, median.

    Two buffer pairs alternate so that no copy reads what the L2 cache still holds.
    """
    pairs = [(torch.randn(size_bytes // 4, device="cuda"), torch.empty(size_bytes // 4, device="cuda"))
             for _ in range(2)]
    times = []
    for i in range(repeats + 3):
        src, dst = pairs[i % 2]
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 3:  # warm-up
            times.append(begin.elapsed_time(end) / 1e3)
    assert torch.equal(pairs[0][0], pairs[0][1]), "the copy did not land"
    del pairs, src, dst  # give the memory back: the modes measured next count every process's use
    torch.cuda.empty_cache()
    return 2 * size_bytes / statistics.median(times) / 1e9


def add_settings_flags(parser: argparse.ArgumentParser, settings_cls: type, notes: dict[str, str] | None = None) -> None:
    """One ``--flag`` per field of the dataclass ``settings_cls``, default None (the field's own
    default applies, see ``settings_from_flags``); ``notes`` adds to a field's help."""
    for key, value in dataclasses.asdict(settings_cls()).items():
        kind = (lambda s: s.lower() in ("1", "true", "yes", "on")) if isinstance(value, bool) else type(value)
        parser.add_argument("--" + key.replace("_", "-"), type=kind, default=None,
                            help=f"default {value}" + (notes or {}).get(key, ""))


def given_settings(args: argparse.Namespace, settings_cls: type) -> dict:
    """The fields of ``settings_cls`` given on the command line (``add_settings_flags``)."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(settings_cls) if getattr(args, f.name) is not None}


def process_tree_rss_mib(marker: bytes) -> tuple[int, int]:
    """Host memory resident now (Linux /proc, MiB) of the first process whose command line holds
    ``marker``, and of all its descendants together ((0, 0) when there is none). Shared pages count
    in every process that maps them."""
    page_mib = os.sysconf("SC_PAGE_SIZE") / 2**20
    parent, rss, root = parent_pids(), {}, None
    for pid in parent:
        try:
            rss[pid] = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * page_mib
            if root is None and marker in Path(f"/proc/{pid}/cmdline").read_bytes():
                root = pid
        except (OSError, ValueError, IndexError):  # a process that ended while being read
            continue
    if root is None:
        return 0, 0
    tree = descendants(root, parent)
    return round(rss[root]), round(sum(rss.get(pid, 0) for pid in tree))


def last_error_line(log_text: str) -> str | None:
    """The last line of a run's log that names an error (a Python traceback's last line, an
    out-of-memory with what it tried to allocate), or None."""
    errors = [line for line in log_text.splitlines() if "Error" in line]
    return errors[-1] if errors else None
