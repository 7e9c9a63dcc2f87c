#!/usr/bin/env bash
# Set up megatron_snake on a fresh machine. Usage: bash tools/install.sh [--dev | --bench]
# --dev: the test extras. --bench: the benchmarks' extras, DeepSpeed (for
# tools/bench_vs_zero_infinity.py) and libaio included.
#
# torch is installed first and only when missing, pinned to 2.13.0 (an unpinned torch would
# make pip fetch the newest build), from pip's configured sources: which build that is
# depends on them (a local CPU wheel on this project's CI machines, PyPI's CUDA build on a
# plain Linux machine); TORCH_INDEX_URL, e.g. https://download.pytorch.org/whl/cpu, picks
# one. A torch that is already there (a GPU build, say) is kept as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
fi

# The native I/O engine in csrc/ links liburing; without it the build falls back to the
# pure-Python engine. Install it when we can (root with apt-get); whether the engine was
# built is checked after the install below, not inferred from apt.
if ! ldconfig -p 2>/dev/null | grep -q "liburing.so " && [ "$(id -u)" = 0 ] \
        && command -v apt-get >/dev/null; then
    (apt-get update -qq && apt-get install -y -qq liburing-dev >/dev/null) \
        || echo "install.sh: could not install liburing-dev"
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

# pip -q hides setup.py's build warning: report what was built, from the module itself.
if "$PY" -c "import megatron_snake._snake_aio" 2>/dev/null; then
    echo "install.sh: native I/O engine built (megatron_snake._snake_aio)"
else
    echo "install.sh: native I/O engine NOT built: offloaded I/O uses the slower pure-Python" \
        "engine. Install liburing-dev and a C compiler, then rerun bash tools/install.sh"
fi
