"""What the trainer and vLLM will hold on the device, per parameter and in total, printed at start.

Bytes per parameter by kind (full-parameter modes; LoRA modes train a few million parameters and
hold the frozen base once in each process):

  weights     bf16, 2 bytes: once in shared_vllm (vLLM's tensors), twice in mode none
  masters     fp32 copy the optimizer steps, 4 bytes (none with --bf16-inplace)
  gradients   fp32 on the masters, 4 bytes; bf16 on the weights with --bf16-inplace, 2 bytes (in
              host memory with --offload-gradients: listed, not counted on the device)
  optimizer   AdamW's two moments: 8 bytes fp32, about 2 bytes with adamw8bit (in host memory
              with --offload-optimizer: listed, not counted on the device)
  reference   --beta in full-parameter modes: a frozen bf16 copy, 2 bytes (LoRA modes: none)

``memory_kinds`` lists them for a mode, from its facts (example_trainer/modes.py).

Activations and the KV cache come on top. Given the model's shape the plan estimates the trainer's
peak too (``activation_bytes``): with gradient checkpointing, every layer's input of one
micro-batch, one layer's recompute and backward, and one --logprob-chunk-tokens slice of the
logits in fp32, plus a fixed allowance for the CUDA context and the allocator (and with
--offload-gradients one for the allocator's larger reserve, ``gradients_in_flight_bytes``); without
checkpointing, every layer's share as the one recomputed layer's. Against the trainer peaks
measured by bench/memory.py (8B and 14B shapes, seq len 2048, checkpointing) it lands within 10%;
without checkpointing it came 8-9% above the allocator's reserve of two 8B runs (bench/vs_trl.py,
one compiled; tests/unit/test_memory_plan.py). Sequences are counted at --seq-len: a batch of
shorter ones holds less.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

import torch

from example_trainer.config import TrainerConfig
from example_trainer.model.model_files import read_config, stored_parameter_count
from example_trainer.modes import mode_facts
from example_trainer.optim.optimizers import STATE_BYTES_PER_PARAM
from example_trainer.profiles import LEANER_PROFILES, PROFILES
from example_trainer.rl.reference import FrozenWeightsReference

logger = logging.getLogger("onecopy.trainer.memory")
GIB = 2**30
HOST_MEMORY = "host memory"  # a kind named with it is held in host memory, not on the device
ON_VLLM_GPUS = "on --vllm-gpus"  # mode server: a kind named with it is on vLLM's GPUs, not the trainer's
CHECKPOINTING_ABOVE_PARAMS = 1_000_000_000  # --gradient-checkpointing unset: on above this size


def use_gradient_checkpointing(cfg: TrainerConfig, params: int) -> bool:
    """--gradient-checkpointing as given, else on for models above a billion parameters (their
    activations at seq_len 2048 outgrow the weights)."""
    return cfg.gradient_checkpointing if cfg.gradient_checkpointing is not None else params > CHECKPOINTING_ABOVE_PARAMS


FIXED_TRAINER_BYTES = 2 * GIB  # CUDA context, cuBLAS workspace, allocator slack (driver peak over the estimate, H100)


@dataclass
class ModelShape:
    """What the activation estimate needs of a model's config."""

    layers: int
    hidden: int
    intermediate: int  # an MoE layer: the experts a token goes to, together
    vocab: int
    query: int = 0  # attention heads x head dim (0: the hidden size)
    key_value: int = 0  # key/value heads x head dim (0: the hidden size)

    @classmethod
    def from_config(cls, config) -> "ModelShape":
        config = getattr(config, "text_config", None) or config
        experts = getattr(config, "num_experts_per_tok", None)
        intermediate = (config.moe_intermediate_size * experts if experts and getattr(config, "moe_intermediate_size", None)
                        else config.intermediate_size)
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return cls(config.num_hidden_layers, config.hidden_size, intermediate, config.vocab_size, heads * head_dim,
                   kv_heads * head_dim)


def micro_batch_sequences(cfg: TrainerConfig, data_ranks: int = 1) -> int:
    """Sequences in one micro-batch: each of ``data_ranks`` ranks trains its share of the batch in
    --gradient-accumulation-steps parts."""
    return cfg.batch_size // (data_ranks * cfg.gradient_accumulation_steps)


def activation_bytes(cfg: TrainerConfig, shape: ModelShape, checkpointing: bool, data_ranks: int = 1) -> float:
    """Estimated activation memory of one micro-batch at --seq-len (bf16 hidden states); with
    ``data_ranks`` data-parallel ranks each trains its share of the batch."""
    tokens = micro_batch_sequences(cfg, data_ranks) * cfg.seq_len
    layer = tokens * (12 * shape.hidden + 16 * shape.intermediate)  # q/k/v/o and norms; gate, up, act, product + grads
    layers = shape.layers * tokens * shape.hidden * 2 + layer if checkpointing else shape.layers * layer
    chunk = min(cfg.logprob_chunk_tokens or tokens, tokens)
    return layers + chunk * shape.vocab * 4 * 3  # fp32 logits, their log-softmax and its gradient


@dataclass
class MemoryPlan:
    params: int
    bytes_per_param: dict[str, float]  # kind -> bytes per parameter
    device_bytes: int | None  # the trainer device's total memory (None: not a GPU)
    kv_cache_bytes: int | None  # vLLM's KV-cache budget when given in bytes
    activation_bytes: float | None = None  # the estimate, when the model's shape is known
    in_flight_bytes: float = 0.0  # --offload-gradients: allowance for the allocator's reserve (gradients_in_flight_bytes)
    tensor_ranks: int = 1  # --parallel tensor: the GPUs the model is split over (``params`` is one GPU's share)

    @property
    def vllm_weight_bytes(self) -> float:
        """The kinds vLLM holds on this device (its weights; named ", vLLM" by the bridges)."""
        return self.params * sum(per for kind, per in self.bytes_per_param.items()
                                 if ", vLLM" in kind and ON_VLLM_GPUS not in kind)

    @property
    def vllm_here(self) -> bool:
        """vLLM (its weights and KV cache) shares the trainer's device (not mode server)."""
        return not any(ON_VLLM_GPUS in kind for kind in self.bytes_per_param)

    @property
    def host_bytes(self) -> float:
        """The kinds held in host memory (named ", host memory")."""
        return self.params * sum(per for kind, per in self.bytes_per_param.items() if HOST_MEMORY in kind)

    @property
    def device_state_bytes(self) -> float:
        """Every kind the device holds, vLLM's and the trainer's, before activations."""
        return self.params * sum(per for kind, per in self.bytes_per_param.items() if ON_VLLM_GPUS not in kind) - self.host_bytes

    @property
    def trainer_state_bytes(self) -> float:
        """What the trainer process holds on the device before activations."""
        return self.device_state_bytes - self.vllm_weight_bytes

    @property
    def trainer_peak_bytes(self) -> float | None:
        """The trainer process's estimated peak: state, activations, the allowances (fixed; gradients in flight)."""
        if self.activation_bytes is None:
            return None
        return self.trainer_state_bytes + self.activation_bytes + self.in_flight_bytes + FIXED_TRAINER_BYTES

    @property
    def total_bytes(self) -> float:
        """On the device, activations aside."""
        return self.device_state_bytes + ((self.kv_cache_bytes or 0) if self.vllm_here else 0)

    def table(self) -> str:
        lines = [(kind, f"{per:.1f}", self.params * per, "  (not in the total)" if ON_VLLM_GPUS in kind else "")
                 for kind, per in self.bytes_per_param.items()]
        if self.kv_cache_bytes and self.vllm_here:
            lines.append(("vLLM KV cache", "", self.kv_cache_bytes, ""))
        lines.append(("total (no activations)", "", self.total_bytes, ""))
        if self.host_bytes:
            lines.append(("of which in host memory", "", self.host_bytes, "  (not in the total)"))
        if self.trainer_peak_bytes is not None:
            lines.append(("activations (estimate)", "", self.activation_bytes, ""))
            if self.in_flight_bytes:
                lines.append(("gradients in flight to host", "", self.in_flight_bytes, ""))
            lines.append(("trainer peak (estimate)", "", self.trainer_peak_bytes, ""))
        if self.device_bytes:
            lines.append(("device memory", "", self.device_bytes, ""))
        # wide enough for the offload rows even where they are absent: plans line up with each other
        width = max(len(label) for label in [*(line[0] for line in lines), "gradients in flight to host"]) + 1
        rows = [f"{'kind':<{width}}{'bytes/param':>12}{'GiB':>10}"]
        rows += [f"{label:<{width}}{per:>12}{size / GIB:>10.2f}{note}" for label, per, size, note in lines]
        return "\n".join(rows)


def plan_memory(cfg: TrainerConfig, params: int, device_bytes: int | None = None,
                shape: ModelShape | None = None, data_ranks: int = 1, tensor_ranks: int = 1) -> MemoryPlan:
    """The plan for training ``params`` parameters with ``cfg`` on one GPU: what the mode holds
    (``memory_kinds``), and with ``shape`` the activation
    estimate. ``tensor_ranks``: the GPUs the model is split over (--parallel tensor); each holds
    1/N of every kind per parameter, as vLLM's weights and the trainer's state are sharded alike
    (the replicated norms, about 2e-5 of a 70B model, counted as split too). The activations stay
    whole: every rank trains the whole batch with whole hidden states between layers and whole
    logits; only the layers' insides are split, which the estimate does not count (it errs high)."""
    kinds = memory_kinds(cfg)
    activations = (None if shape is None else
                   activation_bytes(cfg, shape, use_gradient_checkpointing(cfg, params), data_ranks))
    return MemoryPlan(-(-params // tensor_ranks), kinds, device_bytes, cfg.vllm_kv_cache_bytes or None, activations,
                      gradients_in_flight_bytes(cfg, shape) / tensor_ranks, tensor_ranks)


def memory_kinds(cfg: TrainerConfig) -> dict[str, float]:
    """Bytes per parameter the mode of ``cfg`` holds, by kind (activations and the KV cache aside).
    Full-parameter modes: vLLM's bf16 weights, the trainer's own when it keeps a copy, then the
    masters, gradients and optimizer state, and the --beta reference. A kind named with ", vLLM"
    is vLLM's, one with HOST_MEMORY is held in host memory."""
    mode = mode_facts(cfg.weight_bridge_mode)
    if mode.lora:
        # A few million trainable parameters; the frozen base once in each process, and it is the
        # --beta reference too (the adapter switched off), at no cost.
        return {"frozen base, trainer": 2.0, "frozen base, vLLM": 2.0}
    kinds = {"weights, vLLM (bf16)": 2.0}
    if mode.trainer_weight_copy:
        kinds["weights, trainer"] = 2.0
    if cfg.bf16_inplace:
        kinds["gradients (bf16)" + (f", {HOST_MEMORY}" if cfg.offload_gradients else "")] = 2.0
    else:
        kinds["masters (fp32)"] = 4.0
        kinds["gradients (fp32)"] = 4.0
    optimizer = f"optimizer ({cfg.optimizer})" + (f", {HOST_MEMORY}" if cfg.offload_optimizer else "")
    kinds[optimizer] = STATE_BYTES_PER_PARAM[cfg.optimizer]
    if cfg.beta > 0:
        kinds["KL reference (bf16)"] = FrozenWeightsReference.bytes_per_param
    if mode.own_gpus:  # vLLM's copy is on --vllm-gpus: counted there, not on the trainer's GPU
        kinds = {(f"{kind}, {ON_VLLM_GPUS}" if kind.startswith("weights, vLLM") else kind): per for kind, per in kinds.items()}
    return kinds


def gradients_in_flight_bytes(cfg: TrainerConfig, shape: ModelShape | None) -> float:
    """--offload-gradients: an allowance for the allocator's larger reserve. On the H100 rows of
    bench/memory.py (lean8-offload-grads: 8B, two 14B shapes) the reserve above the tensors' peak was
    3.4-4.3 GiB against 0.8-1.2 GiB with the gradients on the GPU, likely memory backward freed that
    waits for the side stream's copy before reuse (not measured), and the driver peaks sat 0.6-1.7 GiB
    above the plan without this term. Sized as the largest gradient (the embedding's or the LM
    head's: vocab x hidden, bf16), which lands those rows within 3%; fitted, not derived."""
    if not cfg.offload_gradients or shape is None:
        return 0.0
    return shape.vocab * shape.hidden * 2.0


def shape_or_none(config) -> ModelShape | None:
    """The model's shape; None for a config that does not name the fields the estimate needs (an
    architecture outside the families table, trained in mode none): the plan then leaves activations out."""
    try:
        return ModelShape.from_config(config)
    except AttributeError:
        return None


EXPERT_FIELDS = ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size")


def read_shape(model_path: str) -> ModelShape | None:
    """The shape from the config in ``model_path``, without loading anything (``shape_or_none``).
    Read as JSON first: the check runs before vLLM starts, and importing transformers there would
    delay vLLM's start by seconds. A config that leaves a field the shape needs to its class's
    default (an MoE config without the experts per token or their width, say) goes through
    transformers' AutoConfig, which knows the default."""
    try:
        config = read_config(model_path)
        text = getattr(config, "text_config", None) or config
        moe = any(hasattr(text, name) for name in EXPERT_FIELDS)
        if not moe or all(hasattr(text, name) for name in ("num_experts_per_tok", "moe_intermediate_size")):
            return ModelShape.from_config(config)
    except (OSError, ValueError, AttributeError, TypeError):
        pass
    from transformers import AutoConfig

    return shape_or_none(AutoConfig.from_pretrained(model_path))


def count_parameters(model_path: str) -> int:
    """Parameters of the model in ``model_path``, nothing loaded or allocated, so a plan can be
    checked before vLLM starts: from its safetensors headers, else (a folder with a config only)
    from the config's model on the meta device."""
    stored = stored_parameter_count(model_path)
    if stored is not None:
        return stored
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def vllm_bytes(plan: MemoryPlan, cfg: TrainerConfig) -> float:
    """What vLLM takes of the device: its weights and KV budget when the budget is in bytes, else
    its --gpu-memory-utilization share (vLLM allocates that fraction, weights included)."""
    if not plan.vllm_here:  # mode server: vLLM takes its own GPUs
        return 0.0
    if plan.kv_cache_bytes:
        return plan.vllm_weight_bytes + plan.kv_cache_bytes
    return max(plan.vllm_weight_bytes, cfg.vllm_memory_fraction() * (plan.device_bytes or 0))


def needed_bytes(cfg: TrainerConfig, params: int, device_bytes: int, shape: ModelShape | None = None,
                 data_ranks: int = 1, tensor_ranks: int = 1) -> float:
    """What the device must hold at least: vLLM's share and the trainer's state, plus with the
    model's ``shape`` the trainer's estimated activations and fixed allowance (its planned peak).
    vLLM's CUDA graphs and workspace (3-5 GiB at 8-30B) are not counted, so the check errs towards
    letting a run start."""
    plan = plan_memory(cfg, params, device_bytes, shape, data_ranks, tensor_ranks)
    return vllm_bytes(plan, cfg) + (plan.trainer_state_bytes if shape is None else plan.trainer_peak_bytes)


# The leaner settings to suggest, least change first: one flag alone, then the profiles
# (example_trainer/profiles.py; docs/modes.md says what each costs).
LEANER_SETTINGS = [{"optimizer": "adamw8bit"}, {"bf16_inplace": True}, *(PROFILES[name] for name in LEANER_PROFILES)]


def suggestion(setting: dict) -> str:
    """How to ask for ``setting``: its profile and flags where it is a profile, else its flags."""
    name = next((name for name, values in PROFILES.items() if values == setting and values), None)
    return f"--profile {name} ({as_flags(setting)})" if name else as_flags(setting)


def as_flags(setting: dict) -> str:
    """Config fields as the command line spells them: {"bf16_inplace": True, "optimizer": "adamw8bit"}
    -> "--bf16-inplace --optimizer adamw8bit" (a false switch is left out)."""
    return " ".join(f"--{key.replace('_', '-')}" + ("" if value is True else f" {value}")
                    for key, value in setting.items() if value is not False)


def _with(cfg: TrainerConfig, setting: dict) -> TrainerConfig | None:
    """``cfg`` with ``setting``, or None where the mode does not take it (--bf16-inplace in mode none)."""
    try:
        return dataclasses.replace(cfg, **setting)
    except ValueError:
        return None


def check_fits(cfg: TrainerConfig, params: int, device_bytes: int, processes: int = 1,
               shape: ModelShape | None = None, tensor_ranks: int = 1) -> None:
    """Refuse, before anything is loaded, a configuration that cannot fit the device, naming the
    flags of the first leaner setting that would; and one whose offloaded optimizer state would not
    fit in host memory. ``processes``: the data-parallel trainer processes on this machine, each
    holding one state and training its share of the batch; ``tensor_ranks``: the GPUs a
    tensor-parallel model is split over, each holding 1/N of it (``plan_memory``; together the
    ranks pin one model's offloaded state). With gradient checkpointing the trainer
    counts at its planned peak (``needed_bytes`` with the shape), the regime bench/memory.py
    measured; without it at its state alone, and activations that would not fit at --seq-len only
    warn (``warn_if_activations_may_not_fit``): GRPO's sequences are mostly far shorter, and the
    default 135M run on a 16 GB card would be refused on its worst case."""
    check_host_fits(cfg, params, device_bytes, processes=processes)
    if not use_gradient_checkpointing(cfg, params):
        warn_if_activations_may_not_fit(cfg, params, device_bytes, processes, shape, tensor_ranks)
        shape = None
    need = needed_bytes(cfg, params, device_bytes, shape, processes, tensor_ranks)
    if need <= device_bytes:
        return
    accepted = [(s, leaner) for s in LEANER_SETTINGS if (leaner := _with(cfg, s))]  # e.g. none offloads gradients with --parallel data
    lean = next((s for s, leaner in accepted
                 if needed_bytes(leaner, params, device_bytes, shape, processes, tensor_ranks) <= device_bytes), None)
    smaller = ("a smaller model, a smaller KV cache or a larger GPU" if shape is None else
               "fewer activations (more --gradient-accumulation-steps, a shorter --seq-len), a smaller model, a "
               "smaller KV cache or a larger GPU")
    advice = ("try " + suggestion(lean) if lean else
              f"no leaner optimizer setting of this mode fits either (the leanest: --weight-bridge-mode shared_vllm "
              f"{suggestion(accepted[-1][0] if accepted else LEANER_SETTINGS[-1])}): {smaller}")
    counted = ("before activations (vLLM's share and the trainer's state)" if shape is None else
               "(vLLM's share and the trainer's planned peak, activations included)")
    given = as_flags({key: getattr(cfg, key) for key in ("weight_bridge_mode", "optimizer", "bf16_inplace",
                                                         "staged_step", "offload_optimizer", "offload_gradients")})
    table = plan_memory(cfg, params, device_bytes, shape, processes, tensor_ranks).table()
    split = f" over {tensor_ranks} tensor-parallel GPUs" if tensor_ranks > 1 else ""
    raise ValueError(f"{params / 1e9:.2f} B parameters{split} with {given} need {need / GIB:.1f} GiB {counted}, the device has "
                     f"{device_bytes / GIB:.1f} GiB: {advice}\n{table}")


def warn_if_activations_may_not_fit(cfg: TrainerConfig, params: int, device_bytes: int, processes: int,
                                    shape: ModelShape | None, tensor_ranks: int = 1) -> bool:
    """Without gradient checkpointing: warn where vLLM's share, the trainer's state and the
    activations of a micro-batch of --seq-len sequences exceed the device; returns whether it
    warned. The estimate per token was 21-23% above two measured 8B runs (tests/unit/test_memory_plan.py)."""
    if shape is None:
        return False
    need = needed_bytes(cfg, params, device_bytes, shape, processes, tensor_ranks)
    if need <= device_bytes:
        return False
    logger.warning("[memory] without gradient checkpointing a micro-batch of %d sequences of --seq-len %d tokens "
                   "would need %.1f GiB with its activations, the device has %.1f GiB: the run holds only while its "
                   "sequences stay shorter. --gradient-checkpointing, more --gradient-accumulation-steps or a "
                   "shorter --seq-len would fit it", micro_batch_sequences(cfg, processes),
                   cfg.seq_len, need / GIB, device_bytes / GIB)
    return True


HOST_SHARE = 0.8  # of the machine's memory, at most, for the offloaded state: the trainer and vLLM need host memory too
# torch's pinned-memory allocator rounds each buffer up to a power of two: 8% more than the state at
# the 14B shapes' tensor sizes, up to 2x for one buffer just above a power of two.
PINNED_ROUNDING = 1.15


def machine_memory_bytes() -> int:
    """This machine's memory, or its container's limit (cgroup v2 ``memory.max``) when lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = open("/sys/fs/cgroup/memory.max").read().strip()
    except OSError:
        return total
    return min(total, int(limit)) if limit.isdigit() else total


def check_host_fits(cfg: TrainerConfig, params: int, device_bytes: int | None = None,
                    host_bytes: int | None = None, processes: int = 1) -> None:
    """Refuse an offloaded optimizer state (and gradients) that would take more than HOST_SHARE of
    the machine's memory: it is pinned (the kernel cannot page it out), the state's buffers rounded
    up by torch's pinned allocator (the gradients' are registered as they are), and each of
    ``processes`` trainer processes on this machine (data-parallel ranks) holds its own."""
    plan = plan_memory(cfg, params, device_bytes)
    state = processes * params * sum(per * (PINNED_ROUNDING if kind.startswith("optimizer") else 1.0)
                                     for kind, per in plan.bytes_per_param.items() if HOST_MEMORY in kind)
    host_bytes = host_bytes or machine_memory_bytes()
    if state > HOST_SHARE * host_bytes:
        ranks = f" for {processes} trainer processes" if processes > 1 else ""
        what, smaller = (("optimizer state and gradients", "drop --offload-gradients (2 bytes/param), use --optimizer "
                          "adamw4bit (1 byte/param)") if cfg.offload_gradients else
                         ("optimizer state", "use --optimizer adamw4bit (1 byte/param)"))
        raise ValueError(f"--offload-optimizer would pin {state / GIB:.1f} GiB of {what} ({cfg.optimizer}"
                         f"{ranks}) in host memory, more than {HOST_SHARE:.0%} of this machine's "
                         f"{host_bytes / GIB:.1f} GiB: {smaller} or leave the state on the GPU")


def log_memory_plan(plan: MemoryPlan) -> None:
    """Print the plan; warn when it alone exceeds the device."""
    share = f" (one GPU's 1/{plan.tensor_ranks} of a tensor-parallel model)" if plan.tensor_ranks > 1 else ""
    logger.info("[memory] plan for %.2f B parameters%s:\n%s", plan.params / 1e9, share, plan.table())
    if plan.device_bytes and plan.total_bytes > plan.device_bytes:
        logger.warning("[memory] the plan needs %.1f GiB before activations, the device has %.1f GiB: try "
                       "--optimizer adamw8bit, --bf16-inplace (shared_vllm), --offload-optimizer (and "
                       "--offload-gradients) or a smaller "
                       "--vllm-kv-cache-bytes",
                       plan.total_bytes / GIB, plan.device_bytes / GIB)


def use_expandable_segments(device: torch.device) -> bool:
    """Let this process's CUDA allocator grow its segments in place rather than cache blocks of fixed
    sizes; return whether it was set. At 7-8B the allocator had reserved 3-4 GiB beyond the peak its
    tensors held (bench/memory.py on an H100: the per-phase metrics). This process only, hence not
    through PYTORCH_CUDA_ALLOC_CONF, which the vLLM server the trainer starts would inherit: vLLM's
    weights are exported over CUDA IPC and must stay plain allocations. A PYTORCH_CUDA_ALLOC_CONF
    the user set is left alone."""
    if device.type != "cuda" or "PYTORCH_CUDA_ALLOC_CONF" in os.environ:
        return False
    torch._C._accelerator_setAllocatorSettings("expandable_segments:True")  # what torch.cuda's deprecated setter calls
    return True


PHASE_METRICS = {  # phase -> (tensors' peak, allocator's reserved peak), in GiB
    "forward_backward": ("memory/forward_backward_peak_allocated_gib", "memory/forward_backward_peak_reserved_gib"),
    "optimizer_sync": ("memory/optimizer_sync_peak_allocated_gib", "memory/optimizer_sync_peak_reserved_gib"),
}


def phase_peak_memory(device: torch.device, phase: str) -> dict[str, float]:
    """The peak of the trainer's CUDA allocator since the step began or the last phase ended: what
    tensors held and what PyTorch's cache reserved; then counting starts afresh for the next phase.
    The driver's number for the process is about the largest reserved one plus the CUDA context;
    vLLM's shared weights count in neither (the trainer maps them, it did not allocate them)."""
    if device.type != "cuda":
        return {}
    allocated, reserved = PHASE_METRICS[phase]
    peaks = {allocated: torch.cuda.max_memory_allocated(device) / GIB,
             reserved: torch.cuda.max_memory_reserved(device) / GIB}
    torch.cuda.reset_peak_memory_stats(device)
    return peaks
