"""The interface every tier implements; the store (store.py) decides which tier a record
goes to and in what order its operations run, and calls only this (plus the few moves
between the host and the drive that share the host buffers' record format: host.py,
drive.py)."""


class Tier:
    """A place a record's bytes live.

    ``name``      the tier's name in ``sizes.TIERS``: what callers pass as ``tier=``, the key
                  of its counters, and the record's attribute that holds this tier's copy
                  (None where it has none; ``holds``)
    ``memory``    whether its copies are in memory: writes into it run on the store's memory
                  writers, never behind the drive's
    ``write(rec, src, from_device=False, room=None) -> bool``
                  a copy of ``rec`` from ``src`` (contiguous, the record's dtype and shape);
                  False when it was not written because ``room`` (the host's: buffers to
                  leave free) was not there
    ``write_empty(rec, src)``  a put of an empty value: held with nothing to copy
    ``read_into(rec, dst, to_device=False, free=None)``
                  fill the contiguous ``dst`` from this tier's copy, once ``free`` (the
                  caller's event on ``dst``, or None) allows
    ``drop(rec)``  free this tier's copy (nothing when it has none)
    ``capacity()`` the bytes it can hold; None where it does not bound them
    ``bytes_read``, ``bytes_written``  its counters: the store's ``Counters`` under ``name``,
                  which its methods add to

    ``from_device`` / ``to_device``: the other end of the copy is the compute device's
    memory. Bytes cross between host memory and the device only through the copy strategy
    the tier is handed (``copies``: copies.py; the emulated device's is
    ``emulated_device.EmulatedCopies``).
    """

    name: str = ""
    memory: bool = True

    def __init__(self, copies, counters):
        self.copies, self.counters = copies, counters

    def holds(self, rec) -> bool:
        return getattr(rec, self.name) is not None

    def write(self, rec, src, from_device=False, room=None) -> bool:
        raise NotImplementedError

    def write_empty(self, rec, src) -> None:
        setattr(rec, self.name, [])

    def read_into(self, rec, dst, to_device=False, free=None) -> None:
        raise NotImplementedError

    def drop(self, rec) -> None:
        raise NotImplementedError

    def capacity(self) -> int | None:
        return None

    @property
    def bytes_read(self) -> int:
        return self.counters.read[self.name]

    @property
    def bytes_written(self) -> int:
        return self.counters.written[self.name]
