"""The tiers of the tensor store, fastest first, each an object with one small interface
(base.py's ``Tier``: write, write_empty, read_into, drop, capacity, its counters):

  device.py  ``gpu``   tensors on the compute device
  host.py    ``host``  buffers of the pinned host pool, in the drive's record format
  drive.py   ``nvme``  checksummed records in per-kind swap files, through the I/O engine
  gds.py     ``nvme``  the drive, with CUDA tensors' records through GPUDirect Storage

The store (store.py) keeps the keys, the order of their operations and the placement
(which tier, spills, moves up and down) and calls only these interfaces; the tiers move
the bytes, through the copy strategy they are handed (copies.py), and count them.
``open_drive`` picks the drive tier: the one place another (such as one striped over
several directories) would be chosen."""

from megatron_snake.storage.directory import RankDir
from megatron_snake.storage.engine import make_engine
from megatron_snake.storage.tiers.base import Tier
from megatron_snake.storage.tiers.device import DeviceTier
from megatron_snake.storage.tiers.drive import DriveTier
from megatron_snake.storage.tiers.host import HostTier, host_buffers_for


def open_drive(offload_dir, rank, run_id, copies, counters, engine="auto", queue_depth=32,
               io_threads=4, chunk_bytes=1 << 20, **dir_kwargs) -> DriveTier:
    """The drive tier of rank ``rank`` under ``offload_dir``: its directory opened and
    locked first (its errors come before any other), then the I/O engine (``engine``:
    make_engine's kinds, or "gds": GPUDirect Storage for CUDA tensors when kvikio can use
    it, else the native engine through the pinned host pool)."""
    directory = RankDir(offload_dir, rank, run_id, **dir_kwargs)
    try:
        backend = None
        if engine == "gds":
            from megatron_snake.storage.gds import GdsBackend
            backend = GdsBackend.create()   # None (and a log line) when GDS is unavailable
            engine = "auto"
        io = make_engine(engine, queue_depth, io_threads, chunk_bytes)
    except Exception:
        directory.close()
        raise
    if backend is None:
        return DriveTier(directory, io, run_id, copies, counters)
    from megatron_snake.storage.tiers.gds import GdsDriveTier
    return GdsDriveTier(directory, io, backend, run_id, copies, counters)


__all__ = ["Tier", "DeviceTier", "HostTier", "DriveTier", "open_drive", "host_buffers_for"]
