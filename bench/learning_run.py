"""A learning run: the default demo (SmolLM2-135M, arithmetic) in one weight-bridge mode, with
held-out accuracy before and after (greedy, 95% Wilson intervals), the reward curve as PNG and
the per-step metrics as CSV.

    python bench/learning_run.py --out results/learning --steps 120 --model PATH
    python bench/learning_run.py --out results/learning_lean --trainer-args '--optimizer adamw8bit --bf16-inplace'
    python bench/learning_run.py --out /tmp/l --steps 2 --eval-items 8 --batch-size 8   # smoke test

Each phase (training, the evaluation before, the one after) is kept in ``OUT/learning.json`` as it
ends: the same command run again does only what is missing, so a run cut off by a time limit goes on
where it stopped (a training cut short starts over).

Processes are ours: each is started in its own session and stopped by its PID.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import shlex
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from example_trainer.launcher import LoopConfig, run_loop, start  # noqa: E402
from example_trainer.engine.ports import free_port  # noqa: E402
from example_trainer.engine.vllm_process import VllmServerProcess  # noqa: E402

TRAIN_SEED = 7  # --env.seed of the training stream (the eval set has its own seed)
ENV_ARGS = ["--env.difficulty", "2", "--env.operations", "+", "--env.max_token_length", "384", "--env.max_tokens", "192"]


def wilson(correct: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion."""
    if n == 0:
        return (0.0, 1.0)
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (centre - half, centre + half)


def evaluate(model: str, out: Path, tag: str, eval_items: int, port: int, vllm_args: list[str]) -> dict:
    """Serve ``model`` (eager: fast start) and run the environment's greedy held-out evaluation."""
    server = VllmServerProcess(port, out / f"vllm_eval_{tag}.log", vllm_args + ["--enforce-eager"], start_timeout=900)
    server.start(model)
    try:
        log = out / f"eval_{tag}.log"
        proc = start(["-m", "environments.arithmetic_server", "evaluate", "--openai.base_url", server.url,
                      "--env.tokenizer_name", model, "--env.num_eval_items", str(eval_items), *ENV_ARGS], log)
        proc.wait(timeout=1800)
    finally:
        server.stop()
    m = re.search(r"eval accuracy=([0-9.]+) over (\d+) items", log.read_text())
    if not m:
        raise RuntimeError(f"no accuracy in {log}:\n{log.read_text()[-2000:]}")
    n = int(m.group(2))
    correct = round(float(m.group(1)) * n)
    low, high = wilson(correct, n)
    return {"accuracy": correct / n, "correct": correct, "n": n, "ci95_low": low, "ci95_high": high}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    rewards = [r["train/reward_mean"] for r in rows]
    window = max(1, len(rows) // 10)
    smooth = [sum(rewards[max(0, i - window + 1):i + 1]) / len(rewards[max(0, i - window + 1):i + 1]) for i in range(len(rewards))]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, rewards, alpha=0.35, label="reward (batch mean)")
    ax.plot(steps, smooth, label=f"moving mean ({window} steps)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("reward (fraction correct)")
    ax.set_title("GRPO on arithmetic, SmolLM2-135M-Instruct")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


PHASES = {"before", "train_seconds", "after", "separated"}  # what learning.json keeps besides the settings


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default=None, help="HF folder (default: the onecopy default model)")
    p.add_argument("--mode", default="shared_vllm")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=5e-6)
    p.add_argument("--eval-items", type=int, default=400, help="held-out problems (0 = train only, no evaluation)")
    p.add_argument("--workers", type=int, default=8, help="environment groups in flight")
    p.add_argument("--vllm-args", default="", help="extra vLLM flags for every server")
    p.add_argument("--trainer-args", default="", help="more trainer flags, e.g. '--optimizer adamw8bit --bf16-inplace'")
    p.add_argument("--env-args", default="", help="more environment flags, e.g. '--env.max_batches_offpolicy 1'")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.model is None:
        from example_trainer.model.default_model import default_model_path
        a.model = default_model_path()
    from example_trainer.config import TrainerConfig
    from example_trainer.engine.vllm_process import vllm_server_args

    vllm_args = vllm_server_args(TrainerConfig(seq_len=384)) + a.vllm_args.split()
    settings = {"mode": a.mode, "trainer_args": a.trainer_args, "steps": a.steps, "batch_size": a.batch_size,
                "group_size": a.group_size, "lr": a.lr, "model": a.model,
                **({"env_args": a.env_args} if a.env_args else {})}  # earlier runs' files have no env_args
    state = out / "learning.json"
    results: dict = json.loads(state.read_text()) if state.exists() else {}
    if not PHASES & results.keys():  # nothing kept yet (a failed start): this run's settings replace the file's
        results = dict(settings)
    if any(results.get(k) != v for k, v in settings.items()) or results.keys() - settings.keys() - PHASES:
        raise SystemExit(f"{state} is from a run with other settings; pick another --out")

    def keep(phase: str, value) -> None:
        results[phase] = value
        state.write_text(json.dumps(results, indent=2))

    state.write_text(json.dumps(results, indent=2))  # a run cut off in training still says what it ran with

    final = out / "run" / "checkpoints" / f"step_{a.steps}"
    if "train_seconds" not in results:
        shutil.rmtree(out / "run", ignore_errors=True)  # a cut-off training starts over
        cfg = LoopConfig(run_dir=str(out), group_size=a.group_size, timeout=3600,
                         trainer=TrainerConfig(weight_bridge_mode=a.mode, training_steps=a.steps, model_name=a.model,
                                               batch_size=a.batch_size, seq_len=384, lr=a.lr),
                         env_args=shlex.join(["--env.max_num_workers", str(a.workers), "--env.seed", str(TRAIN_SEED), *ENV_ARGS,
                                              *shlex.split(a.env_args)]))
        t0 = time.time()
        result = run_loop(cfg, ["--benchmark", "--vllm-extra-args", a.vllm_args, *shlex.split(a.trainer_args)])
        if result.returncode != 0:
            raise SystemExit(f"trainer failed ({result.outcome}); see {out / 'trainer.log'}")
        rows = [r for r in result.metrics if "train/reward_mean" in r]
        keys = ["step", "train/reward_mean", "train/loss", "train/grad_norm", "train/clip_fraction",
                "time/step", "time/forward_backward", "sync/seconds", "gen/probe_logprob",
                "sampling/logp_difference/max", "sampling/importance_ratio/mean", "off_policy/mean", "off_policy/max",
                "off_policy/dropped", "train/groups_dropped"]
        with open(out / "metrics.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
        plot(rows, out / "reward_curve.png")
        keep("train_seconds", time.time() - t0)
    if a.eval_items == 0:
        print(f"[learning] trained {a.steps} steps in {results['train_seconds']:.0f} s; no evaluation (--eval-items 0)")
        return
    for phase, model in (("before", a.model), ("after", str(final))):
        if phase not in results:
            keep(phase, evaluate(model, out, phase, a.eval_items, free_port(), vllm_args))
            print(f"[learning] {phase}:", results[phase], flush=True)
    results["separated"] = results["after"]["ci95_low"] > results["before"]["ci95_high"]
    state.write_text(json.dumps(results, indent=2))
    b, f_ = results["before"], results["after"]
    print(f"\n| held-out accuracy | value | 95% CI | n |\n|---|---|---|---|\n"
          f"| before | {b['accuracy']:.3f} | [{b['ci95_low']:.3f}, {b['ci95_high']:.3f}] | {b['n']} |\n"
          f"| after {a.steps} steps | {f_['accuracy']:.3f} | [{f_['ci95_low']:.3f}, {f_['ci95_high']:.3f}] | {f_['n']} |\n"
          f"intervals separated: {results['separated']}; training took {results['train_seconds']:.0f} s")


if __name__ == "__main__":
    main()
