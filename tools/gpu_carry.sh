#!/usr/bin/env bash
# Build, on a machine WITH internet, what tools/gpu_check.sh needs on a GPU machine WITHOUT
# it, into .gpu/ (git-ignored; about 29 MiB, carried to the GPU machine beside the
# checkout: name .gpu in the device tool's carry; about 2 minutes here, 3.5 with fio):
#
#   .gpu/wheels/   megatron-core 0.16.1 for the GPU machine's Python (3.12 by default), and
#                  kvikio for CUDA 13 with its two missing dependencies (GDS, optional)
#   .gpu/native/   megatron_snake's native modules built for that Python: the I/O engine
#                  with liburing linked statically (the GPU machine has no liburing), and
#                  the host AdamW update (needs no library)
#   .gpu/bin/fio   a static fio (tools/gpu_check.sh measures the drive's own limit with it),
#                  built from Debian's fio 3.33 source (deb.debian.org) with io_uring and
#                  libaio, stripped; skipped with a warning where it cannot be built (the
#                  store is then measured without its reference)
#   .gpu/next_part the part `tools/gpu_check.sh OUT next` runs (tools/gpu_next_part.py)
#   .gpu/deepspeed/ for the ZeRO-Infinity comparison (gpu_check.sh's part "zero"): the
#                  deepspeed 0.19.8 source distribution, the wheels of its dependencies the
#                  GPU image lacks (hjson, pydantic and pydantic's own), and libaio's Debian
#                  packages (its async_io op compiles against them there)
#   .gpu/plugin/   for the Megatron-LM plug-in (gpu_check.sh's part "plugin"): the
#                  megatron-core 0.19.2 wheel (wheels/, installed apart from the 0.16.1 the
#                  other parts use) and Megatron-LM's training code at core_v0.19.0
#                  (megatron-lm/: megatron/ and the entry scripts, about 12 MiB), copied from
#                  the checkout MEGATRON_LM_DIR names (nothing of it is downloaded here; the
#                  part is skipped with a warning without it)
#
# Usage: [MEGATRON_LM_DIR=/path/to/Megatron-LM@core_v0.19.0] bash tools/gpu_carry.sh [PYTHON_FOR_THE_GPU_MACHINE]
#        (default: python3.12)
# Needs: pip with access to PyPI, gcc, liburing.a (Debian: liburing-dev), and a local Python
# of the same minor version as the GPU machine's (its headers build the engine); for fio,
# curl to deb.debian.org, make, and static zlib and libaio (zlib1g-dev, libaio-dev).
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
mkdir -p .gpu/wheels .gpu/native .gpu/bin .gpu/deepspeed .gpu/plugin/wheels

platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64; do platforms+=(--platform "$p"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
    --implementation cp "${platforms[@]}" -d .gpu/wheels \
    megatron-core==0.16.1 kvikio-cu13==26.10.0 libkvikio-cu13==26.10.0 rapids-logger==0.3.0

# the plug-in's part: megatron-core 0.19.2 (the newest release the plug-in supports) apart,
# and the Megatron-LM checkout's training code at the matching tag
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
    --implementation cp "${platforms[@]}" -d .gpu/plugin/wheels megatron-core==0.19.2
copy_megatron_lm() {
    local src=${MEGATRON_LM_DIR:-} found
    [ -n "$src" ] && [ -f "$src/pretrain_gpt.py" ] || {
        echo "gpu_carry.sh: WARNING: MEGATRON_LM_DIR is not a Megatron-LM checkout: no" \
             ".gpu/plugin/megatron-lm (gpu_check.sh's part plugin needs core_v0.19.0's)" >&2
        return 0; }
    found=$(python3 -c "import sys; sys.path.insert(0, '.'); from megatron_snake import releases; \
print(releases.series_of(releases.version_at(sys.argv[1]) or ''))" "$src")
    [ "$found" = 0.19 ] || {
        echo "gpu_carry.sh: WARNING: $src is Megatron-LM $found, not core_v0.19.0: not copied" >&2
        return 0; }
    rm -rf .gpu/plugin/megatron-lm && mkdir -p .gpu/plugin/megatron-lm
    cp -r "$src/megatron" .gpu/plugin/megatron-lm/
    cp "$src"/*.py .gpu/plugin/megatron-lm/
    find .gpu/plugin/megatron-lm -name __pycache__ -prune -exec rm -rf {} +
    echo "Megatron-LM $found from $src: $(du -sh .gpu/plugin/megatron-lm | cut -f1)"
}
copy_megatron_lm

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
# the flags of setup.py's: -ffp-contract=off keeps torch's bits (csrc/adamw.h)
gcc -O2 -std=gnu11 -Wall -ffp-contract=off -fno-math-errno -pthread -fPIC -shared -I"$inc" \
    csrc/snake_adamw.c csrc/adamw.c -lm \
    -o ".gpu/native/_snake_adamw$suffix"
# a static fio: the GPU machine has none (best effort: the rest is usable without it)
build_fio() {
    local ver=3.33 sum=d2410e13e0f379d061d077cc5ae325835bb7c6186aa7bafc1df954cbc9b014fc
    local work
    work=$(mktemp -d)
    curl -fsSL -o "$work/fio.tar.gz" "https://deb.debian.org/debian/pool/main/f/fio/fio_$ver.orig.tar.gz" &&
        echo "$sum  $work/fio.tar.gz" | sha256sum -c --quiet - &&
        tar xzf "$work/fio.tar.gz" -C "$work" &&
        (cd "$work/fio-$ver" &&
         ./configure --build-static --disable-native --disable-numa --disable-rdma \
             --disable-rados --disable-rbd --disable-http --disable-gfapi --disable-libnfs \
             --disable-pmem --disable-xnvme --disable-libzbc --disable-tcmalloc \
             --disable-dfs > configure.log 2>&1 &&
         make -j"$(nproc)" fio > make.log 2>&1) &&
        strip -o .gpu/bin/fio "$work/fio-$ver/fio" &&
        .gpu/bin/fio --version
    local rc=$?
    rm -rf "$work"
    return $rc
}
if [ -x .gpu/bin/fio ] && .gpu/bin/fio --version >/dev/null 2>&1; then
    echo "static fio: already built ($(.gpu/bin/fio --version))"
else
    build_fio || { rm -f .gpu/bin/fio; echo "gpu_carry.sh: WARNING: no static fio built" >&2; }
fi
# the part `gpu_check.sh OUT next` runs there (the GPU machine gets no .git)
python3 tools/gpu_next_part.py > .gpu/next_part
echo "next part: $(cat .gpu/next_part)"
ls -la .gpu/wheels .gpu/native .gpu/bin .gpu/deepspeed .gpu/plugin/wheels
du -sh .gpu
