"""The I/O backends the engine submits pieces to: io_uring (native/uring.c) and a thread pool, the Backend
contract they keep, and the test-only fault injection of each.
"""
from __future__ import annotations

import bisect
import ctypes
import errno
import itertools
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import numpy as np

from ..errors import BackendUnavailableError
from . import _uring
from .files import ALIGN, File
from .pieces import READ, Piece

log = logging.getLogger("tierstore.io")

FAULTS = {"eio": _uring.FAULT_EIO, "short": _uring.FAULT_SHORT, "enospc": _uring.FAULT_ENOSPC}


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

