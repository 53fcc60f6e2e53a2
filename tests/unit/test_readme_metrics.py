"""docs/metrics.md lists every metric the code emits, and only those (a metric nobody can look up
is as good as none; a documented one nobody logs sends a reader looking for nothing).

A metric here is a string literal in a shipped package (every top-level package but tests/ and
bench/, which read metrics and log none) that starts with one of the metric prefixes, or a vLLM
Prometheus name `onecopy:...`. An f-string's `{...}` part stands for any name of that shape in
the page (`env/groups_{k}` is documented by `env/groups_skipped_too_long` and its siblings).
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import ROOT

PREFIXES = ("train", "time", "sync", "gen", "env", "memory", "parallel")
_PREFIX = "|".join(PREFIXES)
METRIC = re.compile(r"""["']((?:%s)/[A-Za-z0-9_{}]+(?:/[A-Za-z0-9_{}]+)*|onecopy:[a-z0-9_{}]+)["']""" % _PREFIX)
NAME = re.compile(r"(?:(?:%s)/[A-Za-z0-9_]+(?:/[A-Za-z0-9_]+)*|onecopy:[a-z0-9_]+)" % _PREFIX)
DOC = ROOT / "docs" / "metrics.md"


def shipped_sources() -> list[Path]:
    """Every .py file of the packages the project ships (not its tests or benchmarks)."""
    packages = [d for d in ROOT.iterdir() if (d / "__init__.py").exists() and d.name not in ("tests", "bench")]
    return [p for d in packages for p in d.rglob("*.py")]


def emitted_metrics() -> set[str]:
    """Metric names as written in the code; f-string templates keep their `{...}` parts."""
    return {m for path in shipped_sources() for m in METRIC.findall(path.read_text())}


def documented_metrics() -> set[str]:
    """Every metric name written in backticks on the metrics page (a Prometheus counter's scraped
    name, `..._total`, counts as its own)."""
    tokens = re.findall(r"`([^`\s]+)`", DOC.read_text())
    return {re.sub(r"^(onecopy:.+)_total$", r"\1", t) for t in tokens if NAME.fullmatch(t)}


def _pattern(name: str) -> re.Pattern:
    """A name with `{...}` parts as a pattern over documented names."""
    return re.compile("[A-Za-z0-9_]+".join(re.escape(part) for part in re.split(r"\{[^}]*\}", name)))


def test_the_scan_finds_the_metrics_of_every_layer():
    emitted = emitted_metrics()
    assert len(emitted) > 30, sorted(emitted)
    for prefix in ("train/", "sync/", "time/", "env/", "memory/", "parallel/", "gen/", "onecopy:"):
        assert any(m.startswith(prefix) for m in emitted), f"no {prefix} metric found in {sorted(emitted)}"


def test_metrics_page_lists_every_metric_the_code_emits():
    documented = documented_metrics()
    missing = sorted(m for m in emitted_metrics() if not any(_pattern(m).fullmatch(d) for d in documented))
    assert not missing, f"{DOC.relative_to(ROOT)} lacks {missing}: add a row that says what each means"


def test_metrics_page_lists_no_metric_the_code_does_not_emit():
    patterns = [_pattern(m) for m in emitted_metrics()]
    stale = sorted(d for d in documented_metrics() if not any(p.fullmatch(d) for p in patterns))
    assert not stale, f"{DOC.relative_to(ROOT)} documents {stale}, which no code emits"
