"""The README and docs/ are for someone who cloned the repository: short enough to read, true to the
tree, with links that resolve, and no path, word or tracker number from where the project was built."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT

README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]

# What a reader outside the project's workplace cannot follow: paths outside the repository, words
# of the environment it was built in, tracker numbers.
FORBIDDEN = {
    "a path outside the repository": re.compile(r"\.\./shared|\.device/|/opt/|/work/"),
    "a tracker issue number": re.compile(r"\bissues? #?\d+|(?<![\w&/])#\d+\b", re.IGNORECASE),
    "a word of the build environment": re.compile(r"\blent\b|\bhelpers?\b|\bdevice (?:calls?|tool)\b|"
                                                  r"\bsessions?\b|\bstop \d+\b", re.IGNORECASE),
}


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def test_readme_reads_in_five_minutes():
    lines = README.read_text().count("\n")
    assert lines <= 200, f"README.md has {lines} lines; move detail to docs/ (a newcomer reads it in five minutes)"


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_page_names_nothing_a_clone_lacks(page: Path):
    text = page.read_text()
    found = [f"{what}: {m.group(0)!r} (line {text.count(chr(10), 0, m.start()) + 1})"
             for what, pattern in FORBIDDEN.items() for m in pattern.finditer(text)]
    assert not found, f"{_name(page)} has {found}"


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_relative_links_resolve(page: Path):
    broken = []
    for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", page.read_text()):
        if "://" in target:
            continue
        path = (page.parent / target) if target else page
        if not path.exists():
            broken.append(target)
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{target}#{anchor}")
    assert not broken, f"{_name(page)} links to missing files or headings {broken}"


def _folder_table() -> list[tuple[str, str]]:
    """(folder, job) rows of the README's folder table."""
    text = README.read_text()
    start = text.find("\n## Folders")
    if start < 0:
        return []
    section = text[start:]
    end = section.find("\n## ", 1)
    section = section if end < 0 else section[:end]
    return re.findall(r"^\| `([^`]+/)` \| (.*) \|$", section, re.MULTILINE)


def _expand(name: str) -> list[str]:
    """`start_{api,env}.sh` -> start_api.sh, start_env.sh."""
    m = re.search(r"\{([^}]*)\}", name)
    if not m:
        return [name]
    return [x for part in m.group(1).split(",") for x in _expand(name[:m.start()] + part + name[m.end():])]


def test_folder_table_is_true_to_the_tree():
    rows = _folder_table()
    assert rows, "README.md has no folder table under '## Folders'"
    missing = []
    for folder, job in rows:
        if not (ROOT / folder).is_dir():
            missing.append(folder)
            continue
        for token in re.findall(r"`([^`]+\.(?:py|sh|md))`", job):
            for name in _expand(token):
                if not (ROOT / folder / name).exists() and not (ROOT / name).exists():
                    missing.append(f"{folder}{name}")
    assert not missing, f"README.md's folder table names what the tree lacks: {missing}"


# The folders whose every module the table names, each in its own row.
# Every folder of Python modules in the product and its tools: a new subpackage needs its own row.
MODULE_FOLDERS = tuple(sorted(
    f"{folder.relative_to(ROOT)}/" for top in ("api", "environments", "example_trainer", "vllm_patching", "bench", "scripts")
    for folder in [ROOT / top, *(ROOT / top).rglob("*")]
    if folder.is_dir() and "__pycache__" not in folder.parts and any(f.suffix in (".py", ".sh") for f in folder.iterdir())))


def test_folder_table_names_every_module_in_its_folders_row():
    rows = dict(_folder_table())
    missing = {}
    for folder in MODULE_FOLDERS:
        assert folder in rows, f"README.md's folder table has no row for {folder}"
        named = {name for token in re.findall(r"`([\w.{},]+)`", rows[folder]) for name in _expand(token)}
        modules = sorted(f.name for f in (ROOT / folder).iterdir() if f.suffix in (".py", ".sh") and f.name != "__init__.py")
        if absent := [m for m in modules if m not in named]:
            missing[folder] = absent
    assert not missing, f"modules README.md's folder table does not name: {missing}"


def test_folder_table_lists_every_top_level_folder():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    top = {line.split("/", 1)[0] + "/" for line in tracked.splitlines() if "/" in line and not line.startswith(".")}
    listed = {folder for folder, _ in _folder_table()}
    assert not top - listed, f"README.md's folder table lacks {sorted(top - listed)}"


def test_the_trainers_flags_in_flags_md_are_flags_the_trainer_has():
    """docs/flags.md's trainer section named --dynamic-sampling-max-batches, a flag the trainer never
    had (it is --max-batches-per-step): a reader copying it got an error."""
    from environments.config_flags import config_fields, flag_name
    from example_trainer.config import TrainerConfig

    text = (ROOT / "docs" / "flags.md").read_text()
    section = text.split("## The trainer's flags by task", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"--[a-z0-9][a-z0-9-]*(?![\w.-])", section)) - {"--help"}
    flags = {flag_name(name) for name in config_fields(TrainerConfig)}
    assert named and not named - flags, f"not flags of the trainer: {sorted(named - flags)}"


def test_the_flags_in_the_table_of_defaults_that_differ_from_trls_exist_with_those_defaults():
    """docs/flags.md's table of defaults that differ from TRL's names each flag with its default:
    a flag renamed or a default changed must change the table too."""
    from environments.config_flags import config_fields, flag_name
    from example_trainer.config import TrainerConfig
    from example_trainer.launcher import LoopConfig

    text = (ROOT / "docs" / "flags.md").read_text()
    section = text.split("## Defaults that differ from TRL's", 1)[1].split("\n## ", 1)[0]
    assert "TRL 1.16.0" in section
    # the trainer's wins where both have a flag (--vllm-server-port: the launcher's 0 picks a free one)
    defaults = {flag_name(name): spec.default for cls in (LoopConfig, TrainerConfig)
                for name, (_, spec) in config_fields(cls).items() if name != "trainer"}
    rows = [line.split(" | ")[2] for line in section.splitlines() if line.startswith("| `")]
    checked = 0
    for cell in rows:  # "`--flag` (`--alias`) VALUE ..." in the onecopy column
        found = re.match(r"`(--[a-z0-9-]+)`(?: \(`--[a-z-]+`\))? ([^\s,]+)", cell)
        if found and found.group(1) in defaults:
            default, shown = defaults[found.group(1)], found.group(2)
            shown = shown.rstrip(":")
            assert (shown == "none" if default is None else float(shown) == default
                    if isinstance(default, (int, float)) else shown == str(default)), cell
            checked += 1
    assert checked >= 5, rows
