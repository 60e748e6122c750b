#!/usr/bin/env bash
# There, on a lent GPU machine (16 cores, its own Python 3.12 and CUDA torch): carpool's GPU
# checks, every log and result file written to $OUT, and $OUT/summary.txt one line a step.
# First, here: benchmarks/device/prepare.sh; then the device tool's run, with carry
# [".device-kit"] and timeout_s 600:
#
#     bash benchmarks/device/run.sh tests gen mem       (first call: 510 s of limits)
#     bash benchmarks/device/run.sh procs workers w1    (a second call, if time is left)
#
# Each step is bounded by its own timeout (SIGINT first, so a benchmark's servers are
# stopped by its own cleanup), so a call that ends early still brings back the steps
# before; the exit status is 1 when any step failed. Steps:
#   tests     the CUDA tests: torch runner and encoder, memory path, generation, serving
#   gen       issue 26: continuous against classic static batching and HF generate on the
#             GPU (bench_generation; the CPU runs' workload, less the padded baseline)
#   mem       issue 28: pinned overlapped copies, CUDA graphs (bench_cuda_memory_path)
#   procs     issue 24: W1 on 2 process replicas against twice the one-core ceiling
#   workers   issue 24: a no-op model's req/s with 1, 4 and 8 front-end workers on cores
#             0-7, wrk's 8 threads on 8-15 (the target: at least 3x one worker)
#   w1        W1 served on the GPU, batched against one request at a time (bench_cuda)
# CARPOOL_DEVICE_LOCAL=1 skips the installs (a dry run on a machine that has them).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/carpool-device-out}
mkdir -p "$OUT"
KIT=.device-kit
PY=${PYTHON:-python3}
if [ -z "${CARPOOL_DEVICE_LOCAL:-}" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$KIT"/wheels/*.whl || exit 1
    for deb in "$KIT"/debs/*.deb; do dpkg -x "$deb" /tmp/debs; done
    export PATH=/tmp/debs/usr/bin:$PATH
    export LD_LIBRARY_PATH=/tmp/debs/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export PYTHONPATH=/tmp/site:$PWD/src
fi
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
export CARPOOL_BENCH_SERVER_CPU=${CARPOOL_BENCH_SERVER_CPU:-2}
export CARPOOL_BENCH_LOAD_CPU=${CARPOOL_BENCH_LOAD_CPU:-4}

{
    date -u
    nvidia-smi 2>&1 | head -15
    nproc
    $PY -c "import sys, torch; print(sys.version); print(torch.__version__, \
torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA GPU')"
    command -v wrk taskset
} >"$OUT/machine.txt" 2>&1

failed=0
step() {  # name, seconds, command...
    local name=$1 limit=$2 status
    shift 2
    echo "== $name ($(date -u +%T))"
    timeout -s INT -k 20 "$limit" "$@" >"$OUT/$name.log" 2>&1
    status=$?
    [ "$status" -eq 0 ] || failed=1
    echo "$name exit $status" >>"$OUT/summary.txt"
    echo "   exit $status ($(date -u +%T)); last lines:"
    tail -4 "$OUT/$name.log" | sed 's/^/   /'
}

steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests gen mem procs workers w1)
for s in "${steps[@]}"; do
    case $s in
    tests) step tests 120 "$PY" -m pytest -q -p no:cacheprovider \
        tests/unit/models/test_cuda_models.py tests/unit/models/test_cuda_torch_path.py \
        tests/unit/models/test_torch_cuda.py tests/unit/generation/test_cuda_generation.py \
        tests/integration/test_cuda_serving.py tests/integration/test_cuda_generation_serving.py ;;
    gen) step gen 240 "$PY" benchmarks/bench_generation.py --device cuda:0 --model 88m \
        --num-requests 512 --max-len 512 --max-num-seqs 64 --static-batch-size 64 \
        --systems continuous,classic,hf --patterns all-at-once \
        --json "$OUT/generation_88m_512_cuda.json" ;;
    mem) step mem 150 "$PY" benchmarks/bench_cuda_memory_path.py --json "$OUT/cuda_memory_path.json" ;;
    procs) step procs 200 "$PY" benchmarks/bench_w1_process_replicas.py \
        --json "$OUT/w1_process_replicas_16core.json" ;;
    workers) CARPOOL_BENCH_LOAD_CPU=8-15 step workers 150 "$PY" benchmarks/bench_workers.py \
        --models noop --workers 1,4,8 --server-cpus 0-7 --wrk-threads 8 --concurrency 256 \
        --duration-s 3 --repeat 2 --json "$OUT/workers_16core.json" ;;
    w1) step w1 200 "$PY" benchmarks/bench_cuda.py --json "$OUT/cuda.json" ;;
    *) echo "unknown step $s: tests gen mem procs workers w1" && failed=1 ;;
    esac
done
exit "$failed"
