"""Is the bytecode of the big packages there? vLLM and torch are about 4,300 source files; without
their compiled bytecode every Python process compiles what it imports again, each start of the
trainer and of vLLM (measured on an H100 machine whose image set PYTHONDONTWRITEBYTECODE=1 and
held no bytecode: importing vLLM's server took 31.6 s). pip writes the bytecode when it installs;
uv does not unless asked (``--compile-bytecode``), and Python writes it on first import only where
it may (no PYTHONDONTWRITEBYTECODE, a writable folder)."""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger("onecopy.bytecode")

PACKAGES = ("torch", "vllm", "transformers")


def missing_bytecode(package: str) -> tuple[Path, int, int] | None:
    """(folder, source files, of them without bytecode) of an installed package; None if not installed."""
    spec = importlib.util.find_spec(package)  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations)))
    sources = missing = 0
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if name.endswith(".py"):
                sources += 1
                missing += not os.path.exists(importlib.util.cache_from_source(os.path.join(root, name)))
    return folder, sources, missing


def warn_if_compiled_at_every_start(packages: tuple[str, ...] = PACKAGES, dont_write: bool | None = None) -> list[str]:
    """Log a warning, with the command that fixes it, for each package whose missing bytecode Python
    will not write (``dont_write``: PYTHONDONTWRITEBYTECODE's flag, read when None; or a folder it may
    not write): every start pays for it. Returns the warnings."""
    dont_write = sys.flags.dont_write_bytecode if dont_write is None else dont_write
    warnings = []
    for package in packages:
        found = missing_bytecode(package)
        if found is None:
            continue
        folder, sources, missing = found
        if missing < sources / 2 or (not dont_write and os.access(folder, os.W_OK)):
            continue  # compiled, or Python writes it at this start and the next ones find it
        why = "PYTHONDONTWRITEBYTECODE is set" if dont_write else f"{folder} is read-only"
        warnings.append(f"[start] {package}: {missing} of {sources} source files have no bytecode and {why}, so "
                        f"every process that imports it compiles them again (importing vLLM's server took 31.6 s "
                        f"so on an H100 machine); compile them once: {sys.executable} -m compileall -q {folder}")
    for warning in warnings:
        logger.warning(warning)
    return warnings
