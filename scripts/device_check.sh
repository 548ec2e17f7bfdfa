#!/bin/sh
# Run on a GPU machine of the device tool (no network), with .whl/ carried (scripts/device_wheels.sh made it):
#   run(command="sh scripts/device_check.sh", carry=[".whl"], timeout_s=540)
# Installs the wheels and this project's kernel, omni-hf and Wan plugin under /tmp/site, then the Wan GPU check
# and the batching benchmark on the GPU; their outputs land in $OUT (the tool brings them back).
set -eu
OUT=${OUT:-/tmp/omni-device-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade \
    --target /tmp/site . plugins/omni_hf plugins/omni_wan
export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 OMNI_CACHE_DIR=/tmp/omni-cache PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
timeout 240 python3 benchmarks/gpu_check.py 2>&1 | tee "$OUT/gpu_check.log"
timeout 240 python3 benchmarks/wan_batching.py --device cuda --rounds 2 --large-rounds 1 2>&1 \
    | tee "$OUT/wan_batching.log"
