"""GRPO trainer: pull scored groups from the trajectory API, step the policy, hand the new
weights to vLLM through the chosen weight bridge.

    python -m example_trainer.grpo --training-steps 20 --batch-size 8            # single copy (shared_vllm)
    python -m example_trainer.grpo --weight-bridge-mode none --lr 1e-5           # checkpoint + restart
    python -m example_trainer.grpo --weight-bridge-mode lora_only --lr 1e-4      # hot-swapped LoRA
    torchrun --nproc-per-node 4 -m example_trainer.grpo --parallel data          # a vLLM and a copy per GPU
    torchrun --nproc-per-node 2 -m example_trainer.grpo --parallel tensor        # one TP=2 vLLM, one copy
    python -m example_trainer.grpo --help

The loop reads top to bottom: batch → logprobs → loss → step → sync → log.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import random
import signal
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from environments.config_flags import parse_config
from example_trainer.api_client import TrajectoryClient
from example_trainer.batching import build_batch
from example_trainer.bridges import bridge_class, launch_server
from example_trainer.bridges.base import InferenceServerLost
from example_trainer.checkpoint import latest_checkpoint, prune_checkpoints, save_trainer_state, trainer_state_name
from example_trainer.config import TrainerConfig
from example_trainer.default_model import resolve_model
from example_trainer.inprocess_rollouts import InProcessRollouts, load_environment
from example_trainer.logprobs import sequence_logprobs
from example_trainer.loss import grpo_loss
from example_trainer.memory_plan import (log_memory_plan, phase_peak_memory, plan_memory, use_expandable_segments,
                                        use_gradient_checkpointing)
from example_trainer.optimizers import build_optimizer
from example_trainer.parallel import Parallel

logger = logging.getLogger("onecopy.trainer")


def micro_batch_loss(model, ref_model, mb, cfg: TrainerConfig, num_tokens: float, device, weights=None):
    """Forward one micro-batch and return (loss, metrics); prompt tokens are masked out.
    ``weights``: tensors to compute with in place of the model's parameters (None: its own)."""
    tokens = mb.tokens.to(device)  # (b, T)
    attention = mb.attention_mask.to(device)  # (b, T)
    inputs = {"input_ids": tokens, "attention_mask": attention}
    logprobs = sequence_logprobs(model, inputs, cfg.logprob_chunk_tokens, weights)  # (b, T-1)
    # rows sent without rollout logprobs are trained on-policy (ratio 1); batching warns about them
    old = torch.where(mb.has_old_logprobs.to(device)[:, None], mb.old_logprobs.to(device), logprobs.detach())
    ref = None
    if ref_model is not None:
        with torch.no_grad():
            ref = sequence_logprobs(ref_model, inputs, cfg.logprob_chunk_tokens)
    return grpo_loss(logprobs, old, mb.advantages.to(device), mb.completion_mask.to(device),
                     clip_eps=cfg.clip_eps, ref_logprobs=ref, kl_coef=cfg.kl_coef, num_tokens=num_tokens)


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(TrainerConfig, argv, description=__doc__.split("\n\n")[0])  # its first sentence
    try:
        parallel = Parallel.from_environment(cfg.parallel)
        device = parallel.device(cfg.device)
    except ValueError as err:
        raise SystemExit(f"[trainer] {err}") from err
    run_dir = Path(cfg.save_path)
    run_dir.mkdir(parents=True, exist_ok=True)
    # Several ranks: rank 0 logs the run; the others only what goes wrong, each line with its rank.
    logging.basicConfig(level=logging.INFO if parallel.is_main else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s" + (f" rank{parallel.rank}" if parallel.size > 1
                                                                       else "") + ": %(message)s")
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    # A rank may wait in a collective while rank 0 starts vLLM or waits for a batch.
    parallel.start(device, cfg.vllm_start_timeout + cfg.batch_wait_timeout + 600)

    # Resume: weights come from the last checkpoint, optimizer state and step from beside it.
    start_step, resume_from = 0, latest_checkpoint(run_dir) if cfg.resume else None
    if cfg.resume and resume_from is None:
        raise SystemExit(f"--resume: no checkpoint with {run_dir}/checkpoints/step_*/trainer_state.pt")
    model_path = str(resume_from) if resume_from else resolve_model(cfg.model_name)
    logger.info("[trainer] mode=%s model=%s device=%s run_dir=%s", cfg.weight_bridge_mode, model_path, device, run_dir)
    # Not with vLLM in this process (colocate): its cuMem pool and expandable segments do not mix
    # (PyTorch issue 147851; vLLM turns them off around its pool only when set through the env var).
    if cfg.weight_bridge_mode != "colocate" and use_expandable_segments(device):
        logger.info("[memory] CUDA allocator: expandable segments (set PYTORCH_CUDA_ALLOC_CONF to choose otherwise)")

    # SIGTERM (a scheduler, `timeout`, a benchmark's time limit) unwinds like Ctrl-C, so the
    # finally below stops the vLLM server this trainer started.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    # The loop owns the vLLM server process (None: --launch-vllm false, one runs already); the
    # bridge attaches the model to what it serves, syncs, and may restart it. Data parallel: each
    # rank its own server (its port and folder); tensor parallel: rank 0 starts the one server.
    server_cfg, server_dir = parallel.rank_view(cfg, run_dir)
    server = launch_server(server_cfg, server_dir, parallel=parallel)
    bridge = bridge_class(cfg.weight_bridge_mode)(server_cfg, model_path, server_dir, device, server, parallel=parallel)
    metrics_file = open(run_dir / "metrics.jsonl", "a") if parallel.is_main else None
    wandb_run, optimizer = None, None
    try:
        if server is not None:
            server.start(*bridge.serve_on())
        parallel.barrier()  # tensor parallel: every worker's bridge file is written
        model = bridge.attach()
        model.train()
        num_params = sum(p.numel() for p in model.parameters())
        log_memory_plan(plan_memory(cfg, num_params, torch.cuda.get_device_properties(device).total_memory
                                    if device.type == "cuda" else None))
        if use_gradient_checkpointing(cfg, num_params):
            model.gradient_checkpointing_enable()
        optimizer = build_optimizer(cfg.optimizer, bridge.optimizer_parameters(model), cfg.lr, cfg.weight_decay,
                                    cfg.optimizer_chunk_elements)
        if resume_from:
            state = torch.load(resume_from / trainer_state_name(parallel.state_rank), map_location=device,
                               weights_only=False)
            optimizer.load_state_dict(state["optimizer"])
            bridge.load_trainer_state(state)
            start_step = state["step"]
            logger.info("[trainer] resumed from %s at step %d", resume_from, start_step)
        ref_model = None
        if cfg.kl_coef > 0:
            ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        tokenizer = AutoTokenizer.from_pretrained(model_path)

        api = None  # rank 0 alone takes the batches and hands the other ranks theirs
        if bridge.in_process:  # colocate: the environment samples from the engine here, no API
            env = load_environment(cfg.environment, cfg.env_args, cfg.seq_len, tokenizer, server)
            api = InProcessRollouts(env, cfg.batch_size, server if cfg.release_kv_cache else None)
        elif parallel.is_main:
            api = TrajectoryClient(cfg.api_url, cfg.api_key)
        if api is not None:
            api.register(cfg.batch_size, cfg.seq_len, cfg.training_steps, starting_step=start_step,
                         checkpoint_dir=str(run_dir), wandb_project=cfg.wandb_project, wandb_group=cfg.wandb_group)
        if cfg.use_wandb and parallel.is_main:
            import wandb

            if not os.environ.get("WANDB_API_KEY"):
                os.environ.setdefault("WANDB_MODE", "offline")
            wandb_run = wandb.init(project=cfg.wandb_project, group=cfg.wandb_group, config=vars(cfg), dir=str(run_dir))

        if parallel.is_main:
            log_metrics(metrics_file, wandb_run, {"step": start_step, "gen/probe_logprob": bridge.probe_logprob(cfg.probe_prompt)})
        history: list[dict] = []
        weights_step = start_step  # the step whose update the trainer's weights hold
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)  # the phases count from here (each resets after it)
        for step in range(start_step + 1, cfg.training_steps + 1):
            t0 = time.perf_counter()
            batch = parallel.share(build_batch(api.get_batch(cfg.batch_wait_timeout, while_waiting=bridge.watch),
                                               cfg.seq_len) if api is not None else None)
            t_data = time.perf_counter()

            # forward/backward over micro-batches; the loss is normalised by the completion
            # tokens of the whole batch, so accumulation (and data-parallel ranks, each with its
            # share of the rows, their gradients summed) gives the same gradient as one pass
            num_tokens = max(batch.completion_mask.sum().item(), 1.0)
            step_metrics: dict[str, float] = {}
            loss_total = 0.0
            weights = bridge.forward_parameters(model)
            for mb in parallel.my_rows(batch).split(cfg.gradient_accumulation_steps):
                loss, m = micro_batch_loss(model, ref_model, mb, cfg, num_tokens, device, weights)
                loss.backward()
                loss_total += loss.item()
                for k, v in m.items():
                    step_metrics[k] = step_metrics.get(k, 0.0) + v / cfg.gradient_accumulation_steps
            t_fwd = time.perf_counter()
            memory = phase_peak_memory(device, "forward_backward")

            step_metrics.update(bridge.before_optimizer_step(model))
            params = bridge.optimizer_parameters(model)
            parallel.sum_gradients(params)
            grad_norm = parallel.clip_grad_norm(params, cfg.max_grad_norm, bridge.sharded_parameters())
            optimizer.step()
            weights_step = step
            optimizer.zero_grad(set_to_none=True)
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                # CUDA runs the step asynchronously: without this its tail would be timed as
                # part of the weight sync (seen at 1.4B: a "30 ms write" that alone takes ~4 ms).
                torch.cuda.synchronize()
            t_opt = time.perf_counter()

            final = step == cfg.training_steps
            step_metrics.update(bridge.sync(model, step, final))
            t_sync = time.perf_counter()
            if parallel.data:
                step_metrics["parallel/replica_spread"] = parallel.replica_spread(model.parameters())
                if step_metrics["parallel/replica_spread"] and parallel.is_main:
                    logger.warning("[parallel] the data-parallel ranks' weights differ after step %d (spread of their "
                                   "sums %.3g): the GPUs no longer serve one policy", step,
                                   step_metrics["parallel/replica_spread"])
            if step_metrics.get("sync/synced") and parallel.is_main:
                step_metrics["gen/probe_logprob"] = bridge.probe_logprob(cfg.probe_prompt)
            # Resumable checkpoints (weights, optimizer, step); a restart mode's folders hold only
            # the weights vLLM needs, unless this step is also a checkpoint step.
            due = final or (cfg.checkpoint_interval > 0 and step % cfg.checkpoint_interval == 0)
            if due and cfg.checkpoint_interval >= 0:
                save_checkpoint(bridge, model, tokenizer, optimizer, run_dir / "checkpoints" / f"step_{step}", step,
                                parallel)
            if not parallel.is_main:
                continue  # rank 0 prunes checkpoints and logs the step
            prune_checkpoints(run_dir, cfg.keep_last, in_use=bridge.folders_in_use())

            scores = batch.scores
            step_metrics.update({
                "step": step,
                "train/loss": loss_total,
                "train/reward_mean": statistics.fmean(scores),
                "train/grad_norm": float(grad_norm),
                "train/completion_tokens": num_tokens,
                "time/data_wait": t_data - t0,
                "time/forward_backward": t_fwd - t_data,
                "time/optimizer": t_opt - t_fwd,
                "time/sync": t_sync - t_opt,
                "time/step": time.perf_counter() - t0,
                **memory, **phase_peak_memory(device, "optimizer_sync"),
            })
            history.append(step_metrics)
            log_metrics(metrics_file, wandb_run, step_metrics)
            logger.info("[trainer] step %d/%d reward=%.3f loss=%.4f sync=%.3fs%s", step, cfg.training_steps,
                        step_metrics["train/reward_mean"], loss_total, t_sync - t_opt,
                        "" if not cfg.benchmark else format_timings(step_metrics))
        if cfg.benchmark and history:
            print_benchmark_summary(history)
        logger.info("[trainer] reward per step: %s", " ".join(f"{m['step']}:{m['train/reward_mean']:.3f}" for m in history))
        logger.info("[trainer] done: %d steps, checkpoints in %s", len(history), run_dir / "checkpoints")
    except InferenceServerLost as err:
        # vLLM is gone for good; the model holds the trainer's weights: keep them resumable.
        folder = run_dir / "checkpoints" / f"step_{weights_step}"
        save_checkpoint(bridge, model, tokenizer, optimizer, folder, weights_step, parallel)
        raise SystemExit(f"[trainer] stopped: {err}\nThe weights of step {weights_step} are saved in {folder}; "
                         "--resume continues from there.") from err
    finally:
        if optimizer is not None:
            optimizer.release()  # its row-block views may map the server's memory too
        bridge.close()  # before the server goes: it lets go of the server's memory
        # Tensor parallel: rank 0 stops the one server only once every rank has let go of it (on
        # CPU a shared-memory mapping that outlives its exporter aborts the process).
        parallel.wait_for_ranks("let go of vLLM's memory", 120)
        if server is not None:
            server.stop()
        if metrics_file is not None:
            metrics_file.close()
        if wandb_run is not None:
            wandb_run.finish()
        parallel.stop()


def save_checkpoint(bridge, model, tokenizer, optimizer, folder: Path, step: int, parallel: Parallel) -> None:
    """A resumable checkpoint: the bridge's weights folder and the trainer state beside it. Data
    parallel: every rank holds the same weights and optimizer state, rank 0 writes them; tensor
    parallel: every rank takes part (the weights are gathered) and writes its shard's state."""
    if not (parallel.is_main or parallel.tensor):
        return
    folder = bridge.save_checkpoint(model, tokenizer, folder)
    save_trainer_state(folder, step, optimizer, bridge.trainer_state(), rank=parallel.state_rank)


def log_metrics(file, wandb_run, metrics: dict) -> None:
    """One JSON line per step in metrics.jsonl (and wandb when on)."""
    file.write(json.dumps(metrics) + "\n")
    file.flush()
    if wandb_run is not None:
        wandb_run.log({k: v for k, v in metrics.items() if v is not None and k != "step"}, step=metrics["step"])


def format_timings(m: dict) -> str:
    keys = ["time/data_wait", "time/forward_backward", "time/optimizer", "time/sync"]
    return " | " + " ".join(f"{k.split('/')[1]}={m[k]:.3f}s" for k in keys)


def print_benchmark_summary(history: list[dict]) -> None:
    """A table of median and max per timing, over all steps."""
    keys = sorted({k for m in history for k in m if k.startswith(("time/", "sync/")) and isinstance(m[k], float)})
    print(f"\n{'metric':<28}{'median':>16}{'max':>16}")
    for k in keys:
        values = [m[k] for m in history if k in m]
        print(f"{k:<28}{statistics.median(values):>16.4f}{max(values):>16.4f}")


if __name__ == "__main__":
    main()
