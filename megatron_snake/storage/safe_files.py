"""Creating the run's files and directories without following symbolic links.

The offload and checkpoint directories may sit in a parent other users can write to. If the
run followed a link planted there (``rank0/LOCK -> /etc/shadow``), a root job would truncate,
chmod or delete a file it never meant to touch. So every entry the run creates is made with
``O_NOFOLLOW`` / ``O_EXCL`` (neither follows a link in the last component) and checked with
``fstat`` on the opened descriptor: a regular file or directory, owned by this user. The
directory a user names on the command line may itself be a link (their choice); what the
run makes inside it never is.
"""

from __future__ import annotations

import errno
import os
import stat

from megatron_snake.storage.errors import UnsafePathError

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = os.O_NOFOLLOW | _CLOEXEC


def _check(st: os.stat_result, path: str, want_dir: bool, what: str) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePathError(f"{what} {path} is a symbolic link; the run does not follow links "
                              "it did not make: remove it, or give a directory of your own")
    if want_dir != stat.S_ISDIR(st.st_mode) or not (want_dir or stat.S_ISREG(st.st_mode)):
        kind = "a directory" if want_dir else "a regular file"
        raise UnsafePathError(f"{what} {path} exists and is not {kind}; remove it or choose "
                              "another directory")
    if st.st_uid != os.geteuid():
        raise UnsafePathError(f"{what} {path} is owned by uid {st.st_uid}, not by this user "
                              f"(uid {os.geteuid()}); the run uses only files it owns: remove "
                              "it or choose another directory")


def private_dir(path: str, *, what: str = "directory", mode: int = 0o700) -> None:
    """Make the directory ``path`` with ``mode``, or take the one there if it is a real
    directory owned by this user (its mode is then set to ``mode``)."""
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW)
    except OSError as exc:   # ELOOP: a link; ENOTDIR: something else
        _check(os.lstat(path), path, True, what)
        raise UnsafePathError(f"{what} {path}: {exc.strerror}") from exc
    try:
        _check(os.fstat(fd), path, True, what)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def private_dirs(root: str, relative: str, *, what: str = "directory") -> str:
    """``private_dir`` for each component of ``relative`` below ``root`` (which must
    exist); returns the full path."""
    path = root
    for part in relative.split(os.sep):
        if part:
            path = os.path.join(path, part)
            private_dir(path, what=what)
    return path


def create_file(path: str, *, what: str = "file", mode: int = 0o600) -> int:
    """A new file at ``path`` (mode 0600), opened for writing; a leftover entry there (a
    file from a crashed run, or a planted link) is removed first, never followed."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if stat.S_ISDIR(st.st_mode):
            raise UnsafePathError(f"{what} {path} exists and is a directory; remove it")
        os.unlink(path)   # removes a link itself, not what it points to
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, mode)


def open_owned_file(path: str, *, what: str = "file", mode: int = 0o600,
                    flags: int = os.O_RDWR | os.O_CREAT) -> int:
    """Open (creating it if ``flags`` say so) the regular file ``path`` without following a
    link, and check this user owns it."""
    try:
        fd = os.open(path, flags | _NOFOLLOW, mode)
    except OSError as exc:
        try:
            _check(os.lstat(path), path, False, what)
        except FileNotFoundError:
            pass
        raise
    try:
        _check(os.fstat(fd), path, False, what)
    except UnsafePathError:
        os.close(fd)
        raise
    return fd


def open_regular_file(path: str, *, what: str = "file") -> int:
    """Open the existing file ``path`` read-only, refusing a link (not followed) and anything
    but a regular file. O_NONBLOCK: opening a FIFO would otherwise wait for a writer forever;
    it is cleared again once the file is known to be a regular one."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise UnsafePathError(f"{what} {path} is a symbolic link; the run reads only regular "
                              "files, never through a link") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise UnsafePathError(f"{what} {path} is not a regular file (mode "
                              f"{stat.filemode(st.st_mode)}); the run reads only regular files")
    os.set_blocking(fd, True)
    return fd


def fsync_dir(path: str) -> None:
    """Make a rename or unlink in ``path`` durable across a power loss."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomically(path: str, data: bytes, *, what: str = "file") -> None:
    """Replace ``path`` by a 0600 file holding ``data``: written to ``path.part`` (never
    through a link), fsynced, renamed over ``path`` (a link there is replaced, not
    followed), and the rename made durable."""
    part = path + ".part"
    fd = create_file(part, what=what)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, path)
    except BaseException:
        try:
            os.unlink(part)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))
