"""Which of our packages each package may import, read from the source (every import statement,
top-level or inside a function).

The data path runs one way: environment -> API -> trainer -> vLLM, and a package imports only
from its left, with one exception that the code needs: the trainer reads what vLLM's side writes
(the bridge file, the weights gate, the version checks), so ``example_trainer`` imports
``vllm_patching``. ``vllm_patching`` is what vLLM loads (its API server, routes, worker and
scheduler) and imports none of ours: a vLLM process never loads the trainer, and the trainer's
modules can change without touching vLLM's side. ``environments.config_flags`` (the one flag
builder) is why the API imports ``environments``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ALLOWED = {
    "environments": set(),
    "api": {"environments"},
    "example_trainer": {"api", "environments", "vllm_patching"},
    "vllm_patching": set(),
}
OURS = {*ALLOWED, "bench", "tests"}  # no product package imports the benchmarks or the tests either


def imported_packages(package: str) -> set[tuple[str, str]]:
    """(file, top-level package) for every import of one of ours in ``package``'s source."""
    found = set()
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                # A relative import stays inside the package (none are used today).
                names = [package if node.level else node.module]
            else:
                continue
            found |= {(str(path.relative_to(ROOT)), name.split(".")[0]) for name in names}
    return {(file, top) for file, top in found if top in OURS}


@pytest.mark.parametrize("package", ALLOWED)
def test_package_imports_only_the_packages_it_may(package):
    wrong = sorted((file, top) for file, top in imported_packages(package)
                   if top != package and top not in ALLOWED[package])
    assert not wrong, f"{package} may import only {sorted(ALLOWED[package]) or 'none of ours'}: {wrong}"


def test_the_table_covers_every_package():
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert packages - {"bench", "tests"} == set(ALLOWED)


def test_the_trainer_does_not_import_fastapi_to_validate_a_batch():
    # The trainer checks each batch with the API's pydantic models and rules (api.models,
    # api.validation); the web framework is the API server's alone.
    code = ("import sys, example_trainer.grpo; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'fastapi', 'starlette', 'uvicorn'}))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
