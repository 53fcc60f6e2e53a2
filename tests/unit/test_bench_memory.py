"""bench/shapes.py's model folders (bench/memory.py, tests/gpu): real vocabulary sizes on SmolLM2's tokenizer."""

from __future__ import annotations

import pytest

from bench.shapes import padded_tokenizer, shape_folder


def test_every_row_of_a_padded_vocabulary_decodes_and_text_encodes_as_before(default_model, tmp_path):
    from transformers import AutoTokenizer

    padded_tokenizer(default_model, tmp_path, 151936)
    tok, base = AutoTokenizer.from_pretrained(tmp_path), AutoTokenizer.from_pretrained(default_model)
    assert len(tok) == 151936
    assert tok.decode([49152, 151935]) == "<pad_49152><pad_151935>"  # random weights sample these rows
    text = "What is 15 times 7? <pad_49152>"  # no merges lead to the padding entries
    assert tok(text)["input_ids"] == base(text)["input_ids"]


@pytest.mark.parametrize("shape, params", [
    ("qwen2.5-1.5b", 1_543_714_304),  # tied embeddings
    ("qwen3-8b", 8_190_735_360),
    ("qwen3-30b-a3b", 30_532_122_624),  # 128 experts a layer
])
def test_a_shape_folder_has_the_real_parameter_count(shape, params, default_model, tmp_path):
    path, counted = shape_folder(shape, default_model, tmp_path)
    assert counted == params  # the real checkpoint's count
    assert (tmp_path / shape / "config.json").exists()


def test_save_steps_minus_one_means_never_and_below_is_refused():
    from example_trainer.config import TrainerConfig

    assert TrainerConfig(save_steps=-1).save_steps == -1
    with pytest.raises(ValueError, match="--save-steps >= -1"):
        TrainerConfig(save_steps=-2)


def test_host_memory_is_read_for_a_process_and_its_children_apart():
    import subprocess
    import sys
    import time

    from bench.common import process_tree_rss_mib

    # A parent holding ~50 MiB whose child holds ~150 MiB; the marker is in the parent's command line only.
    child = "x = bytearray(150 * 2**20); import time; time.sleep(60)"
    parent = (f"import subprocess, sys, time; x = bytearray(50 * 2**20); "
              f"p = subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(60)  # onecopy-rss-test")
    proc = subprocess.Popen([sys.executable, "-c", parent])
    try:
        deadline = time.time() + 30
        own, children = process_tree_rss_mib(b"onecopy-rss-test")
        while children < 150 and time.time() < deadline:
            time.sleep(0.2)
            own, children = process_tree_rss_mib(b"onecopy-rss-test")
        assert 50 <= own < 120 and 150 <= children < 220, (own, children)
    finally:
        for pid in [int(p) for p in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                                   text=True).stdout.split()]:
            subprocess.run(["kill", str(pid)])  # the child this test's parent started, by its PID
        proc.kill()
        proc.wait()
    assert process_tree_rss_mib(b"onecopy-rss-test-none") == (0, 0)


def test_the_planned_trainer_peak_is_read_from_the_plan_the_trainer_logs():
    import logging

    from bench.memory import planned_trainer_peak_gib
    from example_trainer.config import TrainerConfig
    from example_trainer.memory_plan import GIB, ModelShape, log_memory_plan, plan_memory

    plan = plan_memory(TrainerConfig(optimizer="adamw8bit", bf16_inplace=True), 8_000_000_000, 80 * GIB,
                       ModelShape(layers=32, hidden=4096, intermediate=14336, vocab=128256))
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(handler.format(record))
    logger = logging.getLogger("onecopy.trainer.memory")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        log_memory_plan(plan)
    finally:
        logger.removeHandler(handler)
    log = "[trainer] starting\n" + "\n".join(records)
    assert planned_trainer_peak_gib(log) == pytest.approx(plan.trainer_peak_bytes / GIB, abs=0.006)
    assert planned_trainer_peak_gib("[trainer] no plan logged") is None


def test_gpu_memory_of_a_process_tree_leaves_other_processes_on_the_gpu_out(monkeypatch):
    """tests/gpu measure their trainer and the vLLM it started while other work may share the GPU."""
    import os
    import subprocess
    import sys

    from bench import common

    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    stranger = os.getppid()  # a live process outside this one's tree
    try:
        driver = {("bus0", os.getpid()): 100, ("bus0", child.pid): 300, ("bus1", child.pid): 5,
                  ("bus0", stranger): 7000}
        monkeypatch.setattr(common, "gpu_used_mib_per_gpu", lambda: driver)
        assert common.gpu_used_mib(tree_of=os.getpid()) == {os.getpid(): 100, child.pid: 305}
        assert sum(common.gpu_used_mib().values()) == 7405
    finally:
        child.stdin.close()
        child.wait()
