#!/usr/bin/env bash
# The main job: a short GRPO run of the default model (SmolLM2-135M-Instruct) on the arithmetic
# environment. Builds the venv if needed, starts the API and the environment in the background,
# runs the trainer (which starts vLLM) in the foreground, and stops what it started by PID.
#   bash scripts/run_demo.sh                    # MODE=shared_vllm STEPS=4
#   MODE=none STEPS=6 bash scripts/run_demo.sh --vllm-restart-interval 2  # checkpoint + restart instead of single copy
#   MODE=lora_only bash scripts/run_demo.sh --lr 1e-4   # hot-swapped LoRA adapters (later --lr wins)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_env.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export LOGDIR="${LOGDIR:-$ROOT/runs/demo-$(date +%Y%m%d-%H%M%S)}"
export API_PORT="${API_PORT:-8000}" VLLM_PORT="${VLLM_PORT:-9001}"
MODE="${MODE:-shared_vllm}" STEPS="${STEPS:-4}"
mkdir -p "$LOGDIR"
echo "[demo] mode=$MODE steps=$STEPS logs in $LOGDIR"

PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT
setsid bash scripts/start_api.sh >"$LOGDIR/api.log" 2>&1 & PIDS+=($!)
setsid bash scripts/start_env.sh --env.group_size 4 --env.max_token_length 320 --env.max_tokens 64 \
  --env.difficulty 1 --env.operations + >"$LOGDIR/env.log" 2>&1 & PIDS+=($!)

start=$(date +%s)
MODE="$MODE" bash scripts/start_trainer.sh --training-steps "$STEPS" --batch-size 8 --seq-len 320 --lr 2e-5 \
  --benchmark "$@" 2>&1 | tee "$LOGDIR/trainer.log" \
  | grep --line-buffered -E "\[trainer\] (step|reward|done)|\[vLLM\] healthy|\[Setup\]|ERROR|Error|metric|time/|sync/"
echo "[demo] finished in $(( $(date +%s) - start )) s (trainer log: $LOGDIR/trainer.log)"
