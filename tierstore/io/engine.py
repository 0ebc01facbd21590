"""Engine: asynchronous reads and writes of host buffers at file offsets.

    eng = Engine()                                # io_uring when the kernel allows it, else threads
    f = eng.open("/nvme0/x.bin")                  # O_DIRECT where the filesystem allows it
    fut = eng.write(f, tensor_or_buffer, offset)  # a Future; result() is the byte count
    eng.wait_all()                                # raises the first error since the last wait_all

[Note: requests and pieces]
A request (one read/write call) becomes pieces: one per stripe a striped file maps it to, each split in
`block_size` blocks. On a file opened with O_DIRECT every block goes through the O_DIRECT descriptor:
straight from/into the caller's memory where its address, file offset and length are 4 KiB aligned, else
through the engine's bounce buffers (see [Note: bounce buffers]). All pieces are in flight together, up
to `queue_depth` at once; the request's future resolves when the *last* piece has finished, so the
caller's buffer is never reused while the kernel may still touch it, and carries the first error (naming
the file, offset and length of the failed piece -- the caller's range, not the bounce buffer's).

[Note: bounce buffers]
A block whose buffer address (or file offset, or length) is not 4 KiB aligned -- an ordinary torch tensor
is 64-byte aligned -- cannot go to the O_DIRECT descriptor as it is, and the buffered descriptor is many
times slower on a large transfer (the page cache copies it and writes it back later). So such a block is
copied through one of the engine's own bounce buffers (a small, huge-page advised pool, registered with
io_uring with the caller's pool): a write copies block i+1 in while block i is in flight; a read lands in
a bounce buffer covering the block's 4 KiB-aligned range and is copied out when it completes -- with
io_uring on two copy threads, not on the one thread that completes every request of the engine. The first
such request of an engine is logged once at INFO, naming why. Only two things still use the buffered
descriptor of an O_DIRECT file: the partial 4 KiB blocks at the ends of a *write* whose file range is not
4 KiB aligned -- an O_DIRECT write of them would be a read-modify-write of a block another request may be
writing at the same time, which the page cache serialises and O_DIRECT does not; `stats()` counts them.
A filesystem that refuses O_DIRECT (ramfs, some network filesystems) gets buffered I/O for everything,
and files.py says so once per filesystem.
"""
from __future__ import annotations

import bisect
import ctypes
import errno
import itertools
import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np
import torch

from ..errors import (
    BackendUnavailableError,
    IOStalledError,
    MisuseError,
    TierstoreIOError,
    TierstoreValueError,
    io_error,
)
from . import _uring
from .files import ALIGN, File, StripedFile
from .pool import Buffer, BufferPool
from .stall import Progress, stall_seconds, wait_bounded
from .tuning import Tuning

log = logging.getLogger("tierstore.io")

READ, WRITE = _uring.READ, _uring.WRITE
_OPNAME = {READ: "read", WRITE: "write"}
FAULTS = {"eio": _uring.FAULT_EIO, "short": _uring.FAULT_SHORT, "enospc": _uring.FAULT_ENOSPC}


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
                err = io_error(-result, _OPNAME[self.op], self.file.path, off, length)
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


class _Faults:
    """Test-only fault injection: the nth I/O completion from now is made to fail or come back short."""

    def __init__(self):
        self.count = 0
        self.nth = 0
        self.kind = 0
        self.lock = threading.Lock()

    def arm(self, nth: int, kind: int) -> None:
        with self.lock:
            self.nth = self.count + nth if nth else 0
            self.kind = kind

    def apply(self, res: int) -> int:
        with self.lock:
            self.count += 1
            if not self.nth or self.count != self.nth:
                return res
            self.nth = 0
            kind = self.kind
        if kind == _uring.FAULT_EIO:
            return -errno.EIO
        if kind == _uring.FAULT_ENOSPC:
            return -errno.ENOSPC
        if kind == _uring.FAULT_SHORT:
            return (res // 2) & ~(ALIGN - 1) if res >= 2 * ALIGN else res // 2 if res > 1 else res
        return res


class FaultInjector(Protocol):
    """Test-only: arm(nth, kind) makes the nth I/O completion from now fail (kind: a _uring.FAULT_* value)."""

    def arm(self, nth: int, kind: int) -> None: ...


class Backend(Protocol):
    """What Engine needs from an I/O backend (io_uring or threads).

    Required: `name` (what Engine.backend reports), `faults`, `submit_many` and `close`. Registration is
    optional: a backend without registered buffers or files subclasses this protocol and keeps the defaults
    below (buffers not registered, files used by plain descriptor)."""

    name: str
    faults: FaultInjector

    def submit_many(self, pieces: list[Piece]) -> None:
        """Start every piece; each is finished (Piece.finish) exactly once, from any thread, even on error."""
        ...

    def close(self) -> None:
        """Release the backend; the engine has waited for everything in flight."""
        ...

    def register_buffers(self, regions: list[tuple[int, int]]) -> bool:
        """Register (address, bytes) regions for faster transfers; returns whether they were taken."""
        return False

    def register_file(self, f: File) -> None:
        """Register f's descriptors (recorded in f.slots); optional, the default registers nothing."""
        return None

    def unregister_file(self, f: File) -> None:
        """Undo register_file before f is closed."""
        return None


class _ThreadBackend(Backend):
    """preadv/pwritev on a pool of threads (the GIL is released inside each call)."""

    name = "threads"

    def __init__(self, depth: int):
        self._pool = ThreadPoolExecutor(max_workers=depth, thread_name_prefix="tierstore-io")
        self.faults = _Faults()

    def submit_many(self, pieces: list[Piece]) -> None:
        for p in pieces:
            self._pool.submit(self._run, p)

    def _run(self, p: Piece) -> None:
        done = 0
        try:
            while done < p.length:
                view = (ctypes.c_char * (p.length - done)).from_address(p.addr + done)
                try:
                    if p.op == READ:
                        n = os.preadv(p.fd, [view], p.offset + done)
                    else:
                        n = os.pwritev(p.fd, [view], p.offset + done)
                except OSError as e:
                    n = -(e.errno or errno.EIO)
                n = self.faults.apply(n)
                if n in (-errno.EINTR, -errno.EAGAIN):
                    continue
                if n <= 0:
                    if n < 0:
                        p.finish(n)
                        return
                    break  # end of file / nothing taken
                done += n
        except BaseException as e:  # never lose a completion
            p.fail(e)
            return
        p.finish(done)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class _UringBackend(Backend):
    """native/uring.c: one ring; any thread submits. A native thread reaps the ring and refills it without
    the GIL; a Python thread collects what it finished and completes the futures."""

    name = "io_uring"
    FILE_SLOTS = 4096

    def __init__(self, depth: int):
        self._lib = _uring.lib()
        ring = ctypes.c_void_p()
        rc = self._lib.ts_ring_create(depth, ctypes.byref(ring))
        if rc < 0:
            raise BackendUnavailableError(f"io_uring setup failed: {os.strerror(-rc)} (errno {-rc})")
        self._ring: ctypes.c_void_p | None = ring  # None once closed
        self.faults = self  # the ring injects its own faults (ts_inject)
        self._pieces: dict[int, Piece] = {}
        self._ids = itertools.count(1)
        self._regions: list[tuple[int, int, int]] = []  # (start, end, buf_index) sorted by start
        self._starts: list[int] = []
        self._slots_free: list[int] = []
        self._slot_lock = threading.Lock()
        if self._lib.ts_register_file_table(ring, self.FILE_SLOTS) == 0:
            self._slots_free = list(range(self.FILE_SLOTS - 1, -1, -1))
        else:
            log.debug("io_uring: registered files unavailable; using plain descriptors")
        self._broken = 0  # -errno once the ring itself failed
        rc = self._lib.ts_reaper_start(ring)
        if rc < 0:
            self._lib.ts_ring_destroy(ring)
            raise BackendUnavailableError(f"cannot start the io_uring completion thread: {os.strerror(-rc)}")
        self._collector = threading.Thread(target=self._collect_loop, name="tierstore-uring-collector", daemon=True)
        self._collector.start()

    # -- registration ---------------------------------------------------------------------------
    def register_buffers(self, regions: list[tuple[int, int]]) -> bool:
        if self._regions:
            self._lib.ts_unregister_buffers(self._ring)
            self._regions, self._starts = [], []
        n = len(regions)
        addrs = (ctypes.c_void_p * n)(*[a for a, _ in regions])
        lens = (ctypes.c_uint64 * n)(*[nbytes for _, nbytes in regions])
        rc = self._lib.ts_register_buffers(self._ring, addrs, lens, n)
        if rc < 0:
            log.debug("io_uring: buffer registration refused (%s); using plain reads/writes", os.strerror(-rc))
            return False
        self._regions = sorted((a, a + nbytes, i) for i, (a, nbytes) in enumerate(regions))
        self._starts = [r[0] for r in self._regions]
        return True

    def register_file(self, f: File) -> None:
        for fd in (f.fd, f.direct_fd):
            if fd is None:
                continue
            with self._slot_lock:
                if not self._slots_free:
                    return
                slot = self._slots_free.pop()
            if self._lib.ts_update_file(self._ring, slot, fd) == 0:
                f.slots[fd] = slot
            else:
                with self._slot_lock:
                    self._slots_free.append(slot)

    def unregister_file(self, f: File) -> None:
        for slot in list(f.slots.values()):
            self._lib.ts_update_file(self._ring, slot, -1)
            with self._slot_lock:
                self._slots_free.append(slot)
        f.slots.clear()

    def _buf_index(self, addr: int, length: int) -> int:
        i = bisect.bisect_right(self._starts, addr) - 1
        if i >= 0:
            start, end, idx = self._regions[i]
            if addr + length <= end:
                return idx
        return -1

    # -- requests -------------------------------------------------------------------------------
    def submit_many(self, pieces: list[Piece]) -> None:
        """One native call (one lock, one io_uring_enter) for the whole batch."""
        ios = np.empty(len(pieces), _uring.IO_DTYPE)
        rows = []
        for p in pieces:
            pid = next(self._ids)
            self._pieces[pid] = p
            slot = p.file.slots.get(p.fd)
            rows.append((pid, p.op, p.fd if slot is None else slot, slot is not None, self._buf_index(p.addr, p.length),
                         p.addr, p.length, p.offset))
        ios[:] = rows
        rc = self._broken or self._lib.ts_submit_many(self._ring, ios.ctypes.data, len(pieces))
        if rc < 0 or self._broken:  # nothing was queued, or no reaper is left to complete it
            for pid in ios["id"].tolist():
                self._fail(pid, rc if rc < 0 else self._broken)

    def _fail(self, pid: int, err: int) -> None:
        p = self._pieces.pop(pid, None)  # pop: whoever gets the piece finishes it, exactly once
        if p is not None:
            p.finish(err)

    def _collect_loop(self) -> None:
        ids = (ctypes.c_uint64 * 1024)()
        res = (ctypes.c_int64 * 1024)()
        state = ctypes.c_int(0)
        while True:
            n = self._lib.ts_collect(self._ring, ids, res, 1024, 1, ctypes.byref(state))
            if n < 0:
                log.error("io_uring: the ring failed (%s); failing what is in flight", os.strerror(-n))
                self._broken = n
                for pid in list(self._pieces):
                    self._fail(pid, n)
                return
            for i in range(n):
                p = self._pieces.pop(ids[i])
                try:
                    p.finish(res[i])
                except BaseException:  # a user callback must not kill the collector
                    log.exception("error while completing an I/O future")
            if state.value:  # the completion thread has stopped and everything is collected
                return

    def arm(self, nth: int, kind: int) -> None:
        self._lib.ts_inject(self._ring, nth, kind)

    def close(self) -> None:
        self._lib.ts_reaper_stop(self._ring)  # the engine waited for what was in flight
        self._collector.join()
        self._lib.ts_ring_destroy(self._ring)
        self._ring = None


def io_uring_status() -> tuple[bool, str]:
    """(available, reason) for io_uring on this machine."""
    try:
        rc = _uring.probe()
    except ImportError as e:
        return False, str(e)
    if rc == 0:
        return True, "io_uring available"
    if -rc == errno.ENOSYS:
        return False, "the kernel has no io_uring (ENOSYS)"
    if -rc == errno.EPERM:
        return False, "io_uring is forbidden here (EPERM: seccomp profile or kernel.io_uring_disabled)"
    return False, f"io_uring setup failed: {os.strerror(-rc)}"


class Engine:
    """Asynchronous file I/O of host buffers.

    backend: "auto" (io_uring, else a thread pool, saying why in the log), "io_uring" or "threads".
    queue_depth: requests in flight at once. block_size: a request is split into pieces of this many
    bytes, in flight together. direct: open files with O_DIRECT where possible.
    pool: a BufferPool whose memory is registered with io_uring (fixed buffers).
    bounce_bytes: the engine's own bounce buffers for unaligned memory (see [Note: bounce buffers]).
    stall_timeout: seconds without any completed request after which a wait raises IOStalledError naming
    what is pending (default $TIERSTORE_IO_STALL_S or 300; see [Note: bounded waits] in stall.py).
    `Engine.from_tuning(path)` builds one from what `tierstore tune` recommended.
    """

    def __init__(self, backend: str = "auto", queue_depth: int = 32, block_size: int = 1 << 20, *,
                 direct: bool = True, pool: BufferPool | None = None, bounce_bytes: int = 32 << 20,
                 stall_timeout: float | None = None):
        if backend not in ("auto", "io_uring", "threads"):
            raise TierstoreValueError(f"backend={backend!r}; choose 'auto', 'io_uring' or 'threads'")
        if not 1 <= queue_depth <= 4096:
            raise TierstoreValueError(f"queue_depth={queue_depth} must be in 1..4096")
        if block_size < ALIGN or block_size % ALIGN:
            raise TierstoreValueError(f"block_size={block_size} must be a positive multiple of {ALIGN} bytes")
        if isinstance(bounce_bytes, bool) or not isinstance(bounce_bytes, int) or bounce_bytes < 0:
            raise TierstoreValueError(f"bounce_bytes={bounce_bytes!r} must be an int >= 0 (bytes)")
        self._progress = Progress(stall_seconds(stall_timeout))
        self.queue_depth = queue_depth
        self.block_size = block_size  # bytes
        self.direct = direct
        self._backend: Backend
        if backend in ("auto", "io_uring"):
            ok, why = io_uring_status()
            if ok:
                self._backend = _UringBackend(queue_depth)
            elif backend == "io_uring":
                raise BackendUnavailableError(f"backend='io_uring' requested but {why}; use backend='auto' "
                                              "or 'threads'")
            else:
                log.warning("tierstore: %s; falling back to the thread-pool backend", why)
                self._backend = _ThreadBackend(queue_depth)
        else:
            self._backend = _ThreadBackend(queue_depth)
        # Bounce buffers: a block plus the 4 KiB a read's aligned cover may add; at least two, so a copy
        # overlaps a transfer. Not page-locked (the kernel pins what is in flight); untouched until used.
        bb = block_size + ALIGN
        self._bounce = BufferPool(max(2 * bb, bounce_bytes // bb * bb), bb, lock=False)
        self._counts = {"direct": 0, "bounced": 0, "buffered": 0}  # bytes by path (see stats())
        self._bounce_logged = False
        self._copier: ThreadPoolExecutor | None = None  # bounced reads' copy-out (io_uring), started when needed
        self.buffers_registered = False
        if pool is not None:
            self.register_pool(pool)
        else:
            self._backend.register_buffers(self._bounce.regions())
        self._files: dict[str, File] = {}
        self._owned: list[File | StripedFile] = []
        self._lock = threading.Lock()
        self._outstanding: set[IOFuture] = set()
        self._failed: list[Future] = []
        self._closed = False

    @property
    def backend(self) -> str:
        """Which backend runs: 'io_uring' or 'threads'."""
        return self._backend.name

    def register_pool(self, pool: BufferPool) -> bool:
        """Register the pool's memory as fixed buffers (io_uring). Returns whether the kernel took it. The
        bounce buffers are registered with it where the page-lock limit allows both, else the pool alone."""
        self.buffers_registered = (self._backend.register_buffers(pool.regions() + self._bounce.regions())
                                   or self._backend.register_buffers(pool.regions()))
        return self.buffers_registered

    @classmethod
    def from_tuning(cls, path: str | os.PathLike, **overrides) -> Engine:
        """An engine with the knobs `tierstore tune` wrote to `path` (see tierstore/io/tuning.py); keyword
        arguments override them."""
        return cls(**{**Tuning.load(path).engine_kwargs(), **overrides})

    def stats(self) -> dict:
        """Bytes moved so far by path: 'direct' (O_DIRECT from/into the caller's memory), 'bounced' (O_DIRECT
        through the bounce buffers) and 'buffered' (the page cache: a filesystem without O_DIRECT, or the
        partial end blocks of an unaligned write), plus the bounce buffers' count and size."""
        with self._lock:
            out = dict(self._counts)
        out["bounce_buffers"] = self._bounce.count
        out["bounce_buffer_bytes"] = self._bounce.buffer_bytes
        return out

    # -- files ----------------------------------------------------------------------------------
    def open(self, path: str | os.PathLike, mode: str = "c", *, direct: bool | None = None) -> File:
        """Open a file for this engine. Modes: 'r', 'r+', 'w' (truncate), 'c' (create, keep contents)."""
        self._check_open()
        f = File(path, mode, direct=self.direct if direct is None else direct)
        self._backend.register_file(f)
        with self._lock:
            self._owned.append(f)
        return f

    def open_striped(self, dirs: Sequence[str | os.PathLike], name: str, mode: str = "c", *,
                     stripe_unit: int = 1 << 20, direct: bool | None = None) -> StripedFile:
        """One logical file striped RAID-0 over `dirs` (one per drive), `stripe_unit` bytes per stripe."""
        self._check_open()
        sf = StripedFile(dirs, name, mode, stripe_unit=stripe_unit, direct=self.direct if direct is None else direct)
        for f in sf.parts:
            self._backend.register_file(f)
        with self._lock:
            self._owned.append(sf)
        return sf

    def close_file(self, f: File | StripedFile) -> None:
        """Close a file opened by this engine. Its requests must have finished."""
        for part in f.files():
            self._backend.unregister_file(part)
        f.close()
        with self._lock:
            if f in self._owned:
                self._owned.remove(f)

    def _resolve(self, file: File | StripedFile | str | os.PathLike, op: int) -> File | StripedFile:
        if isinstance(file, (File, StripedFile)):
            if file.closed:
                raise MisuseError(f"{file!r} is closed; open it again with engine.open()")
            return file
        path = os.path.abspath(os.fspath(file))
        with self._lock:
            f = self._files.get(path)
        if f is None:
            f = self.open(path, "r+" if os.path.exists(path) else ("c" if op == WRITE else "r"))
            with self._lock:
                self._files.setdefault(path, f)
                f = self._files[path]
        return f

    # -- requests -------------------------------------------------------------------------------
    def read(self, file, buffer, offset: int = 0) -> IOFuture:
        """Read len(buffer) bytes at `offset` of `file` (a File, StripedFile or path) into `buffer`."""
        return self._submit(READ, file, [(buffer, offset)])

    def write(self, file, buffer, offset: int = 0) -> IOFuture:
        """Write `buffer` at `offset` of `file` (a File, StripedFile or path)."""
        return self._submit(WRITE, file, [(buffer, offset)])

    def read_many(self, file, requests) -> IOFuture:
        """Read each (buffer, offset) of `requests` from `file`, all submitted as one batch.

        One future for the batch: its result is the total bytes, its error the first failed request's (naming
        that request's offset and length). For many small transfers this costs a fraction of single calls."""
        return self._submit(READ, file, list(requests))

    def write_many(self, file, requests) -> IOFuture:
        """Write each (buffer, offset) of `requests` to `file`, all submitted as one batch (see read_many)."""
        return self._submit(WRITE, file, list(requests))

    def _submit(self, op: int, file, requests: list) -> IOFuture:
        self._check_open()
        f = self._resolve(file, op)
        pieces: list[Piece] = []
        keep, total = [], 0
        for buffer, offset in requests:
            if offset < 0:
                raise TierstoreValueError(f"offset={offset} must be >= 0")
            addr, nbytes, k = buffer_address(buffer, writable=op == READ)
            keep.append(k)
            pieces.extend(self._pieces(op, f, addr, nbytes, offset))
            total += nbytes
        fut = IOFuture(op, f.path, min((o for _, o in requests), default=0), total, keep, self._progress)
        if not pieces:
            fut.set_result(0)
            return fut
        counts = dict.fromkeys(self._counts, 0)
        straight, bounced = [], []
        for p in pieces:
            p.fut = fut
            if p.bounce is not None:
                bounced.append(p)
                counts["bounced"] += p.want
            else:
                straight.append(p)
                counts["direct" if p.direct else "buffered"] += p.length
        fut._left = len(pieces)
        with self._lock:
            if not self._outstanding:  # busy from idle: the stall clock starts now ([Note: bounded waits])
                self._progress.tick()
            self._outstanding.add(fut)
            for key, v in counts.items():
                self._counts[key] += v
            first_bounce = bool(bounced) and not self._bounce_logged
            self._bounce_logged = self._bounce_logged or first_bounce
        if first_bounce:
            p = bounced[0]
            why = (f"its buffer address {p.user:#x}" if p.user % ALIGN else
                   f"its file offset {p.offset + p.skip}" if (p.offset + p.skip) % ALIGN else f"its length {p.want}")
            log.info("a %s of %s: %s is not %d-byte aligned, so unaligned blocks go through the "
                     "engine's O_DIRECT bounce buffers (one extra copy); 4 KiB-aligned memory (a BufferPool "
                     "buffer, tierstore.tiers.host.aligned_empty) skips the copy", _OPNAME[op], f.path, why, ALIGN)
        fut.add_done_callback(self._on_done)
        if straight:
            self._backend.submit_many(straight)
        if bounced:
            self._submit_bounced(op, bounced)
        return fut

    def _submit_bounced(self, op: int, pieces: list[Piece]) -> None:
        """Lease a bounce buffer per piece, as they free up, and submit (see [Note: bounce buffers]): a write
        is copied in and submitted at once, so the copy of the next overlaps its transfer; reads are
        submitted in batches of the buffers free at the time, each copied out as it completes."""
        copier = None
        if op == READ and self.backend == "io_uring":  # its one collector thread completes everything
            with self._lock:
                if self._copier is None:
                    self._copier = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tierstore-bounce")
                copier = self._copier
        i = 0
        try:
            while i < len(pieces):
                batch = [pieces[i]]
                batch[0].bounce = self._bounce.lease()
                if op == READ:
                    while i + len(batch) < len(pieces):
                        buf = self._bounce.try_lease()
                        if buf is None:
                            break
                        pieces[i + len(batch)].bounce = buf
                        batch.append(pieces[i + len(batch)])
                for p in batch:
                    p.addr, p.copier = p.bounce.addr, copier
                    if op == WRITE:
                        ctypes.memmove(p.addr, p.user, p.want)
                i += len(batch)
                self._backend.submit_many(batch)
        except BaseException as e:  # never leave a request's future unresolved
            for p in pieces[i:]:
                p.fail(e)
            raise

    def _pieces(self, op, f, addr, nbytes, offset):
        """The pieces of one request (see [Note: requests and pieces]); their future is set by the caller. A
        bounced piece gets its bounce buffer (and so its address) when it is submitted."""
        bs = self.block_size
        for part, phys, boff, length in f.map(offset, nbytes):
            a = addr + boff
            if part.direct_fd is None:  # the filesystem refuses O_DIRECT (files.py logged it)
                for o in range(0, length, bs):
                    yield Piece(None, op, part, part.fd, a + o, min(bs, length - o), phys + o, False)
                continue
            pos, end = 0, length
            if op == WRITE and phys % ALIGN:  # the partial first block of an unaligned write: buffered
                head = min(end, ALIGN - phys % ALIGN)
                yield Piece(None, op, part, part.fd, a, head, phys, False)
                pos = head
            if op == WRITE:  # ... and the partial last block
                tail = (phys + end) % ALIGN if end > pos else 0
                if tail:  # (phys + end - tail is 4 KiB aligned, so it is >= phys + pos)
                    end -= tail
                    yield Piece(None, op, part, part.fd, a + end, tail, phys + end, False)
            for o in range(pos, end, bs):
                n = min(bs, end - o)
                pa, po = a + o, phys + o
                if pa % ALIGN == 0 and po % ALIGN == 0 and n % ALIGN == 0:
                    yield Piece(None, op, part, part.direct_fd, pa, n, po, True)
                    continue
                if pa % ALIGN == 0 and po % ALIGN == 0 and n > ALIGN:  # a read's unaligned tail: bounce it alone
                    body = n - n % ALIGN
                    yield Piece(None, op, part, part.direct_fd, pa, body, po, True)
                    pa, po, n = pa + body, po + body, n - body
                lo = po - po % ALIGN  # the aligned cover of [po, po + n)
                cover = (po + n - lo + ALIGN - 1) // ALIGN * ALIGN
                yield Piece(None, op, part, part.direct_fd, 0, cover, lo, True, bounce=True, user=pa, skip=po - lo,
                            want=n)

    def _on_done(self, fut: Future) -> None:  # an IOFuture
        with self._lock:
            self._outstanding.discard(fut)
            if fut.exception() is not None:
                self._failed.append(fut)

    def wait_all(self) -> None:
        """Wait for every request submitted so far; raise the first error since the last wait_all(), or
        IOStalledError naming what is pending once nothing completed for the stall bound ([Note: bounded
        waits] in stall.py)."""
        while True:
            with self._lock:
                pending = list(self._outstanding)
            if not pending:
                break
            wait_bounded(pending, self._progress, self._pending)
        with self._lock:
            failed, self._failed = self._failed, []
        if failed:
            error = failed[0].exception()
            assert error is not None  # only futures that failed are kept
            raise error

    def wait_for(self, futures) -> None:
        """Wait until every future of `futures` is done -- futures of a layer above (a write through a staging
        buffer) that this engine's requests complete -- bounded as the engine's own waits are: IOStalledError
        naming the engine's pending requests once none completed for the stall bound ([Note: bounded waits]
        in stall.py). Errors stay on the futures."""
        wait_bounded(futures, self._progress, self._pending)

    def _pending(self) -> list[IOFuture]:
        with self._lock:
            return [f for f in self._outstanding if not f.done()]

    def fsync(self, file: File | StripedFile) -> None:
        """Make everything written to `file` durable."""
        file.fsync()

    def inject_fault(self, nth: int, kind: str) -> None:
        """Test-only: make the nth I/O completion from now fail with EIO / ENOSPC, or come back short."""
        if kind not in FAULTS:
            raise TierstoreValueError(f"kind={kind!r}; choose one of {sorted(FAULTS)}")
        self._backend.faults.arm(nth, FAULTS[kind])

    def _check_open(self) -> None:
        if self._closed:
            raise MisuseError("the engine is closed; create a new Engine")

    def close(self) -> None:
        """Wait for what is in flight, then release the ring/threads and close the files it opened."""
        if self._closed:
            return
        try:
            self.wait_all()
        except IOStalledError:
            # what is pending may still be touched by the kernel or a backend thread: keep the backend, files
            # and buffers alive, and say what stalled ([Note: bounded waits] in stall.py)
            self._closed = True
            raise
        except TierstoreIOError:
            pass  # reported through the futures already
        self._closed = True
        self._backend.close()
        if self._copier is not None:
            self._copier.shutdown(wait=True)
        self._bounce.close()
        with self._lock:
            owned, self._owned = self._owned, []
            self._files.clear()
        for f in owned:
            f.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Engine(backend={self.backend!r}, queue_depth={self.queue_depth}, block_size={self.block_size})"
