"""The default offload directory: a new temporary directory per rank, and the sweep of those
that killed runs left behind.

A run given no ``--snake-offload-dir`` offloads into ``$TMPDIR/megatron_snake_<host>_<pid>_*``
and removes it on any exit it lives through. A run killed outright (SIGKILL, the OOM killer,
a node reset) cannot, so each new start removes the directories it can prove dead: made on
this host, by this user, by a process that no longer exists and whose locks are free (a
process in another pid namespace looks dead by pid, but holds its lock). Anything else (another host's
directory on a shared /tmp, a live or unknowable owner, a link, another user's entry) is left
alone. The temporary parent is writable by everyone, so every entry is checked with
``lstat`` and removed by ``shutil.rmtree``, which does not follow links inside it.
"""

from __future__ import annotations

import fcntl
import glob
import logging
import os
import re
import shutil
import socket
import stat
import tempfile

log = logging.getLogger("megatron_snake.storage")

PREFIX = "megatron_snake_"


def _host() -> str:
    # the host name as a file name part: no separator, no field delimiter of ours
    return re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname()) or "host"


def make_temp_offload_dir(parent: str | None = None) -> str:
    """A new private (0700) directory named by this host and process."""
    return tempfile.mkdtemp(prefix=f"{PREFIX}{_host()}_{os.getpid()}_", dir=parent)


def _pid_is_dead(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:       # alive, another user's process
        return False
    return False


def _a_lock_is_held(path: str) -> bool:
    """Whether a live store holds a ``rank*/LOCK`` below ``path`` (its flock is released only
    when its process dies, whatever pid namespace that process is in)."""
    for lock in glob.glob(os.path.join(glob.escape(path), "rank*", "LOCK")):
        try:   # opened without following a link; a link is not a lock
            fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return True
        finally:
            os.close(fd)
    return False


def sweep_dead_temp_offload_dirs(parent: str | None = None) -> list[str]:
    """Remove the temporary offload directories of dead runs of this user on this host.
    Returns the paths removed."""
    parent = parent or tempfile.gettempdir()
    pattern = re.compile(re.escape(PREFIX + _host()) + r"_(\d+)_[^/]+\Z")
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        match = pattern.match(name)
        if not match or int(match.group(1)) == os.getpid():
            continue
        path = os.path.join(parent, name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            continue       # a link, a file, or another user's: not ours to judge
        if not _pid_is_dead(int(match.group(1))) or _a_lock_is_held(path):
            continue       # a pid of another namespace may look dead: its locks do not
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path):
            removed.append(path)
    if removed:
        log.warning("removed %d temporary offload director%s of runs that were killed "
                    "(their processes no longer exist): %s", len(removed),
                    "y" if len(removed) == 1 else "ies", ", ".join(removed))
    return removed
