"""The handlers that turn the API's errors and FastAPI's validation errors into JSON bodies.

Every 4xx body is `{"detail": ...}`; a 422's detail is the list that `api.errors.validation_entry`
writes. The posted value is never echoed back: it may be megabytes, or a NaN that JSON cannot carry.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from api.errors import ApiError, validation_entry

logger = logging.getLogger("onecopy.api.errors")

MAX_REPORTED_ERRORS = 20


def _readable(error: dict[str, Any]) -> dict[str, Any]:
    loc = tuple(error.get("loc", ("body",)))
    kind = error.get("type", "value_error")
    if kind == "json_invalid":
        position = loc[1] if len(loc) > 1 else "?"
        reason = error.get("ctx", {}).get("error", "JSON decode error")
        return validation_entry(
            ("body",),
            f"is not valid JSON ({reason} at character {position}); send one JSON document "
            "with Content-Type: application/json",
            kind,
        )
    message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
    return validation_entry(loc, message, kind)


async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    detail = [_readable(error) for error in errors[:MAX_REPORTED_ERRORS]]
    logger.warning("[API] rejected %s %s: %s", request.method, request.url.path, detail[0]["msg"])
    return JSONResponse(status_code=422, content={"detail": detail})


async def _on_api_error(request: Request, exc: ApiError) -> JSONResponse:
    logger.warning("[API] rejected %s %s (%d): %s", request.method, request.url.path,
                   exc.status_code, exc)
    return JSONResponse(status_code=exc.status_code, content={"detail": exc.detail})


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(ApiError, _on_api_error)
