"""The drive tier, ``nvme``: records kept in swap files on the offload drives, one file per
kind of state in each of the rank's directories, ``<offload-dir>/rank<N>/<kind>.swap``
(swap_file.py: the format, the extent allocator; drive_dir.py: a directory with its own
lock, engine and files) (``rec.nvme``: the record's extents, each in one directory's
file).

A record is cut into the host buffers' segments (host.py), each written as one
checksummed record ``[header][payload]`` aligned to the drive's block size. Bytes move
between the drive and host buffers only, by the I/O engines (engine.py: the native
io_uring ring, or threads): a write from a tensor goes through staging buffers of the host
pool (the copy into them by the copy strategy), one from the host tier's own buffers seals
their headers in place and writes them; a read verifies each record (header and checksum,
IntegrityError naming the key and the file) in a staging buffer and copies the payload out,
or lands in the host tier's buffers directly (a prefetch into host memory).

Several directories (``--snake-offload-dir a,b``: one per drive) are striped: each segment
goes to the directory whose files hold the fewest bytes then, and its request to that
directory's own engine. One rule serves both sizes of record: a large record's consecutive
segments land on different drives (each one placed makes its drive the fuller), so its
reads and writes keep every drive busy at once, and records of any mix of sizes leave the
drives within one segment of each other, which the space checks' equal shares rely on (a
fixed turn would not: records of as many segments as drives would all start on the first
and put their short last segments on the last). A record could instead go whole to one
drive and large ones be cut in N, but that needs a second placement and a size to switch
at, for no more drives busy: the segments (a host buffer each) are already the unit of a
request. The space checks give each directory its share, and the one that cannot hold it
is the one named.

The store calls only the ``DriveTier`` interface (``tiers.open_drive`` makes one):
``DriveTier``'s docstring says what it provides."""

import os
import threading

import megatron_snake.timeline as timeline
import megatron_snake.storage.directory as directory
from megatron_snake.storage.copies import as_bytes
from megatron_snake.storage.errors import IntegrityError, OffloadDirError, OffloadIOError
from megatron_snake.storage.swap_file import (REC_HEADER_BYTES, Checksum, verify_record,
                                              write_record_header)
from megatron_snake.storage.tiers.base import Tier
from megatron_snake.storage.tiers.host import payload


class DriveTier(Tier):
    """Besides the tier interface (``write``, ``read_into``, ``drop``, ``capacity``), what
    the store asks of a drive tier:

    ``stage_through(host)``  the host tier whose buffers its bytes move through
    ``write_from_host(rec)`` / ``read_into_host(rec, bufs)`` / ``fills_host(rec)``
                  a record straight from / into host buffers (``rec.host``, ``bufs``),
                  sealing or verifying their headers in place, no staging copy
    ``location(rec)``  [(path, offset, length)] of the record's extents
    ``preallocate(kind, nbytes)``, ``check_capacity(nbytes, also)``  the drives' space
    ``dir``, ``engine``, ``gds``  the first rank directory, its engine, the GDS backend
    ``drives``    its directories (drive_dir.py), in the order given
    ``describe()``  the engine and the drives, for the store's summary
    ``close(remove_files) -> [(path, bytes, OSError)]``, ``left_behind(left)``

    ``rec.nvme`` is this tier's own (the store only asks whether it is None):
    [(DriveDir, offset, length)], one extent per segment. ``write_bytes`` and
    ``read_bytes`` are where every drive write and read of a host-format record passes
    (tests hold them there)."""

    name = "nvme"
    memory = False

    def __init__(self, drives, run_id, copies, counters):
        super().__init__(copies, counters)
        self.drives = list(drives)
        self.dir, self.engine = self.drives[0].dir, self.drives[0].engine
        self.run_id = run_id
        self.gds = None
        self.checksum = Checksum()
        self._place_lock = threading.Lock()   # a drive is chosen and allocated at once
        self.host = self.pool = None   # stage_through

    def stage_through(self, host) -> None:
        """Move bytes through ``host``'s buffers: its pool's for staging, its records'."""
        self.host, self.pool = host, host.pool

    def _place(self, kind, nbytes):
        """Room for ``nbytes`` of ``kind`` on the drive whose files hold the fewest bytes
        (the first in order among equals): (drive, its swap file, offset, length)."""
        with self._place_lock:
            d = min(self.drives, key=lambda d: d.used())
            f = d.file(kind, self.checksum)
            off, length = f.allocate(nbytes)
        return d, f, off, length

    # ---------------------------------------------------------------- files and space

    def location(self, rec):
        return [(d.files[rec.kind].path, off, ln) for d, off, ln in (rec.nvme or [])]

    def _share(self, nbytes) -> int:
        """A drive's share of ``nbytes`` placed by ``_place``: the even share and one
        segment on top when they are striped (the drives stay within a segment)."""
        n = len(self.drives)
        return nbytes if n == 1 else -(-nbytes // n) + self.host.seg_payload

    def preallocate(self, kind, nbytes) -> None:
        share = self._share(nbytes)
        for d in self.drives:
            d.file(kind, self.checksum).preallocate(share)

    def held(self) -> int:
        """Bytes its files hold on the drives."""
        return sum(d.held() for d in self.drives)

    def _by_file_system(self) -> list[list]:
        """The directories grouped by the file system they are on: two on one drive share
        its free space, so they are checked together."""
        return [[self.drives[i] for i in group]
                for group in directory.file_system_groups([d.path for d in self.drives])]

    def check_capacity(self, nbytes_planned, also=None):
        """Raise CapacityError, naming a directory, unless each file system can take the
        shares of nbytes_planned of the directories on it (with margin) and the bytes
        ``also`` puts on them ({directory path: bytes}); returns (needed, free) summed over
        the file systems."""
        share, also = self._share(nbytes_planned), also or {}
        checked = [group[0].dir.check_capacity(
                       share * len(group) + sum(also.get(d.path, 0) for d in group),
                       sum(d.held() for d in group))
                   for group in self._by_file_system()]
        return tuple(map(sum, zip(*checked)))

    def capacity(self) -> int:
        # equal shares: the tier is full when its smallest share of free space is, and
        # directories on one file system split its free space
        return len(self.drives) * min(
            sum(d.held() for d in group) // len(group) +
            group[0].dir.free_space_probe(group[0].path) // len(group)
            for group in self._by_file_system())

    def all_direct(self) -> bool:
        return all(d.all_direct() for d in self.drives)

    def describe(self) -> str:
        over = f" over {len(self.drives)} drives" if len(self.drives) > 1 else ""
        return f"{self.engine.name}{over}{'' if self.all_direct() else ' buffered'}"

    def close(self, remove_files=True):
        """Close the engines and the files (removed unless ``remove_files``) and release the
        directories; returns [(path, bytes, OSError)] of what could not be removed."""
        if self.gds is not None:
            self.gds.close()
        left, failed = [], None
        for d in self.drives:        # every one closed, whichever fails
            try:
                left += d.close(remove_files)
            except Exception as exc:  # noqa: BLE001 - raised once the others are closed
                failed = failed or exc
        if failed is not None:
            raise failed
        return left

    def left_behind(self, left):
        """One error for what could not be removed, naming each directory's files."""
        errors = [d.dir.left_behind(mine) for d in self.drives
                  if (mine := [x for x in left if os.path.dirname(x[0]) == d.path])]
        return errors[0] if len(errors) == 1 else OffloadDirError("; ".join(map(str, errors)))

    # ---------------------------------------------------------------- writes

    def write(self, rec, src, from_device=False, room=None) -> bool:
        self.write_bytes(rec, as_bytes(src), from_device)
        return True

    def write_from_host(self, rec) -> None:
        """Write the record from its host buffers (``rec.host``), sealed in place."""
        self.write_bytes(rec)

    def write_bytes(self, rec, src_bytes=None, from_device=False) -> None:
        """Write rec to its kind's swap files, from src_bytes (through staging buffers) or,
        when None, from rec.host: each segment to its drive, all in flight at once."""
        with timeline.span(f"drive write {rec.kind}", "drive", bytes=rec.nbytes):
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
                    d, f, off, length = self._place(rec.kind, REC_HEADER_BYTES + n)
                    extents.append((d, off, length))
                    req = d.engine.write(f.fd, f.path, buf.addr, length, off)
                    self.copies.traffic.add("drive", length)
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
                self._free(rec.kind, extents)
                raise
            rec.nvme = extents
            self.counters.add("nvme", nwritten=rec.nbytes, requests=len(segs), kind=rec.kind)

    def _seal(self, rec, buf, seg, n):
        crc = self.checksum(buf.addr + REC_HEADER_BYTES, n)
        self.copies.traffic.add("checksum", n)
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
            segs = self.host.segments(rec.nbytes)
            pending = []   # (request, staging buffer or None, seg, a, b, host buffer, file)

            def finish(item):
                req, buf, seg, a, b, hbuf, f = item
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
                    self.copies.traffic.add("checksum", b - a)
                    if hbuf is None:
                        self.copies.across([(dst_bytes[a:b], payload(buf, b - a))], "h2d",
                                           to_device)
                finally:
                    self.counters.inflight(-1)
                    if buf is not None:
                        self.pool.release([buf])

            try:
                for (seg, a, b), (d, off, length) in zip(segs, rec.nvme):
                    f = d.files[rec.kind]
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
                        req = d.engine.read(f.fd, f.path, (hbuf or buf).addr, length, off)
                        self.copies.traffic.add("drive", length)
                    except BaseException:
                        if buf is not None:
                            self.pool.release([buf])
                        raise
                    self.counters.inflight(+1)
                    pending.append((req, buf, seg, a, b, hbuf, f))
                while pending:
                    finish(pending.pop(0))
            except BaseException:
                self._drain([(req, buf) for req, buf, *_ in pending])
                raise
            self.counters.add("nvme", nread=rec.nbytes, requests=len(segs), kind=rec.kind)

    def drop(self, rec) -> None:
        if rec.nvme is not None:
            self._free(rec.kind, rec.nvme)
            rec.nvme = None

    def _free(self, kind, extents):
        for d, off, length in extents:
            d.files[kind].free(off, length)
