#!/usr/bin/env bash
# The two agentic learning runs on one H200, one after the other: 80 GRPO steps of the guessing
# game (multi-turn, no tools), then of a reasoning-gym task (bench/learning_run.py's rows; held-out
# numbers before and after, with 95% intervals), each in OUT/<environment>/ with its log beside it.
# Each run gets 8 minutes ($RUN_SECONDS, then SIGINT, so it stops its own servers); the same
# command again finishes what a run cut short left (learning_run.py keeps each phase as it ends, a
# training cut short starts over, and a finished run only prints its tables).
# Needs $SMOLLM2_DIR (the default model as an HF folder) and, for the second run, reasoning-gym:
# a device without network installs it from wheels made here with
#   pip download --no-deps -r requirements-reasoning-gym.txt -d rg_wheels
# given as $RG_WHEELS (installed into $RG_SITE, default OUT/site, with --no-index --no-deps).
#   setsid bash bench/run_agentic_learning_h200.sh /tmp/agentic &        # then poll OUT/done
set -u
out="${1:?usage: bench/run_agentic_learning_h200.sh OUT}"
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "${BASH_SOURCE[0]}")/.."
learn() {  # learn ENVIRONMENT
  PYTHONUNBUFFERED=1 timeout -s INT -k 60 "${RUN_SECONDS:-480}" python3 bench/learning_run.py --environment "$1" --out "$out/$1" \
    --steps 80 --lr 1e-5 --model "$SMOLLM2_DIR" >> "$out/$1.log" 2>&1
  echo "$1 exit $? after $SECONDS s" >> "$out/summary"
}
learn guessing_game
if ! python3 -c "import reasoning_gym" 2> /dev/null && [ -n "${RG_WHEELS:-}" ]; then
  site="${RG_SITE:-$out/site}"
  python3 -m pip install -q --no-index --no-deps --target "$site" "$RG_WHEELS"/*.whl >> "$out/summary" 2>&1
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
if python3 -c "import reasoning_gym" 2> /dev/null; then
  learn reasoning_gym
else
  echo "reasoning_gym skipped: reasoning-gym is not installed (give \$RG_WHEELS)" >> "$out/summary"
fi
touch "$out/done"
