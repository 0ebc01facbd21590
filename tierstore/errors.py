"""tierstore's exceptions: one family, each also the builtin a caller would naturally catch.

Every message says what was wrong and, where there is one, how to fix it.
"""
from __future__ import annotations

import errno as _errno
import os


class TierstoreError(Exception):
    """Base of every error raised by tierstore."""


class TierstoreIOError(TierstoreError, OSError):
    """An I/O request failed. Names the file, the byte offset, the length and the errno."""

    errno: int  # always given (OSError's may be None)

    def __init__(self, err: int, message: str, filename: str | None = None,
                 offset: int | None = None, length: int | None = None):
        OSError.__init__(self, err, message, filename)
        self.offset = offset  # bytes
        self.length = length  # bytes

    def __str__(self) -> str:
        name = _errno.errorcode.get(self.errno, str(self.errno)) if self.errno else "?"
        where = []
        if self.filename is not None:
            where.append(f"file {self.filename!r}")
        if self.offset is not None:
            where.append(f"offset {self.offset}")
        if self.length is not None:
            where.append(f"length {self.length}")
        suffix = f" ({', '.join(where)})" if where else ""
        return f"[{name}] {self.strerror}{suffix}"

    def __reduce__(self):
        return (type(self), (self.errno, self.strerror, self.filename, self.offset, self.length))


_DISK_FAILED = "the disk or its filesystem failed (see the kernel log, dmesg): check and repair it"
_ADVICE = {
    _errno.ENOSPC: "the disk is full: free space, or use a disk (or more directories) with room",
    _errno.EDQUOT: "the disk quota is used up: free space or raise the quota",
    _errno.EIO: _DISK_FAILED,
    _errno.EUCLEAN: _DISK_FAILED,
    _errno.ENXIO: "the device is gone: reattach the disk",
    _errno.ENODEV: "the device is gone: reattach the disk",
    _errno.EROFS: "the filesystem is read-only (a filesystem remounts itself read-only after an error): check "
                  "the disk, then remount it read-write",
    _errno.EACCES: "permission denied: give this process write access to the store's directories",
    _errno.EPERM: "operation not permitted: give this process write access to the store's directories",
    _errno.EFBIG: "the file grew past what the filesystem allows: use a smaller extent_file_bytes",
    _errno.EMFILE: "too many open files: raise the limit (ulimit -n)",
    _errno.ENFILE: "too many open files on the system: close some or raise fs.file-max",
}


def advice(err: int | None) -> str:
    """What to do about a failed request with errno `err` (positive), true for that cause; "" if nothing
    specific can be said. Never "free space" for anything but a full disk.

    [Note: advice follows the errno]
    A full disk is fixed by freeing space; an EIO (a failing disk, or a filesystem that was shut down after
    an error -- ext4 and xfs then answer every request with EIO) or EROFS is not, and telling the user to
    free space sends them the wrong way. Callers add what their own state allows (whether a retry can
    succeed); this says only what the cause needs."""
    return _ADVICE.get(err or 0, "")


def io_error(err: int, what: str, filename: str | None, offset: int | None, length: int | None,
             hint: str = "") -> TierstoreIOError:
    """Build the error for a failed request; `err` is a positive errno."""
    msg = f"{what} failed: {os.strerror(err)}"
    if advice(err):
        msg += f"; {advice(err)}"
    if hint:
        msg += f"; {hint}"
    return TierstoreIOError(err, msg, filename, offset, length)


def prefixed(e: TierstoreIOError, prefix: str) -> TierstoreIOError:
    """A TierstoreIOError like `e` (errno, file, offset, length) with `prefix` put before its message: a
    caller adds what the failure means at its level (which value was not kept)."""
    return TierstoreIOError(e.errno, f"{prefix}: {e.strerror}", e.filename, e.offset, e.length)


class CorruptionError(TierstoreIOError):
    """Stored bytes do not match their checksum (or a manifest is unreadable)."""

    def __init__(self, message: str, filename: str | None = None, offset: int | None = None,
                 length: int | None = None):
        super().__init__(_errno.EBADMSG, message, filename, offset, length)


class TierFullError(TierstoreError, MemoryError):
    """No tier has room for a tensor."""


class PinnedMemoryError(TierstoreError, MemoryError):
    """Page-locked memory could not be had (usually the `ulimit -l` limit)."""


class BackendUnavailableError(TierstoreError, RuntimeError):
    """The requested I/O backend cannot run here (for example io_uring refused by the kernel)."""


class TierstoreValueError(TierstoreError, ValueError):
    """Bad input: the message names the argument and what would be accepted."""


class TierstoreTypeError(TierstoreValueError, TypeError):
    """Bad input of a kind Python itself refuses with TypeError (an unknown keyword argument, a value of the
    wrong type): a TierstoreValueError that code catching TypeError still catches."""


class MisuseError(TierstoreError, RuntimeError):
    """An object was used in a state that does not allow it (closed, dropped...); the message says what to do."""


class StalledError(TierstoreError, TimeoutError):
    """A wait that cannot end: what it waits for is held by operations that failed or stopped. The message
    names what waits and what holds it."""


class IOStalledError(TierstoreIOError, StalledError):
    """I/O requests made no progress for the engine's stall bound. Names what was pending (operation, file,
    offset, length); see [Note: bounded waits] in io/stall.py."""
