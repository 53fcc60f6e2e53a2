"""Every weight-bridge mode side by side on one model and one GRPO config, in one call.

    python bench/modes.py --model PATH --out results/modes --modes none shared_vllm --steps 6
    python bench/modes.py --model PATH --out results/modes --overhead-only    # patch overhead only

Per mode it runs the real loop (API + arithmetic environment + trainer, which starts vLLM) and
prints one table: sync latency per step (median, p95), bytes moved per sync, peak GPU memory of
all processes (driver), trainer step time, end-to-end samples/s. The patch overhead is vLLM
generation tokens/s with and without VLLM_ENABLE_SHARED_WEIGHTS=1, same settings, same call.
Metric names are the trainer's --benchmark names.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import GpuMemoryPeak, start, stop  # noqa: E402
from example_trainer.config import TrainerConfig  # noqa: E402
from example_trainer.vllm_process import VllmServerProcess, vllm_server_args  # noqa: E402
from tests.conftest import free_port  # noqa: E402


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def run_mode(mode: str, a, out: Path) -> dict:
    """One short GRPO run in ``mode``; returns the row of the table."""
    out.mkdir(parents=True, exist_ok=True)
    api_port, vllm_port = free_port(), free_port()
    api = start(["-m", "api.server", "--port", str(api_port), "--db-path", str(out / "api.db")], out / "api.log")
    env = start(["-m", "environments.arithmetic_server", "serve", "--env.group_size", str(a.group_size),
                 "--env.max_num_workers", "8", "--env.tokenizer_name", a.model, "--env.seed", "3",
                 "--env.difficulty", "2", "--env.operations", "+", "--env.max_token_length", "384",
                 "--env.max_tokens", "128", "--env.ensure_scores_are_not_same", "false",
                 "--env.rollout_server_url", f"http://127.0.0.1:{api_port}",
                 "--openai.base_url", f"http://127.0.0.1:{vllm_port}"], out / "env.log")
    try:
        with GpuMemoryPeak() as peak:
            t0 = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, "-m", "example_trainer.grpo", "--model-name", a.model, "--weight-bridge-mode", mode,
                 "--training-steps", str(a.steps), "--batch-size", str(a.batch_size), "--seq-len", "384",
                 "--lr", "1e-6", "--api-url", f"http://127.0.0.1:{api_port}", "--vllm-port", str(vllm_port),
                 "--save-path", str(out / "run"), "--benchmark", "--vllm-restart-interval", "2", "--probe-prompt", "",
                 *a.trainer_args.split()],
                cwd=ROOT, stdout=open(out / "trainer.log", "wb"), stderr=subprocess.STDOUT, timeout=1800)
            wall = time.perf_counter() - t0
    finally:
        stop(env)
        stop(api)
    if proc.returncode != 0:
        return {"mode": mode, "error": f"trainer exit {proc.returncode}, see {out / 'trainer.log'}"}
    steps = [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if "train/loss" in m][1:]  # the first step includes warm-up
    syncs = [m["sync/seconds"] for m in steps if m.get("sync/synced")]
    step_time = statistics.median(m["time/step"] for m in steps)
    return {
        "mode": mode,
        "sync/seconds_median": statistics.median(syncs) if syncs else 0.0,
        "sync/seconds_p95": p95(syncs) if syncs else 0.0,
        "sync/bytes_moved": max((m.get("sync/bytes_moved", 0.0) for m in steps), default=0.0),
        "gpu_peak_mib": peak.peak_mib,
        "time/step_median": step_time,
        "time/forward_backward_median": statistics.median(m["time/forward_backward"] for m in steps),
        "samples_per_s": a.batch_size * len(steps) / sum(m["time/step"] for m in steps),
        "wall_seconds": wall,
    }


def generation_tokens_per_s(model: str, shared: bool, out: Path, requests_n: int = 64) -> float:
    """Throughput of /generate: requests_n concurrent requests, n=8, 256 tokens each, ignore nothing."""
    import requests as http

    env = {"VLLM_ENABLE_SHARED_WEIGHTS": "1" if shared else "0", "LOGDIR": str(out)}
    server = VllmServerProcess(free_port(), out / f"vllm_gen_{'shared' if shared else 'plain'}.log",
                               vllm_server_args(TrainerConfig(seq_len=512)), env=env, start_timeout=900)
    server.start(model)
    body = {"prompt": "Write a long story about a robot learning to add numbers.", "n": 8, "max_tokens": 256,
            "temperature": 1.0, "seed": 0}

    def one(i: int) -> int:
        r = http.post(f"{server.url}/generate", json={**body, "seed": i}, timeout=600)
        return sum(len(c["token_ids"]) for c in r.json()["choices"])

    try:
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(one, range(16)))  # warm-up
            t0 = time.perf_counter()
            tokens = sum(pool.map(one, range(requests_n)))
            return tokens / (time.perf_counter() - t0)
    finally:
        server.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--modes", nargs="+", default=["none", "shared_vllm"])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--trainer-args", default="", help="extra trainer flags, e.g. '--lora-r 16'")
    p.add_argument("--overhead-only", action="store_true")
    p.add_argument("--skip-overhead", action="store_true")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for mode in ([] if a.overhead_only else a.modes):
        rows.append(run_mode(mode, a, out / mode))
        print("[modes]", json.dumps(rows[-1]), flush=True)  # partial results survive a timeout
        (out / "modes.json").write_text(json.dumps({"model": a.model, "rows": rows}, indent=2))
    overhead = {}
    if not a.skip_overhead:
        plain = generation_tokens_per_s(a.model, False, out)
        shared = generation_tokens_per_s(a.model, True, out)
        overhead = {"gen/tokens_per_s_plain": plain, "gen/tokens_per_s_shared": shared,
                    "overhead_pct": 100 * (plain - shared) / plain}
    (out / "modes.json").write_text(json.dumps({"model": a.model, "rows": rows, "overhead": overhead}, indent=2))
    if rows:
        cols = ["mode", "sync/seconds_median", "sync/seconds_p95", "sync/bytes_moved", "gpu_peak_mib",
                "time/step_median", "samples_per_s"]
        print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
        for r in rows:
            print("| " + " | ".join(str(r.get(c, r.get("error", ""))) if not isinstance(r.get(c), float)
                                    else f"{r[c]:.4g}" for c in cols) + " |")
    if overhead:
        print(f"generation tokens/s: plain {overhead['gen/tokens_per_s_plain']:.0f}, shared "
              f"{overhead['gen/tokens_per_s_shared']:.0f}, overhead {overhead['overhead_pct']:.2f}%")


if __name__ == "__main__":
    main()
