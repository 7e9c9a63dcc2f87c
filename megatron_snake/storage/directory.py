"""The per-rank offload directory: `<offload-dir>/rank<N>/`, mode 0700, a lock file so that
two jobs never share it, stale files of a killed run detected, reported and removed (never
read), and the free-space check of the run's NVMe plan."""

import errno
import fcntl
import glob
import json
import logging
import os
import shutil
import socket
import time

from megatron_snake.storage.errors import CapacityError, OffloadDirError
from megatron_snake.storage.swap_file import read_file_header

log = logging.getLogger("megatron_snake.storage")

LOCK_NAME = "LOCK"
SWAP_SUFFIX = ".swap"
MARGIN_FRACTION = 0.05
MARGIN_BYTES = 256 << 20


def disk_free_bytes(path):
    return shutil.disk_usage(path).free


def probe_writable(path):
    """Create and remove a file: the only test that is true for root (os.access is not)."""
    probe = os.path.join(path, f".write-probe-{os.getpid()}")
    fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    os.close(fd)
    os.unlink(probe)


def _gib(n):
    return f"{n / 2**30:.2f} GiB"


class RankDir:
    """Owns `<offload_dir>/rank<rank>/` for the life of one job.

    free_space_probe(path) -> bytes and write_probe(path) are injectable for tests.
    """

    def __init__(self, offload_dir, rank, run_id, free_space_probe=None,
                 write_probe=probe_writable):
        self.root = os.path.abspath(os.fspath(offload_dir))
        self.rank = rank
        self.path = os.path.join(self.root, f"rank{rank}")
        # Looked up at call time, so a test can stand in for the file system's free space.
        self.free_space_probe = free_space_probe or (lambda path: disk_free_bytes(path))
        self.stale = []        # [(path, header dict or None, size)] found and removed at open
        self._lock_fd = -1
        flag = "--snake-offload-dir"
        if not os.path.exists(self.root):
            raise OffloadDirError(f"{flag} {self.root} does not exist; create it on the NVMe drive "
                                  "(it is not created for you, so a typo cannot fill another disk)")
        if not os.path.isdir(self.root):
            raise OffloadDirError(f"{flag} {self.root} is not a directory")
        try:
            os.mkdir(self.path, 0o700)
        except FileExistsError:
            if not os.path.isdir(self.path):
                raise OffloadDirError(f"{self.path} exists and is not a directory ({flag} {self.root})")
        except OSError as exc:
            raise OffloadDirError(f"cannot create {self.path}: {exc.strerror}; is {flag} "
                                  f"{self.root} writable by this user?") from exc
        try:
            os.chmod(self.path, 0o700)
            write_probe(self.path)
        except OSError as exc:
            raise OffloadDirError(f"{self.path} is not writable ({exc.strerror}); {flag} must "
                                  "point to a writable directory on a local drive") from exc
        self._lock(run_id)
        self._remove_stale()

    # ------------------------------------------------------------ lock

    def _lock(self, run_id):
        lock_path = os.path.join(self.path, LOCK_NAME)
        for _ in range(10):
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                owner = os.pread(fd, 4096, 0).decode(errors="replace").strip()
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise OffloadDirError(
                        f"{self.path} is in use by another job ({owner or 'owner unknown'}); two "
                        "jobs cannot share --snake-offload-dir: stop that job or give this one "
                        "another directory") from None
                raise OffloadDirError(f"cannot lock {lock_path}: {exc.strerror}") from exc
            # the file we locked must still be the one at lock_path (a closing job unlinks it)
            try:
                same = os.stat(lock_path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        else:
            raise OffloadDirError(f"cannot lock {lock_path}: it keeps being replaced")
        previous = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        if previous:
            self.stale.append((lock_path, {"previous_owner": previous}, len(previous)))
        info = dict(pid=os.getpid(), host=socket.gethostname(), run_id=run_id.hex(),
                    started=time.strftime("%Y-%m-%dT%H:%M:%S"))
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self._lock_fd = fd
        self.lock_path = lock_path

    def _remove_stale(self):
        for path in sorted(glob.glob(os.path.join(self.path, "*" + SWAP_SUFFIX))):
            hdr = read_file_header(path)
            size = os.stat(path).st_size
            self.stale.append((path, hdr, size))
            os.unlink(path)
        if self.stale:
            lines = []
            for path, hdr, size in self.stale:
                if os.path.basename(path) == LOCK_NAME:
                    lines.append(f"lock of a run that did not exit cleanly: {hdr['previous_owner']}")
                else:
                    what = (f"run {hdr['run_id'][:8]} pid {hdr['pid']} kind {hdr['kind']}"
                            if hdr else "not a megatron_snake swap file (bad header)")
                    lines.append(f"{os.path.basename(path)} ({_gib(size)}, {what})")
            log.warning("offload dir %s: stale files from a run that was killed or crashed were "
                        "found and removed, never read: %s", self.path, "; ".join(lines))

    # ------------------------------------------------------------ capacity

    def check_capacity(self, nbytes_planned, nbytes_held=0, margin_fraction=MARGIN_FRACTION,
                       margin_bytes=MARGIN_BYTES):
        """Raise CapacityError unless the file system can take nbytes_planned more than what
        our files already hold (nbytes_held), plus a margin."""
        more = max(0, int(nbytes_planned) - int(nbytes_held))
        need = int(more * (1 + margin_fraction)) + margin_bytes if more else 0
        free = self.free_space_probe(self.path)
        if need > free:
            raise CapacityError(
                f"--snake-offload-dir {self.root} (rank {self.rank}): the run places "
                f"{_gib(nbytes_planned)} on NVMe and needs {_gib(need)} more free space "
                f"(with a {margin_fraction:.0%} + {margin_bytes >> 20} MiB margin), but only "
                f"{_gib(free)} is free on that file system. Free {_gib(need - free)} or point "
                "--snake-offload-dir at a larger drive.")
        return need, free

    # ------------------------------------------------------------ cleanup

    def close(self):
        """Clean exit: remove the lock file (swap files are removed by their owners)."""
        if self._lock_fd >= 0:
            try:
                os.unlink(self.lock_path)
            except FileNotFoundError:
                pass
            os.close(self._lock_fd)   # releases the flock
            self._lock_fd = -1
            try:
                os.rmdir(self.path)   # only when empty
            except OSError:
                pass
