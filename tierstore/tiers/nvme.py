"""The NVMe tier: tensors in a few large extent files, striped over every configured directory.

[Note: extent files, not one file per tensor]
DeepSpeed writes one file per tensor, named after Python ids: thousands of files, stale files after a
crash, and small I/O for small tensors. Here a tier owns a few *extent files* (``extents-0000.bin`` ...),
each one StripedFile over all directories (RAID-0, `stripe_unit` bytes per stripe, so every drive gets
its share of every large tensor). A tensor's encoded bytes occupy one *extent*: a 4 KiB-aligned range
``[offset, offset + alloc)`` of one extent file, found by `ExtentAllocator` (first fit in the free spans
of each file, else the end of a file; a new extent file when a file reaches `extent_file_bytes`). Every
extent carries the crc32c of its `length` payload bytes, checked on every read.

[Note: small tensors are packed, large ones streamed]
A tensor whose aligned size fits in a pool buffer is *staged*: copied into the current staging buffer at
the next 4 KiB boundary of a buffer-sized region allocated in one piece; when the next tensor does not
fit (or someone needs the data: a read, `sync()`), the buffer is written in one request. 10,000 tensors
of 4 KiB-1 MiB thus become ~4 MiB writes. A larger tensor streams through pool buffers, a buffer at a
time, with as many writes in flight as the pool has free buffers (back-pressure when it has none).

[Note: space is never reused before the manifest stops pointing at it]
Crash safety rests on copy-on-write: a new version of a tensor always goes to free space, and the space
of a version named by the last durable manifest (`committed`) is only *pending* free until the next
manifest is durable (`commit_done()`). Space whose write is still in flight, or that a reader is still
reading, is freed only when that I/O has finished, so two requests never race on the same bytes.
"""
from __future__ import annotations

import bisect
import ctypes
import errno
import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import Future

import crc32c
import torch

from ..errors import CorruptionError, MisuseError, TierFullError, TierstoreValueError, io_error
from ..io import ALIGN, Buffer, BufferPool, Engine, StripedFile
from ..io.files import fsync_dir
from .base import Budget, TierStats, profile_range

log = logging.getLogger("tierstore.tiers")

EXTENT_FILE = "extents-{:04d}.bin"
PREALLOC_FROM = 32 << 20  # bytes: extent files are preallocated beyond this size (see _preallocate)


def align_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[:] = src for uint8 tensors. Host to host is a plain memmove: torch's copy_ wakes its intra-op
    thread pool, which on a small machine busy with I/O threads was measured 50x slower for 200 KB."""
    n = src.numel()
    if dst.numel() != n:
        raise ValueError(f"copy of {n} bytes into {dst.numel()}")
    if (n and dst.device.type == "cpu" and src.device.type == "cpu" and dst.is_contiguous()
            and src.is_contiguous()):
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), n)
    elif n:
        dst.copy_(src)


def crc_of(t: torch.Tensor, value: int = 0) -> int:
    """crc32c of a contiguous uint8 CPU tensor."""
    if t.numel() == 0:
        return value
    return crc_at(t.data_ptr(), t.numel(), value)


_FromMemory = ctypes.pythonapi.PyMemoryView_FromMemory
_FromMemory.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int]
_FromMemory.restype = ctypes.py_object


def memory_at(addr: int, nbytes: int) -> memoryview:
    """A read-only memoryview of `nbytes` of host memory at `addr` (the caller keeps the memory alive)."""
    return _FromMemory(addr, nbytes, 0x100)  # PyBUF_READ


def crc_at(addr: int, nbytes: int, value: int = 0) -> int:
    """crc32c of `nbytes` of host memory at `addr` (the crc32c package releases the GIL for large inputs).

    [Note: one pass over the data, while it is in cache]
    Writes compute the checksum on the staging copy right after the memmove that made it; reads compute it
    on each chunk of the destination right after that chunk arrived (and, through a bounce buffer, right
    after the memmove out of it), overlapped with the chunks still in flight. No pass over a whole large
    tensor happens after its I/O."""
    return crc32c.crc32c(memory_at(addr, nbytes), value) if nbytes else value


class Extent:
    """Where one tensor's encoded bytes live: `length` payload bytes at `offset` of extent file `file`,
    `alloc` bytes reserved (4 KiB multiple). `written` is the pending write's future (None once known
    done); `committed` is True while the last durable manifest names this extent."""

    __slots__ = ("file", "offset", "length", "alloc", "crc", "written", "committed", "readers", "freed", "damaged")

    def __init__(self, file: int, offset: int, length: int, alloc: int, crc: int, written: Future | None = None):
        self.file = file
        self.offset = offset  # bytes, logical offset in the striped extent file
        self.length = length  # bytes of payload
        self.alloc = alloc  # bytes reserved (aligned)
        self.crc = crc
        self.written = written
        self.committed = False
        self.readers = 0
        self.freed = False
        self.damaged = False  # reaches past the end of its extent file (found at open): reads are refused

    def to_json(self) -> dict:
        return {"file": self.file, "offset": self.offset, "length": self.length, "alloc": self.alloc,
                "crc32c": self.crc}

    @classmethod
    def from_json(cls, d, path: str | None = None, field: str = "extent") -> "Extent":
        """The extent a manifest entry describes, its fields checked (types, ranges, alignment; whether it lies
        inside the extent files is NvmeTier.check_extents'). CorruptionError names `path` and `field`."""
        def bad(what: str) -> CorruptionError:
            return CorruptionError(f"the manifest {path}: field {field}: {what}; it is damaged or was not written "
                                   "by tierstore: restore it from a backup", path)
        keys = ("file", "offset", "length", "alloc", "crc32c")
        if not isinstance(d, dict) or not all(type(d.get(k)) is int and d[k] >= 0 for k in keys):
            raise bad(f"{str(d)[:120]} is not {{{', '.join(keys)}}} of non-negative integers")
        e = cls(d["file"], d["offset"], d["length"], d["alloc"], d["crc32c"])
        if e.crc >= 1 << 32:
            raise bad(f"crc32c {e.crc} is not 32 bits")
        if e.offset % ALIGN or e.alloc != align_up(e.length) or (e.length == 0 and (e.file or e.offset or e.crc)):
            raise bad(f"{e!r} is not a {ALIGN}-byte aligned extent of align_up(length) bytes")
        e.committed = True
        return e

    def __repr__(self) -> str:
        return f"Extent(file={self.file}, offset={self.offset}, length={self.length}, alloc={self.alloc})"


class ExtentAllocator:
    """Free space of the extent files: per file a sorted list of free spans plus the end of used space."""

    def __init__(self, file_bytes: int):
        if file_bytes <= 0 or file_bytes % ALIGN:
            raise TierstoreValueError(f"extent_file_bytes={file_bytes} must be a positive multiple of {ALIGN}")
        self.file_bytes = file_bytes  # bytes: logical size at which a file is full
        self.free_spans: list[list[tuple[int, int]]] = []  # per file: sorted (start, length)
        self.ends: list[int] = []  # per file: bytes, end of the last used span

    def _ensure(self, f: int) -> None:
        while len(self.free_spans) <= f:
            self.free_spans.append([])
            self.ends.append(0)

    def alloc(self, nbytes: int) -> tuple[int, int]:
        """(file, offset) of `nbytes` (a 4 KiB multiple) of free space; may name a new file."""
        assert nbytes > 0 and nbytes % ALIGN == 0
        for f, spans in enumerate(self.free_spans):  # first fit in freed space
            for i, (start, length) in enumerate(spans):
                if length >= nbytes:
                    if length == nbytes:
                        del spans[i]
                    else:
                        spans[i] = (start + nbytes, length - nbytes)
                    return f, start
        for f, end in enumerate(self.ends):  # then the end of a file with room
            if end + nbytes <= self.file_bytes:
                self.ends[f] = end + nbytes
                return f, end
        f = len(self.ends)  # a new extent file (a tensor larger than a file gets a file of its own)
        self._ensure(f)
        self.ends[f] = nbytes
        return f, 0

    def free(self, f: int, offset: int, nbytes: int) -> None:
        if nbytes == 0:
            return
        spans = self.free_spans[f]
        i = bisect.bisect_left(spans, (offset, 0))
        start, end = offset, offset + nbytes
        if i > 0 and spans[i - 1][0] + spans[i - 1][1] == start:  # merge with the span before
            start = spans[i - 1][0]
            i -= 1
            del spans[i]
        if i < len(spans) and spans[i][0] == end:  # and the one after
            end = spans[i][0] + spans[i][1]
            del spans[i]
        if end == self.ends[f]:  # back to the end of the file
            self.ends[f] = start
        else:
            spans.insert(i, (start, end - start))

    def rebuild(self, used: list[tuple[int, int, int]]) -> None:
        """Set the state from the (file, offset, alloc) spans a manifest names: all the rest is free."""
        self.free_spans, self.ends = [], []
        by_file: dict[int, list[tuple[int, int]]] = {}
        for f, off, n in used:
            if n:
                by_file.setdefault(f, []).append((off, n))
        for f in sorted(by_file):
            self._ensure(f)
            pos = 0
            for off, n in sorted(by_file[f]):
                if off > pos:
                    self.free_spans[f].append((pos, off - pos))
                pos = max(pos, off + n)
            self.ends[f] = pos

    def free_bytes_in_spans(self) -> int:
        return sum(n for spans in self.free_spans for _, n in spans)


class _Staging:
    """The buffer small tensors are packed into, and the region of an extent file it will be written to."""

    __slots__ = ("buf", "file", "base", "region", "fill", "future")

    def __init__(self, buf: Buffer, file: int, base: int, region: int):
        self.buf, self.file, self.base, self.region = buf, file, base, region  # region: bytes
        self.fill = 0  # bytes packed so far (4 KiB multiple)
        self.future: Future = Future()


class NvmeTier:
    """Extent files striped over `dirs`, written and read through `engine` and `pool` buffers."""

    name = "nvme"

    def __init__(self, dirs: list[str], engine: Engine, pool: BufferPool, *, budget_bytes: int | None = None,
                 extent_file_bytes: int = 16 << 30, stripe_unit: int = 1 << 20, read_only: bool = False):
        self.read_only = read_only  # files opened for reading only; write() refuses
        self.dirs = [os.path.abspath(os.fspath(d)) for d in dirs]
        self.engine = engine
        self.pool = pool
        self.stripe_unit = stripe_unit  # bytes
        self.alloc = ExtentAllocator(extent_file_bytes)
        self.budget = Budget("nvme", budget_bytes)  # counts allocated (aligned) bytes
        self.stats = TierStats("nvme")
        self.files: list[StripedFile] = []
        self._lock = threading.RLock()
        self._staging: _Staging | None = None
        self._inflight: set[Future] = set()
        self._inflight_lock = threading.Lock()
        self._late: deque[Extent] = deque()  # freed while their write was in flight
        self._pending_free: list[Extent] = []  # committed extents freed since the last commit
        self._dirty_files: set[int] = set()
        self._dirs_unsynced = False
        self._prealloc: dict[int, int] = {}  # extent file -> logical bytes reserved with fallocate
        self._prealloc_ok = True
        self.closed = False
        self._open_existing()

    # -- files ------------------------------------------------------------------------------------
    def _open_existing(self) -> None:
        """Open the extent files present in every directory (creating nothing: a manifest naming a file
        beyond them is refused by check_extents)."""
        k = 0
        while all(os.path.exists(os.path.join(d, EXTENT_FILE.format(k))) for d in self.dirs):
            self._file(k)
            k += 1

    def _file(self, f: int) -> StripedFile:
        while len(self.files) <= f:
            name = EXTENT_FILE.format(len(self.files))
            new = not all(os.path.exists(os.path.join(d, name)) for d in self.dirs)
            self.files.append(self.engine.open_striped(self.dirs, name, "r" if self.read_only else "c",
                                                       stripe_unit=self.stripe_unit))
            if new:
                self._dirs_unsynced = True  # the new names must be durable before a manifest names them
        return self.files[f]

    def file_paths(self, f: int, offset: int | None = None, length: int | None = None) -> list[str]:
        """The part files holding bytes of extent file `f` (those holding [offset, offset+length) if given)."""
        sf = self._file(f)
        if offset is None or not length:
            return [p.path for p in sf.parts]
        return sorted({part.path for part, *_ in sf.map(offset, length)})

    # -- space --------------------------------------------------------------------------------------
    def _charge(self, nbytes: int) -> None:
        """Count `nbytes` of extents against the budget (the budget counts extents, not staging regions)."""
        if self.budget.limit is not None and self.budget.used + nbytes > self.budget.limit:
            raise TierFullError(f"the nvme tier is full: {self.budget.used} of nvme_budget={self.budget.limit} "
                                f"bytes used, {nbytes} more needed; raise nvme_budget or delete tensors")
        self.budget.take(nbytes)

    def _allocate(self, nbytes: int, account: bool = True) -> tuple[int, int]:
        self._drain_late()
        if account:
            self._charge(nbytes)
        f, off = self.alloc.alloc(nbytes)
        try:
            self._file(f)
        except BaseException:
            self._release(f, off, nbytes, account)
            raise
        self._preallocate(f, off + nbytes)
        return f, off

    def _reserve(self, f: int, off: int, nbytes: int, what: str) -> None:
        """Give logical bytes [off, off + nbytes) of extent file `f` their disk blocks now (lock held).

        [Note: space is reserved when it is allocated]
        A write runs after the call that asked for it has returned (packed writes wait for their buffer to
        fill), so a full disk found by the write is found too late: the value may exist nowhere else (an
        nvme-only tensor's update, a put with no memory tier) and the caller was already told it was stored.
        So every new extent's range is reserved with fallocate() by the call that allocates it: on a full
        disk that call raises ENOSPC while the previous value is intact (copy-on-write), and the write into
        reserved blocks cannot run out of space. Space inside the preallocated prefix of a file (see
        _preallocate) already has its blocks. Where fallocate is not supported the write reports a full disk
        itself, later, and flush() names the values that were lost (see [Note: when a flush fails] in
        store.py); so do errors other than a full disk (EIO), which no reservation can foresee."""
        if not self._prealloc_ok or nbytes == 0 or off + nbytes <= self._prealloc.get(f, 0):
            return
        try:
            for part, phys, _within, length in self.files[f].map(off, nbytes):
                _fallocate(part.fd, phys, length)
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.ENOSYS):
                self._prealloc_ok = False
                return
            paths = self.file_paths(f, off, nbytes)
            raise io_error(e.errno or errno.EIO, f"reserving {nbytes} bytes of disk space for {what}",
                           ",".join(paths), off, nbytes) from None
        self._dirty_files.add(f)

    def _preallocate(self, f: int, end: int) -> None:
        """Make sure extent file `f` has disk space reserved up to logical byte `end` (lock held).

        [Note: extent files are preallocated ahead of the writes]
        An O_DIRECT write past the end of an ext4 file has to change the file's size, and ext4 does such
        writes one at a time instead of overlapping them: streaming 4 MiB requests into a growing file
        ran at half the speed of the same requests into preallocated space (measured, 8 x 64 MiB). So the
        space of each extent file is reserved with fallocate() ahead of use once the file passes
        PREALLOC_FROM (small stores stay as small on disk as their data), growing geometrically (the size
        so far, at most 1 GiB at a time). Best effort: where fallocate is not supported or the disk is too
        full for a step, only what is needed is asked for, then nothing: the reservation of each extent
        (_reserve) then reports a full disk. Reserved space no manifest names is free space, so this changes nothing for
        crash safety; the fsync in sync() covers the new size."""
        have = self._prealloc.get(f, 0)  # bytes, logical
        if end <= have or end <= PREALLOC_FROM or not self._prealloc_ok:
            return
        step = min(end, 1 << 30)
        sf = self.files[f]
        for target in (max(end, min(end + step, self.alloc.file_bytes)), end):
            try:
                for part, start, stop in _part_ranges(sf, have, target):
                    _fallocate(part.fd, start, stop - start)
            except OSError as e:
                if e.errno in (errno.EOPNOTSUPP, errno.ENOSYS):
                    self._prealloc_ok = False
                    return
                continue  # ENOSPC and the like: try a smaller step, then leave it to the write
            self._prealloc[f] = target
            self._dirty_files.add(f)
            return

    def _release(self, f: int, off: int, nbytes: int, account: bool = True) -> None:
        self.alloc.free(f, off, nbytes)
        if account:
            self.budget.give(nbytes)

    def _drain_late(self) -> None:
        while self._late:
            e = self._late.popleft()
            self._release(e.file, e.offset, e.alloc)

    def free(self, e: Extent) -> None:
        """Give back an extent's space: now, after its write/reads finish, or after the next commit."""
        with self._lock:
            if e.freed or e.alloc == 0:
                e.freed = True
                return
            e.freed = True
            if e.committed:
                self._pending_free.append(e)
            elif e.readers:
                pass  # the last reader frees it (end_read)
            elif e.written is not None and not e.written.done():
                e.written.add_done_callback(lambda _f, e=e: self._late.append(e))
            else:
                self._release(e.file, e.offset, e.alloc)

    def unfree(self, e: Extent) -> None:
        """Undo free() of a committed extent (a failed write reverts a tensor to its committed version)."""
        with self._lock:
            if e in self._pending_free:
                self._pending_free.remove(e)
            e.freed = False

    def protect(self, extents: list[Extent]) -> list[Extent]:
        """A manifest naming `extents` is about to be written: from now on freeing them only makes them pending
        (their space must not be reused while that manifest may become durable). Returns those newly
        protected, for unprotect() when the manifest is not written after all."""
        with self._lock:
            new = [e for e in extents if not e.committed and e.alloc]
            for e in new:
                e.committed = True
            return new

    def unprotect(self, extents: list[Extent]) -> None:
        with self._lock:
            for e in extents:
                e.committed = False
                if e in self._pending_free:
                    self._pending_free.remove(e)
                    e.freed = False
                    self.free(e)

    def commit_done(self, live: list[Extent]) -> None:
        """The manifest naming exactly `live` is durable: free the pending extents it no longer names."""
        with self._lock:
            ids = {id(e) for e in live}
            pend, self._pending_free = self._pending_free, []
            for e in pend:
                if id(e) in ids:  # freed while the manifest naming it was written: wait for the next one
                    self._pending_free.append(e)
                    continue
                e.committed = False
                e.freed = False
                self.free(e)

    def check_extents(self, extents: list[tuple[str, Extent]], path: str) -> None:
        """Before adopt(): every (field, extent) a manifest at `path` names lies inside an extent file that
        exists and no two overlap (CorruptionError names the field); one reaching past the end of a part file
        (a truncated file) is marked damaged. Creates, reads and allocates nothing."""
        sizes: dict[int, list[int]] = {}  # extent file -> size of each part, bytes
        spans = []
        for field, e in extents:
            if not e.alloc:
                continue
            if e.file >= len(self.files):
                raise CorruptionError(
                    f"the manifest {path}: field {field}.file: extent file {EXTENT_FILE.format(e.file)} does not "
                    f"exist in every directory (this store has {len(self.files)}); restore the store's files or "
                    "the manifest from a backup", path)
            sf = self.files[e.file]
            if e.file not in sizes:
                sizes[e.file] = [p.size() for p in sf.parts]
            # an extent file cut short damages the tensors past the cut, not the store: they are refused when
            # read (check_readable), before anything is allocated for them; the others stay readable
            e.damaged = any(sizes[e.file][k] < need for k, need in _part_needs(sf, e.offset, e.offset + e.alloc))
            spans.append((e.file, e.offset, e.alloc, field))
        spans.sort()
        for (f, a, an, fa), (g, b, _bn, fb) in zip(spans, spans[1:]):
            if f == g and a + an > b:
                raise CorruptionError(f"the manifest {path}: field {fb}: its extent overlaps that of {fa}; "
                                      "the manifest is damaged: restore it from a backup", path)

    def adopt(self, extents: list[Extent]) -> None:
        """Reopen: the manifest's extents (checked by check_extents) are the only used space."""
        with self._lock:
            self.alloc.rebuild([(e.file, e.offset, e.alloc) for e in extents])
            self.budget.used = sum(e.alloc for e in extents)

    # -- writes ----------------------------------------------------------------------------------
    def _track(self, fut: Future) -> None:
        with self._inflight_lock:
            self._inflight.add(fut)

        def done(f: Future) -> None:
            with self._inflight_lock:
                self._inflight.discard(f)
        fut.add_done_callback(done)

    def write(self, src: torch.Tensor, what: str = "a tensor") -> Extent:
        """Start writing the bytes of `src` (a contiguous CPU tensor, any dtype); returns its extent at once.

        The copy is taken before returning, so `src` may change afterwards. `extent.written` resolves when
        the bytes are in the file (not yet durable: see sync()). The extent's disk space is reserved before
        returning: a full disk raises TierstoreIOError (ENOSPC) here, naming `what`, with nothing written
        (see [Note: space is reserved when it is allocated])."""
        self._check()
        if self.read_only:
            raise MisuseError("the nvme tier was opened read-only (Store.open(paths, mode='r')); open the store "
                              "with mode='w' to write")
        n = src.numel() * src.element_size()  # bytes
        if n == 0:
            return Extent(0, 0, 0, 0, 0)
        if src.device.type != "cpu" or not src.is_contiguous():
            raise TierstoreValueError("the nvme tier writes contiguous CPU tensors")
        alen = align_up(n)
        t0 = time.perf_counter()
        try:
            with profile_range("tierstore::nvme_write"):
                if alen <= self.pool.buffer_bytes:
                    return self._write_staged(src.data_ptr(), n, alen, what)
                return self._write_streamed(src.data_ptr(), n, alen, what)
        finally:
            self.stats.add("in", n, time.perf_counter() - t0)

    def _write_staged(self, addr: int, n: int, alen: int, what: str) -> Extent:
        with self._lock:
            st = self._staging
            self._charge(alen)
            try:
                if st is None or st.fill + alen > st.region:
                    self._seal()
                    buf = self.pool.lease()
                    try:
                        f, base = self._allocate(self.pool.buffer_bytes, account=False)
                    except BaseException:
                        buf.release()
                        raise
                    st = self._staging = _Staging(buf, f, base, self.pool.buffer_bytes)
                self._reserve(st.file, st.base + st.fill, alen, what)
            except BaseException:
                self.budget.give(alen)
                raise
            pos = st.fill
            dst = st.buf.addr + pos
            ctypes.memmove(dst, addr, n)
            st.fill += alen
            return Extent(st.file, st.base + pos, n, alen, crc_at(dst, n), st.future)

    def _seal(self) -> None:
        """Write the staging buffer (caller holds the lock)."""
        st, self._staging = self._staging, None
        if st is None:
            return
        if st.fill < st.region:
            self._release(st.file, st.base + st.fill, st.region - st.fill, account=False)  # the unused tail
        if st.fill == 0:
            st.buf.release()
            st.future.set_result(0)
            return
        self._dirty_files.add(st.file)
        try:
            io = self.engine.write(self.files[st.file], st.buf.tensor(torch.uint8, st.fill), st.base)
        except BaseException as e:
            st.buf.release()
            st.future.set_exception(e)
            raise
        self._track(st.future)

        def done(io_fut: Future, st=st) -> None:
            st.buf.release()
            err = io_fut.exception()
            if err is None:
                st.future.set_result(st.fill)
            else:
                st.future.set_exception(err)
        io.add_done_callback(done)

    def seal(self) -> None:
        """Write what is staged now (normally done when the buffer is full or the data is needed)."""
        with self._lock:
            self._seal()

    def _write_streamed(self, addr: int, n: int, alen: int, what: str) -> Extent:
        with self._lock:
            f, off = self._allocate(alen)
            try:
                self._reserve(f, off, alen, what)
            except BaseException:
                self._release(f, off, alen)
                raise
            self._dirty_files.add(f)
            sf = self.files[f]
        bb = self.pool.buffer_bytes
        chunks = (alen + bb - 1) // bb
        fut: Future = Future()
        state = {"left": chunks, "err": None}
        lock = threading.Lock()

        def chunk_done(io_fut: Future, buf: Buffer) -> None:
            buf.release()
            with lock:
                if io_fut.exception() is not None and state["err"] is None:
                    state["err"] = io_fut.exception()
                state["left"] -= 1
                last = state["left"] == 0
            if last:
                if state["err"] is not None:
                    fut.set_exception(state["err"])
                else:
                    fut.set_result(n)

        self._track(fut)
        crc = 0
        for i in range(chunks):
            a = i * bb
            take = min(bb, n - a)
            buf = self._lease()
            ctypes.memmove(buf.addr, addr + a, take)
            crc = crc_at(buf.addr, take, crc)  # [Note: one pass over the data, while it is in cache]
            try:
                io = self.engine.write(sf, buf.tensor(torch.uint8, align_up(take)), off + a)
            except BaseException as e:
                buf.release()
                with lock:
                    state["err"] = state["err"] or e
                    state["left"] -= chunks - i  # this chunk and the ones never submitted
                    last = state["left"] == 0
                if last:
                    fut.set_exception(state["err"])
                break
            io.add_done_callback(lambda io_fut, buf=buf: chunk_done(io_fut, buf))
        return Extent(f, off, n, alen, crc, fut)

    # -- reads -------------------------------------------------------------------------------------
    def _wait_written(self, e: Extent) -> None:
        w = e.written
        if w is None:
            return
        if not w.done():
            with self._lock:
                if self._staging is not None and self._staging.future is w:
                    self._seal()
        w.result()  # raises the write's error
        e.written = None

    def check_readable(self, e: Extent, what: str) -> None:
        """Raise the CorruptionError of a damaged extent (its file was found truncated at open); call before
        allocating memory for a read of `e`."""
        if e.damaged:
            raise self._truncated(e, what) or CorruptionError(
                f"{what}: its extent {e!r} reached past the end of its extent file when the store was opened; "
                "restore the store's files from a backup, or delete the tensor", None, e.offset, e.length)

    def begin_read(self, e: Extent) -> None:
        with self._lock:
            if e.freed and not e.committed:
                raise MisuseError(f"{e!r} was freed; the tensor was deleted or replaced")
            e.readers += 1

    def end_read(self, e: Extent) -> None:
        with self._lock:
            e.readers -= 1
            if e.readers == 0 and e.freed and not e.committed:
                if e.written is not None and not e.written.done():
                    e.written.add_done_callback(lambda _f, e=e: self._late.append(e))
                else:
                    self._release(e.file, e.offset, e.alloc)

    def read(self, e: Extent, out: torch.Tensor, what: str) -> None:
        """Read extent `e` into `out` (contiguous uint8 CPU tensor of e.length elements), check its crc32c.

        `what` names the tensor in errors. Raises CorruptionError on a checksum mismatch."""
        err = self.read_many([(e, out, what)])[0]
        if err is not None:
            raise err

    def _corruption(self, e: Extent, got: int, what: str) -> CorruptionError:
        paths = self.file_paths(e.file, e.offset, e.length)
        return CorruptionError(
            f"{what}: checksum mismatch (crc32c {got:#010x}, expected {e.crc:#010x}) reading "
            f"{e.length} bytes at offset {e.offset} of extent file {EXTENT_FILE.format(e.file)} "
            f"({', '.join(paths)}); the file was changed outside tierstore or the disk returned bad data",
            paths[0] if len(paths) == 1 else ",".join(paths), e.offset, e.length)

    def _truncated(self, e: Extent, what: str) -> CorruptionError | None:
        """A CorruptionError when extent `e` reaches past the end of a part of its extent file (a read of it
        comes back short), else None."""
        for part, phys, _within, length in self.files[e.file].map(e.offset, e.alloc):
            size = os.fstat(part.fd).st_size  # bytes
            if size < phys + length:
                return CorruptionError(
                    f"{what}: the extent file {part.path} ends at byte {size}, inside this tensor's {e.length} "
                    f"bytes at offset {e.offset} of extent file {EXTENT_FILE.format(e.file)}: the file was "
                    "truncated outside tierstore; restore it from a backup, or delete the tensor",
                    part.path, e.offset, e.length)
        return None

    def read_many(self, items: list[tuple[Extent, torch.Tensor, str]]) -> list[BaseException | None]:
        """Read many extents, each into its `out` (contiguous uint8 CPU tensor of e.length elements).
        Returns one error (or None) per item, in order: a corrupt tensor does not stop the others.

        [Note: how reads are issued]
        Small extents (<= half a pool buffer) are sorted by place and coalesced into buffer-sized reads
        (neighbours at most 64 KiB apart) through pool buffers, then copied out. Larger extents are read in
        buffer-sized chunks, many in flight (across tensors too): straight into `out` with O_DIRECT when it
        is 4 KiB aligned, else through pool buffers with the copy of chunk k overlapping the reads of the
        chunks after it. Each chunk's crc32c is folded in as it completes, in order."""
        self._check()
        errors: list[BaseException | None] = [None] * len(items)
        bb = self.pool.buffer_bytes
        small, big, began = [], [], []
        for i, (e, out, what) in enumerate(items):
            if e.length == 0:
                continue
            if out.numel() != e.length or out.element_size() != 1 or out.device.type != "cpu" \
                    or not out.is_contiguous():
                raise TierstoreValueError(f"{what}: reads go into a contiguous uint8 CPU tensor of {e.length} "
                                          f"elements; got {out.dtype} {tuple(out.shape)} on {out.device}")
            try:
                self.check_readable(e, what)
                self.begin_read(e)
            except BaseException as exc:
                errors[i] = exc
                continue
            began.append(e)
            (small if e.alloc <= bb // 2 else big).append(i)
        t0 = time.perf_counter()
        try:
            for i in small + big:
                try:
                    self._wait_written(items[i][0])
                except BaseException as exc:
                    errors[i] = exc
            small = [i for i in small if errors[i] is None]
            big = [i for i in big if errors[i] is None]
            small.sort(key=lambda i: (items[i][0].file, items[i][0].offset))
            runs: list[list[int]] = []
            for i in small:  # coalesce: same file, gap <= 64 KiB, whole run fits one buffer
                e = items[i][0]
                if runs:
                    r0 = items[runs[-1][0]][0]
                    last = items[runs[-1][-1]][0]
                    if (e.file == r0.file and 0 <= e.offset - (last.offset + last.alloc) <= (64 << 10)
                            and e.offset + e.alloc - r0.offset <= bb):
                        runs[-1].append(i)
                        continue
                runs.append([i])
            with profile_range("tierstore::nvme_read"):
                self._read_runs(items, runs, errors)
                self._read_big(items, big, errors)
        finally:
            for e in began:
                self.end_read(e)
            moved = sum(items[i][0].length for i in small + big if errors[i] is None)  # bytes
            self.stats.add("out", moved, time.perf_counter() - t0)
        return errors

    def _lease(self) -> Buffer:
        """A pool buffer, waiting while every buffer is in flight (back-pressure). The open staging buffer of
        small writes holds one of them until it is sealed; when none is free, it is sealed first -- its
        write then frees the buffer -- so that a small pool (one buffer: pinned_budget == buffer_bytes) can
        never wait on a release that only a later small write or a flush would bring. The wait is short and
        repeated: another thread's small write may take the freed buffer for a new staging buffer."""
        while True:
            buf = self.pool.try_lease()
            if buf is not None:
                return buf
            with self._lock:
                if self._staging is not None:
                    self._seal()
            try:  # another thread's small write may open a new staging buffer with the freed one: look again
                return self.pool.lease(timeout=0.05)
            except TimeoutError:
                continue

    def _lease_or_finish(self, window: deque, finish) -> Buffer:
        """A pool buffer; while none is free, finish the oldest read of `window` (freeing its buffer)."""
        buf = self.pool.try_lease()
        while buf is None:
            if window:
                finish()
                buf = self.pool.try_lease()
            else:
                buf = self._lease()
        return buf

    def _read_big(self, items, idx: list[int], errors: list) -> None:
        bb = self.pool.buffer_bytes  # bytes per chunk
        max_direct = max(8, self.pool.count)  # chunks in flight when reading straight into the results
        window: deque = deque()  # (item, start, take, pool buffer or None, io future), oldest first
        crcs = dict.fromkeys(idx, 0)

        def finish_oldest() -> None:
            i, a, take, buf, io = window.popleft()
            e, out, what = items[i]
            try:
                try:
                    io.result()
                except BaseException as exc:
                    errors[i] = errors[i] or self._truncated(e, what) or exc
                    return
                if errors[i] is not None:
                    return
                dst = out.data_ptr() + a
                if buf is not None:
                    ctypes.memmove(dst, buf.addr, take)
                crcs[i] = crc_at(dst, take, crcs[i])  # [Note: one pass over the data, while it is in cache]
                if a + take == e.length and crcs[i] != e.crc:
                    errors[i] = self._corruption(e, crcs[i], what)
            finally:
                if buf is not None:
                    buf.release()
        try:
            for i in idx:
                e, out, what = items[i]
                sf = self.files[e.file]
                direct = out.data_ptr() % ALIGN == 0
                for a in range(0, e.length, bb):
                    take = min(bb, e.length - a)
                    if direct:
                        while len(window) >= max_direct:
                            finish_oldest()
                        buf, target = None, out[a:a + take]
                    else:
                        buf = self._lease_or_finish(window, finish_oldest)
                        target = buf.tensor(torch.uint8, align_up(take))
                    try:
                        io = self.engine.read(sf, target, e.offset + a)
                    except BaseException as exc:
                        if buf is not None:
                            buf.release()
                        errors[i] = errors[i] or exc
                        break
                    window.append((i, a, take, buf, io))
            while window:
                finish_oldest()
        finally:
            while window:
                _i, _a, _t, buf, io = window.popleft()
                io.exception()  # wait: the kernel may still write into the memory
                if buf is not None:
                    buf.release()

    def _read_runs(self, items, runs: list[list[int]], errors: list) -> None:
        window: deque = deque()
        alone: list[int] = []  # of a run that failed: extents not cut off by a truncation, read again alone

        def finish_oldest() -> None:
            run, start, buf, io = window.popleft()
            try:
                try:
                    io.result()
                except BaseException as exc:
                    for i in run:
                        e, _out, what = items[i]
                        cut = self._truncated(e, what)
                        if cut is None and len(run) > 1:
                            alone.append(i)
                        else:
                            errors[i] = cut or exc
                    return
                for i in run:
                    e, out, what = items[i]
                    dst = out.data_ptr()
                    ctypes.memmove(dst, buf.addr + (e.offset - start), e.length)
                    got = crc_at(dst, e.length)
                    if got != e.crc:
                        errors[i] = self._corruption(e, got, what)
            finally:
                buf.release()
        try:
            for run in runs:
                first, last = items[run[0]][0], items[run[-1]][0]
                length = last.offset + last.alloc - first.offset
                buf = self._lease_or_finish(window, finish_oldest)
                try:
                    io = self.engine.read(self.files[first.file], buf.tensor(torch.uint8, length), first.offset)
                except BaseException as exc:
                    buf.release()
                    for i in run:
                        errors[i] = exc
                    continue
                window.append((run, first.offset, buf, io))
            while window:
                finish_oldest()
        finally:
            while window:
                _r, _s, buf, io = window.popleft()
                io.exception()
                buf.release()
        if alone:
            self._read_runs(items, [[i] for i in alone], errors)

    # -- durability -------------------------------------------------------------------------------
    def sync(self) -> None:
        """Write what is staged, wait for every write, fsync the files written to (and the directories when
        files were created). Errors of individual writes stay on their extents' futures; an fsync error
        raises."""
        with self._lock:
            self._seal()
            dirty, self._dirty_files = self._dirty_files, set()
            dirs_unsynced, self._dirs_unsynced = self._dirs_unsynced, False
        with self._inflight_lock:
            pending = list(self._inflight)
        for fut in pending:
            fut.exception()  # wait
        with profile_range("tierstore::fsync"):
            try:
                for f in sorted(dirty):
                    self.engine.fsync(self.files[f])
                if dirs_unsynced:
                    for d in self.dirs:
                        fsync_dir(d)
            except BaseException:
                with self._lock:
                    self._dirty_files |= dirty
                    self._dirs_unsynced = self._dirs_unsynced or dirs_unsynced
                raise

    def _check(self) -> None:
        if self.closed:
            raise MisuseError("the nvme tier is closed (its store was closed); open the store again")

    def close(self) -> None:
        if self.closed:
            return
        with self._lock:
            st, self._staging = self._staging, None
            if st is not None:
                st.buf.release()
                if not st.future.done():
                    st.future.set_exception(MisuseError("the store was closed before this data was written"))
        with self._inflight_lock:
            pending = list(self._inflight)
        for fut in pending:
            fut.exception()
        self.closed = True
        for sf in self.files:
            self.engine.close_file(sf)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def _fallocate(fd: int, offset: int, length: int) -> None:
    """Reserve [offset, offset + length) of a file (mode 0: the file grows). OSError on failure."""
    if length > 0 and _libc.fallocate(fd, 0, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _part_ranges(sf: StripedFile, start: int, stop: int):
    """(part, physical start, physical stop) covering logical bytes [start, stop) of striped file `sf`,
    whole stripes each (one range per part)."""
    su, n = sf.stripe_unit, len(sf.parts)
    first, last = start // su, (stop + su - 1) // su  # stripes [first, last)
    for k, part in enumerate(sf.parts):
        lo = (first - k + n - 1) // n if first > k else 0  # first stripe index on part k at or after `first`
        hi = (last - k + n - 1) // n if last > k else 0
        if hi > lo:
            yield part, lo * su, hi * su


def _part_needs(sf: StripedFile, start: int, stop: int):
    """(part index, physical size that part must have) for logical bytes [start, stop) of striped file `sf`,
    in O(parts) whatever the length."""
    su, n = sf.stripe_unit, len(sf.parts)
    first, last = start // su, (stop - 1) // su  # stripes holding the first and last byte
    for k in range(n):
        top = last - (last - k) % n if last >= k else -1  # the last stripe on part k at or before `last`
        if top < first or top < 0:
            continue
        end = stop - top * su if top == last else su  # bytes of that stripe in the range's span
        yield k, (top // n) * su + end
