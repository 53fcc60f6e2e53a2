"""LoRA routes of onecopy's vLLM server: hot-swap the adapter that serves the policy.

  POST /lora/load   {lora_name, lora_path}  load a PEFT adapter folder and make it current
  POST /lora/unload {lora_name}             forget an adapter and free the engine's copy
  GET  /lora/status                         current adapter, loaded names, limits

"Current" is the adapter that serves every ``POST /generate`` that names no ``model``, so
environments follow the trainer's newest adapter without knowing its name or restarting. A
request that names the base model gets the base model; one that names an adapter gets that one.
At start, a server given exactly one ``--lora-modules`` adapter makes it current.

Loading and unloading need ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` (as vLLM's own
``/v1/load_lora_adapter`` does: the caller picks files the server reads), and ``/lora/load`` reads
only folders under the server's ``--lora-root`` (symlinks and ``..`` resolved first; default
``$LOGDIR``, the trainer's run folder): any other path is a 403 that names the root. The work is done by
vLLM's own ``OpenAIServingModels``, so its ``/v1/*_lora_adapter`` routes and ``/v1/models`` see
the same adapters.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from vllm_patching.compat import error_response_type

logger = logging.getLogger("vllm.onecopy.lora")

router = APIRouter()


class LoraLoadRequest(BaseModel):
    """Body of ``POST /lora/load``. Use a new name per adapter version: vLLM caches adapters by
    name/id, so a reused name would keep serving the old weights."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1, description="folder with adapter_config.json + adapter_model.safetensors")


class LoraUnloadRequest(BaseModel):
    """Body of ``POST /lora/unload``."""

    lora_name: str = Field(min_length=1)


class LoraStatus(BaseModel):
    """What ``GET /lora/status`` (and load/unload) answer."""

    current: str | None
    loaded: list[str]
    engine_lora_ids: list[int] = Field(description="adapters the engine holds in memory (at most --max-cpu-loras)")
    max_lora_rank: int
    max_loras: int


def current_lora(request: Request) -> str | None:
    return getattr(request.app.state, "onecopy_current_lora", None)


async def resolve_lora(request: Request, name: str | None):
    """The LoRARequest for a ``model`` field of /generate: no name → the current adapter (or the
    base model when none is current); the base model's name → the base model."""
    name = name or current_lora(request)
    if not name or name == request.app.state.onecopy_base_model:
        return None
    models = getattr(request.app.state, "openai_serving_models", None)
    lora = getattr(models, "lora_requests", {}).get(name) if models else None
    if lora is not None:
        return lora
    if name == current_lora(request):
        raise HTTPException(status_code=409, detail=f"current adapter {name!r} is no longer loaded (removed through "
                            "/v1/unload_lora_adapter?): load one with POST /lora/load")
    raise HTTPException(status_code=404, detail=f"model: no base model or LoRA adapter named {name!r}")


def _lora_config(request: Request):
    config = request.app.state.engine_client.vllm_config.lora_config
    if config is None:
        raise HTTPException(status_code=409, detail="LoRA is off on this server: start vLLM with --enable-lora --max-lora-rank R")
    return config


def _require_runtime_updates() -> None:
    import vllm.envs as envs

    if not envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING:
        raise HTTPException(status_code=409, detail="runtime LoRA loading is off: start vLLM with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1")


class OutsideLoraRoot(PermissionError):
    """A ``lora_path`` that resolves outside the server's ``--lora-root`` (answered 403)."""


def folder_under_root(lora_path: str, root: Path) -> Path:
    """``lora_path`` with symlinks and ``..`` resolved, when that lies under ``root``; else OutsideLoraRoot."""
    path, root = Path(lora_path).resolve(), Path(root).resolve()
    if not path.is_relative_to(root):
        raise OutsideLoraRoot(f"lora_path {lora_path!r} ({path}) is outside this server's LoRA root {root}: write "
                              "the adapter under it, or start vLLM with --lora-root covering it")
    return path


def _adapter_rank(path: Path) -> int:
    """The rank in a PEFT adapter folder; 404/400 with the reason when it is not one."""
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise HTTPException(status_code=404, detail=f"lora_path {str(path)!r} has no adapter_config.json: "
                            "give a folder written by PeftModel.save_pretrained")
    try:
        return int(json.loads(config_file.read_text())["r"])
    except (ValueError, KeyError, TypeError) as err:
        raise HTTPException(status_code=400, detail=f"{config_file} is not a PEFT LoRA config ({err!r})") from err


async def _status(request: Request) -> LoraStatus:
    config = _lora_config(request)
    models = request.app.state.openai_serving_models
    return LoraStatus(
        current=current_lora(request),
        loaded=sorted(models.lora_requests),
        engine_lora_ids=sorted(await request.app.state.engine_client.list_loras()),
        max_lora_rank=config.max_lora_rank,
        max_loras=config.max_loras,
    )


@router.post("/lora/load", response_model=LoraStatus)
async def lora_load(body: LoraLoadRequest, request: Request) -> LoraStatus:
    """Load an adapter and make it current. Fails (4xx) before touching the engine when the
    folder is no adapter or its rank is above the server's max; the old adapter keeps serving."""
    from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

    config = _lora_config(request)
    _require_runtime_updates()
    if body.lora_name == request.app.state.onecopy_base_model:
        raise HTTPException(status_code=400, detail=f"lora_name {body.lora_name!r} is the base model's name: pick another")
    try:
        path = folder_under_root(body.lora_path, request.app.state.onecopy_lora_root)  # resolved: vLLM would try the hub
    except OutsideLoraRoot as err:
        # Answered here in vLLM's error shape, not raised: vLLM's HTTPException handler blanks paths
        # in messages, and the root is what the caller has to fix.
        logger.warning("[LoRA] refused: %s", err)
        return JSONResponse(status_code=403, content={"error": {"message": str(err), "type": "Forbidden", "code": 403}})
    rank = _adapter_rank(path)
    if rank > config.max_lora_rank:
        raise HTTPException(status_code=400, detail=f"adapter rank r={rank} exceeds this server's --max-lora-rank "
                            f"{config.max_lora_rank}: restart vLLM with a larger --max-lora-rank or train with "
                            f"--lora-r <= {config.max_lora_rank}")
    models = request.app.state.openai_serving_models
    existing = models.lora_requests.get(body.lora_name)
    if existing is not None and existing.lora_path != str(path):
        raise HTTPException(status_code=409, detail=f"lora_name {body.lora_name!r} is loaded from {existing.lora_path}: "
                            "give each adapter version a new name (a reused name serves the old weights)")
    if existing is None:  # else: a retried load that already went through; just make it current
        result = await models.load_lora_adapter(LoadLoRAAdapterRequest(lora_name=body.lora_name, lora_path=str(path)))
        if isinstance(result, error_response_type()):
            raise HTTPException(status_code=result.error.code, detail=f"vLLM could not load {path}: {result.error.message}")
    previous = current_lora(request)
    request.app.state.onecopy_current_lora = body.lora_name
    logger.info("[LoRA] current adapter: %s (%s), was %s", body.lora_name, path, previous)
    return await _status(request)


@router.post("/lora/unload", response_model=LoraStatus)
async def lora_unload(body: LoraUnloadRequest, request: Request) -> LoraStatus:
    """Forget an adapter that is not current and free the engine's copy of it."""
    from vllm.entrypoints.serve.lora.protocol import UnloadLoRAAdapterRequest

    _lora_config(request)
    _require_runtime_updates()
    if body.lora_name == current_lora(request):
        raise HTTPException(status_code=409, detail=f"{body.lora_name!r} is the current adapter: load its successor first")
    models = request.app.state.openai_serving_models
    lora = models.lora_requests.get(body.lora_name)
    if lora is None:
        raise HTTPException(status_code=404, detail=f"no LoRA adapter named {body.lora_name!r} is loaded")
    result = await models.unload_lora_adapter(UnloadLoRAAdapterRequest(lora_name=body.lora_name))
    if isinstance(result, error_response_type()):
        raise HTTPException(status_code=result.error.code, detail=result.error.message)
    # vLLM's unload only forgets the name; the engine would keep the weights until its LRU cache
    # evicts them. Remove them now so memory tracks the adapters in use. A request still running
    # on this adapter carries its LoRARequest and reloads it from disk if it needs it.
    await request.app.state.engine_client.remove_lora(lora.lora_int_id)
    logger.info("[LoRA] unloaded %s (id %d)", body.lora_name, lora.lora_int_id)
    return await _status(request)


@router.get("/lora/status", response_model=LoraStatus)
async def lora_status(request: Request) -> LoraStatus:
    """The current adapter, the loaded ones, and the server's LoRA limits."""
    return await _status(request)
