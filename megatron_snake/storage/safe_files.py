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


def _at(path: str, dir_fd: int | None) -> str:
    """The name to use with ``dir_fd``: ``path``'s last component when ``dir_fd`` is its
    parent directory, opened (messages still show the whole path), else ``path``."""
    return path if dir_fd is None else os.path.basename(path)


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


def open_private_dir(path: str, *, what: str = "directory", mode: int = 0o700,
                     dir_fd: int | None = None) -> int:
    """``private_dir``, returning the directory opened (``O_DIRECTORY``): entries made
    relative to it (``dir_fd=``) land in this directory whatever is later mounted over,
    renamed to or linked at its path. ``dir_fd``: ``path``'s parent, opened (``_at``)."""
    name = _at(path, dir_fd)
    try:
        os.mkdir(name, mode, dir_fd=dir_fd)
    except FileExistsError:
        pass
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW, dir_fd=dir_fd)
    except OSError as exc:   # ELOOP: a link; ENOTDIR: something else
        _check(os.lstat(name, dir_fd=dir_fd), path, True, what)
        raise UnsafePathError(f"{what} {path}: {exc.strerror}") from exc
    try:
        _check(os.fstat(fd), path, True, what)
        os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def private_dir(path: str, *, what: str = "directory", mode: int = 0o700) -> None:
    """Make the directory ``path`` with ``mode``, or take the one there if it is a real
    directory owned by this user (its mode is then set to ``mode``)."""
    os.close(open_private_dir(path, what=what, mode=mode))


def private_dirs(root: str, relative: str, *, what: str = "directory") -> str:
    """``private_dir`` for each component of ``relative`` below ``root`` (which must
    exist); returns the full path."""
    path = root
    for part in relative.split(os.sep):
        if part:
            path = os.path.join(path, part)
            private_dir(path, what=what)
    return path


def create_file(path: str, *, what: str = "file", mode: int = 0o600,
                dir_fd: int | None = None) -> int:
    """A new file at ``path`` (mode 0600), opened for writing; a leftover entry there (a
    file from a crashed run, or a planted link) is removed first, never followed.
    ``dir_fd``: ``path``'s parent, opened (``_at``)."""
    name = _at(path, dir_fd)
    try:
        st = os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    else:
        if stat.S_ISDIR(st.st_mode):
            raise UnsafePathError(f"{what} {path} exists and is a directory; remove it")
        os.unlink(name, dir_fd=dir_fd)   # removes a link itself, not what it points to
    return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, mode,
                   dir_fd=dir_fd)


def open_owned_file(path: str, *, what: str = "file", mode: int = 0o600,
                    flags: int = os.O_RDWR | os.O_CREAT, dir_fd: int | None = None) -> int:
    """Open (creating it if ``flags`` say so) the regular file ``path`` without following a
    link, and check this user owns it. ``dir_fd``: ``path``'s parent, opened (``_at``)."""
    name = _at(path, dir_fd)
    try:
        fd = os.open(name, flags | _NOFOLLOW, mode, dir_fd=dir_fd)
    except OSError as exc:
        try:
            _check(os.lstat(name, dir_fd=dir_fd), path, False, what)
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
