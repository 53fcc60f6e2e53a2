"""Settings of the trajectory API: one dataclass, help text written once in each field's metadata.

`api.server` builds its command line from these fields, so a flag exists only if a field does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

API_KEY_ENV = "ONECOPY_API_KEY"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def _api_key_from_env() -> str | None:
    return os.environ.get(API_KEY_ENV) or None


@dataclass
class ApiSettings:
    """Where the API listens, where it keeps its state, and what it accepts."""

    host: str = field(default="127.0.0.1", metadata={"help": "Interface to listen on."})
    port: int = field(default=8000, metadata={"help": "TCP port to listen on (0 picks a free one)."})
    db_path: str = field(
        default="./onecopy_api.db",
        metadata={"help": "SQLite file holding the queue, registrations and step counter. "
                  "Restart on the same file to resume after a crash."},
    )
    api_key: str | None = field(
        default_factory=_api_key_from_env,
        metadata={"help": f"Bearer token every endpoint except GET / requires. Defaults to "
                  f"${API_KEY_ENV}; prefer the variable, a flag shows up in `ps`."},
    )
    max_body_bytes: int = field(
        default=64 * 1024 * 1024,
        metadata={"help": "Largest request body accepted, before and after gzip decoding (413 above)."},
    )
    batch_window: int = field(
        default=512,
        metadata={"help": "How many of the oldest queued groups /batch considers when it looks "
                  "for groups that add up to exactly batch_size."},
    )
    log_level: str = field(default="INFO", metadata={"help": f"One of {', '.join(LOG_LEVELS)}."})

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port} is outside 0..65535; pick a free TCP port")
        if self.max_body_bytes < 1024:
            raise ValueError(
                f"max_body_bytes={self.max_body_bytes} is too small to hold one group; use at least 1024"
            )
        if self.batch_window < 1:
            raise ValueError(f"batch_window={self.batch_window} must be at least 1")
        if not self.db_path:
            raise ValueError("db_path is empty; pass a file path such as ./onecopy_api.db")
        if self.api_key == "":
            raise ValueError("api_key is an empty string; pass a real key or leave it unset (None)")
        self.log_level = self.log_level.upper()
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level={self.log_level!r} is not one of {', '.join(LOG_LEVELS)}")
