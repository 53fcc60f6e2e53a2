"""The one interface every ``--weight-bridge-mode`` implements.

A bridge makes vLLM serve the weights the trainer steps. Every mode answers four calls, in this
order (the loop in example_trainer/grpo.py makes them):

  model = bridge.attach()                  once, vLLM up: the model to train, serving vLLM's weights
  with bridge.writing(model) as timings:   every step, once the gradient norm is finite
      optimizer.step()
  bridge.sync(model, step, final)          after every optimizer step: vLLM serves the new weights
  bridge.close()                           always (try/finally), before the loop stops vLLM

The optional hooks below have a default that fits most modes; a mode overrides one only where it
differs (each docstring says when the loop calls it and which modes override it):

  launching vLLM      vllm_args, vllm_env (class methods), serve_on
  the optimizer       optimizer_parameters, forward_parameters, gradients_ready
  while waiting       watch
  checkpoints         save_checkpoint, load_trainer_state
  --beta           reference
  logging             weights_version, probe_logprob

A mode's facts (does it restart vLLM itself, run vLLM in this process, take --bf16-inplace,
--parallel or the --lora-* flags, what the memory plan counts) are its row in
example_trainer/modes.py, which the config check, the memory plan and the loop read without
importing any bridge. ``InferenceServerLost`` from watch/writing/sync: vLLM is gone for good; the
model holds the trainer's weights, so the loop saves them and stops.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import requests
import torch

from example_trainer.bridges.master_weights import MasterWeights
from example_trainer.config import TrainerConfig
from example_trainer.engine.vllm_process import vllm_auth_headers
from example_trainer.model.checkpoint import save_hf_checkpoint
from example_trainer.optim.staged_writes import StagedWrites
from example_trainer.parallel import Parallel
from example_trainer.rl.reference import FrozenWeightsReference

logger = logging.getLogger("onecopy.trainer.bridge")
PROBE_TOP_K = 20  # vLLM's default --max-logprobs


class InferenceServerLost(RuntimeError):
    """vLLM went away and this bridge cannot bring it back. ``weights_kept``: the model's parameters
    hold the trainer's current weights (trainer-owned memory), so they can still be saved; False
    where they lived only in vLLM's memory (--bf16-inplace) and went with it, or cannot be saved from
    here (``not_saved_because`` says why)."""

    def __init__(self, message: str, weights_kept: bool = True,
                 not_saved_because: str = "they lived only in vLLM's memory and went with it") -> None:
        super().__init__(message)
        self.weights_kept = weights_kept
        self.not_saved_because = not_saved_because  # the loop's message when weights_kept is False


class WeightBridge(abc.ABC):
    """How the trainer's weights reach the vLLM server that generates rollouts."""

    def __init__(self, cfg: TrainerConfig, model_path: str, run_dir: Path, device: torch.device,
                 server=None, parallel: Parallel = Parallel()) -> None:
        self.cfg = cfg
        self.parallel = parallel  # this trainer rank's place (mode shared_vllm over several GPUs)
        self.model_path = model_path
        self.run_dir = Path(run_dir)
        self.device = device
        self.server = server  # the loop's (example_trainer.inference); a bridge may restart it, the loop stops it
        # the vLLM server that serves the current policy (ours or one we attach to)
        self.inference_url = f"http://127.0.0.1:{cfg.vllm_server_port}"
        # Full-parameter modes train bf16 weights with fp32 masters (same numerics in every mode); the
        # modes differ only in whose memory the bf16 weights live in and how vLLM sees them.
        self.masters: MasterWeights | None = None
        # --staged-step (example_trainer/optim/staged_writes.py): the new weights wait here for the write.
        self.staging: StagedWrites | None = None

    # -- the contract every mode implements ---------------------------------------------------

    @abc.abstractmethod
    def attach(self) -> torch.nn.Module:
        """Return the model to train, serving the same weights as vLLM (which is up)."""

    @contextlib.contextmanager
    def writing(self, model: torch.nn.Module) -> Iterator[dict[str, float]]:
        """Around ``optimizer.step()``, entered once the gradient norm is known to be finite (a step
        stopped on a NaN or inf norm never enters it); yields a dict it fills with ``sync/*``
        timings. Where the optimizer steps vLLM's own tensors (shared_vllm with --bf16-inplace)
        it closes the weights gate on entry, and ``sync`` opens it; a step that raises inside
        leaves the weights marked half-written (``close`` opens the gate; vLLM steps again only
        after a complete write). The default: nothing to do, the optimizer writes the trainer's
        own tensors."""
        yield {}

    @abc.abstractmethod
    def sync(self, model: torch.nn.Module, step: int, final: bool) -> dict[str, float]:
        """Called after ``optimizer.step()``: make vLLM serve the new weights (now or at its own
        interval). Returns ``sync/*`` metrics; ``sync/synced`` is 1.0 when vLLM changed weights."""

    def close(self) -> None:
        """Let go of what the bridge holds (not the server: the loop stops it). Safe to call twice.
        Overridden by the modes that map vLLM's memory."""

    # == optional hooks ========================================================================
    # -- launching vLLM ------------------------------------------------------------------------

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

    # -- while the loop waits for a batch -----------------------------------------------------

    def watch(self) -> None:
        """Called while the loop waits for a batch: notice (and repair) a lost vLLM early, since
        the environments cannot produce rollouts without it. Overridden by shared_vllm."""

    # -- checkpoints --------------------------------------------------------------------------

    def save_checkpoint(self, model: torch.nn.Module, tokenizer, folder: Path) -> Path:
        """Write what a resumed run passes back as ``model_path``: here a full HF folder.
        Overridden by LoRA (an adapter) and tensor parallel (gathered shards)."""
        return save_hf_checkpoint(model, tokenizer, folder)

    def load_trainer_state(self, state: dict) -> None:
        """Restore the fp32 masters a resumable checkpoint holds (``state["masters"]``, saved by the
        loop) and write them into the bf16 weights. Called on --resume after the optimizer's state
        is loaded; shared_vllm (through the gate) and colocate (a new prefix-cache salt) override it."""
        if self.masters is not None and "masters" in state:
            self.masters.load_state(state["masters"])
            self.masters.push()

    # -- --beta and logging ----------------------------------------------------------------

    def reference(self, model: torch.nn.Module):
        """The frozen reference policy of --beta, taken from the model as it is now (called once,
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
