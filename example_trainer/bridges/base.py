"""The one interface every ``--weight-bridge-mode`` implements.

A bridge makes vLLM serve the weights the trainer steps. Its core contract is three calls:

  model = bridge.attach()                  once, vLLM up: the model to train, serving vLLM's weights
  bridge.sync(model, step, final)          after every optimizer.step(): vLLM serves the new weights
  bridge.close()                           always (try/finally), before the loop stops vLLM

Around them the loop calls hooks that a mode overrides only when it differs from the default
(each hook's docstring says when it is called and who overrides it):

  before the run      vllm_args / vllm_env (class methods: how the loop launches this mode's vLLM),
                      serve_on (what it starts vLLM on)
  the optimizer       optimizer_parameters, forward_parameters, gradients_ready, before_optimizer_step
  while waiting       watch
  checkpoints         save_checkpoint, folders_in_use, trainer_state / load_trainer_state
  --kl-coef           reference
  logging             probe_logprob

A mode's facts (does it restart vLLM itself, run vLLM in this process, support --bf16-inplace or
--parallel, take the --lora-* flags, what the memory plan counts) are class attributes and
``memory_kinds``, declared once on the mode's class; the config checks, the memory plan and the
loop read them from there. ``InferenceServerLost`` from watch/sync: vLLM is gone for good; the
model holds the trainer's weights, so the loop saves them and stops.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import requests
import torch

from example_trainer.bridges.master_weights import MasterWeights
from example_trainer.checkpoint import save_hf_checkpoint
from example_trainer.config import TrainerConfig
from example_trainer.memory_plan import HOST_MEMORY
from example_trainer.optimizers import STATE_BYTES_PER_PARAM
from example_trainer.parallel import Parallel
from example_trainer.reference import FrozenWeightsReference
from example_trainer.staged_writes import StagedWrites
from example_trainer.vllm_process import vllm_auth_headers

logger = logging.getLogger("onecopy.trainer.bridge")
PROBE_TOP_K = 20  # vLLM's default --max-logprobs


class InferenceServerLost(RuntimeError):
    """vLLM went away and this bridge cannot bring it back. ``weights_kept``: the model's parameters
    hold the trainer's current weights (trainer-owned memory), so they can still be saved; False
    where they lived only in vLLM's memory (--bf16-inplace) and went with it."""

    def __init__(self, message: str, weights_kept: bool = True) -> None:
        super().__init__(message)
        self.weights_kept = weights_kept


class WeightBridge(abc.ABC):
    """How the trainer's weights reach the vLLM server that generates rollouts."""

    # -- the mode's facts ---------------------------------------------------------------------
    restarts_vllm: ClassVar[bool] = False  # it (re)starts vLLM itself: --launch-vllm false is refused
    in_process: ClassVar[bool] = False  # vLLM's engine runs in this process (InProcessEngine), not a server
    bf16_inplace: ClassVar[bool] = False  # --bf16-inplace: the optimizer may step vLLM's bf16 tensors
    staged_step: ClassVar[bool] = False  # --staged-step: vLLM generates while the optimizer steps
    parallel_modes: ClassVar[tuple[str, ...]] = ("none",)  # the --parallel values it is built for
    lora: ClassVar[bool] = False  # it takes the --lora-* flags
    trainer_weight_copy: ClassVar[bool] = True  # the memory plan: the trainer holds bf16 weights of its own
    server_flags: ClassVar[bool] = False  # it takes --vllm-gpus, --vllm-tensor-parallel-size, --vllm-gpus-overlap

    def __init__(self, cfg: TrainerConfig, model_path: str, run_dir: Path, device: torch.device,
                 server=None, parallel: Parallel = Parallel()) -> None:
        self.cfg = cfg
        self.parallel = parallel  # this trainer rank's place (mode shared_vllm over several GPUs)
        self.model_path = model_path
        self.run_dir = Path(run_dir)
        self.device = device
        self.server = server  # the loop's (example_trainer.inference); a bridge may restart it, the loop stops it
        # Full-parameter modes train bf16 weights with fp32 masters (same numerics in every mode); the
        # modes differ only in whose memory the bf16 weights live in and how vLLM sees them.
        self.masters: MasterWeights | None = None
        # --staged-step (example_trainer/staged_writes.py): the new weights wait here for the write.
        self.staging: StagedWrites | None = None

    @classmethod
    def check_config(cls, cfg: TrainerConfig) -> None:
        """Refuse flags this mode does not take, naming the flag and the fix (TrainerConfig calls it)."""
        mode = cfg.weight_bridge_mode
        if cls.restarts_vllm and not cfg.launch_vllm:
            how = "builds vLLM in this process" if cls.in_process else "starts and restarts vLLM itself"
            raise ValueError(f"--weight-bridge-mode {mode} {how}: drop --launch-vllm false")
        if cfg.bf16_inplace and not cls.bf16_inplace:
            raise ValueError(f"--bf16-inplace steps vLLM's own bf16 tensors: only --weight-bridge-mode shared_vllm or "
                             f"colocate have them, got {mode!r}")
        if cfg.staged_step and not cls.staged_step:
            raise ValueError(f"--staged-step lets a vLLM server generate during the optimizer step: only "
                             f"--weight-bridge-mode shared_vllm has one beside the trainer, got {mode!r}")
        if cfg.parallel not in cls.parallel_modes:
            raise ValueError(f"--parallel {cfg.parallel} is not built for --weight-bridge-mode {mode!r}; it takes "
                             f"{', '.join(cls.parallel_modes)} (use shared_vllm for several GPUs)")
        if not cls.lora:
            # A LoRA flag in another mode would be silently ignored: say so instead.
            for f in dataclasses.fields(cfg):
                if f.name.startswith("lora_") and getattr(cfg, f.name) != f.default:
                    raise ValueError(f"--{f.name.replace('_', '-')} only applies to --weight-bridge-mode lora_only or "
                                     f"lora_restart; got mode {mode!r}")
        if not cls.server_flags:
            for name in ("vllm_gpus", "vllm_tensor_parallel_size", "vllm_gpus_overlap"):
                if getattr(cfg, name) != TrainerConfig.__dataclass_fields__[name].default:
                    raise ValueError(f"--{name.replace('_', '-')} only applies to --weight-bridge-mode server; got "
                                     f"mode {mode!r}")
        if not cls.in_process and (cfg.env_args or cfg.environment != "arithmetic" or cfg.release_kv_cache):
            raise ValueError("--environment, --env-args and --release-kv-cache are for --weight-bridge-mode colocate; in "
                             "the other modes the environment runs as its own process and posts to the API")

    @classmethod
    def memory_kinds(cls, cfg: TrainerConfig) -> dict[str, float]:
        """Bytes per parameter this mode holds, by kind, for the memory plan (activations and the KV
        cache aside). Full-parameter modes: vLLM's bf16 weights, the trainer's own when it keeps a
        copy, then the masters, gradients and optimizer state, and the --kl-coef reference."""
        kinds = {"weights, vLLM (bf16)": 2.0}
        if cls.trainer_weight_copy:
            kinds["weights, trainer"] = 2.0
        if cfg.bf16_inplace:
            kinds["gradients (bf16)" + (f", {HOST_MEMORY}" if cfg.offload_gradients else "")] = 2.0
        else:
            kinds["masters (fp32)"] = 4.0
            kinds["gradients (fp32)"] = 4.0
        optimizer = f"optimizer ({cfg.optimizer})" + (f", {HOST_MEMORY}" if cfg.offload_optimizer else "")
        kinds[optimizer] = STATE_BYTES_PER_PARAM[cfg.optimizer]
        if cfg.kl_coef > 0:
            kinds["KL reference (bf16)"] = FrozenWeightsReference.bytes_per_param
        return kinds

    @property
    def inference_url(self) -> str:
        """Base URL of the vLLM server that serves the current policy (ours or one we attach to)."""
        return f"http://127.0.0.1:{self.cfg.vllm_port}"

    # -- before the run -----------------------------------------------------------------------

    @classmethod
    def vllm_args(cls, cfg: TrainerConfig) -> list[str]:
        """vLLM flags this mode needs beyond ``vllm_server_args``. Called by ``launch_inference``;
        overridden by modes that need flags (LoRA, colocate)."""
        return []

    @classmethod
    def vllm_env(cls, cfg: TrainerConfig, run_dir: Path) -> dict[str, str]:
        """Environment variables this mode's vLLM server needs. Called by ``launch_inference``;
        overridden by shared_vllm (export the weights) and lora_only (runtime adapter loading)."""
        return {}

    def serve_on(self) -> tuple[str, list[str]]:
        """(model, per-start flags) the loop starts vLLM on, just before ``attach``. Overridden by
        modes that serve something else than ``model_path`` (a LoRA base, a resumed adapter)."""
        return self.model_path, []

    # -- the core contract --------------------------------------------------------------------

    @abc.abstractmethod
    def attach(self) -> torch.nn.Module:
        """Return the model to train, serving the same weights as vLLM (which is up)."""

    @abc.abstractmethod
    def sync(self, model: torch.nn.Module, step: int, final: bool) -> dict[str, float]:
        """Called after ``optimizer.step()``: make vLLM serve the new weights (now or at its own
        interval). Returns ``sync/*`` metrics; ``sync/synced`` is 1.0 when vLLM changed weights."""

    def close(self) -> None:
        """Let go of what the bridge holds (not the server: the loop stops it). Safe to call twice.
        Overridden by the modes that map vLLM's memory."""

    # -- the optimizer ------------------------------------------------------------------------

    def optimizer_parameters(self, model: torch.nn.Module) -> list[torch.Tensor]:
        """The tensors the optimizer steps: the fp32 masters, or the model's own trainable
        parameters. Called once after ``attach`` (and by the loop to clip and sum gradients)."""
        if self.masters is not None:
            return self.masters.params
        return [p for p in model.parameters() if p.requires_grad]

    def forward_parameters(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """Tensors to run the forward pass with in place of the model's own (None: its own).
        Called before every step's forward passes; tensor parallel overrides it (None).

        On CPU the fp32 masters: torch multiplies bf16 matrices with its reference kernel on CPUs
        without AVX-512 BF16 (35x slower than fp32 on a 2-core AVX2 machine: 3.5 s against 0.1 s
        for a 2048x576 @ 576x1536 product), and the masters hold the same weights unrounded.
        Their gradients land on the masters directly."""
        if self.masters is None or self.device.type != "cpu":
            return None
        return {name: master for (name, _), master in zip(model.named_parameters(), self.masters.params)}

    def gradients_ready(self, model: torch.nn.Module) -> dict[str, float]:
        """Called after the last backward of a step, before the gradient norm is taken; returns
        ``sync/*`` timings. The default moves the gradients onto the masters, which the norm and the
        optimizer read."""
        if self.masters is not None:
            self.masters.pull_grads()
        return {}

    def before_optimizer_step(self, model: torch.nn.Module) -> dict[str, float]:
        """Called right before ``optimizer.step()``, once the gradient norm is known to be finite
        (a step stopped on a NaN or inf norm never reaches it); returns ``sync/*`` timings.
        shared_vllm with --bf16-inplace closes the weights gate here: the optimizer is about to
        write vLLM's tensors. The default does nothing."""
        return {}

    # -- while the loop waits for a batch -----------------------------------------------------

    def watch(self) -> None:
        """Called while the loop waits for a batch: notice (and repair) a lost vLLM early, since
        the environments cannot produce rollouts without it. Overridden by shared_vllm."""

    # -- checkpoints --------------------------------------------------------------------------

    def save_checkpoint(self, model: torch.nn.Module, tokenizer, folder: Path) -> Path:
        """Write what a resumed run passes back as ``model_path``: here a full HF folder.
        Overridden by LoRA (an adapter) and tensor parallel (gathered shards)."""
        return save_hf_checkpoint(model, tokenizer, folder)

    def folders_in_use(self) -> list[Path]:
        """Checkpoint folders that must not be deleted now. Called before pruning. Every mode: the
        folder the loop's vLLM server was last started on, which a restart of it loads again (a
        crashed vLLM in mode none or shared_vllm, a restart mode's next start; after --resume, the
        checkpoint resumed from). None without a server process the trainer may restart."""
        folder = getattr(self.server, "restarts_from", None)  # an in-process engine (colocate) is never restarted
        return [Path(folder)] if folder else []

    def trainer_state(self) -> dict:
        """Extra state to put in a resumable checkpoint: the fp32 master weights."""
        return {"masters": self.masters.state()} if self.masters is not None else {}

    def load_trainer_state(self, state: dict) -> None:
        """Restore what ``trainer_state`` returned (and write it into the bf16 weights). Called on
        --resume after the optimizer's state is loaded."""
        if self.masters is not None and "masters" in state:
            self.masters.load_state(state["masters"])
            self.masters.push()

    # -- --kl-coef and logging ----------------------------------------------------------------

    def reference(self, model: torch.nn.Module):
        """The frozen reference policy of --kl-coef, taken from the model as it is now (called once,
        after ``attach`` and any resume). Full-parameter modes: a frozen copy of the weights (the
        memory plan counts it); the LoRA modes override it with the base model, free."""
        return FrozenWeightsReference(model, self.forward_parameters(model))

    def weights_version(self) -> int | None:
        """The weights version vLLM serves now, where it counts them (single copy: the weights gate's
        record), to compare the versions each token was sampled with against; else None."""
        return None

    def probe_logprob(self, prompt: str) -> float | None:
        """``probe_logprob`` of the server that serves the current policy. Colocate overrides it."""
        return probe_logprob(self.inference_url, prompt)


def probe_logprob(url: str, prompt: str) -> float | None:
    """Sum of vLLM's top-20 logprobs for the token after ``prompt`` (greedy, one token): changes
    exactly when the served weights do. Next-token logprobs, not prompt logprobs: vLLM 0.26 can
    crash on prompt logprobs served by a LoRA adapter (vllm_patching/generate_route.py)."""
    if not prompt:
        return None
    try:
        r = requests.post(f"{url}/generate", json={"prompt": prompt, "max_tokens": 1, "temperature": 0.0,
                                                   "logprobs": PROBE_TOP_K}, headers=vllm_auth_headers(), timeout=60)
        r.raise_for_status()
    except requests.RequestException as err:
        logger.warning("[probe] failed: %s", err)
        return None
    first_token = r.json()["logprobs"][0][0]
    return float(sum(lp for entry in first_token for lp in entry.values()))


def sync_by_restart(cfg: TrainerConfig, server, step: int, final: bool,
                    save: Callable[[], tuple[str, list[str] | None, int]]) -> dict[str, float]:
    """The sync of the modes that restart vLLM (none, lora_restart): every
    ``--vllm-restart-interval`` steps, but not after the last, ``save()`` the weights — it returns
    (model path, extra vLLM flags, bytes written) — and restart ``server`` on them; on the other
    steps only bring a dead server back."""
    if step % cfg.vllm_restart_interval != 0 or final:
        server.ensure_alive()
        return {"sync/synced": 0.0}
    start = time.perf_counter()
    model, extra_args, nbytes = save()
    saved = time.perf_counter()
    logger.info("[sync] step %d: restarting vLLM on %s %s", step, model, " ".join(extra_args or []))
    server.restart(model, extra_args)
    done = time.perf_counter()
    return {
        "sync/synced": 1.0,
        "sync/seconds": done - start,
        "sync/save_seconds": saved - start,
        "sync/restart_seconds": done - saved,
        "sync/bytes_moved": float(nbytes),
    }
