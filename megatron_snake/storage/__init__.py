"""The tiered tensor store: GPU <-> pinned host pool <-> NVMe swap files.

    from megatron_snake.storage import TensorStore
    with TensorStore("/nvme/snake", rank=0, host_memory_limit=8 << 30) as store:
        store.put("x", t, tier="nvme").wait()
        t2 = store.get("x").wait()

The bottom layer: it imports nothing else of megatron_snake but the timeline, the errors and
the emulated device's clock, and knows nothing of training.
Modules, from the drive up: engine (the native csrc engine or a Python fallback), swap_file
(the on-disk record format), directory (the rank directory, its lock, stale files and free
space), safe_files (creating files and directories without following links), host_pool
(pinned buffers under a hard limit), gds (GPUDirect through kvikio), copies (the copy
strategy: how bytes cross between host memory and the device), tiers/ (each tier an object:
device, host, drive, GDS drive), record (a key's value and its copies), counters, store
(TensorStore: keys, the order of their operations, placement), errors, and sizes (tier
names and byte sizes).
"""

from megatron_snake.storage.errors import (CapacityError, HostMemoryError, IntegrityError,
                                           OffloadDirError, OffloadError, OffloadIOError)


def __getattr__(name):  # torch is heavy: import the store lazily
    if name in ("TensorStore", "Handle", "Counters"):
        from megatron_snake.storage import store

        return getattr(store, name)
    raise AttributeError(name)


__all__ = ["TensorStore", "Handle", "Counters", "OffloadError", "OffloadDirError",
           "CapacityError", "HostMemoryError", "IntegrityError", "OffloadIOError"]
