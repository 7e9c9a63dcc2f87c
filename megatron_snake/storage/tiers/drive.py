"""The drive tier, ``nvme``: records kept in swap files on the offload drive, one file per
kind of state, ``<offload-dir>/rank<N>/<kind>.swap`` (swap_file.py: the format, the
extent allocator), in the rank's own locked directory (directory.py) (``rec.nvme``: the
record's extents in its kind's file).

A record is cut into the host buffers' segments (host.py), each written as one
checksummed record ``[header][payload]`` aligned to the drive's block size. Bytes move
between the drive and host buffers only, by the I/O engine (engine.py: the native
io_uring ring, or threads): a write from a tensor goes through staging buffers of the host
pool (the copy into them by the copy strategy), one from the host tier's own buffers seals
their headers in place and writes them; a read verifies each record (header and checksum,
IntegrityError naming the key and the file) in a staging buffer and copies the payload out,
or lands in the host tier's buffers directly (a prefetch into host memory).

The store calls only the ``DriveTier`` interface (``tiers.open_drive`` makes one), so
another drive tier over several directories, each with its own files, engine and queue,
replaces it without touching the store: ``DriveTier``'s docstring says what it provides."""

import logging
import os
import threading

import megatron_snake.timeline as timeline
from megatron_snake.storage.copies import as_bytes
from megatron_snake.storage.errors import IntegrityError, OffloadIOError
from megatron_snake.storage.swap_file import (REC_HEADER_BYTES, Checksum, SwapFile,
                                              verify_record, write_record_header)
from megatron_snake.storage.tiers.base import Tier
from megatron_snake.storage.tiers.host import payload

log = logging.getLogger("megatron_snake.storage")


class DriveTier(Tier):
    """Besides the tier interface (``write``, ``read_into``, ``drop``, ``capacity``), what
    the store asks of a drive tier, and a striped one would provide the same way:

    ``stage_through(host)``  the host tier whose buffers its bytes move through
    ``write_from_host(rec)`` / ``read_into_host(rec, bufs)`` / ``fills_host(rec)``
                  a record straight from / into host buffers (``rec.host``, ``bufs``),
                  sealing or verifying their headers in place, no staging copy
    ``location(rec)``  [(path, offset, length)] of the record's extents
    ``preallocate(kind, nbytes)``, ``check_capacity(nbytes)``  the drive's space
    ``dir``, ``engine``, ``gds``  the (first) rank directory, its engine, the GDS backend
    ``describe()``  the engine, for the store's summary
    ``close(remove_files) -> [(path, bytes, OSError)]``, ``left_behind(left)``

    ``rec.nvme`` is this tier's own (the store only asks whether it is None), and so are
    its files, engines and their queues: each record's segments could go to N directories
    with a ring each. ``write_bytes`` and ``read_bytes`` are where every drive write and
    read of a host-format record passes (tests hold them there)."""

    name = "nvme"
    memory = False

    def __init__(self, directory, engine, run_id, copies, counters):
        super().__init__(copies, counters)
        self.dir, self.engine, self.run_id = directory, engine, run_id
        self.gds = None
        self.checksum = Checksum()
        self.files = {}                # kind -> SwapFile
        self._files_lock = threading.Lock()
        self._direct_logged = False
        self.host = self.pool = None   # stage_through

    def stage_through(self, host) -> None:
        """Move bytes through ``host``'s buffers: its pool's for staging, its records'."""
        self.host, self.pool = host, host.pool

    # ---------------------------------------------------------------- files and space

    def _file(self, kind):
        f = self.files.get(kind)
        if f is None:
            with self._files_lock:
                f = self.files.get(kind)
                if f is None:
                    path = os.path.join(self.dir.path, f"{kind}.swap")
                    f = SwapFile(path, kind, self.run_id, self.engine, self.checksum,
                                 block_size=max(4096, os.statvfs(self.dir.path).f_bsize))
                    if not f.direct and not self._direct_logged:
                        self._direct_logged = True
                        log.warning("offload dir %s: the file system does not support O_DIRECT "
                                    "(tmpfs?); using buffered I/O (page cache)", self.dir.path)
                    self.files[kind] = f
        return f

    def location(self, rec):
        f = self.files.get(rec.kind)
        return [(f.path, off, ln) for off, ln in (rec.nvme or [])]

    def preallocate(self, kind, nbytes) -> None:
        self._file(kind).preallocate(nbytes)

    def held(self) -> int:
        """Bytes its files hold on the drive."""
        return sum(f.size for f in self.files.values())

    def check_capacity(self, nbytes_planned):
        """Raise CapacityError unless nbytes_planned fit on the drive (with margin)."""
        return self.dir.check_capacity(nbytes_planned, self.held())

    def capacity(self) -> int:
        return self.held() + self.dir.free_space_probe(self.dir.path)

    def all_direct(self) -> bool:
        return all(f.direct for f in self.files.values())

    def describe(self) -> str:
        return f"{self.engine.name}{'' if self.all_direct() else ' buffered'}"

    def close(self, remove_files=True):
        """Close the engine and the files (removed unless ``remove_files``) and release the
        directory; returns [(path, bytes, OSError)] of what could not be removed."""
        self.engine.close()
        if self.gds is not None:
            self.gds.close()
        left = []
        for f in self.files.values():
            nbytes = f.size
            try:
                f.close(remove=remove_files)
            except OSError as exc:
                left.append((f.path, nbytes, exc))
        return left + self.dir.close()

    def left_behind(self, left):
        return self.dir.left_behind(left)

    # ---------------------------------------------------------------- writes

    def write(self, rec, src, from_device=False, room=None) -> bool:
        self.write_bytes(rec, as_bytes(src), from_device)
        return True

    def write_from_host(self, rec) -> None:
        """Write the record from its host buffers (``rec.host``), sealed in place."""
        self.write_bytes(rec)

    def write_bytes(self, rec, src_bytes=None, from_device=False) -> None:
        """Write rec to its swap file, from src_bytes (through staging buffers) or, when
        None, from rec.host."""
        with timeline.span(f"drive write {rec.kind}", "drive", bytes=rec.nbytes):
            f = self._file(rec.kind)
            segs = self.host.segments(rec.nbytes)
            extents, pending = [], []      # pending: (request, buffer or None)
            loose = None                   # a staging buffer not yet in pending
            try:
                for seg, a, b in segs:
                    n = b - a
                    if src_bytes is None:
                        buf = rec.host[seg]
                        if not rec.sealed:
                            self._seal(rec, buf, seg, n)
                    else:
                        buf = loose = self._staging(pending)
                        self.copies.across([(payload(buf, n), src_bytes[a:b])], "d2h",
                                           from_device)
                        self._seal(rec, buf, seg, n)
                    off, length = f.allocate(REC_HEADER_BYTES + n)
                    extents.append((off, length))
                    req = self.engine.write(f.fd, f.path, buf.addr, length, off)
                    self.counters.inflight(+1)
                    pending.append((req, loose))
                    loose = None
                if src_bytes is None:
                    rec.sealed = True
                while pending:
                    self._reap(pending)
            except BaseException:
                if loose is not None:
                    self.pool.release([loose])
                self._drain(pending)
                for off, length in extents:
                    f.free(off, length)
                raise
            rec.nvme = extents
            self.counters.add("nvme", nwritten=rec.nbytes, requests=len(segs), kind=rec.kind)

    def _seal(self, rec, buf, seg, n):
        crc = self.checksum(buf.addr + REC_HEADER_BYTES, n)
        write_record_header(buf.addr, self.run_id, rec.khash, rec.seq, seg, n, crc)

    def _staging(self, pending):
        """A staging buffer; while none is free, finish this operation's oldest request
        first (so two operations can never hold each other's buffers)."""
        while True:
            buf = self.pool.try_acquire()
            if buf is not None:
                return buf
            if pending:
                self._reap(pending)
            else:
                return self.pool.acquire(1)[0]

    def _reap(self, pending):
        req, buf = pending.pop(0)
        try:
            req.wait()
        finally:
            self.counters.inflight(-1)
            if buf is not None:
                self.pool.release([buf])

    def _drain(self, pending):
        for req, buf in pending:
            try:
                req.wait()
            except OffloadIOError:
                pass
            finally:
                self.counters.inflight(-1)
                if buf is not None:
                    self.pool.release([buf])
        pending.clear()

    # ---------------------------------------------------------------- reads

    def read_into(self, rec, dst, to_device=False, free=None) -> None:
        if free is not None:
            self.copies.wait(free, "h2d")
        self.read_bytes(rec, dst_bytes=as_bytes(dst), to_device=to_device)

    def fills_host(self, rec) -> bool:
        """Whether ``read_into_host`` can read the record (its records are in the host
        buffers' format)."""
        return True

    def read_into_host(self, rec, bufs) -> None:
        """Read the record's records into the host buffers ``bufs`` (one per segment),
        verified there: they hold it sealed."""
        self.read_bytes(rec, into_host=bufs)

    def read_bytes(self, rec, dst_bytes=None, into_host=None, to_device=False) -> None:
        """Read rec's records; verify each; copy payloads to dst_bytes (``to_device``: the
        compute device's) or keep them in the given host buffers (into_host: list of
        buffers, one per segment)."""
        with timeline.span(f"drive read {rec.kind}", "drive", bytes=rec.nbytes):
            f = self.files[rec.kind]
            segs = self.host.segments(rec.nbytes)
            pending = []   # (request, staging buffer or None, seg, a, b, host buffer)

            def finish(item):
                req, buf, seg, a, b, hbuf = item
                try:
                    try:
                        req.wait()
                    except OffloadIOError as exc:
                        if exc.short:
                            raise IntegrityError(
                                f"key {rec.key!r}: record {seg} in {f.path} is truncated: "
                                f"{exc}. The data was NOT returned.") from exc
                        raise
                    target = hbuf if hbuf is not None else buf
                    verify_record(target.addr, self.run_id, rec.khash, rec.seq, seg, b - a,
                                  self.checksum, rec.key, f.path)
                    if hbuf is None:
                        self.copies.across([(dst_bytes[a:b], payload(buf, b - a))], "h2d",
                                           to_device)
                finally:
                    self.counters.inflight(-1)
                    if buf is not None:
                        self.pool.release([buf])

            try:
                for (seg, a, b), (off, length) in zip(segs, rec.nvme):
                    if into_host is not None:
                        hbuf, buf = into_host[seg], None
                    else:
                        hbuf = None
                        buf = self.pool.try_acquire()
                        while buf is None:
                            if pending:
                                finish(pending.pop(0))
                                buf = self.pool.try_acquire()
                            else:
                                buf = self.pool.acquire(1)[0]
                    try:
                        req = self.engine.read(f.fd, f.path, (hbuf or buf).addr, length, off)
                    except BaseException:
                        if buf is not None:
                            self.pool.release([buf])
                        raise
                    self.counters.inflight(+1)
                    pending.append((req, buf, seg, a, b, hbuf))
                while pending:
                    finish(pending.pop(0))
            except BaseException:
                self._drain([(req, buf) for req, buf, *_ in pending])
                raise
            self.counters.add("nvme", nread=rec.nbytes, requests=len(segs), kind=rec.kind)

    def drop(self, rec) -> None:
        if rec.nvme is not None:
            f = self.files[rec.kind]
            for off, length in rec.nvme:
                f.free(off, length)
            rec.nvme = None
