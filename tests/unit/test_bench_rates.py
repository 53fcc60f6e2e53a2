"""The benchmark's generation rate: counts only polls where vLLM generated, survives restarts."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.modes import GenerationRate, p95  # noqa: E402


def test_rate_counts_busy_polls_and_reads_a_drop_as_a_restart():
    rate = GenerationRate("http://unused")
    for value, now in [(None, 0.0), (100.0, 1.0), (300.0, 2.0), (300.0, 3.0), (None, 4.0), (50.0, 5.0), (150.0, 6.0)]:
        rate.add(value, now)
    # grew 200 in 1 s, idle 1 s, restarted (0 -> 50 over 2 s), grew 100 in 1 s
    assert rate.tokens == 350.0
    assert rate.busy_seconds == 4.0
    assert rate.tokens_per_s == 87.5


def test_p95_of_few_values():
    assert p95([3.0]) == 3.0
    assert p95([1.0, 2.0, 3.0, 4.0, 100.0]) == 100.0


def test_kv_cache_tokens_reads_the_last_start_line_of_either_log(tmp_path):
    from bench.modes import kv_cache_tokens

    server_log = tmp_path / "vllm.log"
    assert kv_cache_tokens("no engine here", server_log) is None
    server_log.write_text("INFO GPU KV cache size: 1,024 tokens\nINFO GPU KV cache size: 2,097,152 tokens\n")
    assert kv_cache_tokens("", server_log) == 2_097_152
    assert kv_cache_tokens("(EngineCore) GPU KV cache size: 65,536 tokens", tmp_path / "absent.log") == 65_536
    assert kv_cache_tokens("CPU KV cache size: 4,096 tokens, Maximum concurrency 10.7x", tmp_path / "absent.log") == 4096
