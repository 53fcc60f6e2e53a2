"""TRL's GRPOTrainer and onecopy back to back on one GPU: the same model, prompts, reward, batch,
sampling, learning rate, optimizer, precision, steps, gradient checkpointing and vLLM memory share.

    pip install -r bench/requirements-trl.txt          # TRL 1.16.0: vLLM 0.22-0.31, torch >= 2.x
    python bench/vs_trl.py --model PATH --name smollm2-135m --out results/vs_trl
    python bench/vs_trl.py --random-qwen2 TOKENIZER_DIR --name qwen2-random-1.5b --out results/vs_trl
    python bench/vs_trl.py --table results/vs_trl/*.json

Systems (``--systems``): ``trl-colocate`` (TRL's vLLM in the training process, every weight copied
into it with ``load_weights`` each step), ``trl-colocate-sleep`` (the same with
``vllm_enable_sleep_mode``: weights and KV cache dropped after each generation, woken and
re-pushed before the next), and onecopy's ``shared_vllm``, ``colocate`` and
``colocate-release-kv`` (bench/modes.py runs those). Each system is its own process tree, one after
another, the GPU to itself. The task is environments/arithmetic_rewards_server.py on both sides:
its 512 prompts as chat messages, its two reward functions (the right answer, the \\boxed format),
summed. Per system: samples (completions trained) per second after the first ``--warmup-steps``
(default 1: the first step compiles and allocates). shared_vllm's environment generates up to its
``max_batches_offpolicy`` (3) batches ahead while that first step runs, so the steps right after it
find their batches ready: for the rate a long run keeps, skip those too (``--warmup-steps 5`` with
enough ``--steps``). Also per system: the driver's
peak GPU memory over all processes, weight-sync seconds per step, generation tokens/s, the reward
of the last steps, the KV cache vLLM got; TRL's whole config goes into the results.

Differences that stay (TRL 1.16 has no switch for them): TRL scales advantages by the group's
sample std + 1e-4, onecopy by the population std + 1e-6; onecopy's shared_vllm generates while it
trains (up to the environment's off-policy limit), TRL's colocate and onecopy's colocate alternate.
Results go to OUT/vs_trl_NAME.json after every system.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import (GpuMemoryPeak, add_model_source, add_settings_flags, given_settings,  # noqa: E402
                          last_error_line, model_from_source)
from bench.modes import KV_TOKENS, format_cell, run_mode  # noqa: E402

TRL_SYSTEMS = {"trl-colocate": False, "trl-colocate-sleep": True}  # name -> vllm_enable_sleep_mode
ONECOPY_SYSTEMS = {"onecopy-shared_vllm": "shared_vllm", "onecopy-colocate": "colocate",
                   "onecopy-colocate-release-kv": "colocate-release-kv"}
SYSTEMS = [*TRL_SYSTEMS, *ONECOPY_SYSTEMS]
SEQ_LEN = 384  # prompt + completion, both sides (bench/modes.py's loop uses the same)
REWARD_STEPS = 3  # "reward after N steps": the mean of the last this many steps


@dataclass
class Matched:
    """The settings both systems get."""

    steps: int = 10
    warmup_steps: int = 1  # not counted in samples/s; see the module docstring
    prompts_per_step: int = 4
    group_size: int = 16
    max_completion_tokens: int = 128
    temperature: float = 1.0
    lr: float = 1e-6
    gradient_checkpointing: bool = False
    vllm_gpu_memory_utilization: float = 0.3
    seed: int = 0
    optimizer: str = "adamw"  # onecopy's --optimizer; TRL gets the same torchao optimizer by HF's name
    bf16_weights: bool = False  # onecopy --bf16-inplace; TRL loads the model in bf16 (no fp32 masters either side)

    @property
    def batch_size(self) -> int:
        return self.prompts_per_step * self.group_size

    def onecopy_flags(self) -> list[str]:
        """The trainer flags that give onecopy these settings (the loop's own arguments aside)."""
        return ["--vllm-gpu-memory-utilization", str(self.vllm_gpu_memory_utilization),
                "--gradient-checkpointing", str(self.gradient_checkpointing).lower(), "--optimizer", self.optimizer,
                *(["--bf16-inplace"] if self.bf16_weights else [])]


# HF Trainer's names for torchao's AdamW, AdamW8bit and AdamW4bit (onecopy's --optimizer). HF steps
# bf16 weights with them without stochastic rounding.
TRL_OPTIMIZERS = {"adamw": "adamw_torch", "adamw8bit": "adamw_torch_8bit", "adamw4bit": "adamw_torch_4bit"}


def trl_config_kwargs(m: Matched, sleep: bool, out: Path, cuda: bool) -> dict:
    """GRPOConfig arguments: the matched settings; everything else stays TRL's default."""
    return dict(
        output_dir=str(out), max_steps=m.steps, seed=m.seed,
        num_generations=m.group_size, per_device_train_batch_size=m.batch_size, gradient_accumulation_steps=1,
        max_completion_length=m.max_completion_tokens, temperature=m.temperature,
        learning_rate=m.lr, lr_scheduler_type="constant",  # onecopy's lr is constant; TRL's default decays
        # fp32 model = fp32 masters and moments, as onecopy's default; bf16 weights: none, as --bf16-inplace
        optim=TRL_OPTIMIZERS[m.optimizer],
        **({"model_init_kwargs": {"dtype": "bfloat16"}} if m.bf16_weights else {}),
        bf16=cuda, use_cpu=not cuda,
        gradient_checkpointing=m.gradient_checkpointing,
        beta=0.0, epsilon=0.2, loss_type="dapo", num_iterations=1,
        vllm_importance_sampling_correction=False,  # onecopy trains on the rollout's own logprobs
        use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=sleep,
        vllm_gpu_memory_utilization=m.vllm_gpu_memory_utilization, vllm_max_model_length=SEQ_LEN,
        logging_steps=1, save_strategy="no", report_to="none",
    )


def chat_text(completions: list) -> list[str]:
    """TRL hands chat completions as ``[{"role": "assistant", "content": text}]``."""
    return [c if isinstance(c, str) else c[-1]["content"] for c in completions]


def trl_worker(spec_file: str) -> None:
    """Runs in its own process: one TRL GRPO training, its timings to ``spec["result"]``."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback

    import trl
    from environments.arithmetic_rewards_server import SYSTEM_PROMPT, arithmetic_rows, boxed_format, correct_answer
    from trl import GRPOConfig, GRPOTrainer
    from trl.extras import profiling

    spec = json.loads(Path(spec_file).read_text())
    m = Matched(**spec["matched"])
    timings: dict[str, list[float]] = {}
    log_metrics = profiling.ProfilingContext._log_metrics

    def record(self, duration: float) -> None:  # TRL sends these only to wandb/mlflow/trackio
        timings.setdefault(self.name, []).append(duration)
        log_metrics(self, duration)

    profiling.ProfilingContext._log_metrics = record
    step_ends: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            step_ends.append(time.perf_counter())

    def answer_reward(prompts, completions, answer, **kwargs):
        return correct_answer(prompts, chat_text(completions), answer)

    def format_reward(prompts, completions, **kwargs):
        return boxed_format(prompts, chat_text(completions))

    rows = [{"prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": r["prompt"]}],
             "answer": r["answer"]} for r in arithmetic_rows()]  # as ArithmeticRewardsEnv renders its rows
    cuda = torch.cuda.is_available()
    config = GRPOConfig(**trl_config_kwargs(m, spec["sleep"], Path(spec["out"]), cuda))
    # before training: a run that fails (out of memory at 14B) still says with what config
    Path(spec["result"]).with_name("trl_config.json").write_text(json.dumps(config.to_dict(), default=str))
    trainer = GRPOTrainer(model=spec["model"], reward_funcs=[answer_reward, format_reward], args=config,
                          train_dataset=Dataset.from_list(rows), callbacks=[StepClock()])
    trainer.train()
    Path(spec["result"]).write_text(json.dumps({
        "trl_version": trl.__version__, "config": config.to_dict(), "step_ends": step_ends,
        "timings": timings, "log_history": trainer.state.log_history}, default=str))


def trl_row(name: str, m: Matched, model: str, out: Path, timeout: float) -> dict:
    """One TRL run in a child process (its own CUDA context and vLLM), measured from outside."""
    out.mkdir(parents=True, exist_ok=True)
    spec = {"matched": asdict(m), "sleep": TRL_SYSTEMS[name], "model": model, "out": str(out / "trainer"),
            "result": str(out / "trl_result.json")}
    (out / "spec.json").write_text(json.dumps(spec))
    log = out / "trl.log"
    # TRL turns vLLM's log down to ERROR unless told otherwise; the KV cache size is an INFO line.
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "INFO")}
    with GpuMemoryPeak() as peak, open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, __file__, "--trl-worker", str(out / "spec.json")], stdout=f,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()  # the PID we started
            proc.wait()
            return {"system": name, "error": f"ran past {timeout:.0f} s, see {log}"}
    if returncode != 0:
        return failed_row(name, returncode, log, out / "trl_config.json", peak.peak_mib)
    res = json.loads((out / "trl_result.json").read_text())
    steps = [h for h in res["log_history"] if "reward" in h]
    ends = res["step_ends"]
    generate = res["timings"].get("GRPOTrainer.vLLM.generate", [])
    completion_tokens = sum(h["completions/mean_length"] * m.batch_size for h in steps)
    kv = KV_TOKENS.findall(log.read_text(errors="replace"))
    return {
        "system": name,
        "steps_measured": max(len(ends) - m.warmup_steps, 0),
        "samples_per_s": samples_per_s(ends, m.batch_size, m.warmup_steps),
        "gpu_peak_mib": peak.peak_mib,
        "sync/seconds_median": median(res["timings"].get("GRPOTrainer.sync_weights", [])[m.warmup_steps:]),
        "gen/tokens_per_s": completion_tokens / sum(generate) if generate else None,
        "rewards": [h["reward"] for h in steps],
        "kv_cache_tokens": int(kv[-1].replace(",", "")) if kv else None,
        "trl_version": res["trl_version"],
        "trl_config": res["config"],
    }


def samples_per_s(step_ends: list[float], batch_size: int, warmup_steps: int) -> float | None:
    """Completions trained per second over the steps after the first ``warmup_steps``, from the
    clock times at which each step ended (the last warm-up step's end starts the clock)."""
    if warmup_steps < 1:
        raise ValueError(f"warmup_steps must be at least 1 (the first step's end starts the clock), got {warmup_steps}")
    counted = step_ends[warmup_steps - 1:]
    return batch_size * (len(counted) - 1) / (counted[-1] - counted[0]) if len(counted) > 1 else None


def failed_row(name: str, returncode: int, log: Path, config_file: Path, peak_mib: int | None) -> dict:
    """A TRL run that exited with an error: its last error line (an out-of-memory names what it tried
    to allocate), the GPU peak it reached and the whole config that produced it."""
    error = last_error_line(log.read_text(errors="replace"))
    line = error.strip()[:300] if error else "no error line"
    return {"system": name, "error": f"exit {returncode}: {line} (see {log})",
            "gpu_peak_mib": peak_mib,
            "trl_config": json.loads(config_file.read_text()) if config_file.exists() else None}


def onecopy_row(name: str, m: Matched, model: str, out: Path, timeout: float, onecopy_args: str = "",
                onecopy_env_args: str = "") -> dict:
    """One onecopy run through bench/modes.py's loop, with the task and flags matched to TRL's, and
    ``onecopy_args`` (onecopy's own trainer settings, e.g. --offload-optimizer) and
    ``onecopy_env_args`` (its environment's, e.g. how many groups it generates at once)."""
    a = SimpleNamespace(steps=m.steps, group_size=m.group_size, batch_size=m.batch_size, restart_interval=m.steps,
                        mode_timeout=timeout,
                        trainer_args=shlex.join([*m.onecopy_flags(), "--save-steps", "-1",
                                                 "--vllm-importance-sampling-correction", "false",
                                                 *shlex.split(onecopy_args)]))
    env_args = (f"--env.max_tokens {m.max_completion_tokens} --env.temperature {m.temperature} --env.seed {m.seed} "
                f"--env.max_num_workers 8 --env.ensure_scores_are_not_same false {onecopy_env_args}").strip()
    row = run_mode(ONECOPY_SYSTEMS[name], a, model, out, environment="arithmetic_rewards", env_args=env_args, lr=m.lr,
                   warmup_steps=m.warmup_steps)
    row["system"] = name
    return row


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def reward_after(row: dict) -> float | None:
    rewards = row.get("rewards") or []
    return statistics.fmean(rewards[-REWARD_STEPS:]) if rewards else None


def print_table(results: list[dict]) -> None:
    """One markdown row per model and system, and each TRL model's speed-up against TRL colocate."""
    print(f"| model | system | samples/s | peak GPU MiB | weight sync s / step | gen tokens/s | reward (last {REWARD_STEPS}) "
          "| KV cache tokens |\n|---|---|---|---|---|---|---|---|")
    for res in results:
        for row in res["rows"]:
            if "error" in row:
                print(f"| {res['name']} | {row['system']} | {row['error']} |")
                continue
            cells = [row.get("samples_per_s"), row.get("gpu_peak_mib"), row.get("sync/seconds_median"),
                     row.get("gen/tokens_per_s"), reward_after(row), row.get("kv_cache_tokens")]
            print(f"| {res['name']} | {row['system']} | " + " | ".join(format_cell(c) for c in cells) + " |")
    for res in results:
        rows = repeats_together(res["rows"])
        for trl_name in TRL_SYSTEMS:
            trl = rows.get(trl_name)
            for name, row in rows.items():
                if trl and name in ONECOPY_SYSTEMS:
                    runs = f" (mean of {row['runs']} and {trl['runs']} runs)" if row["runs"] + trl["runs"] > 2 else ""
                    print(f"- {res['name']}: {name} = {row['samples_per_s'] / trl['samples_per_s']:.2f}x {trl_name}'s "
                          f"samples/s at {row['gpu_peak_mib'] - trl['gpu_peak_mib']:+d} MiB peak{runs}")


def repeats_together(rows: list[dict]) -> dict[str, dict]:
    """Per system that ran without error: the mean samples/s and the highest peak over its runs
    (an ABBA order runs each system twice)."""
    runs: dict[str, list[dict]] = {}
    for row in rows:
        if "error" not in row and row.get("samples_per_s"):
            runs.setdefault(row["system"], []).append(row)
    return {name: {"samples_per_s": statistics.fmean(r["samples_per_s"] for r in group),
                   "gpu_peak_mib": max(r["gpu_peak_mib"] for r in group), "runs": len(group)}
            for name, group in runs.items()}


def run_folders(systems: list[str]) -> list[str]:
    """A folder name per run: the system's name, with -2, -3 ... for its repeats, so that a
    repeated run (ABBA order) starts from an empty folder and reports only its own steps."""
    seen: dict[str, int] = {}
    folders = []
    for name in systems:
        seen[name] = seen.get(name, 0) + 1
        folders.append(name if seen[name] == 1 else f"{name}-{seen[name]}")
    return folders


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--trl-worker":
        return trl_worker(sys.argv[2])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_source(p)
    p.add_argument("--out", default="results/vs_trl")
    p.add_argument("--systems", nargs="*", choices=SYSTEMS, default=SYSTEMS,
                   help="run in this order; a system named twice runs twice (ABBA: A B B A)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one system may take")
    p.add_argument("--onecopy-args", default="", help="onecopy's own trainer flags beyond the matched ones, e.g. "
                                                      "--offload-optimizer (they go into the results)")
    p.add_argument("--onecopy-env-args", default="", help="onecopy's environment flags beyond the matched ones "
                                                          "(the later of a flag given twice wins), e.g. "
                                                          "--env.max_num_workers 16 (they go into the results)")
    add_settings_flags(p, Matched, {"gradient_checkpointing": " (1.5B model: true)",
                                    "optimizer": ": adamw, adamw8bit or adamw4bit",
                                    "bf16_weights": " (onecopy --bf16-inplace; TRL loads the model in bf16)"})
    a = p.parse_args()
    if a.table:
        return print_table([json.loads(Path(f).read_text()) for f in a.table])
    overrides = given_settings(a, Matched)
    if (a.random_qwen2 or a.random_shape) and "gradient_checkpointing" not in overrides:
        overrides["gradient_checkpointing"] = True  # onecopy's default above 1B; TRL's default always
    m = Matched(**overrides)
    if not 1 <= m.warmup_steps < m.steps:
        p.error(f"--warmup-steps must be at least 1 and below --steps ({m.steps}), got {m.warmup_steps}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model = model_from_source(a, out)
    result = {"name": a.name, "model": model, "matched": asdict(m), "onecopy_args": a.onecopy_args,
              "onecopy_env_args": a.onecopy_env_args, "rows": []}
    path = out / f"vs_trl_{a.name}.json"
    for name, folder in zip(a.systems, run_folders(a.systems)):
        t0 = time.perf_counter()
        row = (trl_row(name, m, model, out / a.name / folder, a.timeout) if name in TRL_SYSTEMS else
               onecopy_row(name, m, model, out / a.name / folder, a.timeout, a.onecopy_args, a.onecopy_env_args))
        row["wall_seconds"] = time.perf_counter() - t0
        print("[vs_trl]", json.dumps({k: v for k, v in row.items() if k != "trl_config"}), flush=True)
        result["rows"].append(row)
        path.write_text(json.dumps(result, indent=2))
    print_table([result])


if __name__ == "__main__":
    main()
