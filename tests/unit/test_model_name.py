"""--model-name (the launcher's --model, the demo's MODEL) of a local HF folder of any supported
family: a relative folder means the one the user typed it in, in every process the launcher and
the demo start, and LoRA's ``--lora-target-modules auto`` knows every family's projections."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from example_trainer import launcher
from example_trainer.bridges.lora import target_modules
from example_trainer.config import TrainerConfig
from example_trainer.model.families import FAMILIES
from tests.tiny_models import CONFIGS, tiny_config

ROOT = launcher.ROOT


def test_the_launchers_processes_run_in_the_callers_folder_with_this_projects_code(tmp_path, monkeypatch):
    """They ran in the repository's folder: a relative --model, --run-dir or path after -- named
    a folder there, not where the user typed it (the environment then found no tokenizer)."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    code = "import os, example_trainer; print(os.getcwd()); print(example_trainer.__file__)"
    proc = launcher.start(["-c", code], tmp_path / "child.log")
    assert proc.wait(timeout=60) == 0, (tmp_path / "child.log").read_text()
    folder, package = (tmp_path / "child.log").read_text().split()
    assert Path(folder) == work
    assert Path(package).parent.parent == ROOT  # still this checkout's packages, from any folder


def test_the_demo_passes_MODEL_to_the_launcher_from_the_callers_folder(tmp_path):
    """scripts/run_demo.sh took a model only as a trainer flag, and ran the launcher from the
    repository's folder: `MODEL=models/mine bash scripts/run_demo.sh` could not name a folder of
    the user's. Here the venv's python is a stand-in that records how the launcher was started."""
    stamp = Path(sys.prefix) / ".onecopy-stamp"
    if not stamp.exists():
        pytest.skip(f"{sys.prefix} was not built by scripts/setup_env.sh (no stamp): the demo would rebuild it")
    venv, record = tmp_path / "venv", tmp_path / "launcher_args"
    (venv / "bin").mkdir(parents=True)
    (venv / ".onecopy-stamp").write_text(stamp.read_text())  # the demo's setup step finds the venv up to date
    python = venv / "bin" / "python"
    # `-c` (setup_env.sh's version check) goes to the real interpreter; the launcher is recorded;
    # anything else (a rebuild) fails, so the test never touches a real venv.
    python.write_text(f"""#!/usr/bin/env bash
case "$1 $2" in
  "-m example_trainer.launcher") {{ pwd; printf '%s\\n' "$@"; }} > "{record}" ;;
  -c*) exec "{sys.executable}" "$@" ;;
  *) echo "unexpected: $*" >&2; exit 3 ;;
esac
""")
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    work = tmp_path / "work"
    (work / "models" / "mine").mkdir(parents=True)
    env = {**os.environ, "ONECOPY_VENV": str(venv), "MODEL": "models/mine", "LOGDIR": str(tmp_path / "logs")}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "run_demo.sh"), "--learning-rate", "1e-5"], cwd=work, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    folder, *args = record.read_text().splitlines()
    assert Path(folder) == work  # so models/mine is the user's folder
    assert args[args.index("--model-name") + 1] == "models/mine"
    assert args[-2:] == ["--learning-rate", "1e-5"]  # extra arguments still go to the trainer, last
    assert "model=models/mine" in done.stdout


def modules_of(architecture: str) -> set[str]:
    """The names of the nn.Linear layers inside the decoder layers of ``architecture``'s HF model
    (what LoRA can adapt there), read from the model transformers builds."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config(architecture))
    return {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and ".layers." in name}


def test_every_family_with_a_single_copy_entry_has_a_tiny_model_to_test_it():
    assert set(FAMILIES) <= set(CONFIGS), f"add {sorted(set(FAMILIES) - set(CONFIGS))} to tests/tiny_models.py"


@pytest.mark.parametrize("architecture", sorted(CONFIGS))
def test_lora_auto_targets_every_projection_of_each_family(architecture):
    """auto knew llama, mistral, qwen2, qwen3 and gemma: Phi-3 (fused qkv_proj and gate_up_proj),
    OLMo 2/3 and Qwen3-MoE failed at the trainer's start. Qwen3-MoE's experts are fused tensors
    in transformers 5, not Linear layers: auto adapts its attention."""
    model_type = tiny_config(architecture).model_type
    assert set(target_modules(TrainerConfig(), model_type)) == modules_of(architecture)
