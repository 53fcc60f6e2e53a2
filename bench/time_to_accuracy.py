"""Time to accuracy: wall-clock seconds from launch until held-out accuracy first reaches a target
(default 0.6) on two-digit addition, for onecopy's ``shared_vllm`` (async, staleness bounded by
``--max-off-policy-steps``), onecopy's ``colocate`` (strictly on-policy) and TRL's GRPOTrainer in
colocate mode, with the same model, problems, reward, batch, sampling, learning rate, optimizer
and loss (bench/vs_trl.py's matched settings, at a learning rate that learns the task).

    pip install -r bench/requirements-trl.txt        # for the trl-colocate system
    python bench/time_to_accuracy.py --out results/tta --model PATH
    python bench/time_to_accuracy.py --out /tmp/t --steps 2 --save-steps 1 --eval-items 8   # smoke test
    python bench/time_to_accuracy.py --table results/tta/time_to_accuracy.json

How it is measured: each system runs alone on the GPU (one after another) and saves its weights
every ``--save-steps`` steps; the clock is the Unix time at which the benchmark launched the
system and the time each step ended (onecopy's ``time/wall`` metric, a TRL callback for TRL).
After a system's training ends, every saved checkpoint (and the starting model) is evaluated the
same way for all systems: greedy decoding with transformers on the GPU over ``--eval-items``
held-out problems (the arithmetic environment's eval set, a seed the training stream never
uses), exact integer match, 95% Wilson intervals. Saving takes time that training would not: the
table gives the time to the first checkpoint at the target both with the saves and without
(their seconds subtracted). In ``shared_vllm`` vLLM keeps generating while the trainer saves, so
the figure without saves slightly favours it; the figure with saves slightly favours neither.

The bytecode of torch, vLLM, transformers, torchao and TRL is a condition too, recorded in the JSON: where
it is missing and Python may not write it, every process compiles them as it starts (vLLM's server
took 31.6 s to import so on an H100 machine, against 23.8 s with it; pip writes it when it installs).

Each system starts with empty compile caches of its own (``--caches fresh``, the default): vLLM's
(its model-architecture lookup, which otherwise runs in a subprocess, and torch.compile's output),
Inductor's and Triton's. With the machine's caches shared (``--caches shared``) every system after
the first starts on what the first one compiled and looked up, tens of seconds sooner.

Differences that stay (TRL 1.16 has no switch for them): TRL scales advantages by the group's
sample std + 1e-4, onecopy by the population std + 1e-6; TRL shuffles a fixed list of problems,
onecopy's environment draws them from the same seeded stream in order.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import add_settings_flags, given_settings  # noqa: E402
from bench.learning_run import ENVIRONMENTS, TRAIN_SEED, wilson  # noqa: E402
from bench.vs_trl import Matched  # noqa: E402
from example_trainer.bytecode import PACKAGES, missing_bytecode  # noqa: E402

SYSTEMS = ["onecopy-shared_vllm", "onecopy-colocate", "trl-colocate"]
# The compile caches a system fills while it starts: variable -> its folder in a system's own caches
CACHE_VARIABLES = {"VLLM_CACHE_ROOT": "vllm", "TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}
EVAL_SEED = 1_000_003  # environments.arithmetic_server's default --env.eval_seed
DIFFICULTY, OPERATIONS = 2, "+"  # the arithmetic learning run's task


@dataclass
class Settings(Matched):
    """What every system gets: bench/vs_trl.py's matched settings, long enough and at a learning
    rate that learns the task (bench/learning_run.py's), with a save every ``save_steps``."""

    steps: int = 80
    max_completion_tokens: int = 192
    lr: float = 1e-5
    seq_len: int = 384
    save_steps: int = 10


def held_out_items(count: int) -> list[dict]:
    """The arithmetic environment's eval set: its first ``count`` problems from the eval seed."""
    from environments.arithmetic_server import make_problem

    rng = random.Random(EVAL_SEED)
    return [make_problem(rng, DIFFICULTY, OPERATIONS) for _ in range(count)]


def training_items(count: int) -> list[dict]:
    """The training stream as the environment draws it (its seed, eval problems skipped)."""
    from environments.arithmetic_server import make_problem

    held_out = {item["question"] for item in held_out_items(400)}
    rng, items = random.Random(TRAIN_SEED), []
    while len(items) < count:
        item = make_problem(rng, DIFFICULTY, OPERATIONS)
        if item["question"] not in held_out:
            items.append(item)
    return items


def evaluate_folder(folder: str, tokenizer_path: str, items: list[dict], max_new_tokens: int) -> dict:
    """Greedy held-out accuracy of the HF checkpoint in ``folder`` (transformers, bf16, one batch)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from environments.arithmetic_server import SYSTEM_PROMPT, score_arithmetic
    from example_trainer.data.batching import end_token_ids

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, padding_side="left")
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to("cuda" if torch.cuda.is_available()
                                                                                 else "cpu").eval()
    prompts = [tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM_PROMPT},
                                              {"role": "user", "content": item["question"]}],
                                             add_generation_prompt=True, tokenize=False) for item in items]
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    with torch.no_grad():  # stops at the model's end-of-turn token(s), as vLLM does
        out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=sorted(end_token_ids(tokenizer, tokenizer_path)))
    texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    correct = int(sum(score_arithmetic(text, item["answer"]) for text, item in zip(texts, items)))
    low, high = wilson(correct, len(items))
    del model
    return {"accuracy": correct / len(items), "correct": correct, "n": len(items), "ci95_low": low, "ci95_high": high}


def onecopy_run(mode: str, s: Settings, model: str, out: Path, trainer_args: str, more_env_args: str,
                timeout: float) -> dict:
    """One onecopy training through the launcher; step end times and save seconds from its metrics."""
    from example_trainer.config import TrainerConfig
    from example_trainer.launcher import LoopConfig, run_loop

    env_args = [*ENVIRONMENTS["arithmetic"].env_args, "--env.max_num_workers", "8", "--env.seed", str(TRAIN_SEED), "--env.temperature",
                str(s.temperature), "--env.ensure_scores_are_not_same", "false",  # TRL keeps such groups too
                "--env.max_tokens", str(s.max_completion_tokens), "--env.max_token_length", str(s.seq_len),
                *shlex.split(more_env_args)]
    cfg = LoopConfig(run_dir=str(out), num_generations=s.group_size, timeout=timeout, env_args=shlex.join(env_args),
                     trainer=TrainerConfig(weight_bridge_mode=mode, max_steps=s.steps, model_name=model,
                                           batch_size=s.batch_size, seq_len=s.seq_len, learning_rate=s.lr))
    launched = time.time()
    result = run_loop(cfg, [*s.onecopy_flags(), "--save-steps", str(s.save_steps), "--save-total-limit", "0",
                            "--save-only-model",  # as TRL's save_only_model below: the weights are all that is evaluated
                            "--seed", str(s.seed), *shlex.split(trainer_args)])
    if result.returncode != 0:
        raise RuntimeError(f"{mode} trainer failed ({result.outcome}); see {out / 'trainer.log'}")
    steps = [m for m in result.metrics if "time/wall" in m]
    return {"launched": launched, "step_ends": {m["step"]: m["time/wall"] for m in steps},
            "save_seconds": {m["step"]: m["time/checkpoint"] for m in steps if "time/checkpoint" in m},
            "checkpoints": {m["step"]: str(out / "run" / "checkpoints" / f"step_{m['step']}")
                            for m in steps if "time/checkpoint" in m},
            "rewards": [m["train/reward_mean"] for m in steps]}


def bytecode_state() -> dict:
    """Per big package, its source files and how many lack bytecode, and PYTHONDONTWRITEBYTECODE's flag:
    without it every process compiles them at its start (tens of seconds; example_trainer/bytecode.py)."""
    counts = {name: found[1:] for name in (*PACKAGES, "trl") if (found := missing_bytecode(name)) is not None}
    return {"sources_and_missing": counts, "dont_write_bytecode": bool(sys.flags.dont_write_bytecode)}


def cache_variables(caches: str, folder: Path) -> dict[str, str]:
    """The environment that gives a system empty compile caches in ``folder`` (``caches`` fresh),
    or none (shared: the machine's own)."""
    if caches == "shared":
        return {}
    shutil.rmtree(folder, ignore_errors=True)
    return {variable: str(folder / name) for variable, name in CACHE_VARIABLES.items()}


def trl_worker(spec_file: str) -> None:
    """Runs in its own process: TRL's GRPO training, saving every ``save_steps``, its clock to a file."""
    from datasets import Dataset
    from transformers import TrainerCallback

    import trl
    from bench.vs_trl import chat_text, trl_config_kwargs
    from environments.arithmetic_server import SYSTEM_PROMPT, score_arithmetic
    from trl import GRPOConfig, GRPOTrainer

    spec = json.loads(Path(spec_file).read_text())
    s = Settings(**spec["settings"])
    clock = {"step_ends": {}, "save_seconds": {}}

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            clock["step_ends"][state.global_step] = time.time()

        def on_save(self, args, state, control, **kwargs):  # the save follows the step's end
            clock["save_seconds"][state.global_step] = time.time() - clock["step_ends"][state.global_step]

    def answer_reward(prompts, completions, answer, **kwargs):
        return [score_arithmetic(text, value) for text, value in zip(chat_text(completions), answer)]

    rows = [{"prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": item["question"]}],
             "answer": item["answer"]} for item in training_items(s.steps * s.prompts_per_step)]
    kwargs = trl_config_kwargs(s, sleep=False, out=Path(spec["out"]), cuda=True)
    kwargs.update(vllm_importance_sampling_correction=True,  # TRL's default, as onecopy's
                  vllm_max_model_length=s.seq_len, save_strategy="steps", save_steps=s.save_steps,
                  save_only_model=True, model_init_kwargs={"dtype": "float32"})  # fp32 masters, as onecopy's
    config = GRPOConfig(**kwargs)
    trainer = GRPOTrainer(model=spec["model"], reward_funcs=[answer_reward], args=config,
                          train_dataset=Dataset.from_list(rows), callbacks=[Clock()])
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    Path(spec["result"]).write_text(json.dumps({"trl_version": trl.__version__, "config": config.to_dict(),
                                                "rewards": rewards, **clock}, default=str))


def trl_run(s: Settings, model: str, out: Path, timeout: float) -> dict:
    """TRL in a child process (its own CUDA context and vLLM); stopped by its PID past ``timeout``."""
    out.mkdir(parents=True, exist_ok=True)
    spec = {"settings": asdict(s), "model": model, "out": str(out / "trainer"), "result": str(out / "trl_result.json")}
    (out / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}  # with the caches set
    launched = time.time()
    with open(out / "trl.log", "w") as log:
        proc = subprocess.Popen([sys.executable, __file__, "--trl-worker", str(out / "spec.json")], stdout=log,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()  # the PID we started
            proc.wait()
            raise RuntimeError(f"TRL ran past {timeout:.0f} s; see {out / 'trl.log'}")
    if code != 0:
        raise RuntimeError(f"TRL exited {code}; see {out / 'trl.log'}")
    res = json.loads((out / "trl_result.json").read_text())
    ends = {int(k): v for k, v in res["step_ends"].items()}
    saves = {int(k): v for k, v in res["save_seconds"].items()}
    return {"launched": launched, "step_ends": ends, "save_seconds": saves, "rewards": res["rewards"],
            "checkpoints": {step: str(out / "trainer" / f"checkpoint-{step}") for step in saves},
            "trl_version": res["trl_version"], "trl_config": res["config"]}


def curve(run: dict, accuracy: dict[int, dict]) -> list[dict]:
    """Per evaluated step: accuracy, seconds since launch with the saves before it and without."""
    rows = []
    for step in sorted(accuracy):
        end = run["step_ends"].get(step, run["launched"]) if step else run["launched"]
        saved = sum(sec for s, sec in run["save_seconds"].items() if s < step)
        rows.append({"step": step, **accuracy[step], "seconds": end - run["launched"],
                     "seconds_without_saves": end - run["launched"] - saved})
    return rows


def first_at(rows: list[dict], target: float) -> dict | None:
    return next((r for r in rows if r["step"] and r["accuracy"] >= target), None)


def print_table(result: dict) -> None:
    target = result["target"]
    print(f"\n| system | first step at >= {target} | held-out accuracy there [95% CI] | s from launch "
          f"| s without saves | final accuracy | training s (launch to last step) |\n|---|---|---|---|---|---|---|")
    for name, row in result["systems"].items():
        if "error" in row:
            print(f"| {name} | {row['error']} |")
            continue
        hit, last = first_at(row["curve"], target), row["curve"][-1]
        total = max(row["run"]["step_ends"].values()) - row["run"]["launched"]
        cells = (["not reached", "", "", ""] if hit is None else
                 [str(hit["step"]), f"{hit['accuracy']:.3f} [{hit['ci95_low']:.3f}, {hit['ci95_high']:.3f}]",
                  f"{hit['seconds']:.0f}", f"{hit['seconds_without_saves']:.0f}"])
        print(f"| {name} | " + " | ".join(cells) + f" | {last['accuracy']:.3f} | {total:.0f} |")
    hits = {n: first_at(r["curve"], target) for n, r in result["systems"].items() if "curve" in r}
    trl = hits.get("trl-colocate")
    for name, hit in hits.items():
        if trl and hit and name != "trl-colocate":
            print(f"- {name}: {trl['seconds'] / hit['seconds']:.2f}x sooner than TRL with saves, "
                  f"{trl['seconds_without_saves'] / hit['seconds_without_saves']:.2f}x without")


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--trl-worker":
        return trl_worker(sys.argv[2])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="results/time_to_accuracy")
    p.add_argument("--model", default=None, help="HF folder (default: the onecopy default model)")
    p.add_argument("--systems", nargs="*", choices=SYSTEMS, default=SYSTEMS)
    p.add_argument("--target", type=float, default=0.6, help="held-out accuracy to reach")
    p.add_argument("--eval-items", type=int, default=400)
    p.add_argument("--trainer-args", default="", help="more onecopy trainer flags")
    p.add_argument("--env-args", default="", help="more onecopy environment flags, e.g. '--env.max_batches_offpolicy 1'")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds one system may train")
    p.add_argument("--keep-checkpoints", action="store_true", help="keep the saved weights after evaluating them")
    p.add_argument("--caches", choices=["fresh", "shared"], default="fresh",
                   help="fresh: each system starts with empty compile caches of its own (as on a new machine); "
                        "shared: the machine's, so later systems start on what earlier ones compiled")
    p.add_argument("--table", default=None, help="print the table of a results JSON and exit")
    add_settings_flags(p, Settings)
    a = p.parse_args()
    if a.table:
        return print_table(json.loads(Path(a.table).read_text()))
    if a.model is None:
        from example_trainer.model.default_model import default_model_path
        a.model = default_model_path()
    s = Settings(**given_settings(a, Settings))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "time_to_accuracy.json"
    result = {"settings": asdict(s), "model": a.model, "target": a.target, "trainer_args": a.trainer_args,
              "env_args": a.env_args, "caches": a.caches, "bytecode": bytecode_state(), "systems": {}}
    items = held_out_items(a.eval_items)
    base = evaluate_folder(a.model, a.model, items, s.max_completion_tokens)
    print(f"[tta] starting model: {base}", flush=True)
    for name in a.systems:
        try:
            # set here, so the launcher's processes and TRL's inherit them; restored after
            with mock.patch.dict(os.environ, cache_variables(a.caches, out / name / "caches")):
                run = (trl_run(s, a.model, out / name, a.timeout) if name == "trl-colocate" else
                       onecopy_run(name.split("-", 1)[1], s, a.model, out / name, a.trainer_args, a.env_args,
                                   a.timeout))
        except RuntimeError as err:
            result["systems"][name] = {"error": str(err)}
            print(f"[tta] {name}: {err}", flush=True)
            path.write_text(json.dumps(result, indent=2))
            continue
        accuracy = {0: base}
        for step, folder in sorted(run["checkpoints"].items()):
            accuracy[step] = evaluate_folder(folder, a.model, items, s.max_completion_tokens)
            print(f"[tta] {name} step {step}: {accuracy[step]['accuracy']:.3f}", flush=True)
            if not a.keep_checkpoints:
                shutil.rmtree(folder, ignore_errors=True)  # a checkpoint a step: tens of GB over a run
        result["systems"][name] = {"run": run, "curve": curve(run, accuracy)}
        path.write_text(json.dumps(result, indent=2))
    print_table(result)


if __name__ == "__main__":
    main()
