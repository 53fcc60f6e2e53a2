"""How stale the tokens ``shared_vllm`` trains on are: the histogram of versions behind (the
trainer's ``off_policy/tokens_by_lag`` metric, summed over a run's steps) and the groups the bound
dropped, for runs made with bench/learning_run.py.

    python bench/learning_run.py --out runs/stale_free --steps 40 --workers 32 --eval-items 0 \\
        --trainer-args "--max-off-policy-steps none"
    python bench/learning_run.py --out runs/stale_bound --steps 40 --workers 32 --eval-items 0 \\
        --trainer-args "--max-off-policy-steps 2"
    python bench/staleness.py runs/stale_free runs/stale_bound

"Versions behind" counts the optimizer steps written into vLLM's weights between the step a token
was sampled in and the step that trains on it (vLLM tags every token with the version its engine
step ran with; docs/losses.md#staleness).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def lag_histogram(run_dir: Path) -> dict:
    """Token counts per lag, steps, groups dropped by the bound, from RUN_DIR/run/metrics.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/reward_mean" in r]
    counts: list[int] = []
    for r in steps:
        for lag, n in enumerate(r.get("off_policy/tokens_by_lag", [])):
            counts += [0] * (lag + 1 - len(counts))
            counts[lag] += n
    settings = json.loads((run_dir / "learning.json").read_text()) if (run_dir / "learning.json").exists() else {}
    flags = " ".join(f for f in (settings.get("trainer_args", ""), settings.get("env_args", "")) if f)
    return {"run": run_dir.name, "flags": flags, "steps": len(steps),
            "tokens_by_lag": counts, "groups_dropped": int(sum(r.get("off_policy/dropped", 0) for r in steps)),
            "max_lag": max((r.get("off_policy/max", 0) for r in steps), default=0)}


def print_table(histograms: list[dict]) -> None:
    """One row per run: the share of trained tokens at each lag."""
    width = max((len(h["tokens_by_lag"]) for h in histograms), default=1)
    head = " | ".join(f"{lag} behind" for lag in range(width))
    print(f"| run | flags | steps | tokens | {head} | groups dropped |\n|---|---|---|---|"
          + "---|" * width + "---|")
    for h in histograms:
        total = sum(h["tokens_by_lag"]) or 1
        shares = [f"{n / total:.1%}" for n in h["tokens_by_lag"]] + [""] * (width - len(h["tokens_by_lag"]))
        print(f"| {h['run']} | `{h['flags']}` | {h['steps']} | {sum(h['tokens_by_lag'])} | "
              + " | ".join(shares) + f" | {h['groups_dropped']} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="bench/learning_run.py --out folders")
    p.add_argument("--json", default=None, help="also write the histograms here")
    a = p.parse_args()
    histograms = [lag_histogram(Path(r)) for r in a.runs]
    if a.json:
        Path(a.json).write_text(json.dumps(histograms, indent=2))
    print_table(histograms)


if __name__ == "__main__":
    main()
