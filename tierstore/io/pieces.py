"""One request's future and its pieces: the units a backend runs, and the host buffers they move.

A request (one Engine.read / write / read_many / write_many call) has one IOFuture, resolved when its last
Piece finishes; a Piece moves one block between a host address and a file offset, directly or through a
bounce buffer ([Note: requests and pieces] and [Note: bounce buffers] in engine.py).
"""
from __future__ import annotations

import ctypes
import errno
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from ..errors import TierstoreIOError, TierstoreValueError, io_error
from . import _uring
from .pool import Buffer
from .stall import Progress, wait_bounded

READ, WRITE = _uring.READ, _uring.WRITE
OPNAME = {READ: "read", WRITE: "write"}


class IOFuture(Future):
    """Future of one read/write request; result() is the number of bytes moved."""

    def __init__(self, op: int, name: str, offset: int, nbytes: int, keep: Any, progress: Progress | None = None):
        super().__init__()
        self.op, self.name, self.offset, self.nbytes = op, name, offset, nbytes
        self._progress = progress  # the engine's clock: waits give up when it stops ([Note: bounded waits])
        self._keep = keep  # the buffer must live until every piece is done
        self._left = 0
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    def _piece_done(self, error: BaseException | None) -> None:
        with self._lock:
            if error is not None and self._error is None:
                self._error = error
            self._left -= 1
            last = self._left == 0
        if self._progress is not None:
            self._progress.tick()
        if last:
            self._keep = None
            if self._error is not None:
                self.set_exception(self._error)
            else:
                self.set_result(self.nbytes)

    def result(self, timeout: float | None = None) -> Any:
        """The bytes moved; without a timeout, raises IOStalledError once the engine made no progress for its
        stall bound ([Note: bounded waits] in stall.py)."""
        if timeout is None and self._progress is not None:
            wait_bounded([self], self._progress)
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if timeout is None and self._progress is not None:
            wait_bounded([self], self._progress)
        return super().exception(timeout)


def buffer_address(buf: Any, writable: bool) -> tuple[int, int, Any]:
    """(address, nbytes, object to keep alive) of a host buffer: a pool Buffer, a CPU torch tensor, a
    numpy array or anything with the buffer protocol. Must be contiguous."""
    if isinstance(buf, Buffer):
        buf._check()
        return buf.addr, buf.nbytes, buf
    if isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu":
            raise TierstoreValueError(
                f"the engine moves host memory; got a tensor on {buf.device}: copy it to a host (pinned) buffer first")
        if not buf.is_contiguous():
            raise TierstoreValueError("the tensor is not contiguous; pass tensor.contiguous()")
        return buf.data_ptr(), buf.numel() * buf.element_size(), buf
    try:
        arr = np.asarray(buf) if isinstance(buf, np.ndarray) else np.frombuffer(memoryview(buf).cast("B"), np.uint8)
    except (TypeError, ValueError) as e:
        raise TierstoreValueError(f"cannot do I/O into a {type(buf).__name__}: {e}; pass a contiguous "
                                  "tensor, numpy array, bytearray or pool Buffer") from None
    if not arr.flags.c_contiguous:
        raise TierstoreValueError("the array is not contiguous; pass np.ascontiguousarray(array)")
    if writable and not arr.flags.writeable:
        raise TierstoreValueError(f"cannot read into a read-only {type(buf).__name__}; pass a bytearray or array")
    return arr.__array_interface__["data"][0], arr.nbytes, (buf, arr)


class Piece:
    """One transfer a backend runs: `length` bytes between address `addr` and `offset` of one descriptor `fd` of
    `file` (see [Note: requests and pieces]); the backend calls finish() with the result exactly once.

    A bounced piece (`bounce` set, see [Note: bounce buffers]) moves the caller's `want` bytes at address
    `user`, file offset `offset + skip`, through the bounce buffer at `addr`; finish() copies a read out
    and gives the bounce buffer back. Errors always name the caller's range."""

    __slots__ = ("fut", "op", "file", "fd", "addr", "length", "offset", "direct", "bounce", "user", "skip", "want",
                 "copier")

    def __init__(self, fut, op, file, fd, addr, length, offset, direct, bounce=None, user=0, skip=0, want=0):
        self.fut, self.op, self.file, self.fd = fut, op, file, fd
        self.addr, self.length, self.offset, self.direct = addr, length, offset, direct
        self.bounce, self.user, self.skip, self.want = bounce, user, skip, want
        self.copier: ThreadPoolExecutor | None = None  # where a bounced read is copied out (else in finish)

    @property
    def user_range(self) -> tuple[int, int]:
        """(file offset, length) of the caller's bytes this piece moves."""
        return (self.offset + self.skip, self.want) if self.bounce is not None else (self.offset, self.length)

    def finish(self, result: int) -> None:
        """`result` is bytes moved or -errno. A short count is an error too (end of file / no space)."""
        err: BaseException | None = None
        try:
            off, length = self.user_range
            need = self.skip + self.want if self.bounce is not None and self.op == READ else self.length
            if result < 0:
                err = io_error(-result, OPNAME[self.op], self.file.path, off, length)
            elif result < need:
                if self.op == READ:
                    got = max(0, min(result - self.skip, length)) if self.bounce is not None else result
                    what = f"read past end of file (got {got} of {length} bytes)"
                    err = TierstoreIOError(errno.EIO, what, self.file.path, off, length)
                else:
                    err = io_error(errno.ENOSPC, f"write (only {result} of {self.length} bytes taken)",
                                   self.file.path, off, length)
            elif self.bounce is not None and self.op == READ:
                if self.copier is not None:  # off the thread that completes every request of the engine
                    self.copier.submit(self._copy_out)
                    return
                ctypes.memmove(self.user, self.addr + self.skip, self.want)
        except BaseException as e:  # never lose a completion
            err = err or e
        self._done(err)

    def _copy_out(self) -> None:
        err: BaseException | None = None
        try:
            ctypes.memmove(self.user, self.addr + self.skip, self.want)
        except BaseException as e:  # never lose a completion
            err = e
        self._done(err)

    def _done(self, err: BaseException | None) -> None:
        if isinstance(self.bounce, Buffer):
            self.bounce.release()
            self.bounce = None
        self.fut._piece_done(err)

    def fail(self, error: BaseException) -> None:
        """Finish with `error` (raised while running it), giving the bounce buffer back if it has one."""
        self._done(error)

