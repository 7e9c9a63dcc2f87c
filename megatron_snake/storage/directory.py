"""The per-rank offload directory: `<offload-dir>/rank<N>/`, mode 0700, a lock file so that
two jobs never share it, stale files of a killed run detected, reported and removed (never
read), and the free-space check of the run's NVMe plan.

The offload directory may sit in a parent other users can write to, so nothing the run
makes in it is trusted by name (safe_files): the rank directory must be a real directory
owned by this user (not a link), the lock file is opened without following a link and
checked to be this user's regular file before it is read or written, and a stale ``*.swap``
entry that is a link, not a regular file, or not this user's is removed without being
opened."""

import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import stat
import time

from megatron_snake.storage.errors import (NO_SPACE, CapacityError, OffloadDirError,
                                            UnsafePathError, drive_full)
from megatron_snake.storage.safe_files import create_file, open_owned_file, open_private_dir
import megatron_snake.storage.sizes as sizes
from megatron_snake.storage.swap_file import read_file_header

log = logging.getLogger("megatron_snake.storage")

LOCK_NAME = "LOCK"
SWAP_SUFFIX = ".swap"
MARGIN_FRACTION = 0.05
MARGIN_BYTES = 256 << 20


def disk_free_bytes(path):
    return shutil.disk_usage(path).free


def same_directory(path):
    """What identifies the directory ``path`` names: its device and inode when it exists
    (the same directory reached through a bind mount has another real path, but these),
    else its real path."""
    try:
        st = os.stat(path)
    except OSError:
        return os.path.realpath(path)
    return st.st_dev, st.st_ino


def named_twice(paths, same=same_directory) -> list:
    """The entries of ``paths`` that name a directory another entry names too (compared by
    ``same``: ``same_directory`` by default), in their order: --snake-offload-dir's lists."""
    keys = [same(p) for p in paths]
    return [p for p, k in zip(paths, keys) if keys.count(k) > 1]


def stale_bytes(offload_dir, rank) -> int:
    """Drive space a run on ``offload_dir`` gets back as it opens ``rank<rank>/``: the
    blocks of the swap files a run that is gone left there (``RankDir`` removes them), or 0
    while a live job holds that directory's lock (its files are its own). For the space
    checks made before the store opens (the pre-flight)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        dir_fd = os.open(os.path.join(offload_dir, f"rank{rank}"), flags | os.O_DIRECTORY)
    except OSError:
        return 0
    lock_fd = -1
    try:
        try:
            lock_fd = os.open(LOCK_NAME, flags | os.O_NONBLOCK, dir_fd=dir_fd)
            if not stat.S_ISREG(os.fstat(lock_fd).st_mode):
                return 0
            fcntl.flock(lock_fd, fcntl.LOCK_SH | fcntl.LOCK_NB)   # fails while one is held
        except FileNotFoundError:
            pass
        except OSError:
            return 0
        total = 0
        for name in os.listdir(dir_fd):
            if name.endswith(SWAP_SUFFIX):
                st = os.lstat(name, dir_fd=dir_fd)
                if _not_ours(st) is None:     # what RankDir removes and frees
                    total += st.st_blocks * 512
        return total
    finally:
        if lock_fd >= 0:
            os.close(lock_fd)
        os.close(dir_fd)


def file_system_groups(paths) -> list[list[int]]:
    """The indexes of ``paths`` grouped by the file system each is on, in the order of their
    first member (a path that does not exist yet is a group of its own): directories on one
    file system share its free space, so the space checks take them together."""
    groups = {}
    for i, path in enumerate(paths):
        try:
            key = os.stat(path).st_dev
        except OSError:
            key = ("missing", i)
        groups.setdefault(key, []).append(i)
    return list(groups.values())


class UnsafeOffloadDirError(UnsafePathError, OffloadDirError):
    """An entry in the offload directory is a symbolic link, not the kind expected, or owned
    by another user: both an UnsafePathError and an OffloadDirError."""


def probe_writable(path, dir_fd=None):
    """Create and remove a file: the only test that is true for root (os.access is not).
    Created without following a link (a leftover probe or a planted link is replaced);
    ``dir_fd``: ``path``'s directory, opened (``safe_files.create_file``)."""
    probe = os.path.join(path, f".write-probe-{os.getpid()}")
    os.close(create_file(probe, what="write probe", dir_fd=dir_fd))
    os.unlink(os.path.basename(probe) if dir_fd is not None else probe, dir_fd=dir_fd)


def _gib(n):
    return f"{n / 2**30:.2f} GiB"


def _ours(owner: str, run_id: bytes) -> bool:
    """Whether a lock file's text (``RankDir._lock``'s JSON) names this run of this
    process (another store of the same process is another job)."""
    try:
        info = json.loads(owner)
        return (info.get("pid"), info.get("host"), info.get("run_id")) == (
            os.getpid(), socket.gethostname(), run_id.hex())
    except (ValueError, AttributeError):
        return False


def _not_ours(st):
    """Why an entry (``os.lstat``) is not this run's to read, or None for a regular file of
    this user's with no other name."""
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if stat.S_ISDIR(st.st_mode):
        return "a directory"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not by this user"
    if st.st_nlink != 1:
        return "a file with other hard links"
    return None


class RankDir:
    """Owns `<offload_dir>/rank<rank>/` for the life of one job.

    The run holds both directories open (``root_fd``, ``fd``) and makes, reads and removes
    its entries relative to them: a directory mounted over either path, or a link put in
    its place, during the run is never written through, and its own files are still
    removed at the end. Every write at start-up that finds the drive full (no space, no
    inodes) is a CapacityError naming the directory, with nothing of this run left there.

    free_space_probe(path) -> bytes and write_probe(path) are injectable for tests.
    """

    def __init__(self, offload_dir, rank, run_id, free_space_probe=None, write_probe=None):
        self.root = os.path.abspath(os.fspath(offload_dir))
        self.rank = rank
        self.path = os.path.join(self.root, f"rank{rank}")
        # Looked up at call time, so a test can stand in for the file system's free space.
        self.free_space_probe = free_space_probe or (lambda path: disk_free_bytes(path))
        self.stale = []        # [(path, header dict or None, size)] found and removed at open
        self._lock_fd = self.fd = self.root_fd = -1
        flag = "--snake-offload-dir"
        if not os.path.exists(self.root):
            raise OffloadDirError(f"{flag} {self.root} does not exist; create it on the NVMe drive "
                                  "(it is not created for you, so a typo cannot fill another disk)")
        if not os.path.isdir(self.root):
            raise OffloadDirError(f"{flag} {self.root} is not a directory")
        mode = os.stat(self.root).st_mode
        if mode & (stat.S_IWGRP | stat.S_IWOTH) and not mode & stat.S_ISVTX:
            # without the sticky bit anyone who may write there may also rename or remove
            # what this run made (rank<N>, the activation plan) and put their own in its place
            log.warning("%s %s is writable by other users and has no sticky bit: another user "
                        "could replace the entries this run makes there; use a directory of "
                        "your own, or a sticky one like /tmp", flag, self.root)
        # the directory the user named (a link there is their choice)
        self.root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            self._open(write_probe, run_id)
        except BaseException:
            self.close()
            raise

    def _open(self, write_probe, run_id):
        flag = "--snake-offload-dir"
        try:
            # made 0700, or taken only when it is a real directory of ours (never a link)
            self.fd = open_private_dir(self.path, what="rank directory", dir_fd=self.root_fd)
        except UnsafePathError as exc:
            raise self._unsafe(exc) from None
        except OSError as exc:
            if exc.errno in NO_SPACE:
                raise self._full(f"making {self.path}", self.root) from None
            if not os.path.lexists(self.path):
                raise OffloadDirError(f"cannot create {self.path}: {exc.strerror}; is {flag} "
                                      f"{self.root} writable by this user?") from exc
            raise OffloadDirError(f"{self.path} is not writable ({exc.strerror}); {flag} must "
                                  "point to a writable directory on a local drive") from exc
        try:
            if write_probe is None:
                probe_writable(self.path, dir_fd=self.fd)
            else:
                write_probe(self.path)
        except UnsafePathError as exc:
            raise self._unsafe(exc) from None
        except OSError as exc:
            if exc.errno in NO_SPACE:
                raise self._full(f"creating a file in {self.path}") from None
            raise OffloadDirError(f"{self.path} is not writable ({exc.strerror}); {flag} must "
                                  "point to a writable directory on a local drive") from exc
        self._lock(run_id)
        self._remove_stale()

    def _unsafe(self, exc):
        """``exc`` (an UnsafePathError naming the path and what to do) with the flag."""
        return UnsafeOffloadDirError(f"{exc} (--snake-offload-dir {self.root})")

    def _full(self, doing, directory=None):
        return drive_full(f"--snake-offload-dir {self.root} (rank {self.rank})", doing,
                          directory or self.path)

    # ------------------------------------------------------------ lock

    def _open_lock(self, lock_path):
        """The lock file, opened (created when missing) without following a link, and only
        when it is this user's regular file with no other name: nothing else is ever read,
        truncated or written through it."""
        try:
            fd = open_owned_file(lock_path, what="lock file", flags=os.O_RDWR | os.O_CREAT,
                                 dir_fd=self.fd)
        except UnsafePathError as exc:
            raise self._unsafe(exc) from None
        except OSError as exc:
            if exc.errno in NO_SPACE:
                raise self._full(f"creating {lock_path}") from None
            raise OffloadDirError(f"cannot open {lock_path}: {exc.strerror} (--snake-offload-dir "
                                  f"{self.root})") from exc
        if os.fstat(fd).st_nlink != 1:
            os.close(fd)
            raise self._unsafe(UnsafePathError(
                f"lock file {lock_path} has other hard links; the run does not write a file "
                "that has another name: remove it or choose another directory"))
        return fd

    def _lock(self, run_id):
        lock_path = os.path.join(self.path, LOCK_NAME)
        for _ in range(10):
            fd = self._open_lock(lock_path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                owner = os.pread(fd, 4096, 0).decode(errors="replace").strip()
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN) and _ours(owner, run_id):
                    # our own lock, taken through another path to this directory
                    raise OffloadDirError(
                        f"{self.path} is locked by this run itself: the directory is named "
                        "twice in --snake-offload-dir (by another path to it: a link or a "
                        "bind mount?); give each directory once") from None
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise OffloadDirError(
                        f"{self.path} is in use by another job ({owner or 'owner unknown'}); two "
                        "jobs cannot share --snake-offload-dir: stop that job or give this one "
                        "another directory") from None
                raise OffloadDirError(f"cannot lock {lock_path}: {exc.strerror}") from exc
            # the file we locked must still be the one at lock_path (a closing job unlinks it)
            try:
                same = os.lstat(LOCK_NAME, dir_fd=self.fd).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        else:
            raise OffloadDirError(f"cannot lock {lock_path}: it keeps being replaced")
        # ours from here: close() removes it, whatever follows fails
        self._lock_fd, self.lock_path = fd, lock_path
        previous = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        if previous:
            self.stale.append((lock_path, {"previous_owner": previous}, len(previous)))
        info = dict(pid=os.getpid(), host=socket.gethostname(), run_id=run_id.hex(),
                    started=time.strftime("%Y-%m-%dT%H:%M:%S"))
        os.ftruncate(fd, 0)
        try:
            os.pwrite(fd, json.dumps(info).encode(), 0)
        except OSError as exc:
            if exc.errno in NO_SPACE:
                raise self._full(f"writing {lock_path}") from None
            raise

    def _remove_stale(self):
        for name in sorted(n for n in os.listdir(self.fd) if n.endswith(SWAP_SUFFIX)):
            path = os.path.join(self.path, name)
            try:
                st = os.lstat(name, dir_fd=self.fd)   # the entry itself, never a link's target
            except FileNotFoundError:
                continue
            not_read = _not_ours(st)
            if not_read == "a directory":
                raise self._unsafe(UnsafePathError(
                    f"{path} is a directory, not a swap file; remove it or choose another "
                    "directory"))
            # a link, a FIFO or device, another user's file or a hard link is removed (the
            # entry, not what it names) without being opened; read_file_header itself opens
            # without following a link and reads only this user's regular files
            hdr = {"not_read": not_read} if not_read else read_file_header(path,
                                                                           dir_fd=self.fd)
            self.stale.append((path, hdr, 0 if not_read else st.st_size))
            os.unlink(name, dir_fd=self.fd)
        if self.stale:
            lines = []
            for path, hdr, size in self.stale:
                if os.path.basename(path) == LOCK_NAME:
                    lines.append(f"lock of a run that did not exit cleanly: {hdr['previous_owner']}")
                elif hdr and "not_read" in hdr:
                    lines.append(f"{os.path.basename(path)} ({hdr['not_read']}: removed without "
                                 "being followed or opened)")
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
                f"{_gib(nbytes_planned)} on NVMe and needs {_gib(need)} of free space for "
                f"what its files do not hold yet (with a {margin_fraction:.0%} + "
                f"{margin_bytes >> 20} MiB margin), but only {_gib(free)} is free on that "
                f"file system: free {_gib(need - free)} more, or point --snake-offload-dir at "
                "a larger drive.")
        return need, free

    # ------------------------------------------------------------ cleanup

    def unlink(self, path, fd=-1):
        """Remove this run's file ``path`` (an entry of this directory) through the open
        directory. Raises OSError when it cannot; when its name is gone but the file ``fd``
        (open) still has one, it was moved away: ENOENT, named as such."""
        try:
            os.unlink(os.path.basename(path), dir_fd=self.fd)
        except FileNotFoundError:
            if fd >= 0 and os.fstat(fd).st_nlink:
                raise FileNotFoundError(errno.ENOENT, "moved away from its name during the "
                                        "run, so it was not removed", path) from None

    def close(self):
        """Clean exit: remove the lock file (swap files are removed by their owners) and the
        directory when it is empty. Returns [(path, bytes, OSError)] of what could not be
        removed; the lock is released anyway."""
        left = []
        if self._lock_fd >= 0:
            try:
                self.unlink(self.lock_path, self._lock_fd)
            except OSError as exc:
                left.append((self.lock_path, os.fstat(self._lock_fd).st_size, exc))
            os.close(self._lock_fd)   # releases the flock
            self._lock_fd = -1
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            try:
                os.rmdir(os.path.basename(self.path), dir_fd=self.root_fd)   # only when empty
            except OSError:
                pass
        if self.root_fd >= 0:
            os.close(self.root_fd)
            self.root_fd = -1
        return left

    def left_behind(self, left) -> OffloadDirError:
        """The error for files of this run that could not be removed at its end:
        ``left`` is [(path, bytes, OSError)]."""
        def amount(nbytes):
            return f"{nbytes} bytes" if nbytes < 1 << 20 else sizes.size(nbytes)

        reasons = "; ".join(sorted({exc.strerror or str(exc) for _, _, exc in left})).lower()
        files = ", ".join(f"{os.path.basename(path)} ({amount(nbytes)})"
                          for path, nbytes, _ in left)
        total = amount(sum(nbytes for _, nbytes, _ in left))
        return OffloadDirError(
            f"{self.path}: {len(left)} file(s) of this run, {total} in all, could not be "
            f"removed at its end ({reasons}): {files}. Its permissions or its file system "
            f"changed during the run? Restore them (chmod 0700 {self.path}) and remove the "
            "files; nothing reads them again (the next run on --snake-offload-dir "
            f"{self.root} removes them too)")
