"""GRPO trainer: pull scored groups from the trajectory API, step the policy, hand the new
weights to vLLM through the chosen weight bridge.

    python -m example_trainer.grpo --max-steps 20 --batch-size 8            # single copy (shared_vllm)
    python -m example_trainer.grpo --weight-bridge-mode none --learning-rate 1e-5           # checkpoint + restart
    python -m example_trainer.grpo --weight-bridge-mode lora_only --learning-rate 1e-4      # hot-swapped LoRA
    torchrun --nproc-per-node 4 -m example_trainer.grpo --parallel data          # a vLLM and a copy per GPU
    torchrun --nproc-per-node 2 -m example_trainer.grpo --parallel tensor        # one TP=2 vLLM, one copy
    python -m example_trainer.grpo --help

The file reads top to bottom: ``main`` sets the run up (``start_run``), ``train`` runs the loop,
and ``train_step`` is one step: batch → logprobs → loss → backward → optimizer step → sync.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import signal
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from environments.config_flags import parse_config
from example_trainer.bridges import bridge_class
from example_trainer.bridges.base import InferenceServerLost, WeightBridge
from example_trainer.bytecode import warn_if_compiled_at_every_start
from example_trainer.config import TrainerConfig
from example_trainer.data.batching import TrainBatch, end_token_ids, off_policy_metrics
from example_trainer.data.rollouts import TrainBatches, open_batch_source
from example_trainer.engine.gpu_sharing import log_gpu_sharing
from example_trainer.inference import folders_in_use, launch_inference
from example_trainer.memory_plan import (check_fits, count_parameters, log_memory_plan, phase_peak_memory, plan_memory,
                                         read_shape, shape_or_none, use_expandable_segments, use_gradient_checkpointing)
from example_trainer.model.checkpoint import (base_model_folder, latest_checkpoint, prune_checkpoints,
                                              save_trainer_state, trainer_state_name)
from example_trainer.model.compilation import compile_decoder_layers
from example_trainer.model.default_model import resolve_model
from example_trainer.model.model_files import architecture
from example_trainer.model.routing_replay import RoutingReplay, check_architecture
from example_trainer.model.shared_prefix import pack_for_model, packing_applies
from example_trainer.modes import mode_facts
from example_trainer.optim.optimizers import build_optimizer
from example_trainer.parallel import Parallel
from example_trainer.rl.logprobs import projects_in_chunks, sequence_logprobs
from example_trainer.rl.loss import (BatchMetrics, BatchShape, PolicyLoss, masked_share, rollout_correction,
                                     rollout_gap_metrics)
from vllm_patching.cpu_matmul import use_fast_linears
from vllm_patching.gate import GateTimeout

logger = logging.getLogger("onecopy.trainer")


@dataclass
class Run:
    """Everything one training run holds, built by ``start_run`` and ``prepare``."""

    cfg: TrainerConfig
    parallel: Parallel
    device: torch.device
    run_dir: Path
    model_path: str
    resume_from: Path | None
    server: object  # example_trainer.inference.Inference, or None
    bridge: WeightBridge
    metrics_file: object = None
    wandb_run: object = None
    model: torch.nn.Module | None = None
    optimizer: object = None
    reference: object = None  # --beta's frozen policy (example_trainer.rl.reference)
    replay: RoutingReplay | None = None  # --routing-replay's hooks on the model's MoE routers
    tokenizer: object = None
    end_tokens: set[int] | None = None  # --mask-truncated-completions: a completion must end with one of these
    batches: TrainBatches | None = None  # each step's batch, on every rank
    start_step: int = 0
    weights_step: int = 0  # the step whose update the trainer's weights hold
    history: list[dict] = field(default_factory=list)


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(TrainerConfig, argv, description=__doc__.split("\n\n")[0])  # its first sentence
    run = start_run(cfg)
    try:
        prepare(run)
        train(run)
    except BaseException as err:
        run.parallel.report_failure(err)  # at once, with the rank: the cleanup below may take seconds
        reason = None
        try:
            reason = stop_reason(run, err)
        finally:
            finish(run, failed=True)
            run.parallel.exit_after_failure(err, reason)  # several ranks: no exit that waits on the others
        if reason is not None:
            raise SystemExit(reason) from err
        raise
    finish(run)


def stop_reason(run: Run, err: BaseException) -> str | None:
    """The message to stop with for an error the trainer knows (None: the traceback says it)."""
    if isinstance(err, InferenceServerLost):
        return keep_what_a_lost_server_left(run, err)
    if isinstance(err, (GateTimeout, NonFiniteLoss, TimeoutError)):  # NothingKept and a batch that never came too
        return f"[trainer] stopped: {err}"
    return None


def keep_what_a_lost_server_left(run: Run, err: InferenceServerLost) -> str:
    """vLLM is gone for good: save the model's weights as a resumable checkpoint where the trainer
    holds them; returns the message to stop with."""
    if not err.weights_kept:  # the model's parameters no longer point at any weights
        last = latest_checkpoint(run.run_dir)
        return (f"[trainer] stopped: {err}\nThe weights of step {run.weights_step} are not saved: {err.not_saved_because}; "
                f"--resume continues from " + (f"{last}." if last else "the model: no checkpoint was saved yet."))
    folder = run.run_dir / "checkpoints" / f"step_{run.weights_step}"
    save_checkpoint(run, folder, run.weights_step)
    return (f"[trainer] stopped: {err}\nThe weights of step {run.weights_step} are saved in {folder}; --resume "
            "continues from there.")


def log_format(rank: int | None = None) -> str:
    """The trainer log's line format (the launcher echoes and parses these lines); ``rank`` when
    several ranks log."""
    return "%(asctime)s %(levelname)s %(name)s" + (f" rank{rank}" if rank is not None else "") + ": %(message)s"


def start_run(cfg: TrainerConfig) -> Run:
    """Join the ranks, set up logging and seeds, and create (not start) this mode's vLLM and bridge."""
    try:
        parallel = Parallel.from_environment(cfg.parallel, one_vllm=mode_facts(cfg.weight_bridge_mode).one_vllm)
        parallel.check_batch(cfg.batch_size, cfg.gradient_accumulation_steps)
    except ValueError as err:
        raise SystemExit(f"[trainer] {err}") from err
    # Several ranks: rank 0 logs the run; the others only what goes wrong, each line with its rank.
    logging.basicConfig(level=logging.INFO if parallel.is_main else logging.WARNING,
                        format=log_format(parallel.rank if parallel.size > 1 else None))
    mode = mode_facts(cfg.weight_bridge_mode)
    try:
        device = parallel.device(cfg.device)
    except ValueError as err:
        raise SystemExit(f"[trainer] {err}") from err
    run_dir = Path(cfg.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    # A rank may wait in a collective while rank 0 starts vLLM or waits for a batch.
    parallel.start(device, cfg.vllm_server_timeout + cfg.batch_wait_timeout + 600)

    # Resume: weights come from the last checkpoint, optimizer state and step from beside it.
    resume_from = latest_checkpoint(run_dir) if cfg.resume else None
    if cfg.resume and resume_from is None:
        raise SystemExit(f"--resume: no checkpoint with {run_dir}/checkpoints/step_*/trainer_state.pt")
    model_path = str(resume_from) if resume_from else resolve_model(cfg.model_name)
    config_path = base_model_folder(model_path)  # a LoRA checkpoint holds an adapter, no config.json
    if cfg.routing_replay:  # before vLLM starts with --enable-return-routed-experts (which fails on a dense model)
        try:
            check_architecture(architecture(config_path))
        except ValueError as err:
            raise SystemExit(f"[trainer] {err}") from err
    logger.info("[trainer] mode=%s model=%s device=%s run_dir=%s", cfg.weight_bridge_mode, model_path, device, run_dir)
    if device.type == "cuda":
        try:  # before vLLM starts: a run that cannot fit should not cost minutes of loading first
            params = count_parameters(config_path)
            shape = read_shape(config_path)
            check_fits(cfg, params, torch.cuda.get_device_properties(device).total_memory,
                       processes=parallel.data_ranks, shape=shape, tensor_ranks=parallel.tensor_ranks)
        except ValueError as err:
            raise SystemExit(f"[memory] {err}") from err
    if device.type == "cuda" and not mode.in_process and cfg.launch_vllm and parallel.is_main:
        log_gpu_sharing()
    # Not with vLLM in this process (colocate): its cuMem pool and expandable segments do not mix
    # (PyTorch issue 147851; vLLM turns them off around its pool only when set through the env var).
    if not mode.in_process and use_expandable_segments(device):
        logger.info("[memory] CUDA allocator: expandable segments (set PYTORCH_CUDA_ALLOC_CONF to choose otherwise)")

    # SIGTERM (a scheduler, `timeout`, a benchmark's time limit) unwinds like Ctrl-C, so `finish`
    # stops the vLLM server this trainer started.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    # The loop owns vLLM (None: --launch-vllm false, one runs already); the bridge attaches the
    # model to what it serves, syncs, and may restart it. Data parallel: each rank its own server
    # (its port and folder), or rank 0 the one server (mode server); tensor parallel: rank 0 the one server.
    server_cfg, server_dir = parallel.rank_view(cfg, run_dir)
    bridge_cls = bridge_class(cfg.weight_bridge_mode, cfg.parallel)
    server = launch_inference(server_cfg, server_dir, bridge_cls, parallel=parallel)
    bridge = bridge_cls(server_cfg, model_path, server_dir, device, server, parallel=parallel)
    return Run(cfg, parallel, device, run_dir, model_path, resume_from, server, bridge,
               metrics_file=open(run_dir / "metrics.jsonl", "a") if parallel.is_main else None)


def prepare(run: Run) -> None:
    """Start vLLM, attach the model, build the optimizer (restoring a checkpoint's state), the
    --beta reference and the batch source."""
    cfg, bridge, parallel, device = run.cfg, run.bridge, run.parallel, run.device
    if parallel.is_main:  # reads folders only where Python may not write bytecode: 0.1-0.2 s there
        warn_if_compiled_at_every_start()
    in_process = mode_facts(cfg.weight_bridge_mode).in_process
    if run.server is not None and in_process:  # vLLM in this process imports transformers itself
        run.server.start(*bridge.serve_on())
    elif run.server is not None:
        run.server.start(*bridge.serve_on(), wait=False)
        importing = import_while_vllm_starts()  # after the fork: no thread runs while vLLM's process forks
        run.server.wait_started()
        importing.join()  # one thread imports them: the model is built after they are in
    parallel.barrier("every rank's vLLM to start")  # tensor parallel: every worker's bridge file is written
    run.model = model = bridge.attach()
    model.train()
    if use_fast_linears(model, device):
        logger.info("[trainer] this CPU (%s) has no fast bf16 matmul: the linear layers compute in fp32 and round "
                    "to bf16 (vllm_patching/cpu_matmul.py)", torch.backends.cpu.get_cpu_capability())
    num_params = sum(p.numel() for p in model.parameters())  # the whole model's (a DTensor counts its global shape)
    log_memory_plan(plan_memory(cfg, num_params, torch.cuda.get_device_properties(device).total_memory
                                if device.type == "cuda" else None, shape_or_none(model.config), parallel.data_ranks,
                                parallel.tensor_ranks))
    if use_gradient_checkpointing(cfg, num_params):
        model.gradient_checkpointing_enable()
    if cfg.torch_compile:
        compile_decoder_layers(model)
    if cfg.share_group_prefix:
        why = packing_applies(model) or (None if projects_in_chunks(model, cfg.logprob_chunk_tokens) else
                                         "its logprobs come from its own forward, not the decoder then the head in "
                                         "chunks (--logprob-chunk-tokens 0, or a head that is not a plain Linear)")
        if why:
            logger.warning("[trainer] --share-group-prefix: this model's rows stay padded: %s", why)
    if cfg.routing_replay:
        run.replay = RoutingReplay(model)
        logger.info("[trainer] routing replay: %d MoE layers route each token as vLLM did", run.replay.num_moe_layers)
    run.optimizer = build_optimizer(cfg.optimizer, bridge.optimizer_parameters(model), cfg.learning_rate, cfg.weight_decay,
                                    cfg.optimizer_chunk_elements, cfg.offload_optimizer, cfg.offload_gradients,
                                    bridge.staging, model_params=list(model.parameters()))
    if cfg.offload_gradients and cfg.gradient_accumulation_steps > 1:
        logger.warning("[optimizer] --offload-gradients with %d micro-batches: each one after the first brings the "
                       "gradients back from host memory and sends them out again (%.1f GiB over PCIe each way); one "
                       "micro-batch per step avoids that", cfg.gradient_accumulation_steps,
                       run.optimizer.gradients.host_bytes() / 2**30)
    if run.resume_from:
        # To host memory first: the optimizer places each value itself (--offload-optimizer: never
        # the whole state on the device at once), the masters are copied into their own tensors.
        state = torch.load(run.resume_from / trainer_state_name(parallel.state_rank), map_location="cpu",
                           weights_only=False)
        run.optimizer.load_state_dict(state["optimizer"])
        bridge.load_trainer_state(state)
        run.start_step = run.weights_step = state["step"]
        del state
        logger.info("[trainer] resumed from %s at step %d", run.resume_from, run.start_step)
    run.reference = bridge.reference(model) if cfg.beta > 0 else None
    from transformers import AutoTokenizer  # here, not at the top: vLLM is starting (example_trainer/model/model_files.py)

    run.tokenizer = AutoTokenizer.from_pretrained(run.model_path)
    run.end_tokens = end_token_ids(run.tokenizer, run.model_path) if cfg.mask_truncated_completions else None
    source = open_batch_source(cfg, in_process, run.server, run.tokenizer, parallel, run.start_step,
                               str(run.run_dir), bridge.weights_version, run.end_tokens)
    run.batches = TrainBatches(source, cfg, parallel, run.end_tokens)
    if cfg.use_wandb and parallel.is_main:
        run.wandb_run = start_wandb(cfg, run.run_dir)
    if parallel.is_main:
        version = bridge.weights_version()
        log_metrics(run, {"step": run.start_step, "gen/probe_logprob": bridge.probe_logprob(cfg.probe_prompt),
                          **({} if version is None else {"sync/weights_version": float(version)})})


def import_while_vllm_starts() -> threading.Thread:
    """Import, while vLLM starts, what the trainer needs once it is up: transformers' model classes
    and torch's tensor-parallel modules, which it starts vLLM without (example_trainer/model/model_files.py);
    about 12 s between vLLM healthy and the model attached on an H100 machine otherwise."""

    def run() -> None:
        try:
            import torch.distributed.tensor  # noqa: F401
            import transformers.modeling_utils  # noqa: F401  (what the auto classes load when first used)
            from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401
        except Exception:  # noqa: BLE001 (the import fails again where it is needed, with its cause)
            logger.debug("[trainer] importing while vLLM starts failed", exc_info=True)

    thread = threading.Thread(target=run, name="imports-while-vllm-starts", daemon=True)
    thread.start()
    return thread


def train(run: Run) -> None:
    """The loop: one ``train_step`` per step, then checkpoints and the step's log line."""
    cfg = run.cfg
    if run.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(run.device)  # the phases count from here (each resets after it)
    for step in range(run.start_step + 1, cfg.max_steps + 1):
        final = step == cfg.max_steps
        metrics = train_step(run, step, final)
        # Checkpoints (weights, and with them optimizer and step unless --save-only-model); a
        # restart mode's folders hold only the weights vLLM needs, unless this step is also a
        # checkpoint step.
        due = final or (cfg.save_steps > 0 and step % cfg.save_steps == 0)
        if due and cfg.save_steps >= 0:
            t_save = time.perf_counter()
            save_checkpoint(run, run.run_dir / "checkpoints" / f"step_{step}", step, resumable=not cfg.save_only_model)
            metrics["time/checkpoint"] = time.perf_counter() - t_save  # after time/wall: not in the step's time
        if run.parallel.is_main:  # rank 0 prunes checkpoints and logs the step
            prune_checkpoints(run.run_dir, cfg.save_total_limit, in_use=folders_in_use(run.server))
            run.history.append(metrics)
            log_metrics(run, metrics)
            logger.info("[trainer] step %d/%d reward=%.3f loss=%.4f sync=%.3fs%s", step, cfg.max_steps,
                        metrics["train/reward_mean"], metrics["train/loss"], metrics["time/sync"],
                        format_timings(metrics) if cfg.benchmark else "")
    if cfg.benchmark and run.history:
        print_benchmark_summary(run.history)
    if run.parallel.is_main:
        logger.info("[trainer] reward per step: %s",
                    " ".join(f"{m['step']}:{m['train/reward_mean']:.3f}" for m in run.history))
        logger.info("[trainer] done: %d steps, checkpoints in %s", len(run.history), run.run_dir / "checkpoints")


def train_step(run: Run, step: int, final: bool) -> dict[str, float]:
    """One optimizer step; returns its metrics."""
    cfg, bridge, parallel, model, device = run.cfg, run.bridge, run.parallel, run.model, run.device
    t0 = time.perf_counter()
    batch = run.batches.next(while_waiting=bridge.watch)  # the whole batch, on every rank
    behind = off_policy_metrics(batch, bridge.weights_version())  # before this step's write moves the version
    t_data = time.perf_counter()

    metrics = forward_backward(model, run.reference, batch, cfg, device, bridge.forward_parameters(model), parallel,
                               run.replay)
    t_fwd = time.perf_counter()
    refuse_non_finite("loss", metrics["train/loss"], step)
    memory = phase_peak_memory(device, "forward_backward")

    metrics.update(bridge.gradients_ready(model))
    grad_norm = float(run.optimizer.clip_grad_norm(parallel, cfg.max_grad_norm, list(model.parameters())))
    refuse_non_finite("gradient norm", grad_norm, step)
    # In place, this closes the weights gate: only once the step is sure to run, since a gate
    # closed here stays marked half-written, and vLLM then refuses to step on intact weights.
    with bridge.writing(model) as timings:
        run.optimizer.step()
    metrics.update(timings)
    run.weights_step = step
    run.optimizer.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    wait_for_device(device)  # CUDA steps asynchronously: its tail would be timed as the sync's
    t_opt = time.perf_counter()

    metrics.update(bridge.sync(model, step, final))
    t_sync = time.perf_counter()
    metrics.update(parallel.replicas_agree(model.parameters(), step))
    if metrics.get("sync/synced") and parallel.is_main:
        metrics["gen/probe_logprob"] = bridge.probe_logprob(cfg.probe_prompt)
    metrics.update({**run.batches.step_metrics(), **behind, "step": step, "train/grad_norm": grad_norm, **memory,
                    **phase_peak_memory(device, "optimizer_sync")})
    return {**metrics, **batch_metrics(batch, metrics), **timings_of(t0, t_data, t_fwd, t_opt, t_sync)}


def wait_for_device(device: torch.device) -> None:
    """Wait until ``device`` ran what was launched (seen at 1.4B without it: a "30 ms write" of the
    sync that alone takes ~4 ms, the rest the optimizer step's tail)."""
    if device.type == "cuda":
        torch.cuda.synchronize()


def batch_metrics(batch: TrainBatch, metrics: dict[str, float]) -> dict[str, float]:
    """The batch's rewards: every group received, dropped ones too (the group filter's
    ``train/reward_mean``, when one runs), and the kept ones' alone; the completions masked."""
    kept_reward = statistics.fmean(batch.scores)
    return {"train/reward_mean": metrics.get("train/reward_mean", kept_reward), "train/reward_kept_mean": kept_reward,
            "train/truncated_masked": int(batch.truncated.sum())}


def timings_of(t0: float, t_data: float, t_fwd: float, t_opt: float, t_sync: float) -> dict[str, float]:
    """The step's phases in seconds, and the Unix time it ended (benchmarks line steps up with other clocks)."""
    return {"time/data_wait": t_data - t0, "time/forward_backward": t_fwd - t_data, "time/optimizer": t_opt - t_fwd,
            "time/sync": t_sync - t_opt, "time/step": time.perf_counter() - t0, "time/wall": time.time()}


class NonFiniteLoss(RuntimeError):
    """A step's loss or gradient norm is NaN or inf: stepping on it would write NaN into the
    weights (vLLM's too)."""


def refuse_non_finite(what: str, value: float, step: int) -> None:
    """Stop before the optimizer step of a batch whose loss or gradient norm is NaN or inf. Both
    are summed over the ranks, so every rank stops at the same point. Without this a run went on
    with NaN weights: vLLM generated from them, and its null logprobs stopped the environment with
    an error that named none of this."""
    if not math.isfinite(value):
        raise NonFiniteLoss(f"step {step}'s {what} is {value}: the weights, the batch or the backward hold NaN or inf. "
                            f"Its optimizer step did not run. An earlier step may have written the weights: resume "
                            f"(--resume) from a checkpoint saved before the first step whose train/grad_norm in "
                            f"metrics.jsonl looks wrong")


def forward_backward(model, reference, batch: TrainBatch, cfg: TrainerConfig, device: torch.device,
                     weights: dict[str, torch.Tensor] | None = None, parallel: Parallel = Parallel(),
                     replay: RoutingReplay | None = None) -> dict[str, float]:
    """Loss and backward over this rank's rows of ``batch`` in ``--gradient-accumulation-steps``
    micro-batches; returns the whole batch's ``train/*`` and ``sampling/*`` metrics. ``replay``
    (--routing-replay): each micro-batch, forward and backward, routes as vLLM did
    (``sampling/routes_differ``: the share of routes where the trainer's router would not have).

    Each micro-batch's loss is its share of the whole batch's (``BatchShape``), so accumulation (and
    data-parallel ranks, each with its share of the rows, their gradients summed) gives the same
    gradient as one pass. Likewise the metrics: per-token means are weighted by each part's tokens
    and summed over the ranks, ``*/min`` and ``*/max`` taken over the parts, so they are the whole
    batch's, however it was split."""
    num_tokens = max(batch.completion_mask.sum().item(), 1.0)
    steps = cfg.gradient_accumulation_steps
    # A short batch (the group filter could not fill one) leaves micro-batches, even ranks,
    # without rows; the parts that hold one (over all ranks) are what bnpo averages over.
    parts = sum(min(len(share.scores), steps) for share in batch.split(parallel.data_ranks))
    shape = BatchShape(tokens=num_tokens, sequences=len(batch.scores), parts=parts,
                       max_completion_length=cfg.max_completion_length)
    pack = cfg.share_group_prefix and projects_in_chunks(model, cfg.logprob_chunk_tokens)  # once for every micro-batch
    totals = BatchMetrics()
    micro_batches = [mb for mb in parallel.my_rows(batch).split(steps) if mb.scores]
    untrained = not micro_batches  # data parallel, fewer rows than ranks: this rank joins with zeros
    for mb in micro_batches or [batch.untrained_row()]:
        counted = torch.zeros_like(mb.attention_mask) if untrained else mb.attention_mask  # routes replayed
        # the backward inside too: gradient checkpointing routes again there
        with replay.replaying(mb.routes, counted) if replay is not None else contextlib.nullcontext():
            loss, token_means = micro_batch_loss(model, reference, mb, cfg, shape, device, weights, pack)
            loss.backward()
        totals.add(loss.item(), token_means, mb.completion_mask.sum().item())
    metrics = totals.over_ranks(parallel, num_tokens)
    if replay is not None:
        routes = parallel.sum_over_ranks(replay.take_counts())
        metrics["sampling/routes_differ"] = routes["differing"] / max(routes["routed"], 1.0)
    return metrics


def micro_batch_loss(model, reference, mb: TrainBatch, cfg: TrainerConfig, shape: BatchShape, device, weights=None,
                     pack: bool = False):
    """Forward one micro-batch and return (loss, metrics); prompt tokens are masked out.
    ``weights``: tensors to compute with in place of the model's parameters (None: its own);
    ``pack``: each group's prompt goes through the model once (--share-group-prefix, where the
    model allows it: forward_backward decides).

    With ``--vllm-importance-sampling-correction`` (TRL's default) the policy ratio is taken to the
    trainer's own logprobs before this step (as TRL's, with one update per batch) and vLLM's enter
    only as the correction's weights; without it, the ratio is taken to vLLM's logprobs directly."""
    tokens = mb.tokens.to(device)  # (b, T)
    inputs = {"input_ids": tokens, "attention_mask": mb.attention_mask.to(device)}
    packed = pack_for_model(model, mb.tokens, mb.attention_mask, mb.groups, device) if pack else None
    logprobs = sequence_logprobs(model, inputs, cfg.logprob_chunk_tokens, weights, packed)  # (b, T-1)
    mask = mb.completion_mask.to(device)
    has_rollout = mb.has_old_logprobs.to(device)[:, None]
    # rows sent without rollout logprobs are trained on-policy (ratio 1); batching warns about them
    current = logprobs.detach()
    rollout = torch.where(has_rollout, mb.old_logprobs.to(device), current)
    correction, ratios = rollout_correction(current, rollout, mask, cfg.vllm_importance_sampling_mode,
                                            cfg.vllm_importance_sampling_clip_min, cfg.vllm_importance_sampling_clip_max)
    gap = rollout_gap_metrics(current, rollout, mask * has_rollout, ratios)
    if cfg.vllm_importance_sampling_correction:
        gap["sampling/correction_masked"] = masked_share(correction, mask * has_rollout)
    else:
        correction, current = None, rollout
    ref = reference.logprobs(model, inputs, cfg.logprob_chunk_tokens, packed) if reference is not None else None
    loss, metrics = PolicyLoss.from_config(cfg)(logprobs, current, mb.advantages.to(device), mask, shape,
                                                rollout_weights=correction, ref_logprobs=ref)
    if correction is not None:
        # The ratio the clip acts on is to this step's own logprobs: 1 on every token, nothing
        # clipped, whatever happens; left out, not logged as 1 and 0. The ratio to vLLM's logprobs
        # is sampling/importance_ratio/*, what the correction dropped sampling/correction_masked.
        del metrics["train/ratio_mean"], metrics["train/clip_fraction"]
    if cfg.share_group_prefix:
        gap["train/forward_positions_saved"] = packed.saved if packed is not None else 0.0
    return loss, {**metrics, **gap}


def save_checkpoint(run: Run, folder: Path, step: int, resumable: bool = True) -> None:
    """A checkpoint: the bridge's weights folder and, when ``resumable``, the trainer state beside
    it. Data parallel: every rank holds the same weights and optimizer state, rank 0 writes them;
    tensor parallel: every rank takes part (the weights are gathered) and writes its shard's state."""
    if not (run.parallel.is_main or run.parallel.tensor):
        return
    if not resumable:  # an earlier run's state in this folder would pair new weights with old masters
        (Path(folder) / trainer_state_name(run.parallel.state_rank)).unlink(missing_ok=True)
    folder = run.bridge.save_checkpoint(run.model, run.tokenizer, folder)
    if resumable:
        masters = run.bridge.masters  # the fp32 weights the optimizer steps (bridge.load_trainer_state reads them)
        save_trainer_state(folder, step, run.optimizer, {"masters": masters.state()} if masters is not None else {},
                           rank=run.parallel.state_rank)
    elif run.parallel.is_main:
        logger.info("[checkpoint] step %d saved to %s (weights only: --save-only-model)", step, folder)


def finish(run: Run, failed: bool = False) -> None:
    """Let go of vLLM's memory, stop what this trainer started, close the logs (always runs).
    ``failed``: this rank stops on an error, and the other ranks may never get here."""
    if run.optimizer is not None:
        run.optimizer.release()  # its row-block views may map the server's memory too
    run.bridge.close()  # before the server goes: it lets go of the server's memory
    # Tensor parallel: rank 0 stops the one server only once every rank has let go of it (on CPU a
    # shared-memory mapping that outlives its exporter aborts the process). A failing rank does not
    # wait: the others may sit in a collective of their own (gloo's monitored barrier then waited
    # past its timeout), and torchrun stops them once this rank exits.
    if not failed:
        run.parallel.wait_for_ranks("let go of vLLM's memory", 120)
    if run.server is not None:
        run.server.stop()
    if run.metrics_file is not None:
        run.metrics_file.close()
    if run.wandb_run is not None:
        run.wandb_run.finish()
    if not failed:  # a failing rank exits without the group's teardown, which may wait for the others
        run.parallel.stop()


def start_wandb(cfg: TrainerConfig, run_dir: Path):
    """A wandb run for rank 0 (offline without WANDB_API_KEY)."""
    import wandb

    if not os.environ.get("WANDB_API_KEY"):
        os.environ.setdefault("WANDB_MODE", "offline")
    return wandb.init(project=cfg.wandb_project, group=cfg.wandb_group, config=vars(cfg), dir=str(run_dir))


def log_metrics(run: Run, metrics: dict) -> None:
    """One JSON line per step in metrics.jsonl (and wandb when on)."""
    run.metrics_file.write(json.dumps(metrics) + "\n")
    run.metrics_file.flush()
    if run.wandb_run is not None:
        run.wandb_run.log({k: v for k, v in metrics.items() if isinstance(v, (int, float)) and k != "step"},
                          step=metrics["step"])


def format_timings(m: dict) -> str:
    keys = ["time/data_wait", "time/forward_backward", "time/optimizer", "time/sync"]
    return " | " + " ".join(f"{k.split('/')[1]}={m[k]:.3f}s" for k in keys)


def print_benchmark_summary(history: list[dict]) -> None:
    """A table of median and max per timing, over all steps (not ``time/wall``: a Unix time, not a duration)."""
    keys = sorted({k for m in history for k in m if k.startswith(("time/", "sync/")) and isinstance(m[k], float)}
                  - {"time/wall"})
    print(f"\n{'metric':<28}{'median':>16}{'max':>16}")
    for k in keys:
        values = [m[k] for m in history if k in m]
        print(f"{k:<28}{statistics.median(values):>16.4f}{max(values):>16.4f}")


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    main()
