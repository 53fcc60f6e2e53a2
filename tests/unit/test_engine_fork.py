"""vLLM's API server may fork its engine core only if CUDA is untouched in it: on an H100 the import
chain vLLM config -> transformers' torchao quantizer -> torchao.prototype.mx_formats initialised
CUDA (torch asks the GPU whether Triton runs) and vLLM spawned instead, about 20 s slower
(vllm_patching/engine_fork.py). Without a GPU the check is that chain, up to the parsed flags:
torchao stays out of the server process, and the start method asked of vLLM is fork unless the user
chose one. A control imports the server module as a library does (no prepare_fork): torchao comes in."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# What the process holds once the server's flags are parsed (--help stops it there); then vLLM's
# model-class inspection with an empty cache (VLLM_CACHE_ROOT), where starting Python fails.
PROBE = """
import os, runpy, subprocess, sys
entry = sys.argv[1]
sys.argv = [entry, "--help"]
try:
    if entry == "vllm_patching.api_server":
        runpy.run_module(entry, run_name="__main__")
    elif entry == "onecopy-vllm":
        from example_trainer.vllm_api_server import main
        main()
    else:  # the control: imported as a library
        import vllm_patching.api_server
except SystemExit:
    pass
torchao_in = any(name == "torchao" or name.startswith("torchao.") for name in sys.modules)
real_run = subprocess.run
def no_interpreter(command, *args, **kwargs):
    if command[0] == sys.executable:
        raise AssertionError("started an interpreter")
    return real_run(command, *args, **kwargs)
subprocess.run = no_interpreter
from vllm.model_executor.models import registry
try:
    inspected = registry._LazyRegisteredModel(module_name="vllm.model_executor.models.llama",
                                              class_name="LlamaForCausalLM").inspect_model_cls().architecture
except Exception as error:
    inspected = "interpreter" if "started an interpreter" in repr(error) + str(error.__cause__) else repr(error)
print("RESULT", torchao_in, os.environ.get("VLLM_WORKER_MULTIPROC_METHOD"), inspected,
      any(name.startswith("torchao.prototype.mx_formats") for name in sys.modules))
"""
WITHOUT_METHOD = {k: v for k, v in os.environ.items() if k != "VLLM_WORKER_MULTIPROC_METHOD"}
CASES = {  # name: (entry, environment)
    "server": ("vllm_patching.api_server", WITHOUT_METHOD),
    "onecopy-vllm": ("onecopy-vllm", WITHOUT_METHOD),
    "user chose spawn": ("vllm_patching.api_server", {**WITHOUT_METHOD, "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}),
    "control": ("library import", WITHOUT_METHOD),
}


@pytest.fixture(scope="module")
def probed(tmp_path_factory) -> dict[str, list[str]]:
    """Every case's (torchao imported, start method, inspection, mx_formats imported), the probes run
    side by side (each imports vLLM)."""
    pytest.importorskip("torchao")  # without it there is no chain to keep out
    caches = tmp_path_factory.mktemp("vllm_cache")  # one empty cache per case: no cached answer
    procs = {name: subprocess.Popen([sys.executable, "-c", PROBE, entry], cwd=ROOT, text=True,
                                    env={**env, "VLLM_CACHE_ROOT": str(caches / name.replace(" ", "_"))},
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for name, (entry, env) in CASES.items()}
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        lines = [line for line in out.splitlines() if line.startswith("RESULT")]
        assert lines, f"{name}: {out[-2000:]}{err[-2000:]}"
        results[name] = lines[-1].split()[1:]
    return results


@pytest.mark.parametrize("case", ["server", "onecopy-vllm"])
def test_the_server_process_leaves_torchao_out_and_asks_vllm_to_fork(probed, case):
    assert probed[case][:2] == ["False", "fork"]


def test_a_start_method_the_user_chose_is_kept(probed):
    assert probed["user chose spawn"][1] == "spawn"


def test_imported_as_a_library_the_chain_brings_torchao_in(probed):
    # the control: what the server keeps out is really there to keep out
    assert probed["control"][0] == "True"



def test_the_server_inspects_model_classes_in_its_own_process(probed):
    # no interpreter started, and the inspection leaves out the torchao module that initialised CUDA
    assert probed["server"][2:] == ["LlamaForCausalLM", "False"]
    assert probed["onecopy-vllm"][2] == "LlamaForCausalLM"
    assert probed["control"][2] == "interpreter"  # vLLM's own way: a fresh interpreter
