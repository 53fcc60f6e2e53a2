"""ASGI middleware that runs before FastAPI reads a body: the API key check and the body limit.

Both are middleware rather than FastAPI dependencies because FastAPI reads and parses the whole
body before it resolves dependencies: as a dependency, an unauthenticated or oversized request
would already have been buffered.
"""

from __future__ import annotations

import hmac
import logging
import zlib

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger("onecopy.api.middleware")

OPEN_ROUTES = {("GET", "/")}


async def _refuse(scope: Scope, receive: Receive, send: Send, status: int, detail: str,
                  headers: dict[str, str] | None = None) -> None:
    logger.warning("[API] refused %s %s (%d): %s", scope["method"], scope["path"], status, detail)
    await JSONResponse({"detail": detail}, status_code=status, headers=headers)(scope, receive, send)


class ApiKeyMiddleware:
    """Every route except GET / needs `Authorization: Bearer <api_key>`; otherwise 401."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (scope["method"], scope["path"]) in OPEN_ROUTES:
            await self.app(scope, receive, send)
            return
        scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self._key):
            await self.app(scope, receive, send)
            return
        await _refuse(scope, receive, send, 401,
                      "missing or wrong API key; send the header 'Authorization: Bearer <key>' with "
                      "the key the API was started with (--api-key or $ONECOPY_API_KEY)",
                      headers={"WWW-Authenticate": "Bearer"})


def gunzip_bounded(data: bytes, limit: int) -> bytes | None:
    """Decode one gzip member; None if the decoded size would exceed `limit` (a zip bomb stops
    after `limit` bytes). Raises zlib.error on a corrupt or truncated stream."""
    if not data:
        return b""
    decoder = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    decoded = decoder.decompress(data, limit + 1)
    if len(decoded) > limit:
        return None
    if not decoder.eof or decoder.unused_data:
        raise zlib.error("truncated gzip stream or data after its end")
    return decoded


class BodyLimitMiddleware:
    """Read the body up front, refusing (413) once it passes `max_body_bytes`.

    The declared Content-Length is checked before anything is read, the bytes actually received
    while reading (chunked bodies declare none), and the decoded size of a gzip body (Atropos's
    environments gzip bodies of 1 KiB and more). The app then sees a plain body.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.limit = max_body_bytes

    def _too_large(self) -> str:
        return (f"request body is larger than max_body_bytes={self.limit}; post fewer or shorter "
                "groups per request, or start the API with a larger --max-body-bytes")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        declared = headers.get("content-length")
        if declared is not None and not declared.strip().isdigit():
            await _refuse(scope, receive, send, 400, f"Content-Length {declared!r} is not a number")
            return
        if declared is not None and int(declared) > self.limit:
            await _refuse(scope, receive, send, 413, self._too_large())
            return

        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.limit:
                await _refuse(scope, receive, send, 413, self._too_large())
                return
            if not message.get("more_body", False):
                break

        encoding = headers.get("content-encoding", "identity").strip().lower()
        if encoding == "gzip":
            try:
                decoded = gunzip_bounded(bytes(body), self.limit)
            except zlib.error as error:
                await _refuse(scope, receive, send, 400,
                              f"body: Content-Encoding is gzip but the body is not valid gzip ({error})")
                return
            if decoded is None:
                await _refuse(scope, receive, send, 413, self._too_large() + " (after gzip decoding)")
                return
            body = bytearray(decoded)
            scope = dict(scope)
            scope["headers"] = [
                (name, value) for name, value in scope["headers"]
                if name not in (b"content-encoding", b"content-length")
            ] + [(b"content-length", str(len(body)).encode())]
        elif encoding != "identity":
            await _refuse(scope, receive, send, 415,
                          f"Content-Encoding {encoding!r} is not supported; send gzip or no encoding")
            return

        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)
