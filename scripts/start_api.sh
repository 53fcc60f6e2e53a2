#!/usr/bin/env bash
# Trajectory API on 127.0.0.1:${API_PORT:-8000}; queue in $LOGDIR/api.db (survives restarts).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/venv.sh"
LOGDIR="${LOGDIR:-$ROOT/runs/demo}"; mkdir -p "$LOGDIR"
exec "$VENV_PYTHON" -m api.server --port "${API_PORT:-8000}" --db-path "$LOGDIR/api.db" "$@"
