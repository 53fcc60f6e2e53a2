"""Every weight-bridge mode side by side on one model and one GRPO config, plus the patch overhead.

    python bench/modes.py --model PATH --name smollm2-135m --out results/modes
    python bench/modes.py --random-qwen2 TOKENIZER_DIR --name qwen2-random-1.5b --out results/modes
    python bench/modes.py --table results/modes/*.json        # one table from earlier runs

Per mode it runs the real loop (API + arithmetic environment + trainer, which starts its own
vLLM) and records: weight-sync latency per step (median, p95), bytes moved per sync, peak GPU
memory of all processes (the driver's count, sampled every 0.2 s), vLLM generation tokens/s
(from vLLM's Prometheus counter, over the seconds it was generating), trainer step time and
end-to-end samples/s. The first step is left out (warm-up). The patch overhead is generation
tokens/s of fresh servers with and without VLLM_ENABLE_SHARED_WEIGHTS=1, same settings, same
run, both up at once, timed rounds alternating between them. The GPU's copy bandwidth is
measured first, so that the shared_vllm write can be read against it. Results go to OUT/modes_NAME_PART.json after every piece,
so a run cut short keeps what it finished. Metric names are the trainer's --benchmark names.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import GpuMemoryPeak, Poller, add_model_source, device_copy_GBps, model_from_source  # noqa: E402
from example_trainer.config import TrainerConfig  # noqa: E402
from example_trainer.launcher import LoopConfig, run_loop  # noqa: E402
from example_trainer.engine.ports import free_port  # noqa: E402
from example_trainer.engine.vllm_process import VllmServerProcess, vllm_auth_headers, vllm_server_args  # noqa: E402

KV_TOKENS = re.compile(r"(?:GPU|CPU) KV cache size: ([\d,]+) tokens")  # vLLM 0.32 says CPU on CPU
MODES = ["none", "lora_only", "lora_restart", "shared_vllm", "colocate", "colocate-release-kv"]
# A row that is a mode with flags: its --weight-bridge-mode and the trainer flags it adds.
VARIANTS = {"colocate-release-kv": ("colocate", ["--release-kv-cache"])}
GEN_COUNTER = re.compile(r"^vllm:generation_tokens_total\{[^}]*\}\s+([0-9.eE+]+)", re.M)


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


class GenerationRate(Poller):
    """Polls vLLM's generation-token counter; the rate over the polls in which it grew.

    A restarted server starts its counter at zero again; a drop is read as a restart.
    """

    def __init__(self, url: str, every: float = 0.5) -> None:
        super().__init__(every)
        self.url = url
        self.tokens = 0.0
        self.busy_seconds = 0.0
        self._last: float | None = None
        self._last_time = time.perf_counter()

    def read(self) -> float | None:
        try:
            text = requests.get(self.url + "/metrics", timeout=2).text
        except requests.RequestException:
            return None  # not up yet, or restarting
        values = GEN_COUNTER.findall(text)
        return sum(float(v) for v in values) if values else None

    def poll(self) -> bool:
        self.add(self.read(), time.perf_counter())
        return True

    def add(self, value: float | None, now: float) -> None:
        """Count one reading of the counter taken at ``now``."""
        if value is None:
            return
        if self._last is not None:
            grown = value - self._last if value >= self._last else value
            if grown > 0:
                self.tokens += grown
                self.busy_seconds += now - self._last_time
        self._last, self._last_time = value, now

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.busy_seconds if self.busy_seconds else 0.0


ENV_ARGS = ("--env.max_num_workers 8 --env.seed 3 --env.difficulty 2 --env.operations + --env.max_tokens 128 "
            "--env.ensure_scores_are_not_same false")


def run_mode(mode: str, a, model: str, out: Path, environment: str = "arithmetic", env_args: str = ENV_ARGS,
             lr: float = 1e-6, warmup_steps: int = 1, gpus: int = 1) -> dict:
    """One short GRPO run in ``mode`` (or a VARIANTS row); returns its row of the table, its rates
    over the steps after the first ``warmup_steps``. ``gpus`` > 1: data parallel over that many
    (a vLLM, an environment and a copy per GPU; ``a.batch_size`` is the whole step's)."""
    bridge_mode, variant_args = VARIANTS.get(mode, (mode, []))
    cfg = LoopConfig(run_dir=str(out), environment=environment, num_generations=a.group_size, vllm_server_port=free_port(),
                     timeout=a.mode_timeout, env_args=env_args, gpus=gpus,
                     trainer=TrainerConfig(weight_bridge_mode=bridge_mode, max_steps=a.steps, model_name=model,
                                           batch_size=a.batch_size, seq_len=384, learning_rate=lr,
                                           parallel="data" if gpus > 1 else "none"))
    trainer_args = ["--benchmark", "--probe-prompt", "", "--vllm-restart-interval", str(a.restart_interval),
                    *variant_args, *shlex.split(a.trainer_args)]
    with GpuMemoryPeak() as peak, GenerationRate(f"http://127.0.0.1:{cfg.vllm_server_port}") as gen:
        t0 = time.perf_counter()
        result = run_loop(cfg, trainer_args)
        wall = time.perf_counter() - t0
    # A 1.5B mode leaves GBs of checkpoints on the disk; a benchmark keeps only its results.
    shutil.rmtree(out / "run" / "checkpoints", ignore_errors=True)
    if result.returncode != 0:
        return {"mode": mode, "error": f"trainer {result.outcome}, see {out / 'trainer.log'}"}
    steps = [m for m in result.metrics if "train/loss" in m][warmup_steps:]
    synced = [m for m in steps if m.get("sync/synced")]
    syncs = [m["sync/seconds"] for m in synced]
    row = {
        "mode": mode,
        "steps_measured": len(steps),
        "syncs_measured": len(syncs),
        "sync/seconds_median": statistics.median(syncs) if syncs else None,
        "sync/seconds_p95": p95(syncs) if syncs else None,
        "sync/bytes_moved": max((m.get("sync/bytes_moved", 0.0) for m in synced), default=0.0),
        "gpu_peak_mib": peak.peak_mib,
        "gpu_peak_mib_per_gpu": peak.per_gpu_peak_mib,
        # colocate has no server to poll: its steps wait only for generation (and scoring)
        "gen/tokens_per_s": (sum(m["train/completion_tokens"] for m in steps) / sum(m["time/data_wait"] for m in steps)
                             if bridge_mode == "colocate" else gen.tokens_per_s),
        "time/step_median": statistics.median(m["time/step"] for m in steps),
        "time/forward_backward_median": statistics.median(m["time/forward_backward"] for m in steps),
        "samples_per_s": a.batch_size * len(steps) / sum(m["time/step"] for m in steps),
        "rewards": [m["train/reward_mean"] for m in result.metrics if "train/reward_mean" in m],
        "kv_cache_tokens": kv_cache_tokens(result.trainer_log, out / "run" / "vllm.log"),
        "wall_seconds": wall,
    }
    # gate_wait/open: closing and opening the weights gate; pause/resume: the same phases in rows
    # of older runs (the HTTP pause, then the gate before its metrics were renamed).
    for phase in ("gate_wait", "pause", "write", "open", "resume", "vllm_gate_wait", "save", "restart", "load"):
        values = [m[f"sync/{phase}_seconds"] for m in synced if f"sync/{phase}_seconds" in m]
        if values:
            row[f"sync/{phase}_seconds_median"] = statistics.median(values)
    writes = [m["sync/write_bytes"] / m["sync/write_seconds"] for m in synced if m.get("sync/write_bytes")]
    if writes:
        row["sync/write_GBps_median"] = statistics.median(writes) / 1e9
    return row


def kv_cache_tokens(trainer_log: str, server_log: Path) -> int | None:
    """The KV cache vLLM had for generation, in tokens, from its start line (in the trainer's own
    log when the engine runs in-process, else in the server's log)."""
    text = trainer_log + (server_log.read_text(errors="replace") if server_log.exists() else "")
    found = KV_TOKENS.findall(text)
    return int(found[-1].replace(",", "")) if found else None


def patch_overhead(model: str, out: Path, rounds: int = 10, requests_n: int = 64, max_tokens: int = 256,
                   first: str = "plain") -> dict:
    """Generation tokens/s with and without the patch: both servers up at once (each with 0.4 of
    the GPU), timed rounds alternating between them (A B B A A B ...), so that drift of clocks or
    caches during the run falls on both alike. A round: ``requests_n`` concurrent /generate
    calls, n=8, ``max_tokens`` tokens, temperature 1, the same seeds for both servers.
    ``overhead_pct`` is the median over rounds of the difference within a round (paired).
    ``first`` is the server started (and given its GPU memory) first."""
    servers = {}
    flags = {"plain": "0", "shared": "1"}
    try:
        for tag in sorted(flags, key=lambda t: t != first):
            flag = flags[tag]
            (out / tag).mkdir(parents=True, exist_ok=True)
            servers[tag] = VllmServerProcess(
                free_port(), out / f"vllm_gen_{tag}.log",
                vllm_server_args(TrainerConfig(seq_len=512, vllm_gpu_memory_utilization=0.4)),
                env={"VLLM_ENABLE_SHARED_WEIGHTS": flag, "LOGDIR": str(out / tag)}, start_timeout=900)
            servers[tag].start(model)
        body = {"prompt": "Write a long story about a robot learning to add numbers.", "n": 8,
                "max_tokens": max_tokens, "temperature": 1.0}

        def one(url: str, seed: int) -> int:
            response = requests.post(f"{url}/generate", json={**body, "seed": seed}, headers=vllm_auth_headers(),
                                     timeout=600)
            response.raise_for_status()
            return sum(len(c["token_ids"]) for c in response.json()["choices"])

        rates: dict[str, list[float]] = {"plain": [], "shared": []}
        with ThreadPoolExecutor(requests_n) as pool:
            for server in servers.values():  # warm-up: a whole round, so that every batch shape has run once
                list(pool.map(lambda seed: one(server.url, seed), range(requests_n)))
            for r in range(rounds):
                order = ["plain", "shared"] if r % 4 in (0, 3) else ["shared", "plain"]
                for tag in order:
                    seeds = range(1000 * (r + 1), 1000 * (r + 1) + requests_n)  # same seeds for both
                    t0 = time.perf_counter()
                    tokens = sum(pool.map(lambda seed: one(servers[tag].url, seed), seeds))
                    rates[tag].append(tokens / (time.perf_counter() - t0))
    finally:
        for server in servers.values():
            server.stop()
    # Round r of each server ran back to back under the same conditions: compare within rounds.
    paired = [100 * (p - s) / p for p, s in zip(rates["plain"], rates["shared"])]
    return {**rates, "paired_overhead_pct": paired, "overhead_pct": statistics.median(paired), "started_first": first}


def format_cell(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def percent(value: float | None) -> str:
    return "–" if value is None else f"{value:.0%}"


def ms(row: dict, phase: str, older: str) -> str:
    """A sync phase's median in ms (``older``: its name in older rows), with the part spent inside
    vLLM's server where recorded (rows of the HTTP-pause sync, before the weights gate)."""
    if f"sync/{phase}_seconds_median" not in row:
        phase = older
    total, server = row[f"sync/{phase}_seconds_median"], row.get(f"sync/{phase}_server_seconds_median")
    return f"{1e3 * total:.2f}" + (f" ({1e3 * server:.2f})" if server is not None else "")


def merge_by_model(results: list[dict]) -> list[dict]:
    """Results of several runs for one model (``--part``) as one result."""
    merged: dict[str, dict] = {}
    for res in results:
        into = merged.setdefault(res["name"], {**res, "rows": []})
        into["rows"] += [{"copy_GBps": res.get("copy_GBps"), **row} for row in res["rows"]]
        for key in ("copy_GBps", "overhead"):
            if into.get(key) is None and res.get(key) is not None:
                into[key] = res[key]
    return list(merged.values())


def print_tables(results: list[dict]) -> None:
    """Markdown tables (one row per model and mode; one row per model for the overhead)."""
    results = merge_by_model(results)
    cols = ["sync/seconds_median", "sync/seconds_p95", "sync/bytes_moved", "gpu_peak_mib", "gen/tokens_per_s",
            "time/step_median", "samples_per_s", "kv_cache_tokens"]
    print("| model | mode | " + " | ".join(cols) + " |\n|" + "---|" * (len(cols) + 2))
    for res in results:
        for row in res["rows"]:
            cells = [row.get("error", "")] if "error" in row else [format_cell(row.get(c)) for c in cols]
            print(f"| {res['name']} | {row['mode']} | " + " | ".join(cells) + " |")
    print("\n| model | device copy GB/s | shared_vllm write GB/s | write / copy | close gate (or pause) ms (in vLLM) "
          "| write ms | open gate (or resume) ms (in vLLM) | prefix reset |")
    print("|---|---|---|---|---|---|---|---|")
    for res in results:
        for row in res["rows"]:
            if row.get("sync/write_GBps_median"):
                copy = row.get("copy_GBps") or res.get("copy_GBps")  # measured in the same call
                ratio = row["sync/write_GBps_median"] / copy if copy else None
                print(f"| {res['name']} | {format_cell(copy)} | {row['sync/write_GBps_median']:.4g} | "
                      f"{format_cell(ratio)} | {ms(row, 'gate_wait', 'pause')} | {1e3 * row['sync/write_seconds_median']:.2f} | "
                      f"{ms(row, 'open', 'resume')} | {percent(row.get('sync/prefix_cache_reset_fraction'))} |")
    print("\n| model | tokens/s plain (rounds) | tokens/s patched (rounds) | overhead % (median; range over rounds) |"
          "\n|---|---|---|---|")
    for res in results:
        o = res.get("overhead")
        if o:
            paired = o.get("paired_overhead_pct")
            spread = f" ({min(paired):.1f} to {max(paired):.1f})" if paired else " (difference of medians)"
            print(f"| {res['name']} | {' / '.join(f'{x:.0f}' for x in o['plain'])} | "
                  f"{' / '.join(f'{x:.0f}' for x in o['shared'])} | {o['overhead_pct']:.2f}{spread} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_source(p)
    p.add_argument("--part", default="all", help="label of this call when one model's modes are split over calls")
    p.add_argument("--out", default="results/modes")
    p.add_argument("--modes", nargs="*", default=MODES, choices=MODES)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--restart-interval", type=int, default=2, help="none and lora_restart: restart every N steps")
    p.add_argument("--trainer-args", default="", help="extra trainer flags for every mode, e.g. '--lora-r 16'")
    p.add_argument("--mode-timeout", type=int, default=600, help="seconds one mode may take")
    p.add_argument("--no-overhead", action="store_true", help="skip the patch-overhead measurement")
    p.add_argument("--overhead-rounds", type=int, default=10, help="timed rounds per server (alternating)")
    p.add_argument("--overhead-tokens", type=int, default=256, help="max_tokens per request in those rounds")
    p.add_argument("--overhead-requests", type=int, default=64, help="concurrent requests (n=8 each) per round")
    p.add_argument("--overhead-first", choices=["plain", "shared"], default="plain",
                   help="which server starts (and takes its GPU memory) first")
    a = p.parse_args()
    if a.table:
        print_tables([json.loads(Path(f).read_text()) for f in a.table])
        return
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model = model_from_source(a, out)
    result = {"name": a.name, "model": model, "steps": a.steps, "batch_size": a.batch_size,
              "group_size": a.group_size, "restart_interval": a.restart_interval, "rows": []}
    result_file = out / f"modes_{a.name}_{a.part}.json"

    def save() -> None:  # after every piece: a run cut short keeps what it finished
        result_file.write_text(json.dumps(result, indent=2))

    result["copy_GBps"] = device_copy_GBps() if torch.cuda.is_available() else None
    print(f"[modes] device copy bandwidth {result['copy_GBps']} GB/s", flush=True)
    save()
    for mode in a.modes:
        result["rows"].append(run_mode(mode, a, model, out / a.name / mode))
        print("[modes]", json.dumps(result["rows"][-1]), flush=True)
        save()
    if not a.no_overhead:
        result["overhead"] = patch_overhead(model, out / a.name, a.overhead_rounds, a.overhead_requests,
                                            a.overhead_tokens, a.overhead_first)
        save()
    print_tables([result])


if __name__ == "__main__":
    main()
