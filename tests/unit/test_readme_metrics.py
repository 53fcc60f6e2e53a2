"""The README's metrics table lists every metric the trainer emits (a metric nobody can look up
is as good as none)."""

import re

from tests.conftest import ROOT

METRIC = re.compile(r'"((?:train|time|sync|gen|memory)/[a-z_]+)"')


def test_readme_lists_every_metric_the_trainer_emits():
    emitted = {m for path in (ROOT / "example_trainer").rglob("*.py") for m in METRIC.findall(path.read_text())}
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Metrics"):]
    table = table[:table.index("\n## ", 1)]
    assert len(emitted) > 20
    missing = sorted(m for m in emitted if f"`{m}`" not in table)
    assert not missing, f"README's metrics table lacks {missing}"
