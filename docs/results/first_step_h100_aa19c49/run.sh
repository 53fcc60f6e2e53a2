#!/usr/bin/env bash
set -x
TORCH_DIR=$(dirname $(python3 -c "import importlib.util as u;print(u.find_spec('torch').origin)"))
python3 -m compileall -q -j 0 $TORCH_DIR > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv
export PYTHONPATH=$PWD
for m in plain imports_first tiny_model_first plain; do python3 .device/go10/firstcall2.py $m 2>&1 | grep -v Warning; done
