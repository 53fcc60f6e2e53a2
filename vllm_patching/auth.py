"""The bearer token of onecopy's routes: the key of vLLM's own routes, checked by vLLM's own code.

vLLM's ``--api-key`` (or ``VLLM_API_KEY``) installs its AuthenticationMiddleware, which guards only
paths under ``/v1``, ``/v2`` and ``/inference``. onecopy's routes sit at the root (``/generate``,
``/lora/*``, ``/bridge/info``), so api_server.serve includes their routers with the dependency
``api_key_dependencies(args)`` returns: it asks an instance of vLLM's middleware class to verify
the Authorization header (sha256 of each token, ``secrets.compare_digest``), the same tokens read
the same way (the flag wins over the environment variable). ``/health`` and ``/metrics`` stay open,
as vLLM leaves them.
"""

from __future__ import annotations

import ipaddress
import logging

from fastapi import Depends, HTTPException, Request

from vllm_patching.compat import authentication_middleware_type

logger = logging.getLogger("vllm.onecopy.auth")  # under "vllm" to use its log handler

UNAUTHORIZED = ("Unauthorized: send 'Authorization: Bearer <key>' with the key this server was started with "
                "(--api-key or VLLM_API_KEY; onecopy's clients send $VLLM_API_KEY)")


def api_tokens(args) -> list[str]:
    """The tokens vLLM's own routes accept: ``--api-key`` (repeatable), else ``$VLLM_API_KEY``; none = open."""
    import vllm.envs as envs

    return [key for key in (args.api_key or [envs.VLLM_API_KEY]) if key]


def api_key_dependencies(args) -> list:
    """FastAPI ``dependencies`` for onecopy's routers: none without a key, else the bearer check."""
    tokens = api_tokens(args)
    if not tokens:
        return []
    checker = authentication_middleware_type()(app=None, tokens=tokens)  # only its verify_token is used

    async def require_api_key(request: Request) -> None:
        if not checker.verify_token(request.headers):
            raise HTTPException(status_code=401, detail=UNAUTHORIZED)

    return [Depends(require_api_key)]


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` (vLLM's ``--host``) binds only this machine; None or "" binds every interface."""
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve to any interface


def warn_if_open(args) -> None:
    """One warning when the server listens beyond this machine with no key: anyone who reaches
    the port can then generate, load adapters and read the bridge file's path."""
    if getattr(args, "uds", None) or is_loopback(args.host) or api_tokens(args):
        return
    logger.warning("[vLLM server] binding %s:%s without an API key: anyone who can reach this port may call "
                   "/generate, /lora/load and /v1/*. Set VLLM_API_KEY (clients read it from the environment "
                   "too) or bind --host 127.0.0.1", args.host or "every interface", args.port)
