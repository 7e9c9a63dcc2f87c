"""On-disk format: one preallocated swap file per kind of state, records aligned to the
drive's block size, each record checksummed.

File  (`<kind>.swap`):  [file header, 4096 bytes][record][record]...
  file header: magic b"SNAKESWP", format version, block size, checksum name, run id,
               pid, creation time, kind (see FILE_HEADER).
Record (one segment of a tensor, at most one host buffer long):
  [record header, 64 bytes][payload][padding to the block size]
  record header: magic b"SNKREC01", run id, key hash, sequence number, segment number,
                 payload bytes, payload checksum (see REC_HEADER).
A read verifies every header field against the in-memory index and the payload checksum;
any mismatch or a short read (truncated file) is an IntegrityError naming key and file.
"""

import ctypes
import errno
import hashlib
import logging
import mmap
import os
import struct
import threading
import time
import zlib

from megatron_snake.storage.engine import crc32c_native
from megatron_snake.storage.errors import (NO_SPACE, CapacityError, IntegrityError,
                                            OffloadIOError, drive_full)
from megatron_snake.storage.safe_files import open_owned_file

log = logging.getLogger("megatron_snake.storage")

FORMAT_VERSION = 1
FILE_MAGIC = b"SNAKESWP"
REC_MAGIC = b"SNKREC01"
FILE_HEADER_BYTES = 4096
# magic, version, block size, checksum name, run id, pid, created (unix s), kind
FILE_HEADER = struct.Struct("<8sII16s16sQd32s")
# magic, run id, key hash, seq, segment, reserved, payload bytes, checksum
REC_HEADER = struct.Struct("<8s16sQQIIQQ")
REC_HEADER_BYTES = 64
assert REC_HEADER.size == REC_HEADER_BYTES


# ---------------------------------------------------------------- checksums

class Checksum:
    """A checksum over raw memory: fn(addr, nbytes) -> int. Chosen by measurement
    (docs/benchmarks.md, Storage): crc32c in the native engine (SSE4.2, GIL released, ~12 GB/s
    on one core here) when built; zlib.crc32 (GIL released, ~3 GB/s) otherwise."""

    def __init__(self, name=None):
        native = crc32c_native()
        if name is None:
            name = "crc32c" if native is not None else "crc32"
        self.name = name
        if name == "crc32c":
            if native is None:
                raise RuntimeError("crc32c needs the native engine (megatron_snake._snake_aio)")
            self._fn = native
        elif name == "crc32":
            self._fn = _zlib_crc32
        else:
            raise ValueError(f"unknown checksum {name!r} (crc32c|crc32)")

    def __call__(self, addr, nbytes):
        return self._fn(addr, nbytes) if nbytes else 0


def _zlib_crc32(addr, nbytes):
    return zlib.crc32((ctypes.c_ubyte * nbytes).from_address(addr))


def key_hash(key):
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little")


def write_record_header(addr, run_id, khash, seq, segment, nbytes, checksum):
    ctypes.memmove(addr, REC_HEADER.pack(REC_MAGIC, run_id, khash, seq, segment, 0, nbytes, checksum),
                   REC_HEADER_BYTES)


def check_record_header(addr, run_id, khash, seq, segment, nbytes, key, where):
    """Check the record header at addr; return the stored payload checksum."""
    magic, rid, kh, sq, seg, _, n, crc = REC_HEADER.unpack(ctypes.string_at(addr, REC_HEADER_BYTES))
    problems = []
    if magic != REC_MAGIC:
        problems.append(f"bad record magic {magic!r}")
    elif rid != run_id:
        problems.append("record from another run")
    if (kh, sq, seg) != (khash, seq, segment):
        problems.append(f"record belongs to another key/version (hash {kh:x} seq {sq} seg {seg})")
    if n != nbytes:
        problems.append(f"payload length {n} != {nbytes}")
    if problems:
        raise IntegrityError(f"key {key!r}: record {segment} in {where} is corrupt: "
                             + "; ".join(problems) + ". The data was NOT returned.")
    return crc


def verify_record(addr, run_id, khash, seq, segment, nbytes, checksum_fn, key, where):
    """Check the header at addr and the payload after it; raise IntegrityError on mismatch."""
    crc = check_record_header(addr, run_id, khash, seq, segment, nbytes, key, where)
    got = checksum_fn(addr + REC_HEADER_BYTES, nbytes)
    if got != crc:
        raise IntegrityError(f"key {key!r}: record {segment} in {where} is corrupt: "
                             f"{checksum_fn.name} mismatch (stored {crc:08x}, computed {got:08x}). "
                             "The data was NOT returned.")


# ---------------------------------------------------------------- files

def open_direct(path, create=True, dir_fd=None):
    """Open with O_DIRECT when the file system supports it; returns (fd, direct). Never
    through a symbolic link: a new file (O_EXCL), or an existing one without following.
    ``dir_fd``: ``path``'s directory, opened (its last component is opened there)."""
    flags = (os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0) | os.O_NOFOLLOW
             | getattr(os, "O_CLOEXEC", 0))
    name = path if dir_fd is None else os.path.basename(path)
    odirect = getattr(os, "O_DIRECT", 0)
    if odirect:
        try:
            return os.open(name, flags | odirect, 0o600, dir_fd=dir_fd), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return os.open(name, flags, 0o600, dir_fd=dir_fd), False


def read_file_header(path, dir_fd=None):
    """The parsed header of a swap file (dict) or None when it is not one of ours (nor a
    regular file of this user's: a link is not followed). ``dir_fd``: ``path``'s
    directory, opened."""
    try:
        fd = open_owned_file(path, what="swap file", flags=os.O_RDONLY | os.O_NONBLOCK,
                             dir_fd=dir_fd)
        with os.fdopen(fd, "rb") as f:
            raw = f.read(FILE_HEADER.size)
        magic, ver, bs, ck, rid, pid, created, kind = FILE_HEADER.unpack(raw)
    except (OSError, struct.error):
        return None
    if magic != FILE_MAGIC:
        return None
    return dict(version=ver, block_size=bs, checksum=ck.rstrip(b"\0").decode(), run_id=rid.hex(),
                pid=pid, created=created, kind=kind.rstrip(b"\0").decode())


class SwapFile:
    """One preallocated file for one kind of state, with an extent allocator. ``directory``:
    the RankDir it is made in (made and removed through its open directory, and a full
    drive named by it), or None (by path)."""

    def __init__(self, path, kind, run_id, engine, checksum, block_size=4096,
                 growth_bytes=64 << 20, directory=None):
        self.path, self.kind, self.run_id, self.engine = path, kind, run_id, engine
        self.block_size, self.growth_bytes = block_size, growth_bytes
        self.directory = directory
        try:
            self.fd, self.direct = open_direct(path, dir_fd=directory.fd if directory else None)
        except OSError as exc:
            if exc.errno in NO_SPACE:
                raise self._full("creating") from None
            raise
        self._lock = threading.Lock()
        self._free = []            # sorted [(offset, length)]
        self._end = FILE_HEADER_BYTES  # first byte after the last extent handed out
        self._size = 0             # bytes allocated on disk (fallocate)
        self.used = 0
        try:
            self._ensure_size(FILE_HEADER_BYTES)
            try:
                self._write_header(checksum)
            except OSError as exc:
                if exc.errno in NO_SPACE:
                    raise self._full("writing the header of") from None
                raise
        except BaseException:
            self.close(remove=True)
            raise

    def _full(self, doing) -> CapacityError:
        where = (f"--snake-offload-dir {self.directory.root} (rank {self.directory.rank})"
                 if self.directory else os.path.dirname(self.path))
        return drive_full(where, f"{doing} {self.path}", os.path.dirname(self.path))

    def _write_header(self, checksum):
        hdr = mmap.mmap(-1, FILE_HEADER_BYTES)  # page aligned, as O_DIRECT wants
        hdr.write(FILE_HEADER.pack(FILE_MAGIC, FORMAT_VERSION, self.block_size,
                                   checksum.name.encode(), self.run_id, os.getpid(), time.time(),
                                   self.kind.encode()[:32]))
        addr = ctypes.addressof(ctypes.c_char.from_buffer(hdr))
        try:
            self.engine.write(self.fd, self.path, addr, FILE_HEADER_BYTES, 0).wait()
        finally:
            del addr
            hdr.close()

    @property
    def size(self):
        return self._size

    def _ensure_size(self, nbytes):
        if nbytes <= self._size:
            return
        need = -(-nbytes // self.block_size) * self.block_size
        new = max(need, self._size + self.growth_bytes)
        try:
            try:
                os.posix_fallocate(self.fd, self._size, new - self._size)
            except OSError as exc:
                if exc.errno != errno.ENOSPC or new == need:
                    raise
                new = need                     # the growth step does not fit: take what is needed
                os.posix_fallocate(self.fd, self._size, new - self._size)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise CapacityError(
                    f"{self.path}: no space left growing the {self.kind} swap file to "
                    f"{new / 2**30:.2f} GiB; free space on that drive or point "
                    "--snake-offload-dir at a larger one") from exc
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise OffloadIOError("fallocate", self.path, self._size, new - self._size, exc.errno)
            os.ftruncate(self.fd, new)
        self._size = new

    def preallocate(self, nbytes):
        with self._lock:
            self._ensure_size(FILE_HEADER_BYTES + nbytes)

    def allocate(self, nbytes):
        """An extent of at least nbytes (rounded to the block size): (offset, length)."""
        length = -(-nbytes // self.block_size) * self.block_size
        with self._lock:
            for i, (off, ln) in enumerate(self._free):
                if ln >= length:
                    if ln == length:
                        self._free.pop(i)
                    else:
                        self._free[i] = (off + length, ln - length)
                    self.used += length
                    return off, length
            off = self._end
            self._ensure_size(off + length)
            self._end = off + length
            self.used += length
            return off, length

    def free(self, off, length):
        with self._lock:
            self.used -= length
            fr = self._free
            lo, hi = 0, len(fr)
            while lo < hi:
                mid = (lo + hi) // 2
                if fr[mid][0] < off:
                    lo = mid + 1
                else:
                    hi = mid
            fr.insert(lo, (off, length))
            # coalesce with neighbours
            if lo + 1 < len(fr) and fr[lo][0] + fr[lo][1] == fr[lo + 1][0]:
                fr[lo] = (fr[lo][0], fr[lo][1] + fr[lo + 1][1])
                fr.pop(lo + 1)
            if lo > 0 and fr[lo - 1][0] + fr[lo - 1][1] == fr[lo][0]:
                fr[lo - 1] = (fr[lo - 1][0], fr[lo - 1][1] + fr[lo][1])
                fr.pop(lo)
            if fr and fr[-1][0] + fr[-1][1] == self._end:
                self._end = fr[-1][0]
                fr.pop()

    def close(self, remove=True):
        """Close the file and remove it (``remove``); OSError when it cannot be removed
        (closed anyway)."""
        try:
            if remove and self.directory is not None:
                self.directory.unlink(self.path, self.fd)   # a moved file is named
            elif remove:
                try:
                    os.unlink(self.path)
                except FileNotFoundError:
                    pass
        finally:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1
