"""The GDS drive tier, ``nvme`` with ``--snake-io-engine gds``: the drive tier (drive.py),
whose records of CUDA tensors go between GPU memory and the swap file through GPUDirect
Storage (storage/gds.py: kvikio), never through host memory; everything else keeps the
drive tier's host-buffer records and engine.

A GDS record is one extent ``[record header block, 4096 bytes][payload]`` (``rec.gds``):
the header is written and read through the host engine from a pool buffer, the payload by
kvikio; its checksum is computed on the GPU on the copy streams (``gpu_checksum``), never
on the compute stream, and verified on every read. kvikio reads into GPU memory outside any
stream's order, so a read into a buffer the caller may still use waits on the host first.
A GDS record cannot be read into host buffers directly (``fills_host``): a prefetch to the
host tier reads it into device memory first.

Over several directories a GDS record goes whole to the one whose files hold the fewest
bytes (kvikio reads and writes any of their files): GDS records are spread over the
drives, but one record is on one drive, since its payload is one extent after one header
block, so the drives stay within one such record of each other."""

import torch

from megatron_snake.storage.copies import as_bytes
from megatron_snake.storage.errors import IntegrityError, OffloadIOError
from megatron_snake.storage.gds import HEADER_BLOCK, gpu_checksum
from megatron_snake.storage.swap_file import check_record_header, write_record_header
from megatron_snake.storage.tiers.drive import DriveTier


class GdsDriveTier(DriveTier):
    def __init__(self, drives, backend, run_id, copies, counters):
        super().__init__(drives, run_id, copies, counters)
        self.gds = backend

    def write(self, rec, src, from_device=False, room=None) -> bool:
        if src.is_cuda:
            self._write_gds(rec, as_bytes(src))
            return True
        return super().write(rec, src, from_device, room)

    def read_into(self, rec, dst, to_device=False, free=None) -> None:
        if not rec.gds:
            return super().read_into(rec, dst, to_device, free)
        dst_bytes = as_bytes(dst)
        if dst.is_cuda:
            # kvikio writes into dst outside any stream's order: wait here, on the host,
            # until the caller's stream is done with dst
            if free is not None:
                self.copies.wait(free, None)
            self._read_gds(rec, dst_bytes)
            return
        if free is not None:
            self.copies.wait(free, "h2d")
        tmp = self.copies.empty(rec.nbytes, torch.uint8)
        self._read_gds(rec, tmp)
        self.copies.copy([(dst_bytes, tmp)], "h2d")

    def fills_host(self, rec) -> bool:
        return not rec.gds

    def drop(self, rec) -> None:
        super().drop(rec)
        rec.gds = False

    def _write_gds(self, rec, src_bytes):
        """One GPUDirect record: header block through the host engine, payload by kvikio."""
        d, f, off, length = self._place(rec.kind, HEADER_BLOCK + rec.nbytes)
        buf, = self.pool.acquire(1)
        try:
            with self.copies.on("d2h"):       # off the compute stream
                crc = gpu_checksum(src_bytes)
            write_record_header(buf.addr, self.run_id, rec.khash, rec.seq, 0, rec.nbytes, crc)
            req = d.engine.write(f.fd, f.path, buf.addr, HEADER_BLOCK, off)
            try:
                self.gds.write(f.path, src_bytes, off + HEADER_BLOCK)
            finally:
                req.wait()
        except BaseException:
            f.free(off, length)
            raise
        finally:
            self.pool.release([buf])
        rec.nvme, rec.gds = [(d, off, length)], True
        self.counters.add("nvme", nwritten=rec.nbytes, requests=2, kind=rec.kind)

    def _read_gds(self, rec, dst_bytes):
        (d, off, _), = rec.nvme
        f = d.files[rec.kind]
        buf, = self.pool.acquire(1)
        try:
            try:
                d.engine.read(f.fd, f.path, buf.addr, HEADER_BLOCK, off).wait()
            except OffloadIOError as exc:
                if exc.short:
                    raise IntegrityError(f"key {rec.key!r}: record in {f.path} is truncated: "
                                         f"{exc}") from exc
                raise
            crc = check_record_header(buf.addr, self.run_id, rec.khash, rec.seq, 0,
                                      rec.nbytes, rec.key, f.path)
        finally:
            self.pool.release([buf])
        n = self.gds.read(f.path, dst_bytes, off + HEADER_BLOCK)
        if n != rec.nbytes:
            raise IntegrityError(f"key {rec.key!r}: record in {f.path} is truncated "
                                 f"(GDS read {n} of {rec.nbytes} bytes)")
        with self.copies.on("h2d"):           # off the compute stream
            got = gpu_checksum(dst_bytes)
        if got != crc:
            raise IntegrityError(f"key {rec.key!r}: record in {f.path} is corrupt: GPU "
                                 f"checksum mismatch (stored {crc:x}, computed {got:x})")
        self.counters.add("nvme", nread=rec.nbytes, requests=2, kind=rec.kind)
