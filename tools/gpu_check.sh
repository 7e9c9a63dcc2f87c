#!/usr/bin/env bash
# Everything megatron_snake checks and measures on a GPU, in parts of one command each that
# end within 540 s, their set-up (install from .gpu/, env.txt) included: a lent machine
# gives a session 15 minutes (its start 1-2 of them) and a command at most 10, so a part
# fits one command with a minute to spare, and a step cut short can be run again alone
# (SNAKE_GPU_ONLY) in what is left. In order of value:
#
#   bash tools/gpu_check.sh OUTDIR headline  # offloaded (state 3x, 2x the memory given) vs
#                                            # Megatron with and without full recompute and
#                                            # Megatron's CPU offload, clip on and off, then
#                                            # the curve over M; the trace of one steady step
#   bash tools/gpu_check.sh OUTDIR plugin    # Megatron-LM's pretrain_gpt.py with the plug-in on
#                                            # megatron-core 0.19: equal to plain Megatron-LM
#                                            # in fp32, checkpoints both ways; bf16 tokens/s
#                                            # against the own loop
#   bash tools/gpu_check.sh OUTDIR suite     # tests/gpu, the host kernel's tests, the demo,
#                                            # bench_schedule, ZenFlow
#   bash tools/gpu_check.sh OUTDIR zero      # side by side with ZeRO-Infinity (M 16, then
#                                            # M 4 and 1), its ops built in the same command
#   bash tools/gpu_check.sh OUTDIR io        # the store vs fio, the pinned pool vs a plain
#                                            # pinned copy, activation offload, why no GDS
#   bash tools/gpu_check.sh OUTDIR plan      # the cost model against measured GPU steps
#   bash tools/gpu_check.sh OUTDIR setup     # install only (env.txt), to run steps by hand
#   bash tools/gpu_check.sh OUTDIR next      # the first part unmeasured, or measured before
#                                            # its code last changed (tools/gpu_parts.tsv,
#                                            # tools/gpu_next_part.py; without .git, the
#                                            # answer tools/gpu_carry.sh left in .gpu/next_part)
#
# Each part is a list of steps, the most valuable first, each under a time box (`timeout`)
# and the boxes of a part add up to at most 480 s (tests/test_gpu_check.py checks it). A
# step also never runs past SNAKE_GPU_PART_LIMIT (530 s) from the command's start: its box
# shrinks to what is left, and a step with under 20 s left is skipped. Each step leaves
# STEP.log (and its JSON) in OUTDIR and one line in OUTDIR/steps.tsv (step, exit code: 124
# when its box ran out, "skipped"; seconds); set-up is the line "setup".
#
#   SNAKE_SCRATCH    the directory on the drive to offload to (default /tmp/snake_scratch)
#   SNAKE_GPU_ONLY   "step step...": run only the steps named
#   SNAKE_GPU_PACK   a directory (the device tool's $OUT): at the end, OUTDIR packed into
#                    PACK/PART.tgz (traces over 15 MiB left out) and steps.tsv beside it, so
#                    that what comes back is a few files, not one per step
#   SNAKE_GPU_DRY=1  the dry run on a machine without a GPU: the same steps on tiny CPU
#                    sizes, the installs timed into throwaway directories with this
#                    machine's python3.12 (SNAKE_GPU_DRY_PY312), DeepSpeed's ops not built;
#                    it times each step's fixed costs (start-up, imports, builds)
#
# The time boxes, and what each step should take on an H100, reasoned from the H100 run of
# 2026-11-23 (docs/benchmarks.md: imports 15 s a process, the 24-layer Megatron step of 16
# sequences 2.1 s with full recompute, the 95 tests 68 s, the drive 2-3 GB/s) and this
# machine's dry run (SNAKE_GPU_DRY=1: set-up's install 4-12 s, its imports the rest):
#   set-up                 install 5 s, env.txt's imports 10-15 s
#   headline (330)         about 15 s of imports and the offloaded probe (25 s), then runs in
#                          order of value while its --time-budget 290 lasts: Megatron (build,
#                          probe, 4 steps a mode and clip: 50 s at the saturating M, its step
#                          up to --max-step-s 3 s), ours 3x (35 s), Megatron's CPU offload at
#                          2x (40 s) and 3x (out of memory: 15 s), ours 2x and ours without
#                          clipping (35 s each); the curve's other M mostly does not fit, and
#                          is a second call's (docs/benchmarks.md)
#   headline_trace (115)   imports, a build, a warm-up and the recorded step, the export and
#                          the analysis: 55 s on an H200 at M 3 (the NVMe-bound 1B step's 110 s)
#   optimizer_threads (35) imports, 6 trials of 1.5 s and their buffers: 20-25 s
#   plugin_exact (250)     6 runs of pretrain_gpt.py (10 iterations of a tiny GPT), 15-20 s
#                          of imports and 10-15 s of start-up each: 150-200 s (CPU: 2 runs
#                          in 80-90 s)
#   plugin_bench (170)     2 rounds of 2 runs (4 layers, hidden 2048, 10 iterations in bf16):
#                          imports and build 25 s, then 1-2 s a step: 120-150 s
#   gpu_tests (180)        70-90 s; host_kernel (60) imports and its tests at four levels
#                          (torch, generic, avx2, avx512): 30-60 s on the CPU machine;
#                          demo (60) 20 s; bench_schedule (110) 2 cases x 3
#                          variants x 5 steps of about 2 s: 80 s; bench_zenflow (60) 30 s
#   zero_install (75)      15 s (its sdist takes 7 s of CPU); zero_ops (150) 60-90 s, both
#                          ops at once; zero_m16 (160) the aio tuning, three child processes
#                          (imports 20 s each) and 3 steps a system of under 10 s: about
#                          120 s; zero_m4_1 (95) M 4 fits, M 1 only if the drive is fast
#   bench_io (120) 40 s; act_host (100) 40 s; gds_reason (30) 10 s; act_nvme (100) 70 s
#                          (a step sends 8 GB to the drive)
#   validate_planner (450) one calibration and 8 runs of 30-55 s: about 330 s
#
# On a machine without internet (the lent GPU machines have Python 3.12 and a CUDA build
# of torch, but no megatron-core, liburing or fio), first run, where there is internet:
#     MEGATRON_LM_DIR=/path/to/Megatron-LM@core_v0.19.0 bash tools/gpu_carry.sh
#                                      # fills .gpu/ (git-ignored, about 28 MiB)
# and bring .gpu/ along with the checkout. It holds the megatron-core 0.16.1 wheel (and
# kvikio's, for GDS), the native I/O engine built for Python 3.12 with liburing linked
# statically, a static fio (the drive's reference for bench_io), DeepSpeed's sources, and
# for the part plugin the megatron-core 0.19.2 wheel and Megatron-LM core_v0.19.0's
# training code (.gpu/plugin/).
# This script installs them into /tmp/snake_site (nothing outside /tmp changes) and never
# downloads anything.
set -uo pipefail
cd "$(dirname "$0")/.."
PARTS="headline plugin suite zero io plan"
USAGE="usage: tools/gpu_check.sh OUTDIR headline|plugin|suite|zero|io|plan|next|setup|all"
OUTDIR=${1:?$USAGE}
PART=${2:?$USAGE}
if [ "$PART" = next ]; then
    if [ -d .git ] || git rev-parse --git-dir >/dev/null 2>&1; then
        PART=$(python3 tools/gpu_next_part.py) || exit 1
    elif [ -s .gpu/next_part ]; then
        PART=$(cat .gpu/next_part)
    else
        echo "gpu_check.sh: next needs git, or .gpu/next_part from tools/gpu_carry.sh" >&2
        exit 2
    fi
    [ "$PART" = none ] && { echo "gpu_check.sh: every part is measured at its code's last change"; exit 0; }
    echo "=== next: $PART"
fi
case "$PART" in
    setup|headline|plugin|suite|zero|io|plan|all) ;;
    bench) echo "gpu_check.sh: the part bench is now headline (bench_headline.py, the trace)"\
                "and io (bench_io, bench_activations, GDS); bench_schedule and bench_zenflow"\
                "are in suite" >&2; exit 2 ;;
    *) echo "gpu_check.sh: part must be one of $PARTS, setup or all, got $PART" >&2; exit 2 ;;
esac
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
SCRATCH=${SNAKE_SCRATCH:-/tmp/snake_scratch}
mkdir -p "$SCRATCH"
PY=${PYTHON:-python3}
DRY=${SNAKE_GPU_DRY:-0}
PART_LIMIT=${SNAKE_GPU_PART_LIMIT:-530}
PART_T0=0
SITE=/tmp/snake_site
[ "$DRY" = 1 ] && SITE=/tmp/snake_dry/site
# the GPU tests write their reports (the host synchronisations of a steady step) here
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 SNAKE_GPU_REPORT_DIR=$OUTDIR
export PY OUTDIR SCRATCH SITE DRY

# the dry run's tiny sizes, per tool (empty on a GPU)
TINY_GPT="--device cpu --layers 2 --hidden 64 --heads 4 --seq 64 --vocab 1024"
dry() { [ "$DRY" = 1 ] && echo "$@"; }
# the dry run's Python 3.12, which times the installs of the wheels built for it
py312() {
    local py
    for py in "${SNAKE_GPU_DRY_PY312:-}" python3.12 ~/.pyenv/versions/3.12*/bin/python3.12; do
        [ -n "$py" ] && "$py" -c "" 2>/dev/null && { echo "$py"; return; }
    done
    echo "gpu_check.sh: the dry run needs a python3.12 (SNAKE_GPU_DRY_PY312)" >&2
    echo false
}
export -f py312

has_module() {
    "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)" \
        2>/dev/null
}

setup() {
    local t0=$SECONDS rc=0
    export PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}
    if [ "$DRY" = 1 ]; then
        # time the GPU machine's install with this machine's Python 3.12, into a throwaway
        # directory (the megatron-core wheel is built for 3.12; this machine's own Python
        # already has megatron-core)
        local py312
        py312=$(py312)
        rm -rf /tmp/snake_dry && mkdir -p "$SITE"
        "$py312" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --upgrade --target /tmp/snake_dry/site312 .gpu/wheels/*.whl 2>&1 \
            | grep -v "^WARNING" || true
        # (no torch for that Python here: the installed files are checked, not imported)
        grep -H "^__version__\|^MAJOR\|^MINOR\|^PATCH" \
            /tmp/snake_dry/site312/megatron/core/package_info.py || rc=1
    elif ! has_module megatron.core; then   # (found, not imported: torch takes seconds)
        ls .gpu/wheels/*.whl >/dev/null 2>&1 || {
            echo "gpu_check.sh: megatron-core is missing and .gpu/wheels is empty: run "\
                 "tools/gpu_carry.sh where there is internet" >&2; exit 1; }
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --upgrade --target "$SITE" .gpu/wheels/*.whl 2>&1 | grep -v "^WARNING" || true
        has_module megatron.core || exit 1
    fi
    local suffix
    suffix=$("$PY" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
    local module
    for module in _snake_aio _snake_adamw; do
        if [ "$DRY" != 1 ] && [ ! -e "megatron_snake/$module$suffix" ] &&
                [ -e ".gpu/native/$module$suffix" ]; then
            cp ".gpu/native/$module$suffix" megatron_snake/
        fi
    done
    [ -x .gpu/bin/fio ] && export PATH=$PWD/.gpu/bin:$PATH
    local t_install=$((SECONDS - t0))
    {
        date -u; nvidia-smi 2>&1; uname -a; nproc; free -g; df -hT "$SCRATCH"
        "$PY" -c "import torch, megatron.core, megatron_snake.storage.engine as e; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU'); print('megatron-core', megatron.core.__version__); print('native engine', e.native_available()); import megatron_snake.optim.host_kernel as hk; print('host update', hk.implementation())"
        command -v fio && fio --version
        [ "$DRY" = 1 ] && echo "DRY RUN: tiny CPU sizes, not a measurement"
    } > "$OUTDIR/env.txt" 2>&1
    printf "step\trc\tseconds\n" >> "$OUTDIR/steps.tsv"
    printf "setup\t%s\t%s\n" "$rc" "$((SECONDS - t0))" >> "$OUTDIR/steps.tsv"
    echo "=== setup: exit $rc after $((SECONDS - t0)) s (install $t_install s, env.txt the rest)"
}

# step NAME SECONDS COMMAND...: run one step under a time box, log to OUTDIR/NAME.log
step() {
    local name=$1 limit=$2; shift 2
    # SNAKE_GPU_ONLY="bench_io demo": run only these steps (to split the work across calls)
    if [ -n "${SNAKE_GPU_ONLY:-}" ] && [[ " $SNAKE_GPU_ONLY " != *" $name "* ]]; then return; fi
    local left=$((PART_LIMIT - (SECONDS - PART_T0) - 10))
    if (( left < 20 )); then
        printf "%s\tskipped\t0\n" "$name" >> "$OUTDIR/steps.tsv"
        echo "=== $name: skipped, ${left} s left of the part's ${PART_LIMIT} s"
        return
    fi
    (( limit > left )) && limit=$left
    local t0=$SECONDS
    echo "=== $name (limit ${limit}s): $*"
    timeout --kill-after=10 "$limit" "$@" > "$OUTDIR/$name.log" 2>&1
    local rc=$?
    printf "%s\t%s\t%s\n" "$name" "$rc" "$((SECONDS - t0))" >> "$OUTDIR/steps.tsv"
    tail -n 4 "$OUTDIR/$name.log"
    echo "=== $name: exit $rc after $((SECONDS - t0)) s"
}

# --- headline: offloaded vs Megatron, and the trace of one steady step ----------------
part_headline() {
    local size
    size=$(dry $TINY_GPT --rounds 1 --steps 1 --max-micro-batches 2 --time-budget 60)
    # tokens/s, TFLOP/s per GPU and the ratios of ours (state 3x and 2x the memory given) to
    # Megatron with and without full recompute and to Megatron's CPU offload (2x, 3x), clip
    # on and off, then the curve over M while the budget lasts; the model sized by the
    # device's memory (bench_headline.py); the plot of tokens/s over M
    step headline 330 "$PY" tools/bench_headline.py --dir "$SCRATCH/headline" \
        --time-budget 290 --json-out "$OUTDIR/headline.json" \
        --plot "$OUTDIR/headline_curve.png" $size ${SNAKE_BENCH_HEADLINE_FLAGS:-}
    # one steady step of the 3x run at its batch, clip on: GPU idle %, every gap over 1 ms and
    # what the host did in it (trace/gaps.json, trace/timeline.png)
    step headline_trace 115 "$PY" tools/bench_headline.py --dir "$SCRATCH/trace" \
        --trace-dir "$OUTDIR/trace" --from "$OUTDIR/headline.json" $size \
        ${SNAKE_BENCH_HEADLINE_FLAGS:-}
    # the optimizer's thread budget: kernel launches/s of the training thread and the
    # update's rate, an update on every core against the default budget (half of them)
    step optimizer_threads 35 "$PY" tools/bench_optimizer_threads.py --rounds 3 \
        --seconds 1.5 --json-out "$OUTDIR/optimizer_threads.json" $(dry --numel 1048576)
}

# --- plugin: Megatron-LM's pretrain_gpt.py with the plug-in, on megatron-core 0.19 ---------
# megatron-core 0.19.2 from .gpu/plugin/wheels into its own directory, first on PYTHONPATH
# for this part alone (the other parts keep 0.16.1); Megatron-LM core_v0.19.0's training
# code from .gpu/plugin/megatron-lm (tools/gpu_carry.sh), or SNAKE_MEGATRON_LM_DIR. The dry
# run times the wheel's install with this machine's Python 3.12 and trains on a checkout's
# own megatron/core (SNAKE_MEGATRON_LM_DIR: a full core_v0.19.0 checkout).
plugin_env() {
    export MEGATRON_LM_DIR=${SNAKE_MEGATRON_LM_DIR:-$PWD/.gpu/plugin/megatron-lm}
    [ -f "$MEGATRON_LM_DIR/pretrain_gpt.py" ] || {
        echo "gpu_check.sh: no Megatron-LM checkout at $MEGATRON_LM_DIR: run tools/gpu_carry.sh"\
             "with MEGATRON_LM_DIR set to core_v0.19.0's (or set SNAKE_MEGATRON_LM_DIR)" >&2
        return 1; }
    ls .gpu/plugin/wheels/megatron_core-*.whl >/dev/null 2>&1 || {
        echo "gpu_check.sh: .gpu/plugin/wheels has no megatron-core wheel: run tools/gpu_carry.sh" >&2
        return 1; }
    local site=/tmp/snake_site_plugin py=$PY
    if [ "$DRY" = 1 ]; then
        site=/tmp/snake_dry/site_plugin312
        py=$(py312)
    fi
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" .gpu/plugin/wheels/megatron_core-*.whl 2>&1 | grep -v "^WARNING"
    grep -h "^MAJOR\|^MINOR\|^PATCH" "$site/megatron/core/package_info.py" | tr '\n' ' ' \
        >> "$OUTDIR/env.txt"
    [ "$DRY" = 1 ] || export PYTHONPATH=$site:$PYTHONPATH
}

part_plugin() {
    plugin_env || return
    # fp32, dropout 0, 10 iterations: the same losses, grad norms and evaluations as plain
    # Megatron-LM at one rank, and checkpoints both ways each going on as Megatron-LM's own
    # resume does (tests/megatron_lm/test_plugin_runs.py)
    step plugin_exact 250 "$PY" -m pytest -q -rfEs tests/megatron_lm/test_plugin_runs.py \
        -k "$( [ "$DRY" = 1 ] && echo one_rank_equals_plain || echo "one_rank_equals_plain or continues")" \
        --junitxml="$OUTDIR/plugin_exact.xml" -o cache_dir=/tmp/pytest_cache --basetemp=/tmp/snake_plugin_runs
    # tokens/s of the plug-in against the own loop, the same GPT in bf16, alternating
    step plugin_bench 170 "$PY" tools/bench_plugin.py --dir "$SCRATCH/plugin_bench" \
        $( [ "$DRY" = 1 ] && echo "--device cpu --layers 2 --hidden 64 --heads 4 --seq 64 --vocab 1024 --iters 4 --warmup 1 --rounds 1" ||
           echo "--device cuda --flags=--bf16 --layers 4 --hidden 2048 --heads 16 --seq 2048 --vocab 32000 --micro-batch 1 --global-batch 8 --iters 10 --warmup 3 --rounds 2" ) \
        --log-dir "$OUTDIR/plugin_bench_logs" --json-out "$OUTDIR/plugin_bench.json"
}

# --- suite: tests/gpu and the demo, then two short benchmarks -----------------------------
part_suite() {
    step gpu_tests 180 "$PY" -m pytest -q -rfEs tests/gpu --junitxml="$OUTDIR/gpu_tests.xml" \
        -o cache_dir=/tmp/pytest_cache
    # the host update's kernel on this machine's CPU (AVX-512, which the CPU machine lacks)
    step host_kernel 60 "$PY" -m pytest -q -rfEs tests/test_host_kernel.py \
        --junitxml="$OUTDIR/host_kernel.xml" -o cache_dir=/tmp/pytest_cache
    # with the timeline of iteration 2 (draw it here: tools/plot_timeline.py)
    step demo 60 "$PY" examples/pretrain_gpt.py --snake-offload --snake-offload-dir "$SCRATCH" \
        --train-iters 10 --log-interval 5 --snake-trace "$OUTDIR/demo_trace.json"
    # the vertical schedule vs Megatron with full recompute, no optimizer (H100: 0.983)
    step bench_schedule 110 "$PY" tools/bench_schedule.py \
        $( [ "$DRY" = 1 ] && echo "--preset cpu-small --device cpu --steps 1 --warmup 0" ||
           echo "--preset gpu-1b --bf16 --steps 4 --warmup 1" ) \
        --json-out "$OUTDIR/bench_schedule.json"
    step bench_zenflow 60 "$PY" tools/bench_zenflow.py \
        $( [ "$DRY" = 1 ] &&
           echo "--device cpu --layers 2 --hidden 64 --seq 64 --vocab 1024 --steps 1 --warmup 1" ||
           echo "--bf16 --steps 12 --warmup 4" ) \
        --json-out "$OUTDIR/bench_zenflow.json" ${SNAKE_BENCH_ZENFLOW_FLAGS:-}
}

# --- zero: side by side with ZeRO-Infinity ----------------------------------------------
# DeepSpeed from .gpu/deepspeed (tools/gpu_carry.sh): libaio's packages unpacked under
# /tmp/snake_libaio (its headers and library for the async_io op) and the build's
# environment, here in this shell; its source distribution and the wheels the image lacks
# installed into /tmp/snake_site (a step); the ops built into /tmp/snake_ext (a step)
deepspeed_env() {
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
    export TORCH_EXTENSIONS_DIR=/tmp/snake_ext DS_SKIP_CUDA_CHECK=1
    export DS_ACCELERATOR=$( [ "$DRY" = 1 ] && echo cpu || echo cuda )
    export MAX_JOBS=$(nproc)
}

deepspeed_install() {
    has_module deepspeed && { echo "deepspeed already installed"; return 0; }
    ls .gpu/deepspeed/deepspeed-*.tar.gz >/dev/null 2>&1 || {
        echo "gpu_check.sh: deepspeed is missing and .gpu/deepspeed is empty: run "\
             "tools/gpu_carry.sh where there is internet" >&2; return 1; }
    local py=$PY wheels=$SITE
    if [ "$DRY" = 1 ]; then   # the wheels are for 3.12: timed with it, apart
        py=$(py312)
        wheels=/tmp/snake_dry/ds312
    fi
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$wheels" .gpu/deepspeed/*.whl 2>&1 | grep -v "^WARNING"
    DS_BUILD_OPS=0 "$PY" -m pip install -q --no-index --no-deps --no-build-isolation \
        --no-cache-dir --target "$SITE" .gpu/deepspeed/deepspeed-*.tar.gz 2>&1 \
        | grep -v "^WARNING"
    "$PY" -c "import deepspeed; print('deepspeed', deepspeed.__version__)" ||
        [ "$DRY" = 1 ]   # this machine lacks some of the image's packages (msgpack, ...)
}

# both ops at once (each is a few translation units: one process cannot use 16 cores)
deepspeed_ops() {
    if [ "$DRY" = 1 ]; then
        echo "dry run: DeepSpeed's ops not built (2 cores here: cpu_adam 1-1.5 min, async_io 4-10 min)"
        return 0
    fi
    local rc=0 pid
    "$PY" -c "from deepspeed.ops.op_builder import AsyncIOBuilder; AsyncIOBuilder().load(); print('async_io built')" &
    pid=$!
    "$PY" -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(); print('cpu_adam built')" || rc=1
    wait "$pid" || rc=1
    return $rc
}
export -f has_module deepspeed_install deepspeed_ops

# DeepSpeed's aio block size and queue depth the M 16 run tuned (empty if none)
zero_aio() {
    "$PY" -c "import json, sys; a = json.load(open(sys.argv[1]))['args']['aio']; \
print('--aio', f'{a[0]},{a[1]}')" "$OUTDIR/zero_m16.json" 2>/dev/null
}

part_zero() {
    deepspeed_env
    step zero_install 75 bash -c deepspeed_install
    step zero_ops 150 bash -c deepspeed_ops
    grep -h "^deepspeed " "$OUTDIR/zero_install.log" >> "$OUTDIR/env.txt" 2>/dev/null
    # about 280M parameters in bf16 (8 layers, hidden 1536, 2048-token sequences), every
    # state of both on the drive: at M 16 ZeRO-Infinity reads its weights 32 times a step
    # (about 18 GB, under 10 s at 2-3 GB/s), ours twice. Sized so that its 2 x 3 steps, a
    # child process each, fit the box; the CPU runs' tables are in docs/benchmarks.md
    local size="--device cuda --bf16 --layers 8 --hidden 1536 --heads 12 --seq 2048 --micro-batch 1"
    local -a bench=("$PY" tools/bench_vs_zero_infinity.py $size --dir "$SCRATCH/zero" --steps 2
                    --warmup 1 ${SNAKE_BENCH_ZERO_FLAGS:-})
    if [ "$DRY" = 1 ]; then   # no DeepSpeed ops here: a child's fixed cost (start, imports, build)
        mkdir -p "$SCRATCH/zero_initial"
        bench=("$PY" tools/bench_vs_zero_infinity.py --worker initial
               --work "$SCRATCH/zero_initial" $TINY_GPT --micro-batch 1)
    fi
    step zero_m16 160 "${bench[@]}" --micro-batches 16 --json-out "$OUTDIR/zero_m16.json"
    # M 4 then 1 while the box lasts (its JSON is written after every run)
    step zero_m4_1 95 "${bench[@]}" --micro-batches 4 1 $(zero_aio) \
        --json-out "$OUTDIR/zero_m4_1.json"
}

# --- io: the store, the pinned pool, activation offload, GDS -----------------------------
part_io() {
    # the store vs fio (io_uring, O_DIRECT) alternating; then, on the GPU, the pinned pool vs
    # a plain pinned copy_, GPU<->NVMe through the store and the store's GDS attempt
    step bench_io 120 "$PY" tools/bench_io.py --dir "$SCRATCH" \
        $( [ "$DRY" = 1 ] && echo "--size 64MiB --repeat 1 --fallback-size 64MiB" ||
           echo "--size 2GiB --repeat 3 --fallback-size 512MiB" ) \
        --engines auto,python --json-out "$OUTDIR/bench_io.json"
    # activation offload on Megatron's schedule to host memory: peak and step time
    local act="--layers 8 --hidden 2048 --heads 16 --seqs 2048 --micro-batches 2 --steps 3 --warmup 1 --bf16"
    local pool=$((24 << 30))   # host memory for a micro-batch's saved tensors (8 GB at mbs 2)
    if [ "$DRY" = 1 ]; then
        act="--device cpu --layers 2 --hidden 64 --heads 4 --seqs 64 --micro-batches 2 --steps 1 --warmup 1"
        pool=$((1 << 30))
    fi
    step act_host 100 "$PY" tools/bench_activations.py --dir "$SCRATCH/act" $act \
        --tier host --micro-batch-sizes 1,2 --host-memory $pool \
        --json-out "$OUTDIR/act_host.json"
    # kvikio's own words on GDS: its compat mode, the cuFile driver opened through it, and a
    # cuFile write with compat mode OFF (kvikio raises why it cannot)
    step gds_reason 30 "$PY" - <<'EOF'
import json, os, subprocess, sys
out = {}
try:
    import kvikio
    import kvikio.defaults
except Exception as exc:  # noqa: BLE001
    out["import"] = f"{type(exc).__name__}: {exc}"
else:
    out["kvikio"] = getattr(kvikio, "__version__", "?")
    for name in ("compat_mode", "is_compat_mode_preferred"):
        fn = getattr(kvikio.defaults, name, None)
        try:
            out[name] = "absent" if fn is None else str(fn())
        except Exception as exc:  # noqa: BLE001
            out[name] = f"{type(exc).__name__}: {exc}"
    try:
        from kvikio import cufile_driver
        cufile_driver.driver_open()
        out["driver_open"] = "ok"
        props = getattr(cufile_driver, "properties", None) or cufile_driver.DriverProperties()
        out["driver_properties"] = {k: str(getattr(props, k)) for k in dir(props)
                                    if not k.startswith("_") and not callable(getattr(props, k))}
    except Exception as exc:  # noqa: BLE001
        out["driver_open"] = f"{type(exc).__name__}: {exc}"
    path = os.path.join(os.environ.get("SCRATCH", "/tmp"), "gds_probe.bin")
    code = ("import kvikio, torch; x = torch.ones(1 << 20, dtype=torch.uint8, device='cuda'); "
            f"f = kvikio.CuFile({path!r}, 'w'); n = f.write(x); f.close(); "
            "print('cuFile write with compat mode OFF:', n, 'bytes')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=20, env=dict(os.environ, KVIKIO_COMPAT_MODE="OFF"))
    out["write_with_compat_mode_off"] = (r.stdout + r.stderr).strip()[-2000:]
    if os.path.exists(path):
        os.unlink(path)
with open(os.path.join(os.environ["OUTDIR"], "gds_reason.json"), "w") as f:
    json.dump(out, f, indent=1)
print(json.dumps(out, indent=1))
EOF
    step act_nvme 100 "$PY" tools/bench_activations.py --dir "$SCRATCH/act" $act \
        --tier nvme --micro-batch-sizes 1 --json-out "$OUTDIR/act_nvme.json"
}

# --- plan: the cost model against measured GPU steps -------------------------------------
part_plan() {
    # the one-rank configurations (one GPU) at a GPU's shape: hidden 2048, 2048-token
    # sequences, bf16, every state on the drive but where a configuration says otherwise;
    # one calibration for the round (a process each: 8 runs of about 30 s)
    mkdir -p "$SCRATCH/plan"
    step validate_planner 450 "$PY" tools/validate_planner.py --dir "$SCRATCH/plan" \
        $( [ "$DRY" = 1 ] && echo "--device cpu --hidden 64 --seq 64 --host-memory 1GiB --warmup 1 --iters 1" ||
           echo "--device cuda --bf16 --hidden 2048 --seq 2048 --host-memory 16GiB --warmup 2 --iters 3" ) \
        --rounds 1 --calibrate round --json-out "$OUTDIR/validate_planner.json" \
        --png "$OUTDIR/validate_planner.png"
}

# SNAKE_GPU_PACK: OUTDIR as PACK/PART.tgz (traces over 15 MiB left out) and steps.tsv
pack() {
    local dest=${SNAKE_GPU_PACK:-}
    [ -n "$dest" ] || return 0
    mkdir -p "$dest"
    local big
    big=$(cd "$OUTDIR" && find . -type f -size +15728640c | sed 's|^\./||')
    [ -n "$big" ] && echo "=== pack: left out (over 15 MiB): $big"
    (cd "$OUTDIR" && find . -type f -size -15728641c -print0 | tar czf "$dest/$PART.tgz" --null -T -)
    cp "$OUTDIR/steps.tsv" "$dest/$PART-steps.tsv"
    echo "=== packed into $dest/$PART.tgz ($(du -h "$dest/$PART.tgz" | cut -f1))"
}

setup
case "$PART" in
    setup) ;;     # install only (env.txt); for running single steps by hand
    all) for p in $PARTS; do PART_T0=$SECONDS; "part_$p"; done ;;
    *) "part_$PART" ;;
esac
echo "=== steps (rc 124: hit its time box)"
cat "$OUTDIR/steps.tsv"
pack
