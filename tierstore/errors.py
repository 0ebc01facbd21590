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


def io_error(err: int, what: str, filename: str | None, offset: int | None, length: int | None,
             hint: str = "") -> TierstoreIOError:
    """Build the error for a failed request; `err` is a positive errno."""
    msg = f"{what} failed: {os.strerror(err)}"
    if err == _errno.ENOSPC:
        msg += "; the disk is full: free space or add another directory to stripe over"
    if hint:
        msg += f"; {hint}"
    return TierstoreIOError(err, msg, filename, offset, length)


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


class MisuseError(TierstoreError, RuntimeError):
    """An object was used in a state that does not allow it (closed, dropped...); the message says what to do."""
