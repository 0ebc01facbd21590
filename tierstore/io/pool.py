"""BufferPool: one budget of 4 KiB-aligned, page-locked host memory, handed out in fixed-size buffers.

[Note: back-pressure, not assertions]
DeepSpeed's swappers assert when no buffer is free ("Not enough buffers", #3062) or when a tensor is
larger than a buffer (#3506). Here the pool is allocated once, never grows past its budget and never
allocates per I/O: a caller that finds it empty *waits* until another caller releases a buffer, and a
tensor larger than one buffer is streamed through buffers in pieces by the layer above.

[Note: a wait on the pool is bounded]
Back-pressure waits for I/O in flight, which ends in milliseconds to seconds: every buffer is given back
when its request completes. A buffer that is never given back -- held by an operation that failed and
kept it, or by a thread that stopped -- would make every later caller wait forever, with nothing said.
So each lease records who took it (thread, function, when), and a caller that has waited `stall_s`
seconds (STALL_S by default) without any buffer coming back raises StalledError naming the pool and what
holds each buffer, instead of waiting on. Any buffer given back restarts the clock, so a slow disk that
still completes requests never trips it.
"""
from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import resource
import sys
import threading
import time
from typing import Any

import torch

from .._units import fmt_bytes
from ..errors import MisuseError, PinnedMemoryError, StalledError, TierstoreValueError

log = logging.getLogger("tierstore.io")

ALIGN = 4096  # bytes: O_DIRECT alignment used everywhere
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
HUGE = 2 << 20  # bytes: a transparent huge page on x86_64 and most arm64 kernels
STALL_S = 60.0  # seconds a caller waits for a buffer with none given back ([Note: a wait on the pool is bounded])
_LEASERS = frozenset({"lease", "try_lease", "_lease_or_finish", "_hand_out"})  # not the holder's own name
MADV_HUGEPAGE = 14


def advise_huge_pages(addr: int, nbytes: int) -> bool:
    """Ask for transparent huge pages on [addr, addr+nbytes) before its first touch (see [Note: huge pages]).
    Returns whether the kernel took the advice; where THP is off, nothing changes."""
    return _libc.madvise(addr, nbytes, MADV_HUGEPAGE) == 0


MADV_POPULATE_WRITE = 23  # Linux >= 5.14


def populate(addr: int, nbytes: int) -> bool:
    """Fault in [addr, addr+nbytes) writable now (MADV_POPULATE_WRITE), so that an O_DIRECT read into fresh
    memory does not take its page faults one by one inside the submission (see [Note: fresh memory] in
    tiers/nvme/reads.py). Returns False where the kernel lacks it (older than 5.14): the read faults as before."""
    start = addr - addr % ALIGN
    return _libc.madvise(start, nbytes + (addr - start), MADV_POPULATE_WRITE) == 0


def physical_memory() -> int | None:
    """Bytes of physical memory of this machine, None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None


def memlock_limit() -> int | None:
    """The soft RLIMIT_MEMLOCK in bytes, or None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


def check_pinned_budget(nbytes: int, what: str = "the pinned pool") -> None:
    """PinnedMemoryError when `nbytes` of page-locked memory can never be had here (more than this machine's
    memory): the check BufferPool makes, for callers that must refuse such a budget before they create
    anything else."""
    memory = physical_memory()
    if memory is not None and nbytes > memory:
        raise PinnedMemoryError(
            f"{what}: a pinned pool of {fmt_bytes(nbytes)} is larger than this machine's memory "
            f"({fmt_bytes(memory)}): lower the pinned budget (Store's budgets['pinned'] / pinned_bytes; 64-256 MiB "
            "keeps the disk busy)")


class Buffer:
    """A leased buffer of `nbytes` page-locked bytes at a 4 KiB-aligned address. Release it (or use `with`)."""

    __slots__ = ("pool", "index", "addr", "nbytes", "_released", "__weakref__")

    def __init__(self, pool: BufferPool, index: int):
        self.pool = pool
        self.index = index  # which buffer of the pool
        self.nbytes = pool.buffer_bytes  # bytes
        self.addr = pool.base_addr + index * pool.buffer_bytes
        self._released = False

    def tensor(self, dtype: torch.dtype = torch.uint8, numel: int | None = None) -> torch.Tensor:
        """A CPU tensor viewing the first `numel` elements (default: as many as fit) of the buffer."""
        self._check()
        item = torch.empty((), dtype=dtype).element_size()
        n = self.nbytes // item if numel is None else numel
        if n * item > self.nbytes:
            raise TierstoreValueError(f"{n} elements of {dtype} need {n * item} bytes; the buffer has {self.nbytes}")
        start = self.index * self.pool.buffer_bytes
        return self.pool._u8[start:start + n * item].view(dtype)

    def memoryview(self) -> memoryview:
        self._check()
        start = self.index * self.pool.buffer_bytes
        return memoryview(self.pool._mm)[self.pool._off + start:self.pool._off + start + self.nbytes]

    def _check(self) -> None:
        if self._released:
            raise MisuseError("this pool buffer was released; lease a new one with pool.lease()")

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.pool._give_back(self.index)

    def __enter__(self) -> Buffer:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self):  # a forgotten lease must not starve the pool
        try:
            self.release()
        except Exception:
            pass


class BufferPool:
    """`budget_bytes` of page-locked memory split into buffers of `buffer_bytes` (both 4 KiB multiples).

    `lease()` returns a free Buffer, waiting while none is free. With `lock=True` (default) the memory is
    mlock()ed, and registered with CUDA when a CUDA device is present, so device copies can be async.
    """

    def __init__(self, budget_bytes: int, buffer_bytes: int = 4 << 20, *, lock: bool = True):
        for name, v in (("budget_bytes", budget_bytes), ("buffer_bytes", buffer_bytes)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TierstoreValueError(f"{name}={v!r} must be an int number of bytes (e.g. 64 << 20)")
        if buffer_bytes <= 0 or buffer_bytes % ALIGN:
            raise TierstoreValueError(f"buffer_bytes={buffer_bytes} must be a positive multiple of {ALIGN}")
        if budget_bytes < buffer_bytes:
            raise TierstoreValueError(
                f"budget_bytes={budget_bytes} is smaller than one buffer ({buffer_bytes} bytes); "
                "raise the budget or lower buffer_bytes")
        self.buffer_bytes = buffer_bytes  # bytes
        self.count = budget_bytes // buffer_bytes
        self.nbytes = self.count * buffer_bytes  # bytes actually reserved (<= budget)
        check_pinned_budget(self.nbytes)
        # [Note: huge pages] The mapping starts on a 2 MiB boundary and asks for transparent huge pages
        # before its first touch: an O_DIRECT request then pins a few huge pages instead of 256 small ones
        # per MiB, which costs less CPU per request. Best effort: where THP is off, the pool works on small pages.
        try:
            self._mm = mmap.mmap(-1, self.nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except OSError as e:  # ENOMEM: the address space or the overcommit policy refuses it
            raise PinnedMemoryError(
                f"cannot reserve {fmt_bytes(self.nbytes)} of host memory for the pinned pool: {e.strerror}. "
                "Lower the pinned budget (Store's budgets['pinned'] / pinned_bytes) or free memory") from None
        start = ctypes.addressof(ctypes.c_char.from_buffer(self._mm))
        self._off = (-start) % HUGE  # bytes skipped to reach the 2 MiB boundary
        self.base_addr = start + self._off
        self.huge_pages = advise_huge_pages(self.base_addr, self.nbytes)
        self._u8 = torch.frombuffer(self._mm, dtype=torch.uint8)[self._off:self._off + self.nbytes]
        self.locked = False
        self._cuda_registered = False
        if lock:
            self._lock_pages()
        self._free = list(range(self.count - 1, -1, -1))
        self._cond = threading.Condition()
        self._closed = False
        self.waits = 0  # times a caller had to wait for a buffer (back-pressure events)
        self.stall_s = STALL_S  # seconds ([Note: a wait on the pool is bounded])
        self._holders: dict[int, tuple[str, str, float]] = {}  # leased index -> (thread, function, when)
        self._given = time.monotonic()  # when a buffer was last given back

    def _lock_pages(self) -> None:
        if _libc.mlock(self.base_addr, self.nbytes) != 0:
            err = ctypes.get_errno()
            limit = memlock_limit()
            lim = "unlimited" if limit is None else fmt_bytes(limit)
            del self._u8  # drop the view so the mapping can go
            self._mm.close()
            if err in (errno.ENOMEM, errno.EAGAIN) and (limit is None or self.nbytes <= limit):
                raise PinnedMemoryError(  # the limit allows it: the memory itself is short
                    f"cannot page-lock {fmt_bytes(self.nbytes)} of host memory: {os.strerror(err)}, though the "
                    f"page-lock limit (ulimit -l) is {lim}. Lower the pinned budget, free memory, or pass "
                    "lock=False (slower device copies)")
            if err in (errno.ENOMEM, errno.EPERM, errno.EAGAIN):
                raise PinnedMemoryError(
                    f"cannot page-lock {fmt_bytes(self.nbytes)} of host memory: the page-lock limit "
                    f"(ulimit -l) is {lim}. Fix: raise it (`ulimit -l unlimited` in the shell, "
                    "'* - memlock unlimited' in /etc/security/limits.conf, or `docker run --ulimit "
                    "memlock=-1`), or lower the pinned budget, or pass lock=False (slower device copies)")
            raise PinnedMemoryError(f"mlock of {fmt_bytes(self.nbytes)} failed: {errno.errorcode.get(err, err)}")
        self.locked = True
        if torch.cuda.is_available():  # CUDA only: run by tests/test_accelerator.py on a GPU
            rc = torch.cuda.cudart().cudaHostRegister(self.base_addr, self.nbytes, 0)
            self._cuda_registered = int(rc) == 0
            if not self._cuda_registered:
                log.warning("cudaHostRegister of the buffer pool failed (%s); device copies will be synchronous", rc)

    def regions(self) -> list[tuple[int, int]]:
        """(address, nbytes) spans to register with the I/O engine, each at most 1 GiB (the kernel's limit)."""
        step = max(self.buffer_bytes, (1 << 30) // self.buffer_bytes * self.buffer_bytes)
        return [(self.base_addr + o, min(step, self.nbytes - o)) for o in range(0, self.nbytes, step)]

    @property
    def free(self) -> int:
        return len(self._free)

    def lease(self, timeout: float | None = None, *, since: float | None = None) -> Buffer:
        """A free buffer; waits (back-pressure) while every buffer is leased. TimeoutError after `timeout` s;
        StalledError once the wait, begun at `since` (time.monotonic(); default now), has gone `stall_s` s
        without a buffer given back ([Note: a wait on the pool is bounded])."""
        start = time.monotonic() if since is None else since
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            if not self._free:
                self.waits += 1
            while not self._free:
                if self._closed:
                    raise MisuseError("the buffer pool is closed")
                now = time.monotonic()
                quiet = now - max(start, self._given)  # seconds of this wait without a buffer back
                if quiet >= self.stall_s:
                    raise self._stalled(quiet)
                left = self.stall_s - quiet if deadline is None else min(deadline - now, self.stall_s - quiet)
                if deadline is not None and left <= 0:
                    raise TimeoutError(
                        f"no pool buffer became free within {timeout} s ({self.count} buffers of "
                        f"{fmt_bytes(self.buffer_bytes)} all leased); release buffers or raise the budget")
                self._cond.wait(left)
            if self._closed:
                raise MisuseError("the buffer pool is closed")
            return self._hand_out()

    def try_lease(self) -> Buffer | None:
        with self._cond:
            if self._closed or not self._free:
                return None
            return self._hand_out()

    def _hand_out(self) -> Buffer:
        """The next free buffer, its holder recorded (lock held)."""
        index = self._free.pop()
        f: Any = sys._getframe(1)
        while f is not None and f.f_code.co_name in _LEASERS:
            f = f.f_back
        where = "?" if f is None else f"{os.path.basename(f.f_code.co_filename)}:{f.f_code.co_name}"
        self._holders[index] = (threading.current_thread().name, where, time.monotonic())
        return Buffer(self, index)

    def _stalled(self, quiet: float) -> StalledError:
        """The error of a wait that no release has served for `quiet` seconds (lock held)."""
        now = time.monotonic()
        held: dict[tuple[str, str], list[float]] = {}
        for thread, where, when in self._holders.values():
            held.setdefault((where, thread), []).append(now - when)
        holders = "; ".join(f"{len(ages)} by {where} on thread {thread!r} (for {max(ages):.0f} s)"
                            for (where, thread), ages in sorted(held.items()))
        me = threading.current_thread().name
        return StalledError(
            f"the pinned buffer pool ({self.count} x {fmt_bytes(self.buffer_bytes)}) has had no buffer given back "
            f"for {quiet:.0f} s while thread {me!r} waited for one: every buffer is held -- {holders}. They are "
            "held by operations that failed or stopped, so this wait could never end: close the store (or "
            "optimizer) and open it again, and report this message")

    def _give_back(self, index: int) -> None:
        with self._cond:
            self._holders.pop(index, None)
            self._free.append(index)
            self._given = time.monotonic()
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        if self._cuda_registered:  # CUDA-only branch
            torch.cuda.cudart().cudaHostUnregister(self.base_addr)
        if self.locked:
            _libc.munlock(self.base_addr, self.nbytes)
            self.locked = False
        # The mapping itself is unmapped when the last tensor viewing it is gone.

    def __enter__(self) -> BufferPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"BufferPool({self.count} x {fmt_bytes(self.buffer_bytes)}, free={self.free}, "
                f"locked={self.locked})")
