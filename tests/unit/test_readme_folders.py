"""The README's folder table names every module of the project's folders, in its folder's row:
a module added without a word there fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("api", "environments", "environments/multiturn", "example_trainer", "example_trainer/bridges",
           "vllm_patching", "bench", "scripts")


def folder_rows() -> dict[str, str]:
    """The table under '## Folders': folder -> its row's text."""
    section = ROOT.joinpath("README.md").read_text().split("## Folders", 1)[1].split("\n## ", 1)[0]
    return {m.group(1): line for line in section.splitlines() if (m := re.match(r"\| `([^`]+)/` \|", line))}


def test_every_module_is_named_in_its_folders_row():
    rows = folder_rows()
    missing = {}
    for folder in FOLDERS:
        assert folder in rows, f"the README's folder table has no row for {folder}/"
        names = set(re.findall(r"`([\w.]+)`", rows[folder]))
        modules = sorted(f.name for f in ROOT.joinpath(folder).iterdir()
                         if f.suffix in (".py", ".sh") and f.name != "__init__.py")
        if absent := [m for m in modules if m not in names]:
            missing[folder] = absent
    assert not missing, f"modules the README's folder table does not name: {missing}"
