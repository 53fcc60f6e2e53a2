"""Where the optional openenv extra is (requirements-openenv.txt), for the tests that need it: the
folder named by $ONECOPY_OPENENV_PATH, and only that. Its tests put it on pytest's path, where its
mcp 1.x (openenv's server needs it) shadows the mcp 2.x verifiers imports: a test run either
names the extra and leaves the verifiers tests out, or does not name it and leaves the OpenEnv
tests out. Finding the venv's folder by itself made `scripts/run_tests.sh` fail two verifiers
tests for anyone who had installed the extra as docs/environments.md says.

    ONECOPY_OPENENV_PATH=.venv/openenv-extra bash scripts/run_tests.sh \\
        tests/environments/test_env_openenv_server.py tests/e2e/test_openenv_loop.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

INSTALL = ("optional extra: pip install --no-deps --target .venv/openenv-extra -r requirements-openenv.txt, "
           "then name it in ONECOPY_OPENENV_PATH for a pytest run of its own (tests/openenv_extra.py)")
VERIFIERS_LEFT_OUT = ("ONECOPY_OPENENV_PATH puts the OpenEnv extra's mcp 1.x on this process's path; verifiers "
                      "imports mcp 2.x: run the verifiers tests in a pytest run without it")


def openenv_path() -> str:
    """The extra's folder named by $ONECOPY_OPENENV_PATH, or "" when none is named."""
    path = os.environ.get("ONECOPY_OPENENV_PATH", "")
    return path if path and Path(path).is_dir() else ""


def on_path() -> str:
    """Put the extra's folder first on this process's path (as the environment's --env.openenv_path
    does); returns it."""
    path = openenv_path()
    if path and path not in sys.path:
        sys.path.insert(0, path)
    return path
