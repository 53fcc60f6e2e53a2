#!/usr/bin/env bash
# The main job: a short GRPO run of the default model (SmolLM2-135M-Instruct) on the arithmetic
# environment. Builds the venv if needed, then runs the API, the environment and the trainer
# (which starts vLLM) through example_trainer/launcher.py, which stops what it started by PID.
#   bash scripts/run_demo.sh                    # MODE=shared_vllm STEPS=4
#   MODEL=path/to/Qwen3-0.6B bash scripts/run_demo.sh   # a local HF folder of a family in the README's table
#   MODE=none STEPS=6 bash scripts/run_demo.sh --vllm-restart-interval 2  # checkpoint + restart instead of single copy
#   MODE=lora_only bash scripts/run_demo.sh --learning-rate 1e-4   # hot-swapped LoRA adapters (later --learning-rate wins)
# It runs in the folder you call it from: a relative MODEL or path in a trainer flag means one there.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/venv.sh"
bash "$ROOT/scripts/setup_env.sh"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export LOGDIR="${LOGDIR:-$ROOT/runs/demo-$(date +%Y%m%d-%H%M%S)}"
export API_PORT="${API_PORT:-8000}" VLLM_PORT="${VLLM_PORT:-9001}"
MODE="${MODE:-shared_vllm}" STEPS="${STEPS:-4}" MODEL="${MODEL:-default}"
mkdir -p "$LOGDIR"
echo "[demo] mode=$MODE model=$MODEL steps=$STEPS logs in $LOGDIR"

# One launcher (example_trainer/launcher.py) starts the API, the environment and the trainer,
# shows the trainer's progress lines, and stops each process by its PID at the end.
# Every flag but --run-dir, --api-port and --vllm-server-port is the trainer's; the demo's own settings
# (short sequences, lr 2e-5) come before the caller's flags, so a flag given here wins.
exec "$VENV_PYTHON" -m example_trainer.launcher --run-dir "$LOGDIR" --api-port "$API_PORT" --vllm-server-port "$VLLM_PORT" \
  --weight-bridge-mode "$MODE" --max-steps "$STEPS" --model-name "$MODEL" --seq-len 320 --learning-rate 2e-5 \
  --benchmark "$@"
