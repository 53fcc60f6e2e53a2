#!/usr/bin/env bash
# A standalone vLLM server on 127.0.0.1:${VLLM_PORT:-9001} with single-copy export on, for a
# trainer started with --weight-bridge-mode shared_vllm --launch-vllm false. Extra args go to vLLM.
# With VLLM_API_KEY exported, every route but /health and /metrics needs it as a bearer token; the
# trainer and the environments read the same variable (docs/guarantees.md#who-may-call-what).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/venv.sh"
export LOGDIR="${LOGDIR:-$ROOT/runs/demo}"; mkdir -p "$LOGDIR"
export VLLM_ENABLE_SHARED_WEIGHTS="${VLLM_ENABLE_SHARED_WEIGHTS:-1}"
MODEL="${MODEL:-$("$VENV_PYTHON" -m example_trainer.model.default_model)}"
# VLLM_PORT is the HTTP port here; vLLM reads the same name as where the ports it binds inside
# start, and two servers given neighbouring ones can pick the same (the launcher's two data-parallel
# servers did): it does not reach vLLM, which then picks them as usual.
PORT="${VLLM_PORT:-9001}"
exec env -u VLLM_PORT "$VENV_PYTHON" -m vllm_patching.api_server --model "$MODEL" --port "$PORT" \
  --dtype bfloat16 --max-model-len "${MAX_MODEL_LEN:-512}" "$@"
