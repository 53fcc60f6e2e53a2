"""Errors the API answers with, as plain exceptions (api/error_handlers.py turns them into JSON):
the trainer raises GroupRejected too, checking a batch with api.validation, without FastAPI.

Every 4xx body is `{"detail": ...}`. Validation errors (422) are a list of
`{"loc", "field", "msg", "type"}` where `field` is a readable path such as `masks[2]` (or
`[3].masks[2]` inside /scored_data_list) and `msg` starts with that path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def field_path(loc: Sequence[str | int]) -> str:
    """`("body", 3, "masks", 2)` -> `[3].masks[2]`; the leading "body" is dropped."""
    parts = list(loc[1:] if loc and loc[0] == "body" else loc)
    text = ""
    for part in parts:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text or "body"


def validation_entry(loc: Sequence[str | int], reason: str, kind: str = "value_error") -> dict[str, Any]:
    path = field_path(loc)
    return {"loc": list(loc), "field": path, "msg": f"{path}: {reason}", "type": kind}


class ApiError(Exception):
    """A request the API refuses; `status_code` and `detail` become the response."""

    status_code = 400

    def __init__(self, message: str, detail: Any = None) -> None:
        super().__init__(message)
        self.detail = message if detail is None else detail


class GroupRejected(ApiError):
    """A scored group that breaks a rule; `loc` points at the field, as pydantic's would."""

    status_code = 422

    def __init__(self, loc: tuple[str | int, ...], reason: str) -> None:
        self.loc = loc
        self.reason = reason
        entry = validation_entry(loc, reason)
        super().__init__(entry["msg"], [entry])

    def at_index(self, index: int) -> GroupRejected:
        """The same error for group `index` of a /scored_data_list body."""
        return GroupRejected((self.loc[0], index, *self.loc[1:]), self.reason)


class UnknownEnv(ApiError):
    status_code = 404

    def __init__(self, env_id: int, field: str = "env_id") -> None:
        self.env_id = env_id
        super().__init__(
            f"{field}={env_id} is not a registered environment; "
            "POST /register-env first and send the env_id it returns"
        )


class TrainerNotRegistered(ApiError):
    status_code = 409

    def __init__(self) -> None:
        super().__init__(
            "no trainer is registered, so batch_size and max_token_len are unknown; "
            "start the trainer (POST /register) before posting scored data"
        )
