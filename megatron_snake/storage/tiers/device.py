"""The device tier, ``gpu``: records kept on the compute device (a GPU; the CPU on a
machine without one), each a tensor of its own dtype and shape (``rec.gpu``).

Bytes move by the copy strategy: a write copies the put's source into a new device tensor
on the "h2d" copy stream (a plain copy on a CPU), a read copies it into the caller's
buffer on that stream, a prefetch reads the record from a slower tier into a tensor made
for that stream (``keep``). Nothing is checksummed. Its memory is the caller's budget (the
placement's --snake-gpu-memory-limit), not bounded here."""

import torch

from megatron_snake.storage.copies import bitcopy
from megatron_snake.storage.tiers.base import Tier


class DeviceTier(Tier):
    name = "gpu"

    def __init__(self, device: torch.device, copies, counters):
        super().__init__(copies, counters)
        self.device = device

    def write(self, rec, src, from_device=False, room=None) -> bool:
        if src.is_cuda or self.device.type == "cuda":
            if not src.is_cuda:
                self.copies.traffic.add("crossing", src.numel() * src.element_size())

            def copy():
                out = torch.empty(rec.shape, dtype=rec.dtype, device=self.device)
                bitcopy(out, src, non_blocking=True)
                return out
            copy = self.copies.run(copy, "h2d")
        else:
            # from host memory a crossing onto the device (an emulated device's host link
            # when it has one); from the device's own memory a copy on it
            copy = torch.empty(rec.shape, dtype=rec.dtype, device=self.device)
            if from_device:
                self.copies.within_device([(copy, src)], "h2d")
            else:
                self.copies.across([(copy, src)], "h2d", device_side=True)
        rec.gpu = copy
        self.counters.add("gpu", nwritten=rec.nbytes, kind=rec.kind)
        return True

    def write_pieces(self, rec, pieces) -> None:
        """Write the record from the 1-D host tensors ``pieces`` (its host buffers'
        payloads), each into its place on the device."""
        out = self.copies.empty(rec.shape, rec.dtype)   # made on the copy stream it is for
        flat, pairs, at = out.view(-1), [], 0
        for piece in pieces:
            pairs.append((flat[at:at + piece.numel()], piece))
            at += piece.numel()
        self.copies.across(pairs, "h2d", device_side=True)
        rec.gpu = out
        self.counters.add("gpu", nwritten=rec.nbytes, kind=rec.kind)

    def write_empty(self, rec, src) -> None:
        self.write(rec, src)           # an empty tensor of the record's shape

    def keep(self, rec, tensor) -> None:
        """``tensor`` (made by ``copies.empty`` and filled) is the record's copy here."""
        rec.gpu = tensor
        self.counters.add("gpu", nwritten=rec.nbytes, kind=rec.kind)

    def read_into(self, rec, dst, to_device=False, free=None) -> None:
        if free is not None:
            self.copies.wait(free, "h2d")
        if to_device:
            self.copies.within_device([(dst, rec.gpu)], "h2d")
        else:
            self.copies.copy([(dst, rec.gpu)], "h2d")
        self.counters.add("gpu", nread=rec.nbytes, kind=rec.kind)

    def drop(self, rec) -> None:
        rec.gpu = None
