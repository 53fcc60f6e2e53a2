"""Peak GPU memory of full-parameter GRPO in mode shared_vllm, per model shape and optimizer setting.

    python bench/memory.py --out OUT --shapes qwen2.5-1.5b llama3.1-8b --configs adamw lean8 [--tokenizer DIR]
    python bench/memory.py --table OUT/memory_*.json          # the markdown table of earlier runs

Each run is the real loop (API + arithmetic environment + trainer, which starts vLLM) on a model
with a real model's shapes and vocabulary size and random weights: vLLM draws them itself
(``--load-format dummy``), so nothing is written to disk but the config and a tokenizer, SmolLM2's
padded with never-encoded entries up to the vocabulary size (every embedding row counts, as in
the real model). vLLM generates while the trainer trains (random weights write until max_tokens,
so every sequence is about --seq-len long); a GRPO step takes --batch-size sequences one at a time
(gradient accumulation). Memory is the driver's per process (nvidia-smi, every 0.2 s): the
trainer's process and the sum of vLLM's; the trainer's bytes per parameter are what it holds
beyond the shared weights (those are vLLM's allocation). One JSON per run goes to OUT, written
as soon as the run ends, so a run cut short keeps what it finished.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import (Poller, gpu_used_mib_per_gpu, host_used_mib, last_error_line,  # noqa: E402
                          process_tree_rss_mib)
from bench.shapes import SHAPES, shape_folder  # noqa: E402
from example_trainer.config import TrainerConfig  # noqa: E402
from example_trainer.launcher import LoopConfig, run_loop  # noqa: E402
from example_trainer.memory_plan import PHASE_METRICS  # noqa: E402

# Optimizer settings: fp32 masters (the default) or none (the optimizer steps vLLM's bf16 weights).
CONFIGS = {
    "adamw": ["--optimizer", "adamw"],
    "adamw8bit": ["--optimizer", "adamw8bit"],
    # the trainer's profiles (example_trainer/profiles.py): one table of the settings that belong together
    "lean8": ["--profile", "lean"],
    "lean4": ["--profile", "lean4"],
    # the moments in host memory between steps (--offload-optimizer): the 14B shapes on one H100
    "lean8-offload": ["--profile", "offload"],
    "lean4-offload": ["--optimizer", "adamw4bit", "--bf16-inplace", "--offload-optimizer"],
    # lean8 with whole tensors stepped at once (before --optimizer-chunk-elements): the A/B of the chunking
    "lean8-whole": ["--optimizer", "adamw8bit", "--bf16-inplace", "--optimizer-chunk-elements", "0"],
    # the gradients in host memory too, the whole batch in one micro-batch (each extra one would take
    # the gradients to the GPU and back once more)
    "lean8-offload-grads": ["--profile", "offload-grads"],
}


def config_settings(config: str) -> dict:
    """The optimizer settings a CONFIGS row gives the trainer (its profile's, then its own flags)."""
    from environments.config_flags import parse_config

    cfg = parse_config(TrainerConfig, CONFIGS[config])
    return {key: getattr(cfg, key) for key in ("optimizer", "bf16_inplace", "offload_optimizer", "offload_gradients")}


def micro_batches(config: str, batch_size: int) -> int:
    """Micro-batches per step: the config's own --gradient-accumulation-steps (or its profile's),
    else one sequence each."""
    from example_trainer.profiles import PROFILES

    flags = CONFIGS[config]
    if "--gradient-accumulation-steps" in flags:
        return int(flags[flags.index("--gradient-accumulation-steps") + 1])
    profile = PROFILES[flags[flags.index("--profile") + 1]] if "--profile" in flags else {}
    return int(profile.get("gradient_accumulation_steps", batch_size))


# The trainer's allocator per phase (max over steps): which part of the step sets the peak.
PHASE_KEYS = tuple(key for pair in PHASE_METRICS.values() for key in pair)
MIB = 2**20


class ProcessMemoryPeak(Poller):
    """Per-process GPU memory from the driver every 0.2 s: the trainer's peak, vLLM's (all its
    processes summed) and the total's; under tensor parallelism also each one's peak on its
    busiest GPU (``*_gpu``: what must fit on one GPU), and the machine's host memory in use."""

    def __init__(self) -> None:
        super().__init__(every=0.2)
        self.peak = {"trainer": 0, "vllm": 0, "total": 0, "trainer_host": 0, "vllm_host": 0,
                     "trainer_gpu": 0, "vllm_gpu": 0, "total_gpu": 0, "host_used": 0}
        self.trainer_pids: dict[int, bool] = {}
        self.gpu = True  # False once nvidia-smi is found missing (a CPU smoke run: host memory only)

    def is_trainer(self, pid: int) -> bool:
        """Decided at a process's first sighting: an exiting trainer still holds its memory while
        its command line already reads empty (seen on an H100: it was counted as vLLM's)."""
        if pid not in self.trainer_pids:
            try:
                self.trainer_pids[pid] = b"example_trainer.grpo" in Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                return False
        return self.trainer_pids[pid]

    def poll(self) -> bool:
        # Host memory: the trainer's own, and its children's (the vLLM server it started) together.
        host = dict(zip(("trainer_host", "vllm_host"), process_tree_rss_mib(b"example_trainer.grpo")))
        host["host_used"] = host_used_mib()
        self.peak.update({k: max(self.peak[k], v) for k, v in host.items()})
        if not self.gpu:
            return True
        try:
            per_gpu_process = gpu_used_mib_per_gpu()
        except FileNotFoundError:
            self.gpu = False  # no NVIDIA driver (a CPU smoke run)
            return True
        except subprocess.CalledProcessError:
            return True  # a failed query: try again at the next poll
        used = {"trainer": 0, "vllm": 0}
        on_gpu: dict[str, dict[str, int]] = {}
        for (gpu, pid), mib in per_gpu_process.items():
            kind = "trainer" if self.is_trainer(pid) else "vllm"
            used[kind] += mib
            on_gpu.setdefault(gpu, {"trainer": 0, "vllm": 0})[kind] += mib
        used["total"] = used["trainer"] + used["vllm"]
        for kind in ("trainer", "vllm"):
            used[f"{kind}_gpu"] = max((gpu[kind] for gpu in on_gpu.values()), default=0)
        used["total_gpu"] = max((gpu["trainer"] + gpu["vllm"] for gpu in on_gpu.values()), default=0)
        self.peak.update({k: max(self.peak[k], v) for k, v in used.items()})
        return True


def run_one(shape: str, config: str, args, model: str, params: int) -> dict:
    tp = f"_tp{args.tensor_parallel}" if args.tensor_parallel > 1 else ""
    out = Path(args.out) / f"run_{shape}_{config}{tp}"
    parts = micro_batches(config, args.batch_size)
    trainer_args = ["--gradient-accumulation-steps", str(parts), "--learning-rate", "1e-6",
                    "--vllm-kv-cache-bytes", str(args.kv_gib * 2**30), "--save-steps", "-1",
                    "--vllm-extra-args", "--load-format dummy " + args.vllm_args, "--benchmark", *CONFIGS[config]]
    env_args = ["--env.max_tokens", str(args.seq_len - 128), "--env.ensure_scores_are_not_same", "false",
                "--env.max_num_workers", "8", "--env.difficulty", "1"]
    gpus = args.tensor_parallel
    cfg = LoopConfig(run_dir=str(out), num_generations=4, timeout=args.run_timeout, env_args=shlex.join(env_args),
                     echo=r"\[trainer\] (step|done)|Error|ERROR|\[memory\]", gpus=gpus,
                     trainer=TrainerConfig(weight_bridge_mode="shared_vllm", max_steps=args.steps, model_name=model,
                                           batch_size=args.batch_size, seq_len=args.seq_len,
                                           parallel="tensor" if gpus > 1 else "none"))
    t0 = time.time()
    with ProcessMemoryPeak() as memory:
        result = run_loop(cfg, trainer_args)
    steps = [m for m in result.metrics if "time/step" in m]
    timed = steps[1:] or steps  # the first step compiles and warms up
    row = {"shape": shape, "config": config, "params": params, "gpus": gpus, "seq_len": args.seq_len,
           "batch_size": args.batch_size, "micro_batches": parts, "kv_cache_gib": args.kv_gib,
           "returncode": result.returncode,
           "steps_done": len(steps), "seconds": round(time.time() - t0, 1),
           "trainer_peak_mib": memory.peak["trainer"], "vllm_peak_mib": memory.peak["vllm"],
           "total_peak_mib": memory.peak["total"],
           "trainer_host_peak_mib": memory.peak["trainer_host"], "vllm_host_peak_mib": memory.peak["vllm_host"],
           "trainer_gpu_peak_mib": memory.peak["trainer_gpu"], "vllm_gpu_peak_mib": memory.peak["vllm_gpu"],
           "total_gpu_peak_mib": memory.peak["total_gpu"], "host_used_peak_mib": memory.peak["host_used"],
           "trainer_bytes_per_param": memory.peak["trainer"] * MIB / params,
           # per GPU: what a rank holds beyond vLLM's weights, over the parameters of its shard
           "trainer_bytes_per_param_per_gpu": memory.peak["trainer_gpu"] * MIB / (params / gpus),
           "step_median_s": statistics.median(m["time/step"] for m in timed) if timed else None,
           "gate_closed_median_ms": 1e3 * statistics.median(m["sync/gate_closed_seconds"] for m in timed)
           if timed and "sync/gate_closed_seconds" in timed[0] else None,
           # where a step goes: the trainer's own phase timings
           **{f"{phase}_median_s": statistics.median(m[f"time/{phase}"] for m in timed) if timed else None
              for phase in ("forward_backward", "optimizer")}}
    for key in PHASE_KEYS:
        row[key] = max((m[key] for m in steps if key in m), default=None)
    row["plan_trainer_peak_gib"] = planned_trainer_peak_gib(result.trainer_log)
    row["fits"] = result.returncode == 0 and len(steps) >= args.steps
    if not row["fits"]:
        error = last_error_line(result.trainer_log)
        row["error"] = (error[-300:] if error else
                        f"trainer {result.outcome} after {len(steps)} steps (logs in {out})")
    return row


def planned_trainer_peak_gib(trainer_log: str) -> float | None:
    """The trainer's own estimate of its peak, from the memory plan it logs at start."""
    found = re.search(r"trainer peak \(estimate\)\s+([\d.]+)", trainer_log)
    return float(found.group(1)) if found else None


def number(row: dict, key: str, scale: float = 1.0, fmt: str = "{:.2f}") -> str:
    """A row's value for a table cell ("–" where the run did not record it)."""
    return fmt.format(row[key] * scale) if row.get(key) is not None else "–"


def row_start(r: dict, gpus: bool = False) -> str:
    """The cells every table opens with: the shape, its size, (the GPUs,) the setting, whether it fitted."""
    return (f"| {r['shape']} | {r['params'] / 1e9:.2f}B | " + (f"{r.get('gpus', 1)} | " if gpus else "")
            + f"{r['config']} | {'yes' if r['fits'] else 'no: ' + r.get('error', '')[:60]} | ")


def table(rows: list[dict]) -> str:
    lines = ["| model (random weights) | params | optimizer setting | fits | trainer peak GiB (plan) | trainer bytes/param "
             "| tensors peak GiB fwd-bwd / optimizer | vLLM peak GiB | total peak GiB | step s (median) "
             "| fwd-bwd / optimizer s (median) | gate closed ms (median) | host peak GiB trainer / vLLM |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [f"{number(r, 'trainer_peak_mib', 1 / 1024)} ({number(r, 'plan_trainer_peak_gib')})",
                 number(r, "trainer_bytes_per_param"),
                 f"{number(r, PHASE_METRICS['forward_backward'][0])} / {number(r, PHASE_METRICS['optimizer_sync'][0])}",
                 number(r, "vllm_peak_mib", 1 / 1024), number(r, "total_peak_mib", 1 / 1024), number(r, "step_median_s"),
                 f"{number(r, 'forward_backward_median_s')} / {number(r, 'optimizer_median_s')}",
                 number(r, "gate_closed_median_ms", fmt="{:.1f}"),
                 f"{number(r, 'trainer_host_peak_mib', 1 / 1024)} / {number(r, 'vllm_host_peak_mib', 1 / 1024)}"]
        lines.append(row_start(r) + " | ".join(cells) + " |")
    return "\n".join(lines)


def table_per_gpu(rows: list[dict]) -> str:
    """The tensor-parallel rows: what one GPU holds (its busiest), and the machine's host memory."""
    lines = ["| model (random weights) | params | GPUs | optimizer setting | fits | trainer peak GiB per GPU (plan) "
             "| trainer bytes/param per GPU | vLLM peak GiB per GPU | total peak GiB per GPU | step s (median) "
             "| fwd-bwd / optimizer s (median) | host memory in use, peak GiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [f"{number(r, 'trainer_gpu_peak_mib', 1 / 1024)} ({number(r, 'plan_trainer_peak_gib')})",
                 number(r, "trainer_bytes_per_param_per_gpu"), number(r, "vllm_gpu_peak_mib", 1 / 1024),
                 number(r, "total_gpu_peak_mib", 1 / 1024), number(r, "step_median_s"),
                 f"{number(r, 'forward_backward_median_s')} / {number(r, 'optimizer_median_s')}",
                 number(r, "host_used_peak_mib", 1 / 1024, "{:.0f}")]
        lines.append(row_start(r, gpus=True) + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="results/memory")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--configs", nargs="+", default=["adamw", "lean8"], choices=list(CONFIGS))
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the default model's)")
    p.add_argument("--steps", type=int, default=5, help="GRPO steps per run (the first is not timed)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step, one per micro-batch")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--kv-gib", type=int, default=8, help="vLLM's KV cache in GiB")
    p.add_argument("--vllm-args", default="", help="more vLLM flags, e.g. --enforce-eager")
    p.add_argument("--tensor-parallel", type=int, default=1, help="GPUs: N > 1 runs --parallel tensor over N "
                   "trainer ranks beside one vLLM with --tensor-parallel-size N")
    p.add_argument("--run-timeout", type=float, default=900, help="seconds one run may take")
    p.add_argument("--seconds", type=float, default=0, help="start no run after this many seconds (0 = no limit)")
    p.add_argument("--table", nargs="*", help="print the table of these result files and exit")
    a = p.parse_args()
    if a.table is not None:
        rows = [json.loads(Path(f).read_text()) for f in a.table]
        print(table_per_gpu(rows) if any(r.get("gpus", 1) > 1 for r in rows) else table(rows))
        return
    if a.tokenizer is None:
        from example_trainer.model.default_model import default_model_path
        a.tokenizer = default_model_path()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    begin, rows = time.monotonic(), []
    for shape in a.shapes:
        model, params = shape_folder(shape, a.tokenizer, out / "models")
        for config in a.configs:
            if a.seconds and time.monotonic() - begin > a.seconds:
                print(f"[memory] time is up: {shape} {config} not run", flush=True)
                continue
            print(f"[memory] {shape} ({params / 1e9:.2f}B) {config}", flush=True)
            row = run_one(shape, config, a, model, params)
            rows.append(row)
            tp = f"_tp{a.tensor_parallel}" if a.tensor_parallel > 1 else ""
            (out / f"memory_{shape}_{config}{tp}.json").write_text(json.dumps(row, indent=2))
            print(json.dumps(row), flush=True)
    print(table_per_gpu(rows) if a.tensor_parallel > 1 else table(rows))


if __name__ == "__main__":
    main()
