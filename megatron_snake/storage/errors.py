"""Exceptions of the storage layer. Every message names the path and what to do."""

import errno
import os

from megatron_snake.errors import UserError

# what a full drive answers a write or a new file with: no blocks, no inodes, or the quota
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class OffloadError(RuntimeError):
    """Base class of every storage-layer error."""


class OffloadDirError(OffloadError, UserError):
    """The offload directory is missing, not a directory, read-only, or locked by another job;
    or its files could not be removed at the end (its permissions changed during the run)."""


class CapacityError(OffloadError, UserError):
    """The file system under --snake-offload-dir cannot hold what the run plans to put there."""


def drive_full(where: str, doing: str, directory: str) -> CapacityError:
    """The error for a write or a new file refused for want of space (``NO_SPACE``):
    ``where`` names the offload directory, ``doing`` what was being written, and
    ``directory``'s file system says whether its inodes or its blocks ran out."""
    try:
        st = os.statvfs(directory)
        why = "out of inodes" if st.f_favail == 0 and st.f_files else "no space left"
    except OSError:
        why = "no space left"
    return CapacityError(f"{where}: the drive is full ({why}) {doing}; free space on it, or "
                         "point --snake-offload-dir at another drive")


class HostMemoryError(OffloadError, UserError):
    """A request can never fit under --snake-host-memory-limit (waiting would not help)."""


class IntegrityError(OffloadError):
    """A record read back from a swap file is not the one that was written (checksum,
    header or length mismatch, truncated file). Names the key and the file."""


class OffloadIOError(OffloadError, OSError):
    """A read or write failed in the kernel: carries path, offset, length and errno."""

    def __init__(self, op, path, offset, length, errno_, detail=""):
        import os

        self.op, self.path, self.offset, self.length = op, path, offset, length
        reason = os.strerror(errno_) if errno_ and errno_ > 0 else (detail or "short transfer")
        msg = f"{op} of {length} bytes at offset {offset} of {path} failed: {reason}"
        if errno_ and errno_ > 0:
            msg += f" (errno {errno_})"
        if detail and errno_ and errno_ > 0:
            msg += f"; {detail}"
        OSError.__init__(self, errno_ if errno_ and errno_ > 0 else None, msg)
        self.errno = errno_ if errno_ and errno_ > 0 else None
        self.short = not (errno_ and errno_ > 0)

    def __str__(self):
        return self.args[1] if len(self.args) > 1 else self.args[0]


class UnsafePathError(OffloadError, PermissionError, UserError):
    """A path the run would create or reuse is a symbolic link, not the kind of entry
    expected, or owned by another user: the run refuses it rather than follow it."""
