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
exec "$VENV_PYTHON" -m vllm_patching.api_server --model "$MODEL" --port "${VLLM_PORT:-9001}" \
  --dtype bfloat16 --max-model-len "${MAX_MODEL_LEN:-512}" "$@"
