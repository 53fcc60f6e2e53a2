"""Leftovers in /dev/shm: files with the names killed processes leave that nothing holds are found and
removed; a file a running process has mapped or open, or with another name, stays."""

from __future__ import annotations

import subprocess
import sys

from example_trainer.engine.shm_leftovers import find_leftovers, remove_leftovers

HOLDER = """
import mmap, sys, time
mapped = open(sys.argv[1], "r+b")
view = mmap.mmap(mapped.fileno(), 4096)
mapped.close()  # mapped only, as vLLM's message queue and torch's shared tensors are
held_open = open(sys.argv[2], "rb")
print("ready", flush=True)
time.sleep(300)
"""


def test_only_files_nothing_holds_with_a_leftovers_name_are_removed(tmp_path):
    for name in ("torch_123_456_0", "psm_mapped", "onecopy-gate-open", "sem.mp-left", "4123-tp:0-[0-1]-cpushm_0",
                 "someone-elses-file"):
        (tmp_path / name).write_bytes(b"\0" * 8192)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "psm_mapped"),
                               str(tmp_path / "onecopy-gate-open")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        assert [item.path.name for item in find_leftovers(tmp_path)] == [
            "4123-tp:0-[0-1]-cpushm_0", "sem.mp-left", "torch_123_456_0"]
        removed = remove_leftovers(tmp_path)
        assert {item.path.name for item in removed} == {"4123-tp:0-[0-1]-cpushm_0", "sem.mp-left", "torch_123_456_0"}
        assert all(item.bytes_held >= 8192 for item in removed)
        assert sorted(path.name for path in tmp_path.iterdir()) == ["onecopy-gate-open", "psm_mapped", "someone-elses-file"]
    finally:
        holder.kill()
        holder.wait()
    # Once its holder is gone, a file is a leftover too.
    assert {item.path.name for item in remove_leftovers(tmp_path)} == {"onecopy-gate-open", "psm_mapped"}


def test_a_live_semaphore_is_not_a_leftover():
    """glibc makes a named semaphore under a temporary name and renames it: its maker's maps show
    the temporary name, so a check by name took a live one for a leftover."""
    import multiprocessing

    from example_trainer.engine.shm_leftovers import SHM_DIR

    lock = multiprocessing.get_context("spawn").Lock()  # named: a spawned child opens it by name
    name = f"sem.{lock._semlock.name.lstrip('/')}"
    assert (SHM_DIR / name).exists()
    assert name not in {item.path.name for item in find_leftovers(SHM_DIR)}
