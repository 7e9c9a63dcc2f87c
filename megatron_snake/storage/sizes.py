"""Tier names and byte sizes: one definition for the store, the planner, the flags and
the log line."""

from __future__ import annotations

import re

TIERS = ("gpu", "host", "nvme")   # fastest first: the compute device, pinned host, the drive

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text) -> int:
    """'4GiB', '512MiB', '1.5GB', '1M' or a plain byte count. ValueError otherwise."""
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"{text!r} is not a size (e.g. 4GiB, 512MiB, 1000000)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def gib(nbytes: float, digits: int = 2) -> str:
    return f"{nbytes / 2**30:.{digits}f} GiB"


def size(nbytes: float) -> str:
    """GiB from 1 GiB up, MiB below."""
    return gib(nbytes) if nbytes >= 1 << 30 else mib(nbytes)


def gb(nbytes: float) -> str:
    """Decimal gigabytes: what drive bandwidths and capacities are quoted in."""
    return f"{nbytes / 1e9:.2f} GB"
