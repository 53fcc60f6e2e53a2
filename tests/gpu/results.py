"""Where a GPU test writes its summary: ``$OUT`` (the device run's folder) or the test's own folder."""

from __future__ import annotations

import os
from pathlib import Path


def results_folder(fallback: str | os.PathLike) -> Path:
    """``$OUT`` if set, else ``fallback``; made if missing. A test that wrote into a ``$OUT`` no
    earlier test had made failed after all its work (the families test, 7 of 7 on an H200)."""
    out = Path(os.environ.get("OUT", fallback))
    out.mkdir(parents=True, exist_ok=True)
    return out
