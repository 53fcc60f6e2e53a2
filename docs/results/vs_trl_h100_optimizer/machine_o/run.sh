#!/usr/bin/env bash
# 8B under MPS: onecopy base, TRL, onecopy with the trainer at 85% of the SMs, and with float8 moments too.
set -x
source /opt/gpu-env/env.sh
R=/root/res19; W=/root/w19; S=/opt/gpu-env/stash; mkdir -p $R $W
tar -xzf $S/snap.tar.gz -C $W; cp $S/snap.commit $R/commit.txt
python3 -m pip install -q --no-index --no-deps --no-compile --target /opt/gpu-env/site $S/trl/*.whl 2>&1 | grep -vi warning
/usr/bin/time -f "compileall: %e s" python3 -m compileall -q -j 0 /opt/gpu-env/site > /dev/null 2> $R/compileall.txt
cd $W; export PYTHONUNBUFFERED=1
nvidia-smi > $R/nvidia-smi.txt
echo "== optimizer_step $(date +%T)"
timeout 150 python3 -m bench.optimizer_step --shape llama3.1-8b --optimizer adamwfp8 --variants onecopy --rounds 1 --steps 5 --out $R/opt > $R/optimizer_step_fp8.log 2>&1
echo "optimizer_step rc=$? $(date +%T)"
COMMON="--random-shape llama3.1-8b $SMOLLM2_CONFIG_DIR --out $R/vs --optimizer adamw8bit --bf16-weights true --vllm-gpu-memory-utilization 0.35 --steps 16 --warmup-steps 6 --timeout 600"
run() { # name systems onecopy-args onecopy-env-args
  echo "== $1 $(date +%T)"
  timeout 660 python3 bench/vs_trl.py $COMMON --name $1 --systems $2 --onecopy-args="$3" --onecopy-env-args="$4" > $R/$1.log 2>&1
  echo "$1 rc=$? $(date +%T)"
}
nvidia-cuda-mps-control -d; echo "mps daemon rc=$?"
W16="--env.max_num_workers 16 --env.max_batches_offpolicy 4"
run mps-onecopy onecopy-shared_vllm "--torch-compile" "$W16"
run mps-trl trl-colocate-sleep "" ""
run mps-onecopy-sm85 onecopy-shared_vllm "--torch-compile --mps-active-thread-percentage 85" "$W16"
run mps-onecopy-fp8-sm85 onecopy-shared_vllm "--torch-compile --mps-active-thread-percentage 85 --optimizer adamwfp8" "$W16"
echo quit | nvidia-cuda-mps-control; echo "mps quit rc=$?"
echo "== done $(date +%T)"
touch $R/DONE
