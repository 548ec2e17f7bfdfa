#!/bin/sh
# Every GPU path of the runtime in one prepared run (at most 290 s of part time on the GPU, under 5 minutes with the install), for a session whose task is lent
# a GPU by the device tool (no network there). Here, first: `sh scripts/device_wheels.sh` (the wheels the image
# lacks, into .whl/), then the device tool's
#   run(command="sh scripts/device_check.sh", carry=[".whl"], timeout_s=330)
# Dry run of the same code on this CPU, in the current environment:  sh scripts/device_check.sh --device cpu
#
# Parts, each in its own process with its own timeout (a failure or timeout is recorded; the next part runs):
#   ar      benchmarks/gpu_ar_check.py     AR engine: greedy vs HF generate (fp32, bf16; paged, dynamic_cache),
#                                          the KV pool line, throughput vs HF one at a time / static batches
#   serve   benchmarks/gpu_serve_check.py  a real `omni serve` on 127.0.0.1: streamed chat and video jobs through
#                                          the official openai client (inproc, then --placement process)
#   wan     benchmarks/gpu_check.py        Wan stage: bf16, offload on/off, batched vs solo, text K/V
#   wan_batching benchmarks/wan_batching.py  continuous batching of wan_i2v vs sequential and static
#   step_cache   benchmarks/wan_step_cache.py  a continuous batch with the first-block step cache vs uncached,
#                                          against the ideal ratio of its skipped share
# A second try reruns only the parts that failed: --only "PART ..." (each part's timeout is its own).
# Results in $OUT (the tool brings back at most 8 files): env.txt, one .log per part (its JSON lines), summary.json
# (each part's status and final JSON, and the figures of docs/gpu.md's table), the summary also on stdout.
#
# The AR model is a random-weight checkpoint of SmolLM2-135M-Instruct's shape built there with a fixed seed
# (Qwen2ForCausalLM, which the paged engine serves; gpu_ar_check.py --arch llama for LlamaForCausalLM). The real
# SmolLM2 weights do not travel: the registry's GGUF is 98 MB and the bf16 safetensors 269 MB, and the tree that
# travels is at most 64 MiB with the wheels (55 with them). --ar-model DIR uses a real directory where one exists.
#
# Options: --device cuda|cpu (cpu: a dry run, smaller sizes and timeouts), --no-install (use the current Python
# environment instead of installing .whl/ and this tree under /tmp/site; implied by --device cpu),
# --ar-model DIR, --only "ar serve wan wan_batching step_cache" (a subset, in that order).
set -u
cd "$(dirname "$0")/.."
DEVICE=cuda INSTALL=1 AR_MODEL="" ONLY="ar serve wan wan_batching step_cache"
while [ $# -gt 0 ]; do
    case $1 in
        --device) DEVICE=$2; shift 2 ;;
        --no-install) INSTALL=0; shift ;;
        --ar-model) AR_MODEL=$2; shift 2 ;;
        --only) ONLY=$2; shift 2 ;;
        *) echo "device_check.sh: unknown option $1" >&2; exit 2 ;;
    esac
done
[ "$DEVICE" = cpu ] && INSTALL=0
OUT=${OUT:-/tmp/omni-device-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
PARTS=$(mktemp)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
export OMNI_CACHE_DIR=${OMNI_CACHE_DIR:-/tmp/omni-cache}
start=$(date +%s)
{
    if [ $INSTALL = 1 ]; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl 2>&1 | tail -3
        export PYTHONPATH=/tmp/site  # the carried setuptools builds this tree's distributions
        $PY -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade \
            --target /tmp/site . plugins/omni_hf plugins/omni_qwen plugins/omni_wan plugins/omni_bridge plugins/omni_serve \
            plugins/omni_workers 2>&1 | tail -3
    fi
    echo "install: $(($(date +%s) - start))s; device $DEVICE"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    $PY -c "import sys, torch, transformers, diffusers, fastapi, openai, omni_kernel, omni_qwen, omni_wan, omni_serve
print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda,
      torch.cuda.is_available(), 'transformers', transformers.__version__, 'diffusers', diffusers.__version__,
      'fastapi', fastapi.__version__, 'openai', openai.__version__)
print('omni from', omni_kernel.__file__)" 2>&1
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# part NAME TIMEOUT_GPU TIMEOUT_CPU ARGS...: runs benchmarks/ARGS under its timeout, output in $OUT/NAME.log
part() {
    name=$1; limit=$2; [ "$DEVICE" = cpu ] && limit=$3; shift 3
    case " $ONLY " in *" $name "*) ;; *) return 0 ;; esac
    t0=$(date +%s)
    echo "$name: up to ${limit}s: $*"
    timeout -k 10 "$limit" $PY "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    echo "$name $rc $(($(date +%s) - t0)) $limit" >> "$PARTS"
    echo "$name: exit $rc after $(($(date +%s) - t0))s"
}
# GPU timeouts: 80 + 75 + 60 + 45 + 30 = 290 s (the parts' budgets end their work some seconds before the kill)
MODEL_ARG="" SERVE_S=65 AR_S=70
[ "$DEVICE" = cpu ] && SERVE_S=160 AR_S=270
[ -n "$AR_MODEL" ] && MODEL_ARG="--ar-model $AR_MODEL"
part ar 80 300 benchmarks/gpu_ar_check.py --device "$DEVICE" --budget-s $AR_S $MODEL_ARG
part serve 75 180 benchmarks/gpu_serve_check.py --device "$DEVICE" --budget-s $SERVE_S $MODEL_ARG
part wan 60 240 benchmarks/gpu_check.py --device "$DEVICE"
if [ "$DEVICE" = cpu ]; then
    part wan_batching 45 200 benchmarks/wan_batching.py --device cpu --steps 3 --rounds 1 --large-rounds 0 \
        --height 32 --width 32 --num-frames 5 --requests 2
    part step_cache 30 200 benchmarks/wan_step_cache.py --device cpu --rounds 1 --requests 2 --steps 6 \
        --size 64x96 --num-frames 9 --threshold 0.3
else
    part wan_batching 45 120 benchmarks/wan_batching.py --device cuda --rounds 1 --large-rounds 1
    part step_cache 30 120 benchmarks/wan_step_cache.py --device cuda --rounds 2
fi
$PY benchmarks/device_summary.py "$OUT" "$PARTS"
echo "total: $(($(date +%s) - start))s; results in $OUT"
rm -f "$PARTS"
