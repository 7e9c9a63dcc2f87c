"""One directory of the drive tier: a rank directory on one drive (directory.py's
``RankDir``: its lock, its symlink-safe files, its free space), its own I/O engine (a
ring and a request queue of its own, so that a slow or busy drive never holds another's
requests) and its swap files, one per kind of state (swap_file.py). The drive tier
(drive.py) places records' segments over one or several of them."""

import logging
import os
import threading

from megatron_snake.storage.errors import OffloadDirError
from megatron_snake.storage.swap_file import SwapFile

log = logging.getLogger("megatron_snake.storage")


class DriveDir:
    def __init__(self, directory, engine, run_id):
        self.dir, self.engine, self.run_id = directory, engine, run_id
        self.files = {}                # kind -> SwapFile
        self._files_lock = threading.Lock()
        self._direct_logged = False

    @property
    def path(self) -> str:
        return self.dir.path

    def file(self, kind, checksum) -> SwapFile:
        """``kind``'s swap file, made at its first use (its header names ``checksum``)."""
        f = self.files.get(kind)
        if f is None:
            with self._files_lock:
                f = self.files.get(kind)
                if f is None:
                    path = os.path.join(self.path, f"{kind}.swap")
                    try:
                        f = SwapFile(path, kind, self.run_id, self.engine, checksum,
                                     block_size=max(4096, os.fstatvfs(self.dir.fd).f_bsize),
                                     directory=self.dir)
                    except FileNotFoundError:   # nothing can be made in a removed directory
                        raise OffloadDirError(
                            f"{self.path} was removed during the run, so its {kind} swap file "
                            "cannot be made; keep --snake-offload-dir's rank directories "
                            "while a run uses them") from None
                    if not f.direct and not self._direct_logged:
                        self._direct_logged = True
                        log.warning("offload dir %s: the file system does not support O_DIRECT "
                                    "(tmpfs?); using buffered I/O (page cache)", self.path)
                    self.files[kind] = f
        return f

    def used(self) -> int:
        """Bytes its files' records take (what the drive tier balances)."""
        return sum(f.used for f in self.files.values())

    def held(self) -> int:
        """Bytes its files hold on the drive."""
        return sum(f.size for f in self.files.values())

    def check_capacity(self, nbytes_planned):
        """Raise CapacityError, naming this directory, unless ``nbytes_planned`` fit on its
        drive (with margin)."""
        return self.dir.check_capacity(nbytes_planned, self.held())

    def capacity(self) -> int:
        return self.held() + self.dir.free_space_probe(self.path)

    def all_direct(self) -> bool:
        return all(f.direct for f in self.files.values())

    def close(self, remove_files=True):
        """Close the engine and the files (removed unless ``remove_files``) and release the
        directory; returns [(path, bytes, OSError)] of what could not be removed."""
        self.engine.close()
        left = []
        for f in self.files.values():
            nbytes = f.size
            try:
                f.close(remove=remove_files)
            except OSError as exc:
                left.append((f.path, nbytes, exc))
        return left + self.dir.close()
