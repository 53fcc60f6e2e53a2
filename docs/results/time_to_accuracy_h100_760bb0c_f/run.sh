#!/usr/bin/env bash
# Machine F: onecopy time to accuracy with --vllm-compile false, the imports overlapping vLLM's start
set -x
source /opt/gpu-env/env.sh
R=/root/res10; W=/root/w10; mkdir -p $R $W
tar -xzf /opt/gpu-env/stash/snap.tar.gz -C $W; cp /opt/gpu-env/stash/snap.commit $R/commit.txt
cd $W; export PYTHONUNBUFFERED=1
nvidia-smi > $R/nvidia-smi.txt
python3 -X importtime -c "import example_trainer.grpo" 2> $R/trainer_importtime.txt
tta() { # name, then env assignments
  name=$1; shift
  echo "== tta $name $(date +%T)"
  env "$@" timeout 330 python3 bench/time_to_accuracy.py --out $R/tta_$name --model $SMOLLM2_DIR --systems onecopy-shared_vllm \
    --env-args "--env.max_batches_offpolicy 2" --trainer-args "--max-off-policy-steps 2 --vllm-compile false" > $R/tta_$name.log 2>&1
  rc=$?; echo "tta $name rc=$rc"; return $rc
}
tta overlap
echo "== done $(date +%T)"
touch $R/DONE
