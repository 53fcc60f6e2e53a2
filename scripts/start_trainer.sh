#!/usr/bin/env bash
# The GRPO trainer; it starts vLLM itself (and restarts it in modes none, lora_restart). MODE=none|shared_vllm|lora_only|lora_restart|colocate.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/venv.sh"
LOGDIR="${LOGDIR:-$ROOT/runs/demo}"; mkdir -p "$LOGDIR"
exec "$VENV_PYTHON" -m example_trainer.grpo --weight-bridge-mode "${MODE:-shared_vllm}" \
  --api-url "http://127.0.0.1:${API_PORT:-8000}" --vllm-server-port "${VLLM_PORT:-9001}" --output-dir "$LOGDIR/trainer" "$@"
