#!/usr/bin/env bash
# Build, on a machine WITH internet, what tools/gpu_check.sh needs on a GPU machine WITHOUT
# it, into .gpu/ (git-ignored; about 8 MiB, carried to the GPU machine beside the checkout):
#
#   .gpu/wheels/   megatron-core 0.16.1 for the GPU machine's Python (3.12 by default), and
#                  kvikio for CUDA 13 with its two missing dependencies (GDS, optional)
#   .gpu/native/   megatron_snake's native I/O engine built for that Python, with liburing
#                  linked statically (the GPU machine has no liburing)
#   .gpu/bin/fio   a static fio, when one has been built (tools/gpu_check.sh then measures
#                  the drive's own limit with it; without it, a raw O_DIRECT reference)
#   .gpu/deepspeed/ for the ZeRO-Infinity comparison (gpu_check.sh's part "zero"): the
#                  deepspeed 0.19.8 source distribution, the wheels of its dependencies the
#                  GPU image lacks (hjson, pydantic and pydantic's own), and libaio's Debian
#                  packages (its async_io op compiles against them there)
#
# Usage: bash tools/gpu_carry.sh [PYTHON_FOR_THE_GPU_MACHINE]   (default: python3.12)
# Needs: pip with access to PyPI, gcc, liburing.a (Debian: liburing-dev), and a local Python
# of the same minor version as the GPU machine's (its headers build the engine).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-python3.12}
"$PY" -c "import sysconfig" 2>/dev/null || PY=$(ls ~/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | head -1)
"$PY" -c "import sysconfig" 2>/dev/null || {
    echo "gpu_carry.sh: no python3.12 here to build the native engine with" >&2; exit 1; }
PYVER=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >> "$exclude"
mkdir -p .gpu/wheels .gpu/native .gpu/bin .gpu/deepspeed

platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64; do platforms+=(--platform "$p"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
    --implementation cp "${platforms[@]}" -d .gpu/wheels \
    megatron-core==0.16.1 kvikio-cu13==26.10.0 libkvikio-cu13==26.10.0 rapids-logger==0.3.0

# DeepSpeed ships only a source distribution; the image has its other dependencies (einops,
# msgpack, ninja, packaging, psutil, py-cpuinfo, tqdm: device README's package list)
python3 -m pip download -q --no-deps --no-binary=:all: -d .gpu/deepspeed deepspeed==0.19.8
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
    --implementation cp "${platforms[@]}" -d .gpu/deepspeed \
    hjson==3.1.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 \
    typing-inspection==0.4.2
(cd .gpu/deepspeed && rm -f libaio*.deb && apt-get download libaio1 libaio-dev)

liburing=$(ls /usr/lib/x86_64-linux-gnu/liburing.a /usr/lib/liburing.a 2>/dev/null | head -1 || true)
[ -n "$liburing" ] || { echo "gpu_carry.sh: liburing.a not found (apt-get install liburing-dev)" >&2; exit 1; }
inc=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
suffix=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
gcc -O2 -std=gnu11 -Wall -fPIC -shared -I"$inc" csrc/snake_aio.c csrc/engine.c csrc/crc32c.c \
    "$liburing" -lpthread \
    -o ".gpu/native/_snake_aio$suffix"
ls -la .gpu/wheels .gpu/native .gpu/bin .gpu/deepspeed
du -sh .gpu
