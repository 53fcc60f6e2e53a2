"""Is the bytecode of the big packages there? torch and vLLM are about 4,300 source files; without
their compiled bytecode every Python process compiles what it imports again, at each start of the
trainer and of vLLM. On an H100 machine whose image set PYTHONDONTWRITEBYTECODE=1 and held none,
importing vLLM's server took 31.6 s, against 23.8 s with it (docs/results.md). pip writes the
bytecode when it installs; uv does not unless asked (``--compile-bytecode``); Python writes it at
first import only where it may (no PYTHONDONTWRITEBYTECODE, a folder it can write)."""

from __future__ import annotations

import importlib.util
import logging
import os
import shlex
import sys
from pathlib import Path

logger = logging.getLogger("onecopy.trainer.bytecode")

PACKAGES = ("torch", "vllm", "transformers", "torchao")


def package_folder(package: str) -> Path | None:
    """The folder of an installed package (a namespace package's first), found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def count_missing(folder: Path) -> tuple[int, int]:
    """(source files under ``folder``, of them without bytecode)."""
    sources = missing = 0
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if name.endswith(".py"):
                sources += 1
                # cache_from_source follows sys.pycache_prefix and -O, as the import system does
                missing += not os.path.exists(importlib.util.cache_from_source(os.path.join(root, name)))
    return sources, missing


def missing_bytecode(package: str) -> tuple[Path, int, int] | None:
    """(folder, source files, of them without bytecode) of an installed package; None if not installed."""
    folder = package_folder(package)
    return None if folder is None else (folder, *count_missing(folder))


def python_may_write_bytecode(folder: Path, dont_write: bool) -> bool:
    """Whether an import writes the bytecode it compiles, for the next start to find."""
    return not dont_write and os.access(sys.pycache_prefix or folder, os.W_OK)


def warn_if_compiled_at_every_start(packages: tuple[str, ...] = PACKAGES, dont_write: bool | None = None) -> list[str]:
    """Log a warning, with the command that fixes it, for each package most of whose source files
    lack bytecode that Python will not write either (``dont_write``: PYTHONDONTWRITEBYTECODE's flag,
    read when None; or a folder this user cannot write): every start pays for it. Returns them."""
    dont_write = sys.flags.dont_write_bytecode if dont_write is None else dont_write
    warnings = []
    for package in packages:
        folder = package_folder(package)
        if folder is None or python_may_write_bytecode(folder, dont_write):
            continue  # compiled at most once, at this start: no need to read the folders
        sources, missing = count_missing(folder)
        if 2 * missing <= sources:
            continue
        why = ("PYTHONDONTWRITEBYTECODE is set" if dont_write else
               f"this user cannot write {sys.pycache_prefix or folder} (compile as its owner, or set PYTHONPYCACHEPREFIX)")
        optimize = f" -o {sys.flags.optimize}" if sys.flags.optimize else ""
        warnings.append(f"[trainer] {package}: {missing} of {sources} source files have no bytecode and {why}, so "
                        f"every process that imports it compiles them again at its start (tens of seconds for torch "
                        f"and vLLM); compile them once: {shlex.quote(sys.executable)} -m compileall -q -j 0{optimize} "
                        f"{shlex.quote(str(folder))}")
    for warning in warnings:
        logger.warning(warning)
    return warnings
