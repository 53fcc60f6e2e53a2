#!/usr/bin/env bash
# The arithmetic environment (ENV=gsm8k for GSM8K; pass --env.data_path FILE.jsonl).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/venv.sh"
exec "$VENV_PYTHON" -m "environments.${ENV:-arithmetic}_server" serve \
  --env.rollout_server_url "http://127.0.0.1:${API_PORT:-8000}" --openai.base_url "http://127.0.0.1:${VLLM_PORT:-9001}" "$@"
