"""The tiers of the tensor store, fastest first, each an object with one small interface
(base.py's ``Tier``: write, write_empty, read_into, drop, capacity, its counters):

  device.py  ``gpu``   tensors on the compute device
  host.py    ``host``  buffers of the pinned host pool, in the drive's record format
  drive.py   ``nvme``  checksummed records in per-kind swap files, through the I/O engine,
                       in one directory or striped over several (drive_dir.py: one)
  gds.py     ``nvme``  the drive, with CUDA tensors' records through GPUDirect Storage

The store (store.py) keeps the keys, the order of their operations and the placement
(which tier, spills, moves up and down) and calls only these interfaces; the tiers move
the bytes, through the copy strategy they are handed (copies.py), and count them.
``open_drive`` picks the drive tier: over one directory, or striped over several (one per
drive: drive.py), with GPUDirect Storage or without."""

import os

from megatron_snake.storage.directory import RankDir, named_twice
from megatron_snake.storage.engine import make_engine
from megatron_snake.storage.errors import OffloadDirError
from megatron_snake.storage.tiers.base import Tier
from megatron_snake.storage.tiers.device import DeviceTier
from megatron_snake.storage.tiers.drive import DriveTier
from megatron_snake.storage.tiers.drive_dir import DriveDir
from megatron_snake.storage.tiers.host import HostTier, host_buffers_for


def open_drive(offload_dirs, rank, run_id, copies, counters, engine="auto", queue_depth=32,
               io_threads=4, chunk_bytes=1 << 20, **dir_kwargs) -> DriveTier:
    """The drive tier of rank ``rank`` under ``offload_dirs`` (a directory, or a list of
    them: the tier is striped over them): every rank directory opened and locked first
    (their errors come before any other), then an I/O engine for each (``engine``:
    make_engine's kinds, or "gds": GPUDirect Storage for CUDA tensors when kvikio can use
    it, else the native engine through the pinned host pool). What was opened is closed
    again when a later one fails."""
    paths = [os.fspath(p) for p in (
        [offload_dirs] if isinstance(offload_dirs, (str, os.PathLike)) else offload_dirs)]
    twice = named_twice(paths)
    if twice:
        raise OffloadDirError(f"--snake-offload-dir names one directory more than once "
                              f"({', '.join(twice)}: named twice, by another path, a link "
                              "or a bind mount); give each once (one per drive)")
    dirs, drives, backend = [], [], None
    try:
        for path in paths:
            dirs.append(RankDir(path, rank, run_id, **dir_kwargs))
        if engine == "gds":
            from megatron_snake.storage.gds import GdsBackend
            backend = GdsBackend.create()   # None (and a log line) when GDS is unavailable
            engine = "auto"
        for directory in dirs:
            drives.append(DriveDir(directory, make_engine(engine, queue_depth, io_threads,
                                                          chunk_bytes), run_id))
    except BaseException:
        if backend is not None:
            backend.close()
        for d in drives:
            d.engine.close()
        for directory in dirs:
            directory.close()
        raise
    if backend is None:
        return DriveTier(drives, run_id, copies, counters)
    from megatron_snake.storage.tiers.gds import GdsDriveTier
    return GdsDriveTier(drives, backend, run_id, copies, counters)


__all__ = ["Tier", "DeviceTier", "HostTier", "DriveTier", "open_drive", "host_buffers_for"]
