#!/usr/bin/env bash
# One device call's share of bench/modes.py: run it under a time limit in /tmp (checkpoints stay
# there), then copy the JSON results and the logs under $OUT/modes.
#   bash bench/device_modes.sh SECONDS NAME PART [modes.py flags...]
# e.g. bash bench/device_modes.sh 540 smollm2-135m b --model "$SMOLLM2_DIR" --modes none lora_restart --steps 3
set -u
limit=$1 name=$2 part=$3
shift 3
work=/tmp/modes
timeout "$limit" python3 bench/modes.py --name "$name" --part "$part" --out "$work" "$@" 2>&1 | grep -v '^\s*$' | tail -30
mkdir -p "$OUT/modes"
cp "$work"/modes_*.json "$OUT/modes/"
for dir in "$work/$name"/*/; do
  mode=$(basename "$dir")
  [ -f "$dir/trainer.log" ] && cp "$dir/trainer.log" "$OUT/modes/${name}_${mode}_trainer.log"
  [ -f "$dir/run/vllm.log" ] && tail -400 "$dir/run/vllm.log" > "$OUT/modes/${name}_${mode}_vllm.log"
done
cp "$work/$name"/vllm_gen_*.log "$OUT/modes/" 2>/dev/null
exit 0
