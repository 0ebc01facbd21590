"""Bounded waits on I/O requests: a request that can never complete is an error naming it, not a hang.

[Note: bounded waits]
Every wait on the engine's requests -- ``IOFuture.result()`` / ``exception()`` without a timeout of the
caller's, ``Engine.wait_all()`` and so ``Engine.close()`` -- waits in slices and gives up once *no* request of
the engine has completed a piece for ``stall_s`` seconds (the engine's ``stall_timeout``; default
``DEFAULT_STALL_S``, or the ``TIERSTORE_IO_STALL_S`` environment variable). The bound is on the absence of
progress, not on the wait's length: a long queue on a slow disk keeps completing pieces and is never cut
short, while a request the kernel or a backend lost (a dead completion thread, a hung device) stops every
completion and is reported after ``stall_s``. The clock starts again when the engine goes from idle to busy,
so a long pause without I/O is never taken for a stall; futures of the layers above that the engine's
requests complete (the nvme tier's writes) are waited for with ``Engine.wait_for``, bounded the same way
while the engine has requests in flight. The error (IOStalledError: a TierstoreIOError and a
TimeoutError, errno ETIMEDOUT) names the pending requests: operation, file, offset and length.

A request that stalled may still be touched by the kernel or a backend thread, so ``Engine.close()`` after a
stall does not free what the request refers to: it marks the engine closed, keeps its backend, files and
buffers alive, and raises the error.
"""
from __future__ import annotations

import errno
import os
import time
from collections.abc import Iterable
from concurrent.futures import Future, wait

from ..errors import IOStalledError, TierstoreValueError
from ._uring import READ, WRITE

DEFAULT_STALL_S = 300.0  # seconds without any completed piece before a wait gives up
_SLICE_S = 0.25  # seconds: how often a waiter looks at the progress clock


def stall_seconds(value: float | None) -> float:
    """The stall bound of an engine: `value`, else $TIERSTORE_IO_STALL_S, else DEFAULT_STALL_S."""
    name = "stall_timeout"
    if value is None:
        env = os.environ.get("TIERSTORE_IO_STALL_S")
        if env is None:
            return DEFAULT_STALL_S
        name = "TIERSTORE_IO_STALL_S"
        try:
            value = float(env)
        except ValueError:
            raise TierstoreValueError(f"TIERSTORE_IO_STALL_S={env!r} is not a number; set it to seconds, "
                                      "e.g. 300") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise TierstoreValueError(f"{name}={value!r} must be a number of seconds > 0 (default {DEFAULT_STALL_S})")
    return float(value)


class Progress:
    """When a piece of the engine's requests last completed (monotonic seconds)."""

    __slots__ = ("last", "stall_s")

    def __init__(self, stall_s: float):
        self.stall_s = stall_s
        self.last = time.monotonic()

    def tick(self) -> None:
        self.last = time.monotonic()


def describe(fut) -> str:
    """'write of 4096 bytes at offset 0 of /x' for an IOFuture (anything with op/name/offset/nbytes)."""
    op = {READ: "read", WRITE: "write"}.get(getattr(fut, "op", -1), "request")
    return f"{op} of {fut.nbytes} bytes at offset {fut.offset} of {fut.name}"


def stalled(pending: list, progress: Progress) -> IOStalledError:
    """The error for requests `pending` that saw no progress for the bound."""
    first = pending[0]
    shown = "; ".join(describe(f) for f in pending[:4])
    more = f" and {len(pending) - 4} more" if len(pending) > 4 else ""
    return IOStalledError(
        errno.ETIMEDOUT,
        f"no I/O request completed for {progress.stall_s:g} s; pending: {shown}{more}. The disk, its driver or "
        "the I/O backend stopped answering (see the kernel log, dmesg); if the disk is only slow, raise "
        "Engine(stall_timeout=...) or TIERSTORE_IO_STALL_S", first.name, first.offset, first.nbytes)


def wait_bounded(futures: Iterable[Future], progress: Progress, everything=None) -> None:
    """Wait until every future of `futures` is done, or raise IOStalledError once no piece of the engine
    completed for the bound. `everything()`: the pending requests to name (default: those waited for)."""
    futs = [f for f in futures if not f.done()]
    while futs:
        wait(futs, timeout=_SLICE_S)
        futs = [f for f in futs if not f.done()]
        if futs and time.monotonic() - progress.last > progress.stall_s:
            pending = everything() if everything is not None else futs
            if not pending:  # no request in flight to blame: what is awaited waits on something else
                continue
            raise stalled(sorted(pending, key=lambda f: (f.name, f.offset)), progress)
