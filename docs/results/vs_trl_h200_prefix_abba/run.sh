#!/usr/bin/env bash
# One H200, MPS on, one engine at a time with the whole GPU: onecopy with --share-group-prefix
# against TRL in the order vllm-first, prefix, TRL, TRL, prefix, vllm-first (prefix = the 8B
# head-to-head's best setting with --share-group-prefix; vllm-first = the same with --mps-vllm-first),
# then the shared-prefix GPU test. Started in the background; results in /root/res.
set -x
source /opt/gpu-env/env.sh
R=/root/res; W=/root/w; mkdir -p $R $W
cp -a . $W/ 2>/dev/null; rm -rf $W/.device $W/.trlwheels
echo "${COMMIT:-unknown}" > $R/commit.txt
cd $W; export PYTHONUNBUFFERED=1
nvidia-smi > $R/nvidia-smi.txt
for f in /root/cc*.pid; do while kill -0 "$(cat $f)" 2>/dev/null; do sleep 2; done; done  # the bytecode compiles (see README)
python3 -c "import torch,vllm,transformers,torchao,trl;print(torch.__version__,vllm.__version__,transformers.__version__,torchao.__version__,trl.__version__)" > $R/versions.txt 2>&1
COMMON="--random-shape llama3.1-8b $SMOLLM2_CONFIG_DIR --out $R/vs --optimizer adamw8bit --bf16-weights true --vllm-gpu-memory-utilization 0.35 --steps 16 --warmup-steps 6 --timeout 600"
BEST="--torch-compile --staged-step --optimizer adamwfp8 --share-group-prefix"
W16="--env.max_num_workers 16 --env.max_batches_offpolicy 4"
run() { # name systems onecopy-args
  echo "== $1 $(date +%T)"
  timeout 560 python3 bench/vs_trl.py $COMMON --name $1 --systems $2 --onecopy-args="$3" --onecopy-env-args="$W16" > $R/$1.log 2>&1
  echo "$1 rc=$? $(date +%T)"
  grep -h "^| llama3.1-8b\|^- llama" $R/$1.log
}
nvidia-cuda-mps-control -d; echo "mps daemon rc=$?"
run first-1 onecopy-shared_vllm "$BEST --mps-vllm-first"
run prefix-1 onecopy-shared_vllm "$BEST"
run trl-1 trl-colocate-sleep ""
run trl-2 trl-colocate-sleep ""
run prefix-2 onecopy-shared_vllm "$BEST"
run first-2 onecopy-shared_vllm "$BEST --mps-vllm-first"
echo quit | nvidia-cuda-mps-control; echo "mps quit rc=$?"
echo "== shared prefix gpu test $(date +%T)"
timeout 300 python3 -m pytest -p no:cacheprovider -ra tests/gpu/test_shared_prefix_gpu.py > $R/gpu_shared_prefix.log 2>&1
echo "gpu test rc=$? $(date +%T)"
echo "== done $(date +%T)"
touch $R/DONE
