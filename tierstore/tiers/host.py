"""The host tier: tensors in page-locked host memory under a byte budget.

[Note: host memory layout]
Copies of at least `ALIGNED_MIN` bytes get their own 4 KiB-aligned, page-locked mapping, so the NVMe tier
can read and write them with O_DIRECT straight from/to the tensor (no bounce buffer) and an accelerator
can DMA from them. Smaller copies come from torch's allocator (a mapping per 100-byte tensor would waste a
page each); the engine handles their unaligned I/O. With CUDA present, torch's pinned allocator is used
instead (it registers the memory with the driver). Page-locking beyond `ulimit -l` is refused by the
kernel for non-root users: the tier then keeps working unlocked and says so once in the log.
"""
from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import threading
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable

import numpy
import torch

from ..errors import TierFullError
from ..io import pool as io_pool
from ..io.pool import advise_huge_pages
from .base import Budget, TierStats, profile_range

log = logging.getLogger("tierstore.tiers")

ALIGN = 4096  # bytes
ALIGNED_MIN = 64 << 10  # bytes: smaller host copies use torch's allocator
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_lock_warned = False


def aligned_empty(nbytes: int, *, lock: bool = True, huge: bool = True) -> torch.Tensor:
    """A uint8 CPU tensor of `nbytes` at a 4 KiB-aligned address (page-locked when `lock` and allowed; advised
    for transparent huge pages when `huge`)."""
    if nbytes < ALIGNED_MIN:
        return torch.empty(nbytes, dtype=torch.uint8)
    if lock and torch.cuda.is_available():  # CUDA-only branch: let the driver pin it
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return aligned_mapping(nbytes, lock=lock, huge=huge)[0]


def aligned_mapping(nbytes: int, *, lock: bool = False, huge: bool = True) -> tuple[torch.Tensor, mmap.mmap]:
    """aligned_empty's memory as a mapping of its own, with the mmap object: it lives exactly as long as the
    tensor's storage (views included), so a weak reference to it tells whether that memory is still this
    allocation's (nbytes > 0)."""
    global _lock_warned
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(mm, dtype=torch.uint8)  # keeps `mm` alive; unmapped (and unlocked) with the tensor
    if huge:
        advise_huge_pages(t.data_ptr(), nbytes)  # fewer page faults and fewer pages per O_DIRECT request
    if lock and _libc.mlock(t.data_ptr(), nbytes) != 0 and not _lock_warned:
        _lock_warned = True
        log.warning("host tier: page-locking failed (errno %d, `ulimit -l` too low?); host copies stay "
                    "pageable. Raise the limit (`ulimit -l unlimited`) for faster device copies.",
                    ctypes.get_errno())
    return t, mm


def result_empty(nbytes: int, what: str | None = None) -> torch.Tensor:
    """Memory for a tensor handed to the caller (get()): from RESULTS, the recycled aligned mappings, when
    large (see [Note: result memory]); else torch's allocator. With `what` (the value, for errors), memory
    the machine cannot give raises TierFullError ([Note: memory for a result])."""
    if what is not None:
        check_result_fits(nbytes, what)
    try:
        if nbytes >= RESULT_ALIGNED_MIN:
            return RESULTS.empty(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)
    except (OSError, MemoryError, RuntimeError) as exc:
        if what is None or not _out_of_memory(exc):
            raise
        raise TierFullError(
            f"{what}: its {nbytes} bytes of memory could not be had ({exc}): free memory or raise this "
            f"process's limit (ulimit -v), or read it {_IN_PIECES}") from None


_IN_PIECES = ("in pieces (get(name, rows=slice(start, stop))), or into memory of your own (get(name, out=...), "
              "e.g. a tensor mapped from a file with torch.from_file)")


def check_result_fits(nbytes: int, what: str) -> None:
    """Raise TierFullError, naming `what` and the size, when `nbytes` of memory for a result can never be had:
    more than this machine's memory.

    [Note: memory for a result]
    A read that returns a new tensor (get(), get(rows=...)) needs memory for all of it. One larger than the
    machine is refused before anything is allocated or read, naming the tensor and its size; an allocation
    refused anyway (the kernel's overcommit check, a `ulimit -v`) raises the same error, naming both too,
    never a bare OSError(ENOMEM). Either tells how to read it instead: in pieces, or into the caller's own
    memory. A range read allocates only the rows it returns ([Note: range reads] in tiers/nvme/reads.py)."""
    memory = io_pool.physical_memory()
    if memory is not None and nbytes > memory:
        raise TierFullError(f"{what}: it is {nbytes} bytes, more than this machine's memory ({memory} bytes), "
                            f"so it cannot be returned as one tensor; read it {_IN_PIECES}")


def _out_of_memory(exc: BaseException) -> bool:
    """Whether an allocation's exception says memory could not be had (mmap's ENOMEM, torch's allocator)."""
    if isinstance(exc, OSError):
        return exc.errno == errno.ENOMEM
    if isinstance(exc, MemoryError):
        return True
    text = str(exc).lower()
    return "not enough memory" in text or "can't allocate memory" in text or "out of memory" in text


RESULT_ALIGNED_MIN = 1 << 20  # bytes


class ResultPool:
    """Recycled 4 KiB-aligned memory for large results (RESULTS is the process's).

    [Note: result memory]
    get() hands the caller a new tensor, and a large one is read into with O_DIRECT, so it must start at a
    4 KiB-aligned address; torch's allocator gives no such address. A fresh mapping per result is aligned,
    but every one of its pages is faulted in anew (see [Note: fresh memory] in tiers/nvme/reads.py) and
    unmapped again when the caller drops it -- per step, for every parameter shard a ZeRO-3 forward reads.
    So the mappings are recycled: each result is a new numpy array over a pooled mapping (torch.from_numpy
    keeps the array alive as long as any tensor uses its storage: views, autograd's saved tensors), and a
    weakref finalizer on that array gives the mapping back when the storage dies -- nothing is polled, and
    memory a caller still refers to is never handed out again. A mapping given back is reused, already
    faulted in, by the next request of the same size; at most `idle_limit` bytes are kept idle, the oldest
    unmapped first. Results are not advised for huge pages (their compaction made populating slower and
    far more variable here, docs/io.md) and not page-locked. holds(addr) tells the reader that memory is a
    result's (read through pool buffers: [Note: results are read through the pool] in tiers/nvme/reads.py).

    Finalizers run in whichever thread drops the last reference, even inside this class's own code (a
    garbage collection): they only append to a deque, and drain it themselves when the lock is free.
    """

    def __init__(self, idle_limit: int):
        self.idle_limit = idle_limit  # bytes
        # tighter limits in force (limit_idle): bytes, or functions giving them now; the smallest holds
        self._caps: list[int | Callable[[], int]] = []
        self._lock = threading.Lock()
        self._back: deque[mmap.mmap] = deque()  # given back, not yet sorted (appended by finalizers)
        self._idle: OrderedDict[int, mmap.mmap] = OrderedDict()  # id -> mapping, oldest first
        self._by_size: dict[int, list[int]] = {}  # bytes -> ids of idle mappings of that size
        self._out: dict[int, int] = {}  # id(mapping) -> its address, while handed out
        self._addrs: set[int] = set()  # the addresses of _out
        self.idle_bytes = 0
        self.lent_bytes = 0  # bytes of mappings handed out and not yet filed back (in use, or given back just now)
        self.reused = 0  # results served from a recycled mapping
        self.mapped = 0  # results that needed a new mapping

    def empty(self, nbytes: int) -> torch.Tensor:
        """A uint8 CPU tensor of `nbytes` at a 4 KiB-aligned address, its memory recycled when possible."""
        size = -(-nbytes // ALIGN) * ALIGN
        mm = None
        with self._lock:
            self._sort_back()
            ids = self._by_size.get(size)
            if ids:
                mm = self._idle.pop(ids.pop())
                self.idle_bytes -= size
                self.reused += 1
            else:
                self.mapped += 1
                self._trim(max(0, self._cap() - size))  # the new mapping counts against the limits too
            self.lent_bytes += size
        if mm is None:
            mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        arr = numpy.frombuffer(mm, dtype=numpy.uint8, count=nbytes)
        with self._lock:
            self._out[id(mm)] = arr.ctypes.data
            self._addrs.add(arr.ctypes.data)
        weakref.finalize(arr, _give_back, weakref.ref(self), mm).atexit = False
        return torch.from_numpy(arr)

    def holds(self, addr: int) -> bool:
        """Whether `addr` is the start of a result this pool handed out that is still in use."""
        with self._lock:
            return addr in self._addrs

    def limit_idle(self, nbytes: int | Callable[[], int]) -> Callable[[], None]:
        """Keep at most `nbytes` idle (with idle_limit and any other limit in force, the smallest holds) until the
        returned function is called: a user of result memory whose own budget must bound the process's resident
        memory (offloaded inference: [Note: the inference budget] in zero/inference/offload.py). A function is
        asked, under the pool's lock, each time mappings are filed or mapped: e.g. a budget less ``lent_bytes``,
        so that what is lent and what is idle together stay within the budget."""
        with self._lock:
            self._caps.append(nbytes)
            self._sort_back()

        def lift() -> None:
            with self._lock:
                for i, c in enumerate(self._caps):
                    if c is nbytes:
                        del self._caps[i]
                        break
        return lift

    def idle(self) -> int:
        """Bytes kept idle, every mapping given back so far filed and the limits applied (``idle_bytes`` read
        without the lock can catch another thread between filing and trimming)."""
        with self._lock:
            self._sort_back()
            return self.idle_bytes

    def trim(self, keep: int = 0) -> None:
        """Unmap idle mappings, the oldest first, until at most `keep` bytes stay idle."""
        with self._lock:
            self._sort_back()
            self._trim(keep)

    def _given_back(self, mm: mmap.mmap) -> None:
        self._back.append(mm)
        if self._lock.acquire(blocking=False):  # else the next empty() or trim() sorts it
            try:
                self._sort_back()
            finally:
                self._lock.release()

    def _sort_back(self) -> None:
        """Under the lock: file the given-back mappings as idle, then keep within idle_limit."""
        while self._back:
            mm = self._back.popleft()
            self._addrs.discard(self._out.pop(id(mm), -1))
            self._idle[id(mm)] = mm
            self._by_size.setdefault(len(mm), []).append(id(mm))
            self.idle_bytes += len(mm)
            self.lent_bytes -= len(mm)
        self._trim(self._cap())

    def _cap(self) -> int:
        """Under the lock: the most bytes to keep idle now."""
        return max(0, min([self.idle_limit, *(c() if callable(c) else c for c in self._caps)]))

    def _trim(self, keep: int) -> None:
        while self.idle_bytes > keep:
            key, mm = self._idle.popitem(last=False)
            self._by_size[len(mm)].remove(key)
            self.idle_bytes -= len(mm)  # unmapped when `mm` goes


def _give_back(pool_ref: weakref.ref, mm: mmap.mmap) -> None:
    pool = pool_ref()
    if pool is not None:
        pool._given_back(mm)


RESULTS = ResultPool(idle_limit=256 << 20)  # the process's result memory ([Note: result memory])


class HostTier:
    """Page-locked host memory under a byte budget."""

    name = "host"

    def __init__(self, budget_bytes: int | None, *, lock: bool = True):
        self.budget = Budget("host", budget_bytes)
        self.lock = lock
        self.stats = TierStats("host")

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised host tensor (aligned and locked when large)."""
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        return aligned_empty(nbytes, lock=self.lock).view(dtype).view(shape)

    def copy_in(self, src: torch.Tensor) -> torch.Tensor:
        """A new host tensor holding `src` (from any device, any layout)."""
        nbytes = src.numel() * src.element_size()
        with profile_range("tierstore::to_host"), self.stats.timing("in", nbytes):
            dst = self.empty(tuple(src.shape), src.dtype)
            dst.copy_(src)
        return dst

    def copy_out(self, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        """Copy the host tensor `src` into the CPU tensor `dst`; returns `dst`."""
        nbytes = src.numel() * src.element_size()
        with profile_range("tierstore::from_host"), self.stats.timing("out", nbytes):
            dst.copy_(src)
        return dst

    def __repr__(self) -> str:
        return f"HostTier({self.budget})"
