#!/usr/bin/env bash
# Everything megatron_snake checks and measures on a GPU, in two commands of under 10
# minutes each (GPU time is rare: prepare beforehand, spend it measuring):
#
#   bash tools/gpu_check.sh OUTDIR suite   # the GPU test suite (tests/gpu) + the demo
#   bash tools/gpu_check.sh OUTDIR bench   # the GPU part of every benchmark + a trace
#   bash tools/gpu_check.sh OUTDIR zero    # side by side with ZeRO-Infinity on the GPU
#   bash tools/gpu_check.sh OUTDIR plan    # the cost model against measured GPU steps
#
# Every step is time-boxed (`timeout`); each leaves STEP.log (and its JSON, the suite a
# junit XML) in OUTDIR, and one line in OUTDIR/steps.tsv (step, exit code, seconds).
# SNAKE_SCRATCH (default /tmp/snake_scratch) is the directory on the drive to offload to;
# SNAKE_GPU_ONLY="step step..." runs only the steps named.
#
# On a machine without internet (the lent GPU machines have Python 3.12 and a CUDA build
# of torch, but no megatron-core, liburing or fio), first run, where there is internet:
#     bash tools/gpu_carry.sh          # fills .gpu/ (git-ignored, ~8 MiB)
# and bring .gpu/ along with the checkout. It holds the megatron-core 0.16.1 wheel (and
# kvikio's, for GDS), the native I/O engine built for Python 3.12 with liburing linked
# statically, and a static fio when one was built (the drive's reference; without it
# bench_io reports its raw O_DIRECT reference only). This script installs them into
# /tmp/snake_site (nothing outside /tmp changes) and never downloads anything.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${1:?"usage: tools/gpu_check.sh OUTDIR suite|bench|zero|plan|all|setup"}
PART=${2:-all}
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
SCRATCH=${SNAKE_SCRATCH:-/tmp/snake_scratch}
mkdir -p "$SCRATCH"
PY=${PYTHON:-python3}
# the GPU tests write their reports (the host synchronisations of a steady step) here
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 SNAKE_GPU_REPORT_DIR=$OUTDIR

setup() {
    export PYTHONPATH=/tmp/snake_site:$PWD${PYTHONPATH:+:$PYTHONPATH}
    if ! "$PY" -c "import megatron.core" 2>/dev/null; then
        ls .gpu/wheels/*.whl >/dev/null 2>&1 || {
            echo "gpu_check.sh: megatron-core is missing and .gpu/wheels is empty: run "\
                 "tools/gpu_carry.sh where there is internet" >&2; exit 1; }
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --upgrade --target /tmp/snake_site .gpu/wheels/*.whl 2>&1 | grep -v "^WARNING" || true
        "$PY" -c "import megatron.core" || exit 1
    fi
    if ! "$PY" -c "import megatron_snake._snake_aio" 2>/dev/null && ls .gpu/native/*.so >/dev/null 2>&1; then
        cp .gpu/native/*.so megatron_snake/
    fi
    [ -x .gpu/bin/fio ] && export PATH=$PWD/.gpu/bin:$PATH
    {
        date -u; nvidia-smi 2>&1; uname -a; nproc; free -g; df -hT "$SCRATCH"
        "$PY" -c "import torch, megatron.core, megatron_snake.storage.engine as e; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0)); print('megatron-core', megatron.core.__version__); print('native engine', e.native_available())"
        command -v fio && fio --version
    } > "$OUTDIR/env.txt" 2>&1
    printf "step\trc\tseconds\n" >> "$OUTDIR/steps.tsv"
}

# step NAME SECONDS COMMAND...: run one step under a time box, log to OUTDIR/NAME.log
step() {
    local name=$1 limit=$2; shift 2
    # SNAKE_GPU_ONLY="bench_io demo": run only these steps (to split the work across calls)
    if [ -n "${SNAKE_GPU_ONLY:-}" ] && [[ " $SNAKE_GPU_ONLY " != *" $name "* ]]; then return; fi
    local t0=$SECONDS
    echo "=== $name (limit ${limit}s): $*"
    timeout --kill-after=10 "$limit" "$@" > "$OUTDIR/$name.log" 2>&1
    local rc=$?
    printf "%s\t%s\t%s\n" "$name" "$rc" "$((SECONDS - t0))" >> "$OUTDIR/steps.tsv"
    tail -n 4 "$OUTDIR/$name.log"
    echo "=== $name: exit $rc after $((SECONDS - t0)) s"
}

suite() {
    step gpu_tests 420 "$PY" -m pytest -q -rfEs tests/gpu --junitxml="$OUTDIR/gpu_tests.xml" \
        -o cache_dir=/tmp/pytest_cache
    # with the timeline of iteration 2 (draw it here: tools/plot_timeline.py)
    step demo 90 "$PY" examples/pretrain_gpt.py --snake-offload --snake-offload-dir "$SCRATCH" \
        --train-iters 10 --log-interval 5 --snake-trace "$OUTDIR/demo_trace.json"
}

bench() {
    step bench_io 100 "$PY" tools/bench_io.py --dir "$SCRATCH" --size 2GiB --repeat 3 \
        --engines auto,python --fallback-size 512MiB --json-out "$OUTDIR/bench_io.json"
    step bench_schedule 110 "$PY" tools/bench_schedule.py --preset gpu-1b --bf16 --steps 4 \
        --warmup 1 --json-out "$OUTDIR/bench_schedule.json"
    # state 3x the 10% of GPU memory given; weights and optimizer state in pinned host memory
    step bench_step 200 "$PY" tools/bench_step.py --dir "$SCRATCH" --micro-batches 4 \
        --steps 1 --warmup 1 --gpu-hidden 2048 --gpu-micro-batches 16 \
        --json-out "$OUTDIR/bench_step.json" \
        --gpu-snake-flags "--snake-param-tier host --snake-optimizer-tier host \
        --snake-host-memory-limit 40GiB" ${SNAKE_BENCH_STEP_FLAGS:-}
    # issue 13's GPU figure: state 10x the 3% of GPU memory given (the model is built
    # layer by layer into the store, so it never has to fit on the device)
    step bench_step_10x 240 "$PY" tools/bench_step.py --dir "$SCRATCH" --micro-batches 2 \
        --steps 1 --warmup 1 --gpu-hidden 2048 --gpu-micro-batches 16 --gpu-fraction 0.03 \
        --gpu-state-ratio 10 --json-out "$OUTDIR/bench_step_10x.json" \
        --gpu-snake-flags "--snake-param-tier host --snake-optimizer-tier host \
        --snake-host-memory-limit 40GiB"
    step bench_activations 100 "$PY" tools/bench_activations.py --dir "$SCRATCH" --layers 8 \
        --hidden 2048 --heads 16 --seqs 2048 --micro-batch-sizes 1,2,4 --micro-batches 2 \
        --steps 3 --warmup 1 --bf16 --json-out "$OUTDIR/bench_activations.json"
    step bench_zenflow 60 "$PY" tools/bench_zenflow.py --bf16 --steps 12 --warmup 4 \
        --json-out "$OUTDIR/bench_zenflow.json" ${SNAKE_BENCH_ZENFLOW_FLAGS:-}
    step gpu_trace 200 "$PY" tools/gpu_trace.py --dir "$SCRATCH" --warmup 1 --out-dir "$OUTDIR/trace"
}

# DeepSpeed from .gpu/deepspeed (tools/gpu_carry.sh): its source distribution and the
# wheels the image lacks into /tmp/snake_site, libaio's packages unpacked under
# /tmp/snake_libaio (its headers and library for the async_io op), the ops built into
# /tmp/snake_ext once (about a minute each on 16 cores)
deepspeed_setup() {
    local aio=/tmp/snake_libaio
    mkdir -p "$aio"
    for deb in .gpu/deepspeed/*.deb; do [ -e "$deb" ] && dpkg -x "$deb" "$aio"; done
    local lib=$aio/usr/lib/x86_64-linux-gnu
    [ -e "$lib/libaio.so" ] || ln -sf "$(ls "$lib"/libaio.so.1* 2>/dev/null | head -1)" "$lib/libaio.so"
    export CFLAGS="-I$aio/usr/include" LDFLAGS="-L$lib" CPATH=$aio/usr/include${CPATH:+:$CPATH}
    # the async_io op links -laio and -lcuda: libaio's from its packages; CUDA's stub
    # libcuda.so where the driver's directory has only libcuda.so.1 (the driver's is loaded)
    local cuda_home
    cuda_home=$(dirname "$(dirname "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")")
    export LIBRARY_PATH=$lib:$cuda_home/lib64/stubs${LIBRARY_PATH:+:$LIBRARY_PATH}
    export LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export TORCH_EXTENSIONS_DIR=/tmp/snake_ext DS_ACCELERATOR=cuda DS_SKIP_CUDA_CHECK=1
    export MAX_JOBS=$(nproc)
    if ! "$PY" -c "import deepspeed" 2>/dev/null; then
        ls .gpu/deepspeed/deepspeed-*.tar.gz >/dev/null 2>&1 || {
            echo "gpu_check.sh: deepspeed is missing and .gpu/deepspeed is empty: run "\
                 "tools/gpu_carry.sh where there is internet" >&2; return 1; }
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/snake_site .gpu/deepspeed/*.whl 2>&1 | grep -v "^WARNING"
        DS_BUILD_OPS=0 "$PY" -m pip install -q --no-index --no-deps --no-build-isolation \
            --no-cache-dir --target /tmp/snake_site .gpu/deepspeed/deepspeed-*.tar.gz 2>&1 \
            | grep -v "^WARNING"
    fi
    "$PY" -c "import deepspeed; print('deepspeed', deepspeed.__version__)" >> "$OUTDIR/env.txt" 2>&1
}

zero() {
    # two steps of up to 9 minutes: within one call's 10, run them apart on a machine kept
    # warm (the ops stay in /tmp/snake_ext): SNAKE_GPU_ONLY=zero_ops, then
    # SNAKE_GPU_ONLY=bench_zero_infinity
    deepspeed_setup || return 1
    step zero_ops 540 "$PY" -c "from deepspeed.ops.op_builder import AsyncIOBuilder, \
CPUAdamBuilder; AsyncIOBuilder().load(); CPUAdamBuilder().load(); print('ops built')"
    # about 470M parameters in bf16 (8 layers, hidden 2048, 2048-token sequences), every
    # state of both on the drive; the CPU runs' tables are in docs/benchmarks.md
    step bench_zero_infinity 540 "$PY" tools/bench_vs_zero_infinity.py --device cuda --bf16 \
        --dir "$SCRATCH" --layers 8 --hidden 2048 --heads 16 --seq 2048 --micro-batch 1 \
        --micro-batches 1 4 16 --steps 2 --warmup 1 \
        --json-out "$OUTDIR/bench_zero_infinity.json" ${SNAKE_BENCH_ZERO_FLAGS:-}
}

plan() {
    # the one-rank configurations (one GPU) at a GPU's shape: hidden 2048, 2048-token
    # sequences, bf16, every state on the drive but where a configuration says otherwise
    step validate_planner 560 "$PY" tools/validate_planner.py --device cuda --bf16 \
        --dir "$SCRATCH" --hidden 2048 --seq 2048 --host-memory 16GiB --rounds 1 \
        --warmup 2 --iters 3 --json-out "$OUTDIR/validate_planner.json" \
        --png "$OUTDIR/validate_planner.png"
}

setup
case "$PART" in
    setup) ;;     # install only (env.txt); for running single steps by hand
    suite) suite ;;
    bench) bench ;;
    zero) zero ;;
    plan) plan ;;
    all) suite; bench; zero; plan ;;
    *) echo "gpu_check.sh: part must be suite, bench, zero, plan or all, got $PART" >&2
       exit 2 ;;
esac
echo "=== steps (rc 124: hit its time box)"
cat "$OUTDIR/steps.tsv"
