"""Slow drives emulated on one disk: loop devices over sparse files, an ext4 file system on
each, mounted, and each throttled to a rate by the cgroup v1 blkio controller
(``blkio.throttle.read_bps_device`` / ``write_bps_device``) in a group this process joins.

    with EmulatedDrives(4, rate=100e6) as dirs:     # four directories, one per drive
        ...

The throttle counts the I/O this process submits: the store's direct I/O (O_DIRECT), not
buffered writes (the kernel's writeback threads are outside the group). The loop devices
do direct I/O on their files (``--direct-io=on``), so what is read comes from the disk,
not from the page cache. Everything is undone on exit, in reverse order, whatever failed.
Needs root, loop devices and the blkio controller: ``why_not()`` says which is missing.
Used by tools/bench_drives.py and tests/test_striped_drives_throttled.py."""

import os
import shutil
import subprocess
import tempfile

BLKIO = "/sys/fs/cgroup/blkio"


def why_not() -> str | None:
    """Why drives cannot be emulated here, or None when they can."""
    if os.geteuid() != 0:
        return "emulated drives need root (losetup, mount, the blkio cgroup)"
    if not os.path.isdir(BLKIO) or not os.path.exists(os.path.join(
            BLKIO, "blkio.throttle.read_bps_device")):
        return f"no cgroup v1 blkio controller at {BLKIO} (blkio.throttle.*)"
    if not os.path.exists("/dev/loop-control") or not shutil.which("losetup") \
            or not shutil.which("mkfs.ext4"):
        return "no loop devices here (/dev/loop-control, losetup, mkfs.ext4)"
    return None


def _run(*cmd):
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


def _own_blkio_group() -> str:
    """This process's blkio group now (where it goes back to)."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if "blkio" in controllers.split(","):
                return os.path.join(BLKIO, path.lstrip("/"))
    return BLKIO


class EmulatedDrives:
    """``n`` drives of ``size`` bytes each, throttled to ``rate`` bytes/s each way, their
    image files in a new directory under ``parent``; entering gives one empty directory on
    each. ``devices``: their /dev/loopN."""

    def __init__(self, n, rate, size=2 << 30, parent=None):
        reason = why_not()
        if reason:
            raise RuntimeError(reason)
        self.n, self.rate, self.size, self.parent = n, int(rate), size, parent
        self.devices, self._undo = [], []

    def __enter__(self):
        try:
            self._set_up()
        except BaseException:
            self._tear_down()
            raise
        return self.dirs

    def __exit__(self, *exc):
        self._tear_down()

    def _set_up(self):
        root = tempfile.mkdtemp(prefix="snake_drives_", dir=self.parent)
        self._undo.append(lambda: shutil.rmtree(root, ignore_errors=True))
        self.dirs = []
        for i in range(self.n):
            image, mnt = os.path.join(root, f"drive{i}.img"), os.path.join(root, f"mnt{i}")
            with open(image, "wb") as f:
                f.truncate(self.size)                         # sparse
            _run("mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0",
                 image)                                       # no background init later
            dev = subprocess.run(["losetup", "--find", "--show", "--direct-io=on", image],
                                 check=True, capture_output=True, text=True).stdout.strip()
            self._undo.append(lambda dev=dev: _run("losetup", "-d", dev))
            self.devices.append(dev)
            os.mkdir(mnt)
            _run("mount", "-t", "ext4", "-o", "noatime", dev, mnt)
            self._undo.append(lambda mnt=mnt: _run("umount", mnt))
            os.mkdir(os.path.join(mnt, "offload"))
            self.dirs.append(os.path.join(mnt, "offload"))
        group = os.path.join(BLKIO, f"snake_drives_{os.getpid()}")
        os.mkdir(group)
        self._undo.append(lambda: os.rmdir(group))
        for dev in self.devices:
            rdev = os.stat(dev).st_rdev
            for way in ("read", "write"):
                _write(os.path.join(group, f"blkio.throttle.{way}_bps_device"),
                       f"{os.major(rdev)}:{os.minor(rdev)} {self.rate}")
        home = _own_blkio_group()
        _write(os.path.join(group, "cgroup.procs"), str(os.getpid()))
        self._undo.append(lambda: _write(os.path.join(home, "cgroup.procs"), str(os.getpid())))
        self.group = group

    def served_bytes(self) -> dict:
        """{device: [read bytes, written bytes]} this group's I/O reached each drive with."""
        rdevs = {f"{os.major(os.stat(d).st_rdev)}:{os.minor(os.stat(d).st_rdev)}": d
                 for d in self.devices}
        out = {d: [0, 0] for d in self.devices}
        with open(os.path.join(self.group, "blkio.throttle.io_service_bytes")) as f:
            for line in f:
                parts = line.split()
                if len(parts) == 3 and parts[0] in rdevs and parts[1] in ("Read", "Write"):
                    out[rdevs[parts[0]]][parts[1] == "Write"] += int(parts[2])
        return out

    def _tear_down(self):
        """Undo in reverse order; every step is tried, the first failure raised at the end."""
        first = None
        while self._undo:
            try:
                self._undo.pop()()
            except (OSError, subprocess.CalledProcessError) as exc:
                first = first or exc
        if first is not None:
            raise first
