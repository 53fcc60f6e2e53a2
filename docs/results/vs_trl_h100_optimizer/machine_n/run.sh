#!/usr/bin/env bash
# 8B: optimizer step variants (tensors per compiled call), then onecopy (best variant) against TRL under MPS, ABBA.
set -x
source /opt/gpu-env/env.sh
R=/root/res18; W=/root/w18; S=/opt/gpu-env/stash; mkdir -p $R $W
tar -xzf $S/snap.tar.gz -C $W; cp $S/snap.commit $R/commit.txt
python3 -m pip install -q --no-index --no-deps --no-compile --target /opt/gpu-env/site $S/trl/*.whl 2>&1 | grep -vi warning
/usr/bin/time -f "compileall: %e s" python3 -m compileall -q -j 0 /opt/gpu-env/site > /dev/null 2> $R/compileall.txt
cd $W; export PYTHONUNBUFFERED=1
nvidia-smi > $R/nvidia-smi.txt
python3 -c "import torch,vllm,transformers,torchao,trl;print(torch.__version__,vllm.__version__,transformers.__version__,torchao.__version__,trl.__version__)" > $R/versions.txt 2>&1
echo "== optimizer_step $(date +%T)"
timeout 420 python3 -m bench.optimizer_step --shape llama3.1-8b --optimizer adamw8bit --variants torchao onecopy:1 onecopy:8 onecopy:16 onecopy:32 --rounds 2 --steps 5 --out $R/opt > $R/optimizer_step.log 2>&1
echo "optimizer_step rc=$? $(date +%T)"
BEST=$(grep "^onecopy:" $R/optimizer_step.log | sort -t' ' -k3 -g | head -1 | cut -d: -f2 | cut -d' ' -f1)
echo "best group size: ${BEST:-1}"
sed -i "s/^    group_size = 16$/    group_size = ${BEST:-1}/" example_trainer/low_bit_adam.py; grep -n "group_size = " example_trainer/low_bit_adam.py
COMMON="--random-shape llama3.1-8b $SMOLLM2_CONFIG_DIR --out $R/vs --optimizer adamw8bit --bf16-weights true --vllm-gpu-memory-utilization 0.35 --steps 16 --warmup-steps 6 --timeout 600"
run() { # name systems onecopy-args onecopy-env-args
  echo "== $1 $(date +%T)"
  timeout 660 python3 bench/vs_trl.py $COMMON --name $1 --systems $2 --onecopy-args="$3" --onecopy-env-args="$4" > $R/$1.log 2>&1
  echo "$1 rc=$? $(date +%T)"
}
nvidia-cuda-mps-control -d; echo "mps daemon rc=$?"
W16="--env.max_num_workers 16 --env.max_batches_offpolicy 4"
run mps-onecopy-1 onecopy-shared_vllm "--torch-compile" "$W16"
run mps-trl-1 trl-colocate-sleep "" ""
run mps-trl-2 trl-colocate-sleep "" ""
run mps-onecopy-2 onecopy-shared_vllm "--torch-compile" "$W16"
run mps-onecopy-w24 onecopy-shared_vllm "--torch-compile" "--env.max_num_workers 24 --env.max_batches_offpolicy 6"
echo quit | nvidia-cuda-mps-control; echo "mps quit rc=$?"
echo "== done $(date +%T)"
touch $R/DONE
