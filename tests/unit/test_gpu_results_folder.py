"""The GPU tests' summary folder: made when missing, and read through one helper."""

from __future__ import annotations

import re
from pathlib import Path

from tests.gpu.results import results_folder

GPU_TESTS = Path(__file__).resolve().parents[1] / "gpu"


def test_a_missing_out_folder_is_made(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path / "run" / "gpu"))
    out = results_folder(tmp_path / "unused")
    (out / "summary.json").write_text("{}")  # the families test's write, which failed on an H200
    assert out == tmp_path / "run" / "gpu" and (out / "summary.json").exists()


def test_without_out_the_fallback_is_used(tmp_path, monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    assert results_folder(tmp_path / "own") == tmp_path / "own" and (tmp_path / "own").is_dir()


def test_every_gpu_test_finds_its_folder_through_the_helper():
    # Three tests read $OUT themselves and wrote into a folder nobody had made yet.
    direct = [f.name for f in sorted(GPU_TESTS.glob("test_*.py")) if re.search(r"environ(\.get)?\W+\"OUT\"", f.read_text())]
    assert direct == []
