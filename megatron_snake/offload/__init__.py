"""Storage tiers: GPU <-> pinned host pool <-> NVMe swap files, through one tensor store.

    from megatron_snake.offload import TensorStore
    with TensorStore("/nvme/snake", rank=0, host_memory_limit=8 << 30) as store:
        store.put("x", t, tier="nvme").wait()
        t2 = store.get("x").wait()

Modules: engine (native csrc engine + Python fallback), host_pool, swap_file (on-disk
format), directory (rank dir, lock, stale files, capacity), store (TensorStore), gds.
"""

from megatron_snake.offload.errors import (CapacityError, HostMemoryError, IntegrityError,
                                           OffloadDirError, OffloadError, OffloadIOError)


def __getattr__(name):  # torch is heavy: import the store lazily
    if name in ("TensorStore", "Handle", "Counters"):
        from megatron_snake.offload import store

        return getattr(store, name)
    raise AttributeError(name)


__all__ = ["TensorStore", "Handle", "Counters", "OffloadError", "OffloadDirError",
           "CapacityError", "HostMemoryError", "IntegrityError", "OffloadIOError"]
