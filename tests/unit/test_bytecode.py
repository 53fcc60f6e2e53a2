"""The start-up warning about packages Python compiles again at every start."""

import compileall
import shlex
import sys

import pytest

from example_trainer.bytecode import missing_bytecode, warn_if_compiled_at_every_start


@pytest.fixture
def package(tmp_path, monkeypatch):
    """An installed package of three source files and no bytecode."""
    folder = tmp_path / "pkg_without_bytecode"
    (folder / "sub").mkdir(parents=True)
    for path in (folder / "__init__.py", folder / "a.py", folder / "sub" / "b.py"):
        path.write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return folder


def test_counts_the_sources_without_bytecode(package):
    assert missing_bytecode("pkg_without_bytecode") == (package, 3, 3)
    compileall.compile_dir(str(package), quiet=1)
    assert missing_bytecode("pkg_without_bytecode") == (package, 3, 0)
    assert missing_bytecode("no_such_package_here") is None


def test_warns_with_the_fix_only_where_every_start_compiles_again(package, caplog):
    [warning] = warn_if_compiled_at_every_start(("pkg_without_bytecode",), dont_write=True)
    assert "3 of 3 source files have no bytecode" in warning and "PYTHONDONTWRITEBYTECODE" in warning
    assert f"{shlex.quote(sys.executable)} -m compileall -q -j 0 {package}" in warning and warning in caplog.text
    # Python writes it at this start, and the next starts find it: nothing to say
    assert warn_if_compiled_at_every_start(("pkg_without_bytecode",), dont_write=False) == []
    # Most of it compiled (2 of 3): nothing to say either
    compileall.compile_file(str(package / "__init__.py"), quiet=1)
    compileall.compile_file(str(package / "a.py"), quiet=1)
    assert warn_if_compiled_at_every_start(("pkg_without_bytecode",), dont_write=True) == []


def test_a_package_without_source_files_is_not_reported(tmp_path, monkeypatch):
    (tmp_path / "pkg_binary_only").mkdir()
    (tmp_path / "pkg_binary_only" / "__init__.pyc").write_bytes(b"")  # found as a namespace package: no .py
    monkeypatch.syspath_prepend(str(tmp_path))
    assert warn_if_compiled_at_every_start(("pkg_binary_only",), dont_write=True) == []
