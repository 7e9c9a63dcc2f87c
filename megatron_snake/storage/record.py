"""A record: one value of a key in the store, and what each tier holds of it."""

from dataclasses import dataclass

import torch


@dataclass
class Record:
    """What the value is, its identity on the drive, the copies the tiers hold (each in the
    attribute named like the tier: None where it has none) and its operations' state."""

    key: object
    kind: str                    # the kind of state: its swap file, its counters
    dtype: torch.dtype
    shape: tuple
    nbytes: int
    device: torch.device         # where it was put from: a get's default
    khash: int                   # in every record header on the drive (swap_file.key_hash)
    seq: int                     # this value's number, in every record header on the drive
    gpu: object = None           # tiers/device.py: a tensor on the compute device
    host: list = None            # tiers/host.py: [HostBuffer] (record format: header + payload)
    sealed: bool = False         # tiers/host.py: the host buffers' headers carry checksums
    nvme: list = None            # tiers/drive.py: [(DriveDir, offset, length)] in the
                                 # kind's swap file of each segment's directory
    gds: bool = False            # tiers/gds.py: the drive's copy is one GPUDirect record
    source: object = None        # the put's source while the put is running (forwarding)
    ready: object = None         # the source's producer's event (the copy strategy's)
    last: object = None          # future of the last operation on this key
    lent: bool = False           # borrow()ed: the caller may be changing it
    lent_copy: object = None     # what was lent when it was not lent in place
    lent_gpu: bool = False       # lent in place on the device tier (its tensor itself)
