#!/usr/bin/env bash
# Set up megatron_snake on a fresh machine. Usage: bash tools/install.sh [--dev]
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
if [ "${1:-}" = "--dev" ]; then
    extras="[dev]"
fi
"$PY" -m pip install -q -e ".${extras}"
