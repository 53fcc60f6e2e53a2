"""Data-parallel scaling: the same GRPO step per GPU on 1, 2 or 4 GPUs (a vLLM, an environment and a
single copy on each), with the head-to-head's task and settings (bench/vs_trl.py's ``Matched``).

    # one N per call; the GPUs are the visible ones (CUDA_VISIBLE_DEVICES)
    python bench/data_parallel.py --shape qwen2.5-1.5b --tokenizer DIR --gpus 2 --out results/dp
    python bench/data_parallel.py --table results/dp/*.json     # the scaling table of earlier runs

The model is a real model's shape with random weights that vLLM draws itself (``--load-format
dummy``; bench/shapes.py), so nothing but a config and a tokenizer is written. Weak scaling: each
GPU trains ``prompts_per_step * group_size`` sequences a step (64 by default), so N GPUs train N
times as many; samples/s counts every GPU's, after the first step. Also per run: the median sync
seconds (rank 0's), each GPU's peak memory (the driver's count, all processes), and whether the
ranks' weights stayed equal (``parallel/replica_spread`` 0.0 every step). Generation tokens/s is
rank 0's vLLM alone.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.modes import run_mode  # noqa: E402
from bench.shapes import SHAPES, shape_folder  # noqa: E402
from bench.vs_trl import Matched  # noqa: E402


def run(shape: str, tokenizer: str, gpus: int, out: Path, m: Matched, trainer_args: str, timeout: float) -> dict:
    """One data-parallel run of ``shape`` over ``gpus`` GPUs; its row of the table."""
    model, params = shape_folder(shape, tokenizer, out / "shapes")
    per_gpu = m.batch_size
    a = SimpleNamespace(steps=m.steps, group_size=m.group_size, batch_size=per_gpu * gpus, restart_interval=m.steps,
                        mode_timeout=timeout,
                        trainer_args=shlex.join([*m.onecopy_flags(), "--save-steps", "-1",
                                                 "--vllm-importance-sampling-correction", "false",
                                                 "--vllm-extra-args", "--load-format dummy",
                                                 *shlex.split(trainer_args)]))
    env_args = (f"--env.max_tokens {m.max_completion_tokens} --env.temperature {m.temperature} --env.seed {m.seed} "
                "--env.max_num_workers 8 --env.ensure_scores_are_not_same false")  # random weights score 0
    row = run_mode("shared_vllm", a, model, out / f"{shape}-{gpus}gpu", environment="arithmetic_rewards",
                   env_args=env_args, lr=m.lr, warmup_steps=m.warmup_steps, gpus=gpus)
    return {"shape": shape, "params": params, "gpus": gpus, "per_gpu_batch": per_gpu, "trainer_args": trainer_args,
            "matched": asdict(m), **row}


def print_table(rows: list[dict]) -> None:
    """One row per shape and N, with the speed-up over the same shape's N=1 run."""
    print("| shape | GPUs | samples/s | speed-up over 1 GPU | sync s (median) | peak GiB per GPU (max) | trainer flags |\n"
          "|---|---|---|---|---|---|---|")
    for row in sorted(rows, key=lambda r: (r["shape"], r["gpus"])):
        if "error" in row:
            print(f"| {row['shape']} | {row['gpus']} | {row['error']} | | | | |")
            continue
        one = next((r for r in rows if r["shape"] == row["shape"] and r["gpus"] == 1 and "error" not in r), None)
        speedup = f"{row['samples_per_s'] / one['samples_per_s']:.2f}x" if one else "-"
        peak = max(row.get("gpu_peak_mib_per_gpu") or [row["gpu_peak_mib"]]) / 1024
        sync = row.get("sync/seconds_median")
        print(f"| {row['shape']} | {row['gpus']} | {row['samples_per_s']:.1f} | {speedup} | "
              f"{'-' if sync is None else f'{sync:.4f}'} | {peak:.1f} | `{row['trainer_args'] or '-'}` |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), help="the model's shape (bench/shapes.py)")
    p.add_argument("--tokenizer", help="a tokenizer folder, padded to the shape's vocabulary")
    p.add_argument("--gpus", type=int, default=1, help="data-parallel ranks (one per visible GPU)")
    p.add_argument("--out", default="results/data_parallel")
    p.add_argument("--steps", type=int, default=Matched.steps)
    p.add_argument("--trainer-args", default="", help="onecopy trainer flags beyond the matched ones, e.g. "
                   "'--bf16-inplace --optimizer adamw8bit' for 8B")
    p.add_argument("--timeout", type=float, default=900, help="seconds one run may take")
    p.add_argument("--table", nargs="+", metavar="JSON", help="print the table of earlier runs and exit")
    a = p.parse_args()
    if a.table:
        print_table([json.loads(Path(f).read_text()) for f in a.table])
        return
    if not (a.shape and a.tokenizer):
        p.error("--shape and --tokenizer are needed for a run")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    row = run(a.shape, a.tokenizer, a.gpus, out, Matched(steps=a.steps), a.trainer_args, a.timeout)
    (out / f"dp_{a.shape}_{a.gpus}gpu.json").write_text(json.dumps(row, indent=2))
    print_table([row])


if __name__ == "__main__":
    main()
