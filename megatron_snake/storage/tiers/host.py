"""The host tier, ``host``: records kept in buffers of the host pool (host_pool.py, pinned
on a GPU machine, under --snake-host-memory-limit), resident until dropped (``rec.host``).

A record is cut into segments of one buffer's payload each (``segments``); a buffer holds
``[record header][payload]``, the swap file's record format (swap_file.py), so the drive
writes a host copy from these buffers and reads into them with no copy in between
(drive.py); ``rec.sealed`` says whether their headers carry the payload's checksum yet (the
drive seals them when it writes them). Bytes move by the copy strategy: a write copies the
source into the payloads, a read copies the payloads out (with ``from_device`` /
``to_device`` over the device's copy streams or host link). ``lend`` hands the payloads
themselves out to be changed in place (``TensorStore.borrow``)."""

import torch

import megatron_snake.timeline as timeline
from megatron_snake.storage.copies import as_bytes, copy_concatenation
from megatron_snake.storage.host_pool import DEFAULT_BUFFER_BYTES
from megatron_snake.storage.swap_file import REC_HEADER_BYTES
from megatron_snake.storage.tiers.base import Tier


def host_buffers_for(nbytes: int, buffer_bytes: int = DEFAULT_BUFFER_BYTES) -> int:
    """Host buffers a record of ``nbytes`` holds on the host tier: whole buffers, each
    carrying ``buffer_bytes - REC_HEADER_BYTES`` of it (what ``segments`` cuts)."""
    return -(-int(nbytes) // (buffer_bytes - REC_HEADER_BYTES))


def payload(buf, n):
    """The first n payload bytes of a host buffer (after its record header)."""
    return buf.tensor[REC_HEADER_BYTES:REC_HEADER_BYTES + n]


class HostTier(Tier):
    name = "host"

    def __init__(self, pool, copies, counters):
        super().__init__(copies, counters)
        self.pool = pool
        self.seg_payload = pool.buffer_bytes - REC_HEADER_BYTES

    def segments(self, nbytes):
        """[(segment, first byte, end byte)]: a record cut into buffers' payloads."""
        n = self.seg_payload
        return [(i, a, min(a + n, nbytes)) for i, a in enumerate(range(0, nbytes, n))]

    def buffers_for(self, nbytes: int) -> int:
        return host_buffers_for(nbytes, self.pool.buffer_bytes)

    def capacity(self) -> int:
        return self.pool.count * self.seg_payload

    # ---------------------------------------------------------------- buffers

    def buffers(self, rec, room, segs=None):
        """Resident buffers for rec's segments. ``room`` None: wait for them (raise
        HostMemoryError when they could never fit); else only if they fit now with
        ``room`` buffers left free, else None (counted as spilled)."""
        if segs is None:
            segs = self.segments(rec.nbytes)
        if room is None:
            return self.pool.acquire(len(segs), resident=True, what=f"key {rec.key!r}") \
                if segs else []
        bufs = self.pool.try_acquire_resident(len(segs), room)
        if bufs is None:
            self.counters.add_spilled()
        return bufs

    def release(self, bufs) -> None:
        """Give back resident buffers this tier took and did not keep."""
        self.pool.release(bufs, resident=True)

    def keep(self, rec, bufs, sealed=False) -> None:
        """``bufs`` (from ``buffers``, filled) hold the record's copy here."""
        rec.host, rec.sealed = bufs, sealed
        self.counters.add("host", nwritten=rec.nbytes, kind=rec.kind)

    # ---------------------------------------------------------------- the interface

    def write(self, rec, src, from_device=False, room=None) -> bool:
        segs = self.segments(rec.nbytes)
        bufs = self.buffers(rec, room, segs)
        if bufs is None:
            return False
        src_bytes = as_bytes(src)
        try:
            self.copies.across([(payload(buf, b - a), src_bytes[a:b])
                                for buf, (_, a, b) in zip(bufs, segs)], "d2h", from_device,
                               span=f"host write {rec.kind}")
        except BaseException:
            self.pool.release(bufs, resident=True)
            raise
        rec.host, rec.sealed = bufs, False
        self.counters.add("host", nwritten=rec.nbytes, kind=rec.kind)
        return True

    def read_into(self, rec, dst, to_device=False, free=None) -> None:
        if free is not None:
            self.copies.wait(free, "h2d")
        dst_bytes = as_bytes(dst)
        self.copies.across([(dst_bytes[a:b], payload(buf, b - a))
                            for buf, (_, a, b) in zip(rec.host, self.segments(rec.nbytes))],
                           "h2d", to_device, span=f"host read {rec.kind}")
        self.counters.add("host", nread=rec.nbytes, kind=rec.kind)

    def drop(self, rec) -> None:
        if rec.host is not None:
            self.pool.release(rec.host, resident=True)
            rec.host = None

    # ---------------------------------------------------------------- in place

    def take_for_converted(self, nbytes: int, keep_free: int):
        """Resident buffers for a record of ``nbytes`` if they fit now with ``keep_free``
        left free, else None (a put that may spill: ``TensorStore.put_converted``)."""
        segs = self.segments(nbytes)
        return self.pool.try_acquire_resident(len(segs), keep_free) if segs else None

    def convert_into(self, bufs, pieces, dtype, nbytes: int, kind: str) -> None:
        """Fill ``bufs`` with the concatenation of the 1-D CPU tensors ``pieces``, converted
        to ``dtype`` as it is copied (no converted copy first)."""
        self.copies.traffic.add("copy", nbytes + sum(p.numel() * p.element_size()
                                                     for p in pieces))
        with timeline.span(f"host write {kind}", "host copy", bytes=nbytes):
            copy_concatenation([payload(buf, b - a).view(dtype)
                                for buf, (_, a, b) in zip(bufs, self.segments(nbytes))],
                               pieces)

    def lend(self, rec):
        """The record's payloads themselves, to be changed in place (counted as read)."""
        self.counters.add("host", nread=rec.nbytes, kind=rec.kind)
        return self.payloads(rec)

    def payloads(self, rec):
        """The record's payloads as 1-D views of its dtype, one per buffer."""
        return [payload(buf, b - a).view(rec.dtype)
                for buf, (_, a, b) in zip(rec.host, self.segments(rec.nbytes))]

    def changed(self, rec, kept: bool) -> None:
        """The lent payloads hold a new value: their headers' checksums are stale (sealed
        again when the drive writes them); ``kept``: it stays here, counted as written."""
        rec.sealed = False
        if kept:
            self.counters.add("host", nwritten=rec.nbytes, kind=rec.kind)

    def copy_out(self, rec):
        """A new uint8 tensor with the record's bytes (a plain CPU copy)."""
        copy = torch.empty(rec.nbytes, dtype=torch.uint8)
        if rec.nbytes:
            self.copies.copy([(copy[a:b], payload(buf, b - a))
                              for buf, (_, a, b) in zip(rec.host, self.segments(rec.nbytes))],
                             None)
        return copy
