#!/usr/bin/env bash
# The test command: builds/refreshes the venv, then runs every test (GPU tests skip without CUDA).
#   bash scripts/run_tests.sh [pytest args]          (ONECOPY_VLLM=0.32.0 for vLLM 0.32; scripts/venv.sh)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source scripts/venv.sh
bash scripts/setup_env.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 WANDB_MODE=offline
# Convert the default model once before the tests start their clocks (about 30 s on 2 cores).
"$VENV_PYTHON" -m example_trainer.model.default_model
set +e
"$VENV_PYTHON" -m pytest -p no:cacheprovider -ra --durations=15 "$@"
code=$?
set -e
# pytest exits 5 when it collected nothing (e.g. a -k filter that matches no test): not a failure.
if [ "$code" -eq 5 ]; then echo "[tests] no tests collected"; exit 0; fi
exit "$code"
