"""The one kind of error a user's input causes, and how an entry point reports it.

A ``UserError`` is a run refused because of something the user gave it: a flag, a path, a
checkpoint, a dataset, the room on a drive or in memory. Its message is one line that names
that input and says what to do. An entry point prints the message alone (``report``: no
traceback) and exits with ``exit_status``; any other exception is a defect and keeps its
traceback. ``SNAKE_DEBUG=1`` shows the traceback of a ``UserError`` too. Specific errors
subclass it together with the builtin they refine (``ValueError``, ``OSError``, ...), so
callers that catch the builtin still do.
"""

from __future__ import annotations

import datetime
import os
import sys

DEBUG_ENV = "SNAKE_DEBUG"
# How long a rank other than 0 waits to learn whether rank 0 reports the same refusal.
_SAME_AS_RANK0_WAIT = datetime.timedelta(seconds=3)
_KEY = "megatron_snake/refused/0"


class UserError(Exception):
    """Refused because of the user's input; the message names it and what to do."""

    exit_status = 1


class FlagError(UserError, ValueError):
    """A flag's value that a component refuses (the message starts with the flag); the
    command line turns it into a usage error, a run refuses with it."""


def debugging() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def report(exc: BaseException, *, prog: str) -> int:
    """Print ``exc`` as ``prog: error: <message>`` on one rank and return its exit status.

    Most refusals are the same on every rank (the same flags, data and checkpoint): rank 0
    prints it and the others stay silent. Before the process group exists every rank has
    the same command line, so only rank 0 speaks. After, a rank whose refusal is its own
    (its drive, its checkpoint file) prints it with its rank, so that it is not lost: each
    rank other than 0 waits briefly for rank 0's message through the process group's
    store and prints its own only when it differs."""
    message = " ".join(str(exc).split()) or type(exc).__name__
    line = f"{prog}: error: {message}"
    rank, store = _rank_and_store()
    if rank in (None, 0):
        if store is not None:
            _quietly(store.set, _KEY, message)
        print(line, file=sys.stderr, flush=True)
    elif store is not None and _rank0_says(store) != message:
        print(f"[rank {rank}] {line}", file=sys.stderr, flush=True)
    return getattr(exc, "exit_status", 1)


def _rank_and_store():
    """This process's rank (None when not launched as one of several) and the default
    process group's store, when there is one."""
    try:
        import torch.distributed as dist
        if dist.is_initialized():
            from torch.distributed import distributed_c10d
            return dist.get_rank(), distributed_c10d._get_default_store()
    except (ImportError, RuntimeError, AttributeError, ValueError):
        pass
    rank = os.environ.get("RANK")
    return (int(rank) if rank and rank.isdigit() else None), None


def _rank0_says(store) -> str | None:
    try:
        store.wait([_KEY], _SAME_AS_RANK0_WAIT)
        return store.get(_KEY).decode()
    except Exception:  # noqa: BLE001 - rank 0 said nothing in time, or is gone
        return None


def _quietly(call, *args) -> None:
    try:
        call(*args)
    except Exception:  # noqa: BLE001 - a gone peer must not hide the message
        pass
