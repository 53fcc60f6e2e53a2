#!/usr/bin/env bash
# vLLM without torch.compile (full CUDA graphs only) against the default, and TRL, on one H100.
set -x
source /opt/gpu-env/env.sh
R=/root/res8; W=/root/w8; mkdir -p $R $W
tar -xzf /opt/gpu-env/stash/snap.tar.gz -C $W; cp /opt/gpu-env/stash/snap.commit $R/commit.txt
python3 -m pip install -q --no-index --no-deps --no-compile --target /opt/gpu-env/site /opt/gpu-env/stash/trl/*.whl 2>&1 | grep -vi warning
cd $W; export PYTHONUNBUFFERED=1
nvidia-smi > $R/nvidia-smi.txt
python3 -c "import torch,vllm,transformers,torchao,trl;print(torch.__version__,vllm.__version__,transformers.__version__,torchao.__version__,trl.__version__)" > $R/versions.txt 2>&1
tta() { # name, vllm flags
  echo "== tta $1 $(date +%T)"
  python3 bench/time_to_accuracy.py --out $R/tta_$1 --model $SMOLLM2_DIR --systems onecopy-shared_vllm \
    --env-args "--env.max_batches_offpolicy 2" --trainer-args "--max-off-policy-steps 2 --vllm-extra-args='$2'" > $R/tta_$1.log 2>&1; echo "tta $1 rc=$?"
}
tta nocompile_fdo "-cc.mode=none -cc.cudagraph_mode=FULL_DECODE_ONLY"
echo "== tta trl $(date +%T)"
python3 bench/time_to_accuracy.py --out $R/tta_trl --model $SMOLLM2_DIR --systems trl-colocate > $R/tta_trl.log 2>&1; echo "tta trl rc=$?"
tta nocompile_full "-cc.mode=none -cc.cudagraph_mode=FULL"
tta default ""
echo "== done $(date +%T)"
touch $R/DONE
