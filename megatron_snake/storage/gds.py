"""GPUDirect Storage backend (optional): GPU memory <-> swap file through kvikio, behind the
same TensorStore API (`TensorStore(..., engine="gds")`). Used for nvme records of CUDA
tensors; everything else keeps the native engine. When kvikio is missing, no GPU is present
or kvikio runs in compatibility mode (no real GDS), the store logs why and uses the native
engine through the pinned host pool.

A GDS record is one extent: [record header block, 4096 bytes, written through the host
engine][payload, written by kvikio from GPU memory]. The payload checksum is computed on the
GPU (`gpu_checksum`: a position-weighted 64-bit sum of the 32-bit words, in chunks) so the
bytes never touch host memory; it is verified on every read like the crc32c of host records.
The store runs it on its copy streams, never on the compute stream. kvikio reads into GPU
memory outside any stream's order, so the store waits on the host until the destination is
free before a GDS read.

Not exercised in CI (no GPU there); docs/benchmarks.md says what was measured on a GPU.
"""

import logging

import torch

log = logging.getLogger("megatron_snake.storage")

HEADER_BLOCK = 4096
_MOD = (1 << 61) - 1


def gpu_checksum(byte_view, chunk_words=1 << 24):
    """A 64-bit checksum of a CUDA uint8 tensor, computed on the GPU."""
    n = byte_view.numel()
    pad = (-n) % 4
    if pad:
        byte_view = torch.cat([byte_view, byte_view.new_zeros(pad)])
    words = byte_view.view(torch.int32)
    s1 = torch.zeros((), dtype=torch.int64, device=byte_view.device)
    s2 = torch.zeros((), dtype=torch.int64, device=byte_view.device)
    for start in range(0, words.numel(), chunk_words):
        w = words[start:start + chunk_words].to(torch.int64) & 0xFFFFFFFF
        idx = torch.arange(start + 1, start + 1 + w.numel(), device=w.device, dtype=torch.int64) % 65521
        s1 = (s1 + w.sum()) % _MOD
        s2 = (s2 + ((w % 65521) * idx).sum()) % _MOD
    return int(((s1 << 2) ^ s2 ^ n) & 0xFFFFFFFFFFFFFFFF)


def _cufile_in_use(kvikio) -> tuple[bool, str]:
    """Whether kvikio's reads and writes go through cuFile (GPUDirect), and why not.

    kvikio's compat mode is ON (POSIX I/O through host memory: nothing gained over our own
    engine), OFF (cuFile, or an error) or AUTO (cuFile when the system allows it, else
    POSIX); under AUTO kvikio itself says which it prefers."""
    defaults = kvikio.defaults
    try:
        mode = defaults.compat_mode() if hasattr(defaults, "compat_mode") \
            else defaults.get("compat_mode")
    except Exception as exc:  # noqa: BLE001 - an old or broken kvikio
        return False, f"cannot read kvikio's compat mode ({exc})"
    name = str(getattr(mode, "name", mode)).upper()
    if name in ("ON", "TRUE", "1"):
        return False, "KVIKIO_COMPAT_MODE is ON"
    if name in ("OFF", "FALSE", "0"):
        return True, ""
    preferred = getattr(defaults, "is_compat_mode_preferred", None)
    if preferred is None:
        return False, f"compat mode {name} and this kvikio cannot say which it will use"
    if preferred():
        return False, (f"compat mode {name}: cuFile is unavailable here (no libcufile, no "
                       "nvidia-fs, or /run/udev unreadable)")
    return True, ""


class GdsBackend:
    @classmethod
    def create(cls):
        """A backend, or None (with a log line saying why) when GDS cannot be used."""
        if not torch.cuda.is_available():
            log.warning("--snake-io-engine gds: no GPU; using the native engine")
            return None
        try:
            import kvikio
            import kvikio.defaults
        except ImportError as exc:
            log.warning("--snake-io-engine gds: kvikio is not installed (%s); using the native "
                        "engine through the pinned host pool", exc)
            return None
        direct, why = _cufile_in_use(kvikio)
        if not direct:
            log.warning("--snake-io-engine gds: kvikio would not use cuFile (%s); using the "
                        "native engine through the pinned host pool", why)
            return None
        log.info("offload: GPUDirect Storage through kvikio %s", getattr(kvikio, "__version__", "?"))
        return cls(kvikio)

    def __init__(self, kvikio):
        self._kvikio = kvikio
        self._files = {}

    def _file(self, path):
        f = self._files.get(path)
        if f is None:
            f = self._files[path] = self._kvikio.CuFile(path, "r+")
        return f

    def write(self, path, gpu_bytes, offset):
        n = self._file(path).pwrite(gpu_bytes, gpu_bytes.numel(), offset).get()
        if n != gpu_bytes.numel():
            raise OSError(f"GDS write of {gpu_bytes.numel()} bytes at {offset} of {path} wrote {n}")

    def read(self, path, gpu_bytes, offset):
        return self._file(path).pread(gpu_bytes, gpu_bytes.numel(), offset).get()

    def close(self):
        for f in self._files.values():
            f.close()
        self._files.clear()
