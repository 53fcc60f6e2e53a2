"""bench/time_to_accuracy.py: each system starts with compile caches of its own, so a system run
after another does not start on what the first compiled (the start-up is part of the clock)."""

import os
import subprocess
import sys
from unittest import mock

from bench.time_to_accuracy import CACHE_VARIABLES, bytecode_state, cache_variables
from example_trainer.launcher import start
from tests.conftest import ROOT


def test_each_system_gets_empty_caches_of_its_own_and_the_processes_it_starts_use_them(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", "/the/machines/own")
    monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)
    folder = tmp_path / "onecopy-shared_vllm" / "caches"
    (folder / "vllm").mkdir(parents=True)
    (folder / "vllm" / "left-by-an-earlier-run").write_text("x")
    variables = cache_variables("fresh", folder)
    assert set(variables) == set(CACHE_VARIABLES) and not folder.exists()  # emptied
    with mock.patch.dict(os.environ, variables):  # as main() sets them around a system's run
        child = start(["-c", "import os; print(os.environ['VLLM_CACHE_ROOT'], os.environ['TRITON_CACHE_DIR'])"],
                      tmp_path / "child.log")
        assert child.wait(timeout=60) == 0
    assert (tmp_path / "child.log").read_text().split() == [str(folder / "vllm"), str(folder / "triton")]
    assert os.environ["TRITON_CACHE_DIR"] == "/the/machines/own" and "VLLM_CACHE_ROOT" not in os.environ  # restored
    assert cache_variables("shared", folder) == {}  # --caches shared: the machine's own


def test_the_caches_flag_is_offered_with_fresh_as_the_default():
    out = subprocess.run([sys.executable, "bench/time_to_accuracy.py", "--help"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0 and "--caches {fresh,shared}" in out.stdout, out.stderr[-2000:]


def test_the_results_record_which_packages_have_their_bytecode():
    state = bytecode_state()
    sources, missing = state["sources_and_missing"]["torch"]
    assert sources > 1000 and 0 <= missing <= sources
    assert state["dont_write_bytecode"] == bool(sys.flags.dont_write_bytecode)
