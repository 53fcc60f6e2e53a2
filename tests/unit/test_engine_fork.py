"""vLLM's API server may fork its engine core only if CUDA is untouched in it: on an H100 the import
chain vLLM config -> transformers' torchao quantizer -> torchao.prototype.mx_formats initialised
CUDA (torch asks the GPU whether Triton runs) and vLLM spawned instead, about 20 s slower
(vllm_patching/engine_fork.py). Without a GPU the check is that chain: torchao stays out of the
server process, and the start method asked of vLLM is fork unless the user chose one."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# What the server process holds once its flags are parsed (--help stops it there).
PROBE = """
import os, runpy, sys
sys.argv = [sys.argv[1], "--help"]
try:
    if sys.argv[0] == "vllm_patching.api_server":
        runpy.run_module("vllm_patching.api_server", run_name="__main__")
    else:
        from example_trainer.vllm_api_server import main
        main()
except SystemExit:
    pass
print("RESULT", any(name == "torchao" or name.startswith("torchao.") for name in sys.modules),
      os.environ.get("VLLM_WORKER_MULTIPROC_METHOD"))
"""


def probe(entry: str, env: dict[str, str]) -> list[str]:
    out = subprocess.run([sys.executable, "-c", PROBE, entry], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT")]
    assert lines, out.stdout[-2000:] + out.stderr[-2000:]
    return lines[-1].split()[1:]


@pytest.mark.parametrize("entry", ["vllm_patching.api_server", "onecopy-vllm"])
def test_the_server_process_leaves_torchao_out_and_asks_vllm_to_fork(entry):
    env = {k: v for k, v in os.environ.items() if k != "VLLM_WORKER_MULTIPROC_METHOD"}
    assert probe(entry, env) == ["False", "fork"]


def test_a_start_method_the_user_chose_is_kept():
    assert probe("vllm_patching.api_server", {**os.environ, "VLLM_WORKER_MULTIPROC_METHOD": "spawn"})[1] == "spawn"
