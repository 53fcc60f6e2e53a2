"""The one interface every ``--weight-bridge-mode`` implements.

The loop (example_trainer/grpo.py) owns the vLLM server process; a bridge is handed it (None
when the trainer attaches to a server it did not start, --launch-vllm false) and only attaches,
syncs and closes:
  server = launch_server(cfg, run_dir)     the flags and environment come from the bridge class
  bridge = bridge_class(mode)(cfg, model_path, run_dir, device, server)
  server.start(*bridge.serve_on())         what this mode's vLLM starts on
  model = bridge.attach()                  once; vLLM is serving the same weights afterwards
  opt = AdamW(bridge.optimizer_parameters(model))
  per step: bridge.watch() while waiting for data → backward → bridge.before_optimizer_step(model)
            → opt.step() → bridge.sync(model, step) → bridge.save_checkpoint(model, tokenizer, folder)
            at checkpoint steps
  InferenceServerLost from watch/sync: vLLM is gone for good; the model holds the trainer's
  weights, so the loop saves them and stops
  bridge.close()                           always (try/finally); then the loop stops the server
"""

from __future__ import annotations

import abc
import logging
import time
from collections.abc import Callable
from pathlib import Path

import requests
import torch

from example_trainer.bridges.master_weights import MasterWeights
from example_trainer.checkpoint import save_hf_checkpoint
from example_trainer.config import TrainerConfig
from example_trainer.parallel import Parallel
from example_trainer.vllm_process import VllmServerProcess

logger = logging.getLogger("onecopy.trainer.bridge")
PROBE_TOP_K = 20  # vLLM's default --max-logprobs


class InferenceServerLost(RuntimeError):
    """vLLM went away and this bridge cannot bring it back. The model's parameters hold the
    trainer's current weights (trainer-owned memory), so they can still be saved."""


class WeightBridge(abc.ABC):
    """How the trainer's weights reach the vLLM server that generates rollouts."""

    in_process = False  # True: the loop runs vLLM's engine in this process (InProcessEngine), not a server

    def __init__(self, cfg: TrainerConfig, model_path: str, run_dir: Path, device: torch.device,
                 server: VllmServerProcess | None = None, parallel: Parallel = Parallel()) -> None:
        self.cfg = cfg
        self.parallel = parallel  # this trainer rank's place (mode shared_vllm over several GPUs)
        self.model_path = model_path
        self.run_dir = Path(run_dir)
        self.device = device
        self.server = server  # the loop's; a bridge may restart it, the loop stops it
        # Every mode trains bf16 weights with fp32 masters (same numerics in every mode); the
        # modes differ only in whose memory the bf16 weights live in and how vLLM sees them.
        self.masters: MasterWeights | None = None

    @property
    def inference_url(self) -> str:
        """Base URL of the vLLM server that serves the current policy (ours or one we attach to)."""
        return f"http://127.0.0.1:{self.cfg.vllm_port}"

    @classmethod
    def vllm_args(cls, cfg: TrainerConfig) -> list[str]:
        """vLLM flags this mode needs beyond ``vllm_server_args``."""
        return []

    @classmethod
    def vllm_env(cls, cfg: TrainerConfig, run_dir: Path) -> dict[str, str]:
        """Environment variables this mode's vLLM needs."""
        return {}

    def serve_on(self) -> tuple[str, list[str]]:
        """(model, per-start flags) the loop starts vLLM on, just before ``attach``."""
        return self.model_path, []

    @abc.abstractmethod
    def attach(self) -> torch.nn.Module:
        """Return the model to train, serving the same weights as vLLM (which is up)."""

    def optimizer_parameters(self, model: torch.nn.Module) -> list[torch.Tensor]:
        """The tensors the optimizer steps: the fp32 masters, or the model's own parameters."""
        if self.masters is not None:
            return self.masters.params
        return [p for p in model.parameters() if p.requires_grad]

    def sharded_parameters(self) -> list[bool] | None:
        """Per optimizer parameter: is it one rank's shard (tensor parallel)? None: none is."""
        return None

    def forward_parameters(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """Tensors to run the forward pass with in place of the model's own (None: its own).

        On CPU the fp32 masters: torch multiplies bf16 matrices with its reference kernel on CPUs
        without AVX-512 BF16 (35x slower than fp32 on a 2-core AVX2 machine: 3.5 s against 0.1 s
        for a 2048x576 @ 576x1536 product), and the masters hold the same weights unrounded.
        Their gradients land on the masters directly."""
        if self.masters is None or self.device.type != "cpu" or self.parallel.tensor:
            return None  # tensor parallel: the masters are plain local shards, the model's are DTensors
        return {name: master for (name, _), master in zip(model.named_parameters(), self.masters.params)}

    def probe_logprob(self, prompt: str) -> float | None:
        """``probe_logprob`` of the server that serves the current policy."""
        return probe_logprob(self.inference_url, prompt)

    def before_optimizer_step(self, model: torch.nn.Module) -> dict[str, float]:
        """Called after backward, before ``optimizer.step()``; returns ``sync/*`` timings."""
        if self.masters is not None:
            self.masters.pull_grads()
        return {}

    def watch(self) -> None:
        """Called while the loop waits for a batch: notice (and repair) a lost vLLM early, since
        the environments cannot produce rollouts without it."""

    @abc.abstractmethod
    def sync(self, model: torch.nn.Module, step: int, final: bool) -> dict[str, float]:
        """Called after ``optimizer.step()``: make vLLM serve the new weights (now or at its own
        interval). Returns ``sync/*`` metrics; ``sync/synced`` is 1.0 when vLLM changed weights."""

    def save_checkpoint(self, model: torch.nn.Module, tokenizer, folder: Path) -> Path:
        """Write what a resumed run passes back as ``model_path``: here a full HF folder."""
        return save_hf_checkpoint(model, tokenizer, folder)

    def folders_in_use(self) -> list[Path]:
        """Checkpoint folders that must not be deleted now (the one vLLM was started on)."""
        return []

    def trainer_state(self) -> dict:
        """Extra state to put in a resumable checkpoint: the fp32 master weights."""
        return {"masters": self.masters.state()} if self.masters is not None else {}

    def load_trainer_state(self, state: dict) -> None:
        """Restore what ``trainer_state`` returned (and write it into the bf16 weights)."""
        if self.masters is not None and "masters" in state:
            self.masters.load_state(state["masters"])
            self.masters.push()

    def close(self) -> None:
        """Let go of what the bridge holds (not the server: the loop stops it). Safe to call twice."""


def probe_logprob(url: str, prompt: str) -> float | None:
    """Sum of vLLM's top-20 logprobs for the token after ``prompt`` (greedy, one token): changes
    exactly when the served weights do. Next-token logprobs, not prompt logprobs: vLLM 0.26 can
    crash on prompt logprobs served by a LoRA adapter (example_trainer/generate_route.py)."""
    if not prompt:
        return None
    try:
        r = requests.post(f"{url}/generate", json={"prompt": prompt, "max_tokens": 1, "temperature": 0.0,
                                                   "logprobs": PROBE_TOP_K}, timeout=60)
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
