"""Which checkpoint ``--load`` takes, and which iteration directories ``--save`` may write.

A checkpoint directory holds ``iter_NNNNNNN/`` directories and
``latest_checkpointed_iteration.txt``, the tracker naming the newest complete one (Megatron-LM's
layout; both formats share it). The tracker is read only when it is a regular file, opened
without following a link (a link could name any file on the machine, and a FIFO would block
the run), and it must hold an iteration number and nothing else. ``--ckpt-step N`` takes
``iter_N`` whatever the tracker says, as in Megatron-LM.

Megatron-LM trains from scratch when the tracker is missing, even with iteration
directories beside it, and later writes over them. Here a directory that holds iteration
directories but no readable tracker is refused, naming the newest one and ``--ckpt-step`` to
take it. The iteration the tracker names, the directory's name and the iteration stored
inside must agree (each format's loader calls ``check_saved_iteration``).

A run saves only iterations above the one it starts from. An iteration directory already in
``--save`` in that range was written by another run, so the run refuses at start
(``check_save_dir``) rather than replace it when it gets there.
"""

from __future__ import annotations

import dataclasses
import os
import re
import stat

from megatron_snake.errors import UserError

TRACKER = "latest_checkpointed_iteration.txt"
_ITERATION_NAME = re.compile(r"iter_([0-9]{7,})")
_TRACKER_BYTES = 64       # digits and a newline; anything longer is not a tracker


class CheckpointChoiceError(UserError, ValueError):
    """Which checkpoint to load, or where to save, cannot be decided safely: the tracker is
    unreadable beside saved iterations, an iteration asked for is not there, or a save would
    write over another run's iteration."""


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """One iteration directory to load: ``folder`` is ``root``/iter_<iteration>."""
    root: str
    iteration: int
    folder: str
    format: str          # "torch" or "torch_dist"


def iter_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def saved_iterations(root: str) -> list[int]:
    """The iterations of ``root``'s ``iter_N`` entries, ascending (a half-written
    ``iter_N.tmp`` is not one; an entry that is not a real directory is listed too, so that
    what a save would replace is never missed)."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    return sorted(int(m.group(1)) for m in map(_ITERATION_NAME.fullmatch, names) if m)


def saved_format(folder: str) -> str | None:
    """"torch_dist" when ``folder`` holds Megatron's ``metadata.json`` (written last, so it
    marks a complete torch_dist checkpoint), "torch" when it holds a rank directory with a
    state file, else None. ``folder`` must be a real directory: a link is not followed."""
    try:
        if not stat.S_ISDIR(os.lstat(folder).st_mode):
            return None
        names = os.listdir(folder)
    except OSError:
        return None
    if _is_file(os.path.join(folder, "metadata.json")):
        return "torch_dist"
    if any(name.startswith("mp_rank_") and
           _is_file(os.path.join(folder, name, "model_optim_rng.pt")) for name in names):
        return "torch"
    return None


def describe_saved(root: str) -> str:
    """The iterations saved in ``root`` and how to take the newest, for an error message."""
    found = saved_iterations(root)
    if not found:
        return f"no iteration directory in {root}"
    complete = [n for n in found if saved_format(iter_dir(root, n))]
    listed = ", ".join(map(str, found[-8:])) + (" ..." if len(found) > 8 else "")
    if not complete:
        return f"saved in {root}: iterations {listed}, none of them complete"
    return (f"saved in {root}: iterations {listed}; --ckpt-step {complete[-1]} loads the "
            f"newest complete one")


def find_checkpoint(root: str, *, ckpt_step: int | None = None) -> Checkpoint | None:
    """The checkpoint ``--load root`` (with ``--ckpt-step``) takes, or None when ``root``
    holds no checkpoint at all (a first run: Megatron-LM trains from scratch)."""
    if ckpt_step is not None:
        return _checkpoint(root, ckpt_step, f"--ckpt-step {ckpt_step}")
    tracker = os.path.join(root, TRACKER)
    iteration = _read_tracker(root, tracker)
    if iteration is None:
        return None
    return _checkpoint(root, iteration, f"{tracker} names iteration {iteration}, but")


def check_save_dir(save: str, *, start: int, last: int) -> None:
    """Refuse a run that would write over an iteration directory in ``save`` it did not
    write: one of ``start`` < N <= ``last`` (this run saves only those)."""
    ahead = [n for n in saved_iterations(save) if start < n <= last]
    if ahead:
        listed = ", ".join(map(str, ahead))
        raise CheckpointChoiceError(
            f"--save {save} already holds iteration {listed}, which this run (from iteration "
            f"{start} to {last}) would write over: a run replaces only what it wrote. Move "
            f"{'it' if len(ahead) == 1 else 'them'} away, give --save another directory, or "
            f"resume from {ahead[-1]} with --load {save} --ckpt-step {ahead[-1]}")


def check_not_there(save: str, iteration: int) -> None:
    """At a save: the last guard against replacing an iteration directory (another run's,
    made after this one started)."""
    final = iter_dir(save, iteration)
    if os.path.lexists(final):
        raise CheckpointChoiceError(
            f"--save {save}: {final} appeared while this run trained (another run saving "
            "into the same directory?); it is not replaced and this iteration is not saved. "
            "Give each run its own --save directory")


def _read_tracker(root: str, tracker: str) -> int | None:
    """The tracker's iteration; None when there is no tracker and no iteration saved."""
    try:
        st = os.lstat(tracker)
    except FileNotFoundError:
        if saved_iterations(root):
            raise _unreadable(root, f"{TRACKER} is missing") from None
        return None
    if not stat.S_ISREG(st.st_mode):
        kind = ("a symbolic link" if stat.S_ISLNK(st.st_mode) else
                "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file")
        raise _unreadable(root, f"{tracker} is {kind}; it is not followed or read")
    try:
        fd = os.open(tracker, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK |
                     getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise _unreadable(root, f"{tracker} cannot be read ({exc.strerror})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):   # swapped since the lstat
            raise _unreadable(root, f"{tracker} is not a regular file")
        raw = os.read(fd, _TRACKER_BYTES + 1)
    finally:
        os.close(fd)
    text = raw.strip()
    if len(raw) > _TRACKER_BYTES or not re.fullmatch(rb"[0-9]{1,18}", text):
        # its bytes are not shown: the file may be anything
        raise _unreadable(root, f"{tracker} does not hold an iteration number "
                          f"({st.st_size} bytes)")
    return int(text)


def _unreadable(root: str, what: str) -> CheckpointChoiceError:
    if not saved_iterations(root):
        return CheckpointChoiceError(f"--load {root}: {what}, and no iteration directory is "
                                     "there: remove it to start from scratch")
    return CheckpointChoiceError(
        f"--load {root}: {what}; training from scratch would later write over the "
        f"iterations there ({describe_saved(root)}). Pass --ckpt-step N, or give --load "
        "another directory")


def _checkpoint(root: str, iteration: int, why: str) -> Checkpoint:
    folder = iter_dir(root, iteration)
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        raise CheckpointChoiceError(f"--load {root}: {why} {folder} does not exist "
                                    f"({describe_saved(root)})") from None
    if not stat.S_ISDIR(st.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a directory"
        raise CheckpointChoiceError(
            f"--load {root}: {folder} is {kind}; an iteration directory is read only where a "
            f"save made it ({describe_saved(root)})")
    kind = saved_format(folder)
    if kind is None:
        raise CheckpointChoiceError(
            f"--load {root}: {folder} is not a complete checkpoint (neither Megatron's "
            "metadata.json of --ckpt-format torch_dist nor a rank directory with "
            f"model_optim_rng.pt of --ckpt-format torch); {describe_saved(root)}")
    return Checkpoint(root, iteration, folder, kind)


def _is_file(path: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False
