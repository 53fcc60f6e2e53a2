"""Which tokenizer an environment uses: --env.tokenizer_name, else the model the inference server serves.

Environments do not import the trainer (the data path runs one way), so without
--env.tokenizer_name the environment asks the inference server. vLLM's GET /v1/models lists each
base model with `root`, the path it was loaded from, then the LoRA adapters it holds, each with a
`parent`. The environment runs on vLLM's machine, so the base model's `root` is the tokenizer's
folder. The server may still be starting (the launcher starts the environment beside the trainer,
which starts vLLM), so the lookup waits for it, as every other call to that server does, but only
up to a deadline: a tokenizer is needed before anything else can run.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Optional

import httpx
from pydantic import ValidationError

from environments.clients import TRANSIENT, Backoff, Retries, checked_json, inference_headers
from environments.schemas import ServedModels

logger = logging.getLogger("onecopy.env")
PASS_TOKENIZER = "pass --env.tokenizer_name with the local folder of the model vLLM serves"
REQUEST_TIMEOUT_S = 10.0  # vLLM binds its port before the engine is up: connections then hang


def served_model_root(base_url: str, wait_s: float, backoff: Backoff) -> str:
    """The path the inference server at `base_url` loaded its base model from (GET /v1/models).

    Retries while the server is down or answers 5xx, for about `wait_s` seconds; then raises
    RuntimeError naming --env.tokenizer_name.
    """
    url = f"{base_url.rstrip('/')}/v1/models"
    retries = Retries("inference server", backoff)
    start = time.monotonic()
    with httpx.Client(timeout=REQUEST_TIMEOUT_S, headers=inference_headers()) as http:
        while True:
            try:
                body = checked_json(http.get(url))
                break
            except TRANSIENT as exc:
                waited = time.monotonic() - start
                if waited >= wait_s:
                    raise RuntimeError(
                        f"no --env.tokenizer_name given, and the inference server did not answer GET "
                        f"{url} in {waited:.0f} s ({str(exc) or type(exc).__name__}): start it "
                        f"(--openai.base_url), or {PASS_TOKENIZER}"
                    ) from exc
                time.sleep(retries.next_wait(exc))
    try:
        models = ServedModels.model_validate(body).data
    except ValidationError as exc:
        raise RuntimeError(f"GET {url} answered an unexpected body ({exc}); {PASS_TOKENIZER}") from exc
    # Adapters name their base model in `parent`; the base models (normally one) name none.
    base = next((m for m in models if m.parent is None), None)
    if base is None or not base.root:
        raise RuntimeError(f"GET {url} lists no base model with a path: {body!r}; {PASS_TOKENIZER}")
    return base.root


def resolve_tokenizer_path(name: Optional[str], base_url: str, wait_s: float, backoff: Backoff) -> str:
    """The tokenizer folder: `name` if given, else the folder of the model `base_url` serves."""
    if name:
        return name
    root = served_model_root(base_url, wait_s, backoff)
    if not os.path.isdir(root):
        raise FileNotFoundError(
            f"no --env.tokenizer_name given, and the inference server at {base_url} serves {root!r}, "
            f"which is not a folder on this machine; {PASS_TOKENIZER}"
        )
    logger.info("[env] tokenizer from %s: the model the inference server serves", root)
    return root


def load_tokenizer(path: str):
    """Load a tokenizer from a local folder; never from the HF hub."""
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"tokenizer_name {path!r} is not a local folder; onecopy does not download at run time: "
            + PASS_TOKENIZER
        )
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)
