"""Modes ``lora_only`` and ``lora_restart``: the base model stays frozen (bf16, one copy in the
trainer and one in vLLM); only PEFT LoRA adapters train (fp32), and only they travel to vLLM.

- ``lora_only``: every ``--lora-sync-interval`` steps save the adapter (PEFT format) to
  ``run_dir/adapters/step_N/`` and hot-swap it into the running vLLM under a new name
  (``POST /lora/load``), then unload the previous version. No restart; a swap costs a file write
  and an adapter load (milliseconds to a second).
- ``lora_restart``: every ``--vllm-restart-interval`` steps save the adapter and restart vLLM
  with it (``--lora-modules``), like mode ``none`` but with megabytes instead of the full model.

Either way vLLM serves the adapter by default: a ``/generate`` without ``model`` uses it.

Old versions are deleted at each sync, keeping what vLLM may still read. vLLM reads an adapter's
folder again whenever a request needs it and the engine does not hold it (after ``/lora/unload``,
or evicted), and a missing folder then fails the engine's step, which takes the server down. So
``lora_only`` keeps the current version (a server that died is restarted on it), the one before
(requests admitted just before the swap use it) and any whose requests vLLM still runs or queues
(its ``/metrics``); ``lora_restart`` keeps the version vLLM was started on (a restart ends every
request of the older ones). Checkpoints (``--save-steps``) are what keeps old versions.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
import uuid
from pathlib import Path

import requests
import torch

from example_trainer.bridges.base import WeightBridge, sync_by_restart
from example_trainer.config import TrainerConfig
from example_trainer.engine.vllm_process import vllm_auth_headers
from example_trainer.memory_plan import use_gradient_checkpointing
from example_trainer.model.checkpoint import ADAPTER_CONFIG, base_model_folder
from example_trainer.rl.reference import DisabledAdapterReference

logger = logging.getLogger("onecopy.trainer.bridge")

# All attention and MLP projections: what --lora-target-modules auto means per model family.
_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TARGET_MODULES = {family: _PROJECTIONS for family in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2",
                                                      "gemma3_text", "olmo2", "olmo3")}
TARGET_MODULES["phi3"] = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]  # Phi-3 holds q/k/v and gate/up fused
# Qwen3-MoE: transformers 5 holds the experts as fused 3D tensors, not Linear layers: attention only.
TARGET_MODULES["qwen3_moe"] = ["q_proj", "k_proj", "v_proj", "o_proj"]
# vLLM 0.26 accepts only these --max-lora-rank values (vllm.config.lora.MaxLoRARanks).
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_VERSION_FOLDER = re.compile(r"step_(\d+)(\.tmp)?")  # save_adapter's folders under run_dir/adapters
_VERSION_NAME = re.compile(r"policy-[0-9a-f]+-step-(\d+)")  # version_name's, of any run
_LORA_INFO = "vllm:lora_requests_info"  # vLLM's gauge naming the adapters its requests use


def target_modules(cfg: TrainerConfig, model_type: str) -> list[str]:
    """``--lora-target-modules`` as a list; ``auto`` picks the family's projections."""
    if cfg.lora_target_modules != "auto":
        return [name.strip() for name in cfg.lora_target_modules.split(",")]
    if model_type not in TARGET_MODULES:
        raise ValueError(f"--lora-target-modules auto knows no modules for model type {model_type!r} "
                         f"(known: {', '.join(TARGET_MODULES)}): pass the names, e.g. q_proj,v_proj")
    return list(TARGET_MODULES[model_type])


def vllm_lora_args(cfg: TrainerConfig) -> list[str]:
    """vLLM flags that enable LoRA with room for the trainer's rank."""
    rank = next((r for r in VLLM_MAX_LORA_RANKS if r >= cfg.lora_r), None)
    if rank is None:
        raise ValueError(f"--lora-r {cfg.lora_r} is above vLLM's largest --max-lora-rank {VLLM_MAX_LORA_RANKS[-1]}")
    # Two slots: the current adapter, and the previous one that in-flight requests may still use.
    return ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", "2"]


def lora_module_args(name: str, path: Path) -> list[str]:
    """``--lora-modules`` for one adapter, in JSON form (the name=path form breaks on ',' in paths)."""
    return ["--lora-modules", json.dumps({"name": name, "path": str(Path(path).resolve())})]


def version_name(step: int, tag: str) -> str:
    """A name vLLM has never seen for this adapter version: a reused name serves the old weights.
    ``tag`` is per trainer run, so a resumed run against a still-running server gets new names."""
    return f"policy-{tag}-step-{step}"


def save_adapter(model: torch.nn.Module, folder: Path) -> int:
    """Write the PEFT adapter (adapter_config.json + adapter_model.safetensors) to ``folder``
    atomically (temp folder + rename: a load never reads half a file). Returns the weight bytes."""
    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    if folder.exists():  # a resumed run redoing this step
        shutil.rmtree(folder)
    tmp.rename(folder)
    return (folder / ADAPTER_WEIGHTS).stat().st_size


def adapters_in_use(url: str) -> set[str] | None:
    """The adapter names that vLLM's requests run or wait on, as its ``/metrics`` last said:
    ``vllm:lora_requests_info`` keeps one series per set of names it ever reported, valued at the
    time it was last set, so the newest counts. None when vLLM does not say (unreachable, or
    started with ``--disable-log-stats``)."""
    try:
        response = requests.get(url + "/metrics", timeout=30)
        response.raise_for_status()
    except requests.RequestException:
        return None
    names, newest = None, float("-inf")
    for line in response.text.splitlines():
        if line.startswith(f"# HELP {_LORA_INFO} ") and names is None:
            names = set()  # the gauge exists; no series yet: no step has run
        elif line.startswith(_LORA_INFO + "{"):
            labels, _, value = line.rpartition(" ")
            if float(value) > newest:
                newest = float(value)
                found = dict(re.findall(r'(\w+)="([^"]*)"', labels))
                names = {name for key in ("running_lora_adapters", "waiting_lora_adapters")
                         for name in found.get(key, "").split(",") if name}
    return names


def prune_adapters(folder: Path, keep: list[Path]) -> list[Path]:
    """Delete the adapter versions under ``folder`` (``step_N``, and ``step_N.tmp`` left by a save
    that stopped) except those in ``keep``. Returns the deleted folders."""
    keep_resolved = {Path(k).resolve() for k in keep}
    versions = sorted((int(m.group(1)), path) for path in (folder.iterdir() if folder.is_dir() else ())
                      if (m := _VERSION_FOLDER.fullmatch(path.name)))
    removed = [path for _, path in versions if path.resolve() not in keep_resolved]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    if removed:
        logger.info("[sync] deleted %d adapter version(s) vLLM no longer reads: %s (kept %s)", len(removed),
                    ", ".join(p.name for p in removed), ", ".join(sorted(p.name for p in keep_resolved)) or "none")
    return removed


def post_with_retry(url: str, path: str, body: dict, timeout_s: float, revive=None) -> tuple[dict, int]:
    """POST ``body``; while the server is down (connection refused, timeout, 503) retry with
    backoff until ``timeout_s`` has passed, calling ``revive()`` before each retry (restart our
    own server if it died). Any other non-200 answer fails at once. Returns (json, attempts)."""
    deadline = time.monotonic() + timeout_s
    delay, attempts = 0.5, 0
    while True:
        attempts += 1
        try:
            response = requests.post(url + path, json=body, headers=vllm_auth_headers(), timeout=120)
        except (requests.ConnectionError, requests.Timeout) as err:
            problem = f"{type(err).__name__}: {err}"
        else:
            if response.status_code == 200:
                return response.json(), attempts
            if response.status_code != 503:
                raise RuntimeError(f"vLLM {path} answered {response.status_code}: {response.text[:500]}")
            problem = "503 " + response.text[:200]
        if time.monotonic() + delay > deadline:
            raise TimeoutError(f"vLLM {url}{path} still unreachable after {attempts} tries in {timeout_s:.0f} s "
                               f"({problem}); the adapter stays on disk at {body.get('lora_path', '-')}")
        logger.warning("[sync] %s%s failed (%s); retry %d in %.1f s", url, path, problem, attempts, delay)
        time.sleep(delay)
        if revive is not None:
            revive()
        delay = min(delay * 2, 10.0)


class LoraBridge(WeightBridge):
    """Shared PEFT setup: frozen bf16 base, fp32 adapters, adapter saving, checkpoints, and
    the vLLM server this trainer owns. Subclasses decide how an adapter reaches vLLM."""

    runtime_updates = False  # lora_only turns on vLLM's runtime adapter loading

    def reference(self, model: torch.nn.Module) -> DisabledAdapterReference:
        """The base model: the LoRA model with its adapter disabled (no copy)."""
        return DisabledAdapterReference()

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Resuming from one of our checkpoints: it holds an adapter; the base is named inside.
        self.resume_adapter = Path(self.model_path) if (Path(self.model_path) / ADAPTER_CONFIG).exists() else None
        self.base_path = base_model_folder(self.model_path)
        self.tag = uuid.uuid4().hex[:6]
        self.current: str | None = None  # name of the adapter vLLM serves now
        self.adapters_dir = self.run_dir / "adapters"  # one step_N folder per version synced

    @classmethod
    def vllm_args(cls, cfg) -> list[str]:
        return vllm_lora_args(cfg)

    @classmethod
    def vllm_env(cls, cfg, run_dir) -> dict[str, str]:
        # LOGDIR: the server's default --lora-root, so /lora/load reads this run's adapters and no other folder
        return {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "LOGDIR": str(run_dir)} if cls.runtime_updates else {}

    def serve_on(self) -> tuple[str, list[str]]:
        return self.base_path, []

    def build_model(self) -> torch.nn.Module:
        """The PEFT model: bf16 base (fp32 on CPU, see WeightBridge.forward_parameters) with
        requires_grad off, fp32 LoRA A/B trainable."""
        from peft import LoraConfig, PeftModel, get_peft_model

        dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(self.base_path, dtype=dtype).to(self.device)
        base.requires_grad_(False)
        if self.resume_adapter is not None:
            model = PeftModel.from_pretrained(base, str(self.resume_adapter), is_trainable=True)
        else:
            config = LoraConfig(r=self.cfg.lora_r, lora_alpha=self.cfg.lora_alpha, lora_dropout=self.cfg.lora_dropout,
                                target_modules=target_modules(self.cfg, base.config.model_type), task_type="CAUSAL_LM")
            model = get_peft_model(base, config)
        trainable = [p for p in model.parameters() if p.requires_grad]
        for p in trainable:
            p.data = p.data.float()  # PEFT already upcasts by default; the optimizer must see fp32
        if use_gradient_checkpointing(self.cfg, sum(p.numel() for p in base.parameters())):
            # Checkpointed blocks get their input from frozen embeddings: without this no gradient
            # would reach the adapters inside them.
            model.enable_input_require_grads()
        logger.info("[lora] %d trainable tensors (%.2f M params), rank %d, modules %s", len(trainable),
                    sum(p.numel() for p in trainable) / 1e6, self.cfg.lora_r, model.peft_config["default"].target_modules)
        return model

    def save_version(self, model: torch.nn.Module, step: int) -> tuple[str, Path, int]:
        """Save this step's adapter; returns (new version name, folder, bytes)."""
        folder = self.adapters_dir / f"step_{step}"
        return version_name(step, self.tag), folder, save_adapter(model, folder)

    def save_checkpoint(self, model: torch.nn.Module, tokenizer, folder: Path) -> Path:
        """A resumable LoRA checkpoint: the adapter (naming its base model) and the tokenizer."""
        save_adapter(model, Path(folder))
        tokenizer.save_pretrained(folder)
        return Path(folder)


class LoraOnlyBridge(LoraBridge):
    """Hot-swap each new adapter into the running vLLM; never restart it."""

    runtime_updates = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.served: list[Path] = []  # the folders of the current version and the one before it
        self._use_unknown_warned = False

    def attach(self) -> torch.nn.Module:
        model = self.build_model()
        if self.resume_adapter is not None:
            self._swap(version_name(0, self.tag), self.resume_adapter)
        return model

    def sync(self, model: torch.nn.Module, step: int, final: bool) -> dict[str, float]:
        if step % self.cfg.lora_sync_interval != 0:
            if self.server is not None:
                self.server.ensure_alive()
            return {"sync/synced": 0.0}
        start = time.perf_counter()
        name, folder, nbytes = self.save_version(model, step)
        saved = time.perf_counter()
        attempts = self._swap(name, folder)
        done = time.perf_counter()
        self._prune(folder)
        return {
            "sync/synced": 1.0,
            "sync/seconds": time.perf_counter() - start,  # the swap latency as the trainer sees it
            "sync/save_seconds": saved - start,
            "sync/load_seconds": done - saved,  # load + make current + unload the previous
            "sync/load_attempts": float(attempts),
            "sync/bytes_moved": float(nbytes),
        }

    def _swap(self, name: str, folder: Path) -> int:
        """Load ``folder`` as ``name`` (current from then on), then unload the previous version."""
        revive = self.server.ensure_alive if self.server is not None else None
        _, attempts = post_with_retry(self.inference_url, "/lora/load", {"lora_name": name, "lora_path": str(folder)},
                                      self.cfg.vllm_server_timeout, revive)
        previous, self.current = self.current, name
        if self.server is not None:
            # Should our server die, ensure_alive brings it back serving this adapter.
            self.server.extra_args = lora_module_args(name, folder)
        if previous is not None:
            response = requests.post(f"{self.inference_url}/lora/unload", json={"lora_name": previous},
                                     headers=vllm_auth_headers(), timeout=60)
            if response.status_code == 404:  # the server restarted since and never had it
                logger.warning("[sync] previous adapter %s was already gone", previous)
            elif response.status_code != 200:
                raise RuntimeError(f"vLLM /lora/unload {previous} answered {response.status_code}: {response.text[:300]}")
        logger.info("[sync] vLLM serves adapter %s from %s", name, folder)
        return attempts

    def _prune(self, folder: Path) -> None:
        """Delete the versions vLLM can no longer read (module docstring): all but the current,
        the previous, and those its requests still run or wait on."""
        self.served = [*self.served[-1:], folder]
        in_use = adapters_in_use(self.inference_url)
        if in_use is None:
            if not self._use_unknown_warned:
                self._use_unknown_warned = True
                logger.warning("[sync] vLLM at %s does not report which adapters its requests use (no %s in its "
                               "/metrics: started with --disable-log-stats?): old versions in %s are kept, not "
                               "deleted", self.inference_url, _LORA_INFO, self.adapters_dir)
            return
        steps = [m.group(1) for m in map(_VERSION_NAME.fullmatch, in_use) if m]
        prune_adapters(self.adapters_dir, [*self.served, *(self.adapters_dir / f"step_{s}" for s in steps)])


class LoraRestartBridge(LoraBridge):
    """Restart our own vLLM (by PID) with the newest adapter every ``--vllm-restart-interval`` steps."""

    def serve_on(self) -> tuple[str, list[str]]:
        if self.resume_adapter is None:
            return self.base_path, []
        self.current = version_name(0, self.tag)
        return self.base_path, lora_module_args(self.current, self.resume_adapter)

    def attach(self) -> torch.nn.Module:
        return self.build_model()

    def sync(self, model: torch.nn.Module, step: int, final: bool) -> dict[str, float]:
        def save() -> tuple[str, list[str], int]:
            name, folder, nbytes = self.save_version(model, step)
            return self.base_path, lora_module_args(name, folder), nbytes

        metrics = sync_by_restart(self.cfg, self.server, step, final, save)
        if metrics["sync/synced"]:
            self.current = version_name(step, self.tag)
            # The old server and its requests are gone; the new one reads the folder it started on.
            prune_adapters(self.adapters_dir, [self.adapters_dir / f"step_{step}"])
        return metrics
