"""Several benchmarks at once on one multi-GPU host, one GPU per lane, then one archive.

    python bench/lanes.py smollm2 --out /tmp/bench --archive bench_smollm2.tar.gz --seconds 540
    python bench/lanes.py qwen2   --out /tmp/bench --archive bench_qwen2.tar.gz --seconds 540

One vLLM start takes 1-3 minutes, so every mode at two sizes, the patch overhead and the learning
run (docs/results.md) take about 40 minutes one after the other on one GPU. Here each lane is a list
of commands run one after the other on its own GPU (CUDA_VISIBLE_DEVICES, its own compile caches),
the lanes run at the same time, and no lane shares a GPU, so no measurement sees another's GPU
load (they do share the host's CPUs). With fewer GPUs than lanes, lanes share GPUs and run one
after another (``--gpus``); ``--only`` picks commands by tag.

Plan ``smollm2``: SmolLM2-135M in all four modes, the patch overhead, the learning run, and the
random 1.5B model for plan ``qwen2``. Plan ``qwen2``: the 1.5B model in all four modes, the patch
overhead and the single-copy GPU test at 135M. Needs $SMOLLM2_DIR (the model,
``python -m example_trainer.model.default_model`` prints it) and $SMOLLM2_CONFIG_DIR (a folder with its
tokenizer and config; the same folder does). Every lane stops at the deadline; what finished is
kept.
"""

from __future__ import annotations

import argparse
import fnmatch
import io
import json
import os
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import random_qwen2  # noqa: E402
from bench.modes import print_tables  # noqa: E402
from example_trainer.launcher import start  # noqa: E402
from example_trainer.engine.vllm_process import stop_group  # noqa: E402

ARCHIVED = ("modes_*.json", "lanes_*.json", "learning.json", "gpu_results.json", "metrics.jsonl", "*.log", "*.csv",
            "*.png")
MAX_FILE_BYTES = 512 * 1024  # keep the tail of longer logs: the archive must come back from the device


def modes(out: Path, name: str, model: str, part: str, *args: str) -> tuple[str, list[str]]:
    return part, ["bench/modes.py", "--model", model, "--name", name, "--part", part, "--out", str(out / "modes"),
                  *args]


Command = tuple[str, list[str]]  # (tag for --only, python arguments)


def plan(which: str, out: Path) -> list[list[Command]]:
    """Lanes (one GPU each), each a list of tagged python argument lists run in order."""
    qwen2 = str(out / "qwen2-random")
    if which == "smollm2":
        model, name = os.environ["SMOLLM2_DIR"], "smollm2-135m"
        return [
            [modes(out, name, model, "none", "--modes", "none", "--steps", "3", "--no-overhead"),
             modes(out, name, model, "shared_vllm", "--modes", "shared_vllm", "--steps", "8", "--no-overhead")],
            [modes(out, name, model, "lora_restart", "--modes", "lora_restart", "--steps", "3", "--no-overhead"),
             ("qwen2_model", ["-c", "from bench.common import random_qwen2; random_qwen2(__import__('pathlib')"
                                    f".Path({qwen2!r}), {os.environ['SMOLLM2_CONFIG_DIR']!r})"])],
            [modes(out, name, model, "lora_only", "--modes", "lora_only", "--steps", "8", "--no-overhead"),
             modes(out, name, model, "overhead", "--modes")],
            [("learning", ["bench/learning_run.py", "--out", str(out / "learning"), "--model", model, "--steps", "80",
                           "--batch-size", "64", "--group-size", "16", "--lr", "1e-5", "--eval-items", "400",
                           "--workers", "8"])],
        ]
    if which == "qwen2":
        name, accumulate = "qwen2-random-1.5b", ["--trainer-args", "--gradient-accumulation-steps 8"]
        return [
            [modes(out, name, qwen2, "none", "--modes", "none", "--steps", "3", "--no-overhead", *accumulate),
             modes(out, name, qwen2, "shared_vllm", "--modes", "shared_vllm", "--steps", "6", "--no-overhead",
                   *accumulate)],
            [modes(out, name, qwen2, "lora_restart", "--modes", "lora_restart", "--steps", "3", "--no-overhead",
                   *accumulate),
             modes(out, name, qwen2, "lora_only", "--modes", "lora_only", "--steps", "6", "--no-overhead",
                   *accumulate)],
            [modes(out, name, qwen2, "overhead", "--modes")],
            # the 135M case only: both cases took 539 s on the H100, more than a lane has
            [("gpu_test", ["-m", "pytest", "tests/gpu/test_shared_vllm_gpu.py", "-k", "smollm2", "-q", "-s", "-p",
                           "no:cacheprovider"])],
        ]
    raise ValueError(f"unknown plan {which!r}: smollm2 or qwen2")


def assign(lanes: list[list[Command]], gpus: int, only: list[str] | None) -> list[list[list[str]]]:
    """The commands for each of ``gpus`` GPUs: lane i goes to GPU i % gpus (after the ones before
    it there), keeping only the tags in ``only`` when given."""
    per_gpu: list[list[list[str]]] = [[] for _ in range(min(gpus, len(lanes)))]
    for i, lane in enumerate(lanes):
        per_gpu[i % len(per_gpu)] += [args for tag, args in lane if only is None or tag in only]
    return per_gpu


def run_lane(gpu: int, commands: list[list[str]], out: Path, deadline: float, report: dict) -> None:
    """Run ``commands`` in order on GPU ``gpu`` until done or past ``deadline``."""
    env = {"CUDA_VISIBLE_DEVICES": str(gpu), "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
           "VLLM_CACHE_ROOT": str(out / f"cache{gpu}" / "vllm"),
           "TORCHINDUCTOR_CACHE_DIR": str(out / f"cache{gpu}" / "inductor"),
           "TRITON_CACHE_DIR": str(out / f"cache{gpu}" / "triton"), "OUT": str(out / f"lane{gpu}")}
    (out / f"lane{gpu}").mkdir(parents=True, exist_ok=True)
    for i, args in enumerate(commands):
        log, t0 = out / f"lane{gpu}" / f"command{i}.log", time.perf_counter()
        proc = start(args, log, env)
        try:
            code: int | str = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            stop_group(proc)  # SIGTERM first: each benchmark then stops the servers it started
            code = "deadline"
        report.setdefault(f"gpu{gpu}", []).append(
            {"command": " ".join(args)[:300], "exit": code, "seconds": round(time.perf_counter() - t0, 1)})
        print(f"[lanes] gpu{gpu} command {i} exit={code} {time.perf_counter() - t0:.0f}s: {' '.join(args)[:120]}",
              flush=True)
        if code == "deadline":
            return


def archive(out: Path, target: Path) -> None:
    """Results and logs under ``out`` into one .tar.gz (caches and model files left out)."""
    with tarfile.open(target, "w:gz") as tar:
        for path in sorted(out.rglob("*")):
            top = path.relative_to(out).parts[0]
            if top.startswith("cache") or top == "qwen2-random" or not path.is_file():
                continue
            if not any(fnmatch.fnmatch(path.name, pattern) for pattern in ARCHIVED):
                continue
            data = path.read_bytes()
            data = data[-MAX_FILE_BYTES:] if path.suffix == ".log" else data
            info = tarfile.TarInfo(str(path.relative_to(out)))
            info.size, info.mtime = len(data), int(path.stat().st_mtime)
            tar.addfile(info, io.BytesIO(data))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("plan", choices=["smollm2", "qwen2"])
    p.add_argument("--out", default="/tmp/bench")
    p.add_argument("--archive", required=True, help="the .tar.gz to write (results and logs)")
    p.add_argument("--seconds", type=float, default=540, help="deadline of every lane")
    p.add_argument("--gpus", type=int, default=max(1, torch.cuda.device_count()),
                   help="GPUs to spread the lanes over (default: all); lanes that share a GPU run one after another")
    p.add_argument("--only", nargs="+", metavar="TAG", help="run only these commands (a mode, 'overhead', "
                   "'learning', 'gpu_test', 'qwen2_model')")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + a.seconds
    per_gpu = assign(plan(a.plan, out), a.gpus, a.only)
    qwen2 = out / "qwen2-random"
    if a.plan == "qwen2" and any(str(qwen2) in args for commands in per_gpu for args in commands):
        random_qwen2(qwen2, os.environ["SMOLLM2_CONFIG_DIR"])  # once here, not by each lane at the same time
    report: dict = {}
    lanes = [threading.Thread(target=run_lane, args=(gpu, commands, out, deadline, report))
             for gpu, commands in enumerate(per_gpu)]
    for lane in lanes:
        lane.start()
    for lane in lanes:
        lane.join()
    (out / f"lanes_{a.plan}.json").write_text(json.dumps(report, indent=2))
    archive(out, Path(a.archive))
    print(f"[lanes] archive {a.archive}: {Path(a.archive).stat().st_size / 1e6:.1f} MB", flush=True)
    results = [json.loads(f.read_text()) for f in sorted((out / "modes").glob("modes_*.json"))]
    if results:
        print_tables(results)
    for summary in [out / "learning" / "learning.json", *sorted(out.glob("lane*/gpu_results.json"))]:
        if summary.exists():
            print(f"[lanes] {summary.name}: {summary.read_text()[:1500]}")


if __name__ == "__main__":
    main()
