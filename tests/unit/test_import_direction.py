"""Which of our packages each package may import, read from the source (every import statement,
top-level or inside a function).

The data path runs one way: environment -> API -> trainer -> vLLM, and a package imports only
from its left, with one exception that the code needs: the trainer reads what vLLM's side writes
(the bridge file, the weights gate, the version checks), so ``example_trainer`` imports
``vllm_patching``. ``vllm_patching`` is what vLLM loads (its API server, routes, worker and
scheduler) and imports none of ours: a vLLM process never loads the trainer, and the trainer's
modules can change without touching vLLM's side. ``environments.config_flags`` (the one flag
builder) is why the API imports ``environments``.

Inside ``example_trainer`` no module imports itself through others: an import inside a function
only hides such a circle (the config check and the memory plan once reached the bridges that way,
to learn a mode's facts, while the bridges imported both); the facts now sit in a table that
imports nothing of ours (``example_trainer/modes.py``).
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


def module_graph(package: str, root: Path = ROOT) -> dict[str, set[str]]:
    """{module: the modules of ``package`` it imports}, every import statement counted (top-level or
    inside a function); ``from a.b import c`` counts ``a.b`` and, where it is a module, ``a.b.c``."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
        graph[name] = {m for m in imported if m in modules and m != name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of ``graph`` with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            part = []
            while not part or part[-1] != node:
                part.append(stack.pop())
            if len(part) > 1:
                cycles.append(sorted(part))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_no_trainer_module_imports_itself_through_others():
    assert import_cycles(module_graph("example_trainer")) == []


def layer_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """``graph`` with each subpackage of the trainer as one node (``example_trainer.rl``) and each
    top-level module as its own: what the layers import of each other."""
    def layer(module: str) -> str:
        return ".".join(module.split(".")[:2])
    layers: dict[str, set[str]] = {}
    for module, imported in graph.items():
        layers.setdefault(layer(module), set()).update(layer(m) for m in imported if layer(m) != layer(module))
    return layers


def test_the_trainers_subpackages_import_each_other_one_way():
    # The folders are layers (model, engine below rl, optim, data below bridges below the loop): a
    # module of a lower folder that imports a higher one makes two folders one, whatever the tree says.
    assert import_cycles(layer_graph(module_graph("example_trainer"))) == []


def test_the_layer_check_sees_two_folders_that_import_each_other(tmp_path):
    package = tmp_path / "pkg"
    for folder in (package, package / "rl", package / "model"):
        folder.mkdir()
        (folder / "__init__.py").write_text("")
    (package / "rl" / "loss.py").write_text("from pkg.model.families import FAMILIES\n")
    (package / "model" / "families.py").write_text("FAMILIES = {}\n")
    (package / "model" / "checkpoint.py").write_text("def save():\n    from pkg.rl.loss import x\n")
    assert import_cycles(module_graph("pkg", tmp_path)) == []  # no module imports itself through others
    assert import_cycles(layer_graph(module_graph("pkg", tmp_path))) == [["pkg.model", "pkg.rl"]]


def test_the_cycle_check_sees_an_import_inside_a_function(tmp_path):
    # The shape the config check and the memory plan had with the bridges: a top-level import one
    # way, one inside a function the other way.
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "config.py").write_text("def check():\n    from pkg.bridges.base import facts\n")
    (package / "bridges").mkdir()
    (package / "bridges" / "__init__.py").write_text("")
    (package / "bridges" / "base.py").write_text("from pkg.config import check\n\nfacts = {}\n")
    (package / "leaf.py").write_text("import pkg.config\n")
    assert import_cycles(module_graph("pkg", tmp_path)) == [["pkg.bridges.base", "pkg.config"]]


def test_the_mode_table_imports_nothing_of_ours():
    # The config check, the memory plan, the loop, the launcher and the bridges all read it.
    assert module_graph("example_trainer")["example_trainer.modes"] == set()
    assert not {top for file, top in imported_packages("example_trainer") if file.endswith("modes.py")}


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
