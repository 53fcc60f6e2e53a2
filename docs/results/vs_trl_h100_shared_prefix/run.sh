#!/usr/bin/env bash
# One H100, MPS on: the shared-prefix GPU test, then onecopy at the 8B head-to-head's
# settings (--staged-step, float8 moments, 4 batches at once) with --share-group-prefix,
# then TRL once if the session's device time lasts (it has about 9 minutes).
set -x
source /opt/gpu-env/env.sh
R=/root/res; W=/root/w; mkdir -p $R $W
cp -a . $W/ 2>/dev/null; rm -rf $W/.device $W/.trlwheels
mkdir -p /root/trlwheels; cp .trlwheels/*.whl /root/trlwheels/
echo "${COMMIT:-unknown}" > $R/commit.txt
cd $W; export PYTHONUNBUFFERED=1
nvidia-smi > $R/nvidia-smi.txt
echo "== shared prefix gpu test $(date +%T)"
timeout 300 python3 -m pytest -p no:cacheprovider -ra tests/gpu/test_shared_prefix_gpu.py > $R/gpu_shared_prefix.log 2>&1
echo "gpu test rc=$? $(date +%T)"
COMMON="--random-shape llama3.1-8b $SMOLLM2_CONFIG_DIR --out $R/vs --optimizer adamw8bit --bf16-weights true --vllm-gpu-memory-utilization 0.35 --steps 16 --warmup-steps 6 --timeout 600"
nvidia-cuda-mps-control -d; echo "mps daemon rc=$?"
W16="--env.max_num_workers 16 --env.max_batches_offpolicy 4"
echo "== prefix-1 $(date +%T)"
timeout 420 python3 bench/vs_trl.py $COMMON --name prefix-1 --systems onecopy-shared_vllm \
  --onecopy-args="--torch-compile --staged-step --optimizer adamwfp8 --share-group-prefix" --onecopy-env-args="$W16" > $R/prefix-1.log 2>&1
echo "prefix-1 rc=$? $(date +%T)"
python3 -m pip install -q --no-index --no-deps --no-compile --target /opt/gpu-env/site /root/trlwheels/*.whl 2>&1 | grep -vi warning
echo "== trl-1 $(date +%T)"
timeout 400 python3 bench/vs_trl.py $COMMON --name trl-1 --systems trl-colocate-sleep > $R/trl-1.log 2>&1
echo "trl-1 rc=$? $(date +%T)"
echo quit | nvidia-cuda-mps-control
echo "== done $(date +%T)"
touch $R/DONE
