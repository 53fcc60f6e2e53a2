"""Where the optional openenv extra is (requirements-openenv.txt), for the tests that need it:
$ONECOPY_OPENENV_PATH, else the venv's openenv-extra folder (where requirements-openenv.txt says to
install it; scripts/setup_env.sh does not: in one pytest process its mcp 1.x shadows the mcp 2.x
verifiers' tests import), else "" (openenv importable as it is, or not installed: those tests skip)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

INSTALL = "optional extra: pip install --no-deps --target .venv/openenv-extra -r requirements-openenv.txt"


def openenv_path() -> str:
    """The extra's folder, or "" when there is none."""
    path = os.environ.get("ONECOPY_OPENENV_PATH") or str(Path(sys.prefix) / "openenv-extra")
    return path if Path(path).is_dir() else ""


def on_path() -> str:
    """Put the extra's folder first on this process's path (as the environment's --env.openenv_path
    does); returns it."""
    path = openenv_path()
    if path and path not in sys.path:
        sys.path.insert(0, path)
    return path
