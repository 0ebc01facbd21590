"""Writes into extents: small tensors packed into a staging buffer, large ones streamed, disk space reserved.

[Note: small tensors are packed, large ones streamed]
A tensor whose aligned size fits in a pool buffer is *staged*: copied into the current staging buffer at
the next 4 KiB boundary of a buffer-sized region allocated in one piece; when the next tensor does not
fit (or someone needs the data: a read, `sync()`), the buffer is written in one request. 10,000 tensors
of 4 KiB-1 MiB thus become ~4 MiB writes. A larger tensor streams through pool buffers, a buffer at a
time, with as many writes in flight as the pool has free buffers (back-pressure when it has none).

[Note: large aligned tensors are written in place]
A tensor at a 4 KiB-aligned address (a host-tier copy, a BufferPool buffer, aligned_empty) at least as
large as the whole pool would stream through every pool buffer and wait for them anyway. So it is written
straight from its own memory with O_DIRECT, no copy, in pool-buffer-sized requests all in flight; its crc32c
is computed on the calling thread over each request's bytes while the disk moves them, and the call returns
once the writes are done -- the tensor may change after it returns, as with a copy. Only the partial last
4 KiB block goes through a pool buffer (the extent's padding follows it).

[Note: lent tensors]
A caller that can leave the tensor unchanged until the disk has it -- the step pipeline writing the buffers
it steps in, which it recycles anyway -- lends it (`write(..., lend=callback)`): an aligned tensor larger
than half a pool buffer (the size from which reads too go alone, not packed) is then written in place the
same way but the call returns at once, and `callback()` runs (on the engine's completion thread, or at
once where the tensor was copied after all) when the memory is the caller's again, whether the write
succeeded or not. Its error, as a streamed write's, is reported by
the read or the flush. The step's writes then cost the crc32c alone, not a memmove of every byte first.
"""
from __future__ import annotations

import ctypes
import errno
import functools
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

from ...errors import MisuseError, StalledError, TierstoreValueError, io_error
from ...io import ALIGN, Buffer, BufferPool, Engine, StripedFile
from ..base import TierStats, profile_range
from .extents import BlockCrcs, Extent, ExtentSpace, align_up, block_crcs
from .files import ExtentFiles, part_ranges

PREALLOC_FROM = 32 << 20  # bytes: extent files are preallocated beyond this size (see _preallocate)
PREALLOC_SHARE = 8  # a preallocation step is at most 1/PREALLOC_SHARE of the live extents (see _preallocate)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def _fallocate(fd: int, offset: int, length: int) -> None:
    """Reserve [offset, offset + length) of a file (mode 0: the file grows). OSError on failure."""
    if length > 0 and _libc.fallocate(fd, 0, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


class _Staging:
    """The buffer small tensors are packed into, and the region of an extent file it will be written to."""

    __slots__ = ("buf", "file", "base", "region", "fill", "future")

    def __init__(self, buf: Buffer, file: int, base: int, region: int):
        self.buf, self.file, self.base, self.region = buf, file, base, region  # region: bytes
        self.fill = 0  # bytes packed so far (4 KiB multiple)
        self.future: Future = Future()


class ExtentWriter:
    """Writes tensors into newly allocated extents of `files` through `engine` and `pool` buffers, and knows
    every write still in flight. Shares `space.lock` with the tier."""

    def __init__(self, engine: Engine, pool: BufferPool, space: ExtentSpace, files: ExtentFiles, stats: TierStats):
        self.engine = engine
        self.pool = pool
        self.space = space
        self.files = files
        self.stats = stats
        self._lock = space.lock
        self._staging: _Staging | None = None
        self._inflight: set[Future] = set()
        self._inflight_lock = threading.Lock()
        self._prealloc: dict[int, int] = {}  # extent file -> logical bytes reserved with fallocate
        self._prealloc_ok = True

    # -- space --------------------------------------------------------------------------------------
    def _allocate(self, nbytes: int, account: bool = True) -> tuple[int, int]:
        """(file, offset) of `nbytes` of free space, its extent file open (lock held)."""
        f, off = self.space.allocate(nbytes, account)
        try:
            self.files.get(f)
        except BaseException:
            self.space.release(f, off, nbytes, account)
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
            for part, phys, _within, length in self.files.list[f].map(off, nbytes):
                _fallocate(part.fd, phys, length)
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.ENOSYS):
                self._prealloc_ok = False
                return
            paths = self.files.paths(f, off, nbytes)
            raise io_error(e.errno or errno.EIO, f"reserving {nbytes} bytes of disk space for {what}",
                           ",".join(paths), off, nbytes) from None
        self.files.dirty.add(f)

    def _preallocate(self, f: int, end: int) -> None:
        """Make sure extent file `f` has disk space reserved up to logical byte `end` (lock held).

        [Note: extent files are preallocated ahead of the writes]
        An O_DIRECT write past the end of an ext4 file has to change the file's size, and ext4 does such
        writes one at a time instead of overlapping them. So the space of each extent file is reserved with
        fallocate() ahead of use once the file passes PREALLOC_FROM (small stores stay as small on disk as
        their data), a step at a time: 1/PREALLOC_SHARE of the bytes of live extents (at least PREALLOC_FROM,
        at most 1 GiB). A step as large as the file so far (as before) left files at ~2x the live states:
        the reservation beyond the high-water mark is never used when the states stop growing, and
        copy-on-write keeps only a sub-group or so of old versions alive, so the file's end tracks the live
        bytes, not its own size. Best effort: where
        fallocate is not supported or the disk is too full for a step, only what is needed is asked for,
        then nothing: the reservation of each extent (_reserve) then reports a full disk. Reserved space no
        manifest names is free space, so this changes nothing for crash safety; the fsync in sync() covers
        the new size."""
        have = self._prealloc.get(f, 0)  # bytes, logical
        if end <= have or end <= PREALLOC_FROM or not self._prealloc_ok:
            return
        step = min(max(self.space.budget.used // PREALLOC_SHARE, PREALLOC_FROM), 1 << 30)  # bytes
        sf = self.files.list[f]
        for target in (max(end, min(end + step, self.space.alloc.file_bytes)), end):
            try:
                for part, start, stop in part_ranges(sf, have, target):
                    _fallocate(part.fd, start, stop - start)
            except OSError as e:
                if e.errno in (errno.EOPNOTSUPP, errno.ENOSYS):
                    self._prealloc_ok = False
                    return
                continue  # ENOSPC and the like: try a smaller step, then leave it to the write
            self._prealloc[f] = target
            self.files.dirty.add(f)
            return

    # -- writes ----------------------------------------------------------------------------------
    def _track(self, fut: Future) -> None:
        with self._inflight_lock:
            self._inflight.add(fut)

        def done(f: Future) -> None:
            with self._inflight_lock:
                self._inflight.discard(f)
        fut.add_done_callback(done)

    def write(self, src: torch.Tensor, what: str, lend: Callable[[], None] | None = None) -> Extent:
        """Start writing the bytes of `src` (a contiguous CPU tensor, any dtype); see NvmeTier.write. `lend`:
        see [Note: lent tensors]."""
        n = src.numel() * src.element_size()  # bytes
        if src.device.type != "cpu" or not src.is_contiguous():
            if lend is not None:
                lend()
            raise TierstoreValueError("the nvme tier writes contiguous CPU tensors")
        alen = align_up(n)
        aligned = src.data_ptr() % ALIGN == 0
        t0 = time.perf_counter()
        try:
            with profile_range("tierstore::nvme_write"):
                if n == 0:
                    return Extent(0, 0, 0, 0, 0)
                if lend is not None and aligned and alen > self.pool.buffer_bytes // 2:
                    e = self._write_direct(src, n, alen, what, lend)
                    lend = None  # _write_direct calls it once the disk has the bytes
                    return e
                if alen <= self.pool.buffer_bytes:
                    return self._write_staged(src.data_ptr(), n, alen, what)
                if aligned and alen >= self.pool.nbytes:  # [Note: large aligned tensors are written in place]
                    e = self._write_direct(src, n, alen, what, None)
                    assert e.written is not None
                    e.written.exception()  # wait: the tensor is the caller's again when this returns
                    return e
                return self._write_streamed(src.data_ptr(), n, alen, what)
        finally:
            self.stats.add("in", n, time.perf_counter() - t0)
            if lend is not None:
                lend()  # copied, or nothing written: the memory is the caller's again

    def _write_staged(self, addr: int, n: int, alen: int, what: str) -> Extent:
        with self._lock:
            st = self._staging
            self.space.charge(alen)
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
                self.space.budget.give(alen)
                raise
            pos = st.fill
            dst = st.buf.addr + pos
            ctypes.memmove(dst, addr, n)
            st.fill += alen
            crc, blocks = block_crcs(dst, n)  # [Note: block checksums] in extents.py
            return Extent(st.file, st.base + pos, n, alen, crc, st.future, blocks)

    def _seal(self) -> None:
        """Write the staging buffer (caller holds the lock)."""
        st, self._staging = self._staging, None
        if st is None:
            return
        if st.fill < st.region:
            self.space.release(st.file, st.base + st.fill, st.region - st.fill, account=False)  # the unused tail
        if st.fill == 0:
            st.buf.release()
            st.future.set_result(0)
            return
        self.files.dirty.add(st.file)
        try:
            io = self.engine.write(self.files.list[st.file], st.buf.tensor(torch.uint8, st.fill), st.base)
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

    def _claim(self, alen: int, what: str) -> tuple[int, int, StripedFile]:
        """(file, offset, striped file) of a new extent of `alen` bytes, its disk space reserved."""
        with self._lock:
            f, off = self._allocate(alen)
            try:
                self._reserve(f, off, alen, what)
            except BaseException:
                self.space.release(f, off, alen)
                raise
            self.files.dirty.add(f)
            return f, off, self.files.list[f]

    def _write_direct(self, src: torch.Tensor, n: int, alen: int, what: str,
                      lend: Callable[[], None] | None) -> Extent:
        """Write `src` (4 KiB-aligned) from its own memory ([Note: large aligned tensors are written in place],
        [Note: lent tensors]); returns at once. `lend()` runs once every request has finished."""
        f, off, sf = self._claim(alen, what)
        addr, bb = src.data_ptr(), self.pool.buffer_bytes
        src = src.reshape(-1).view(torch.uint8)  # bytes
        body = n - n % ALIGN  # bytes written from the tensor itself
        tail: Buffer | None = None
        fut: Future = Future()
        left = 1  # requests not finished yet, +1 until every one is submitted
        err: BaseException | None = None  # the first error
        lock = threading.Lock()

        def one_done(io: Future | None) -> None:
            nonlocal left, err
            with lock:
                if io is not None and io.exception() is not None and err is None:
                    err = io.exception()
                left -= 1
                if left:
                    return
            if tail is not None:
                tail.release()
            if lend is not None:
                lend()
            if err is None:
                fut.set_result(n)
            else:
                fut.set_exception(err)  # reported like a streamed write's: by the read or the flush

        def submit(data: torch.Tensor, at: int) -> None:
            nonlocal left
            io = self.engine.write(sf, data, at)
            with lock:
                left += 1
            io.add_done_callback(one_done)

        self._track(fut)
        crcs = BlockCrcs()  # [Note: block checksums] in extents.py
        try:
            for a in range(0, body, bb):
                take = min(bb, body - a)
                submit(src[a:a + take], off + a)
                crcs.feed(addr + a, take)  # [Note: one pass over the data, while it is in cache]
            if body < n:
                tail = self.lease()
                ctypes.memmove(tail.addr, addr + body, n - body)
                crcs.feed(tail.addr, n - body)
                submit(tail.tensor(torch.uint8, ALIGN), off + body)
        except BaseException as e:  # the rest is never submitted: the extent is never read (its future fails)
            with lock:
                err = err or e
        one_done(None)  # every request is submitted
        if crcs.total != n:
            return Extent(f, off, n, alen, 0, fut)
        crc, blocks = crcs.finish()
        return Extent(f, off, n, alen, crc, fut, blocks)

    def _write_streamed(self, addr: int, n: int, alen: int, what: str) -> Extent:
        f, off, sf = self._claim(alen, what)
        bb = self.pool.buffer_bytes
        chunks = (alen + bb - 1) // bb
        fut: Future = Future()
        left = chunks  # chunk writes not yet finished (or never to be submitted)
        err: BaseException | None = None  # the first one's error
        lock = threading.Lock()

        def chunk_done(io_fut: Future, buf: Buffer) -> None:
            nonlocal left, err
            buf.release()
            with lock:
                if io_fut.exception() is not None and err is None:
                    err = io_fut.exception()
                left -= 1
                last = left == 0
                failed = err
            if last:
                if failed is not None:
                    fut.set_exception(failed)
                else:
                    fut.set_result(n)

        self._track(fut)
        crcs = BlockCrcs()  # [Note: block checksums] in extents.py
        for i in range(chunks):
            a = i * bb
            take = min(bb, n - a)
            buf: Buffer | None = None
            try:  # a lease that fails (sealing the staging buffer failed, a stalled pool) fails the extent too:
                buf = self.lease()  # its future must settle, or every flush after would wait for it forever
                ctypes.memmove(buf.addr, addr + a, take)
                crcs.feed(buf.addr, take)  # [Note: one pass over the data, while it is in cache]
                io = self.engine.write(sf, buf.tensor(torch.uint8, align_up(take)), off + a)
            except BaseException as e:
                if buf is not None:
                    buf.release()
                with lock:
                    err = err or e
                    left -= chunks - i  # this chunk and the ones never submitted
                    last = left == 0
                    failed = err
                if last:
                    fut.set_exception(failed)
                break
            io.add_done_callback(functools.partial(chunk_done, buf=buf))
        if crcs.total != n:  # a chunk failed to submit: the extent is never read (its future failed)
            return Extent(f, off, n, alen, 0, fut)
        crc, blocks = crcs.finish()
        return Extent(f, off, n, alen, crc, fut, blocks)

    # -- buffers and completion ------------------------------------------------------------------------
    def lease(self) -> Buffer:
        """A pool buffer, waiting while every buffer is in flight (back-pressure). The open staging buffer of
        small writes holds one of them until it is sealed; when none is free, it is sealed first -- its
        write then frees the buffer -- so that a small pool (one buffer: budgets['pinned'] == buffer_bytes) can
        never wait on a release that only a later small write or a flush would bring. The wait is short and
        repeated: another thread's small write may take the freed buffer for a new staging buffer. Bounded
        as every wait on the pool ([Note: a wait on the pool is bounded] in io/pool.py)."""
        start = time.monotonic()
        while True:
            buf = self.pool.try_lease()
            if buf is not None:
                return buf
            with self._lock:
                if self._staging is not None:
                    self._seal()
            try:  # another thread's small write may open a new staging buffer with the freed one: look again
                return self.pool.lease(timeout=0.05, since=start)
            except StalledError:
                raise
            except TimeoutError:
                continue

    def wait_written(self, e: Extent) -> None:
        """Wait until `e`'s bytes are in its file (sealing the staging buffer holding them); raises the
        write's error."""
        w = e.written
        if w is None:
            return
        if not w.done():
            with self._lock:
                if self._staging is not None and self._staging.future is w:
                    self._seal()
        self.engine.wait_for([w])  # bounded ([Note: bounded waits] in io/stall.py)
        w.result()  # raises the write's error
        e.written = None

    def wait_all(self) -> None:
        """Wait for every write in flight (their errors stay on their futures)."""
        with self._inflight_lock:
            pending = list(self._inflight)
        self.engine.wait_for(pending)  # bounded ([Note: bounded waits] in io/stall.py)

    def drop_staging(self) -> None:
        """Close: what is staged and not yet written never will be (its extents' futures say so)."""
        with self._lock:
            st, self._staging = self._staging, None
            if st is not None:
                st.buf.release()
                if not st.future.done():
                    st.future.set_exception(MisuseError("the store was closed before this data was written"))
