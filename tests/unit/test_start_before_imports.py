"""The trainer starts vLLM before it imports transformers' model classes and torch's tensor-parallel
modules (7 s of an H100 machine's 13 s from launch to vLLM's start: example_trainer/model/model_files.py),
and imports them while vLLM starts: what it checks first comes from config.json and the safetensors
headers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from example_trainer.memory_plan import count_parameters
from example_trainer.model.model_files import architecture, stored_parameter_count
from tests.tiny_models import CONFIGS, tiny_model

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ["transformers.modeling_utils", "transformers.models.auto.auto_factory", "torch.distributed.tensor",
         "torch._dynamo", "peft", "torchao"]
# The trainer CLI up to the moment it starts vLLM: what is imported then, and whether the model classes
# come while vLLM starts (the start waits for them, then stops the trainer).
PROBE = f"""
import sys, time
from example_trainer import grpo
from example_trainer.engine.vllm_process import VllmServerProcess

def start(self, model, extra_args=None, env=None, wait=True):
    print("AT_START", [m for m in {HEAVY!r} if m in sys.modules], flush=True)
    return 0.0

def wait_started(self):
    deadline = time.monotonic() + 60  # as vLLM takes to start: the model classes come meanwhile
    while "transformers.modeling_utils" not in sys.modules and time.monotonic() < deadline:
        time.sleep(0.1)
    print("WHILE_STARTING", "transformers.modeling_utils" in sys.modules, flush=True)
    raise SystemExit(0)

VllmServerProcess.start, VllmServerProcess.wait_started = start, wait_started
grpo.main(["--weight-bridge-mode", sys.argv[2], "--output-dir", sys.argv[1], "--max-steps", "1"])
"""


@pytest.mark.parametrize("mode", ["shared_vllm", "lora_only"])
def test_vllm_starts_before_the_heavy_imports(tmp_path, default_model, mode):
    """(Mode none's trainer builds its own copy of the model from the start: it imports them first.)"""
    done = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path), mode], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("AT_START")]
    assert lines, done.stdout[-2000:] + done.stderr[-3000:]
    assert lines[0] == "AT_START []"
    assert "WHILE_STARTING True" in done.stdout


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_the_stored_count_is_the_models_parameters(tmp_path, default_model, arch):
    """Each family's tied or untied head counted as the model's parameters() count it."""
    from transformers import AutoModelForCausalLM

    folder = tiny_model(arch, default_model, tmp_path / "model")
    expected = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).parameters())
    # None: a stored head whose tying the saved config leaves to the class default (counted on meta)
    assert stored_parameter_count(folder) in (expected, None) and count_parameters(folder) == expected
    assert architecture(folder) == arch


def test_only_the_files_transformers_loads_are_counted(tmp_path, default_model):
    """A sharded folder's index names its files; another copy beside them (Mistral's folders hold
    consolidated.safetensors too) is not counted twice."""
    import shutil

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100MB")
    shutil.copy(Path(default_model) / "model.safetensors", tmp_path / "sharded" / "consolidated.safetensors")
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 1
    assert stored_parameter_count(str(tmp_path / "sharded")) == sum(p.numel() for p in model.parameters())


def test_the_default_model_and_a_config_only_folder(tmp_path, default_model):
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        expected = sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(default_model)).parameters())
    assert stored_parameter_count(default_model) == expected  # 134,515,008: the head tied to the embedding
    AutoConfig.from_pretrained(default_model).save_pretrained(tmp_path)
    assert stored_parameter_count(str(tmp_path)) is None and count_parameters(str(tmp_path)) == expected
