#!/usr/bin/env bash
# Set up megatron_snake on a fresh machine. Usage: bash tools/install.sh [--dev | --bench]
# --dev: the test extras. --bench: the benchmarks' extras, DeepSpeed (for
# tools/bench_vs_zero_infinity.py) and libaio included.
#
# torch is installed first and only when missing: an unpinned torch would make pip fetch the
# newest CUDA build, and a torch that is already there (a GPU build, say) is kept as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install "torch==2.13.0"
fi

# The native I/O engine in csrc/ links liburing; without it the build falls back to the
# pure-Python engine (and says so). Install it when we can (root with apt-get).
if ! ldconfig -p 2>/dev/null | grep -q "liburing.so " && [ "$(id -u)" = 0 ] \
        && command -v apt-get >/dev/null; then
    (apt-get update -qq && apt-get install -y -qq liburing-dev >/dev/null) \
        || echo "install.sh: could not install liburing-dev; using the Python I/O fallback"
fi

extras=""
case "${1:-}" in
    --dev) extras="[dev]" ;;
    --bench)
        extras="[bench]"
        # DeepSpeed builds against the torch that is here: no build isolation (which would
        # fetch another torch) and no dependency resolution (which could replace it). Its
        # async_io op needs libaio; its ops compile on first use.
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
            (apt-get update -qq && apt-get install -y -qq libaio-dev >/dev/null) \
                || echo "install.sh: could not install libaio-dev (DeepSpeed's async_io needs it)"
        fi
        "$PY" -m pip install -q hjson msgpack ninja py-cpuinfo pydantic psutil einops tqdm
        DS_ACCELERATOR=${DS_ACCELERATOR:-cpu} "$PY" -m pip install -q --no-build-isolation \
            --no-deps "deepspeed==0.19.8"
        ;;
    "") ;;
    *) echo "install.sh: unknown option $1 (use --dev or --bench)" >&2; exit 2 ;;
esac
"$PY" -m pip install -q -e ".${extras}"
