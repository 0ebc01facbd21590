"""Reads of extents: small ones coalesced into buffer-sized runs, large ones in chunks, every crc32c checked.

[Note: how reads are issued]
Small extents (<= half a pool buffer) are sorted by place and coalesced into buffer-sized reads
(neighbours at most 64 KiB apart) through pool buffers, then copied out. Larger extents are read in
buffer-sized chunks, many in flight (across tensors too): straight into `out` with O_DIRECT when it
is 4 KiB aligned and not a get() result's ([Note: results are read through the pool]), else through pool
buffers with the copy of chunk k overlapping the reads of the chunks after it. Each chunk's crc32c is
folded in as it completes, in order.

[Note: range reads]
A read of byte ranges of one extent (read_ranges; Store.get(name, rows=...)) reads the CRC_BLOCK blocks covering
them ([Note: block checksums] in extents.py) -- consecutive blocks as one request of at most RANGE_SPAN bytes,
every request 4 KiB aligned and O_DIRECT into aligned memory, half of RANGE_SCRATCH bytes of blocks submitted as
one batch while the batch before is checked -- checks each block's crc32c, then copies the ranges out. So its
memory is the result and at most RANGE_SCRATCH more, however many blocks the rows fall in. An extent without block
crcs is read whole (and its whole crc32c checked), so a range read is never less verified than a full one -- but
streamed through pool buffers, copying out only the ranges, so its memory is the result alone. The block crcs
computed on the way are kept on the extent once the whole crc32c matched, so the later range reads of it read only
the blocks covering their ranges.

[Note: results are read through the pool]
A get() result (RESULTS.holds it: [Note: result memory] in tiers/host.py) is read through pool buffers and
copied out, not straight into it with O_DIRECT, though it is aligned: its small pages cost the disk more than
the copy costs the CPU. Measured here (1 GiB, page cache dropped, alternated, load ~3): O_DIRECT into populated
small-page memory ran at 0.75x the same read into the pool's huge, registered buffers, a 1 MiB request becoming
several of at most 254 pages (the virtual disk's max_segments); get() into a fresh result read straight into it
at 0.78x the engine's read into a pool buffer, and through pool buffers with the copy out at 0.90x. The result
is still faulted in ahead by the thread of [Note: fresh memory] (the copy out does not wait for it: it faults
a page the thread has not reached itself). Aligned memory of the caller's (out=, the step's buffers) is read
straight into, as before.

[Note: fresh memory]
get() reads into memory allocated for the result. Its pages do not exist yet: an O_DIRECT read into it
takes a page fault per page inside the submission, on the reading thread, one after another, and that --
not the disk -- bounded get() to a fraction of get(out=). So a thread faults the direct chunks in ahead of
the reads (MADV_POPULATE_WRITE, one call per chunk) while the reads of the chunks before are in flight, and
the reader submits a chunk once it is populated. On memory already populated (out=) the call only walks the
page tables -- as on a result's memory recycled ([Note: result memory] in tiers/host.py). Result memory is not
advised for huge pages: measured here, a fresh huge page's compaction made populating slower and far more
variable than small pages (docs/io.md).
"""
from __future__ import annotations

import ctypes
import errno
import os
import threading
import time
from collections import deque

import torch

from ...errors import CorruptionError, TierstoreIOError, TierstoreValueError, io_error
from ...io import ALIGN, Buffer, BufferPool, Engine
from ...io.checksum import crc_at
from ...io.pool import populate
from ..base import TierStats, profile_range
from ..host import RESULTS, aligned_empty
from .extents import CRC_BLOCK, EXTENT_FILE, BlockCrcs, Extent, ExtentSpace, align_up
from .files import ExtentFiles
from .writes import ExtentWriter

RUN_GAP = 64 << 10  # bytes: the largest hole between two small extents read in one request
RANGE_SPAN = 16 * CRC_BLOCK  # bytes: the largest request of a range read (consecutive blocks)
RANGE_SCRATCH = 64 << 20  # bytes: the most memory a range read takes besides its result
PREFAULT_MIN = 16 << 20  # bytes read straight into memory from which the memory is faulted in ahead


class Prefault:
    """Faults in `ranges` [(address, bytes)] in order on a thread (see [Note: fresh memory]); wait(k) returns
    once range k is populated (or populating is unavailable, or the thread stopped)."""

    def __init__(self, ranges: list[tuple[int, int]]):
        self._ranges = ranges
        self._done = 0  # ranges populated so far
        self._stop = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="tierstore-prefault", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for i, (addr, nbytes) in enumerate(self._ranges):
                if self._stop or not populate(addr, nbytes):
                    break
                with self._cond:
                    self._done = i + 1
                    self._cond.notify_all()
        finally:
            with self._cond:
                self._done = len(self._ranges)  # nothing more to wait for
                self._cond.notify_all()

    def wait(self, k: int) -> None:
        with self._cond:
            while self._done <= k:
                self._cond.wait()

    def close(self) -> None:
        self._stop = True
        self._thread.join()


def plan_runs(extents: list[Extent], buffer_bytes: int) -> list[list[int]]:
    """Indices of `extents` grouped into runs, each one read of at most `buffer_bytes` bytes: neighbours in
    one extent file at most RUN_GAP apart, in file order."""
    runs: list[list[int]] = []
    for i in sorted(range(len(extents)), key=lambda i: (extents[i].file, extents[i].offset)):
        e = extents[i]
        if runs:
            r0, last = extents[runs[-1][0]], extents[runs[-1][-1]]
            if (e.file == r0.file and 0 <= e.offset - (last.offset + last.alloc) <= RUN_GAP
                    and e.offset + e.alloc - r0.offset <= buffer_bytes):
                runs[-1].append(i)
                continue
        runs.append([i])
    return runs


def corruption(files: ExtentFiles, e: Extent, got: int, what: str) -> CorruptionError:
    """The error of extent `e` whose bytes read back with crc32c `got`."""
    paths = files.paths(e.file, e.offset, e.length)
    return CorruptionError(
        f"{what}: checksum mismatch (crc32c {got:#010x}, expected {e.crc:#010x}) reading "
        f"{e.length} bytes at offset {e.offset} of extent file {EXTENT_FILE.format(e.file)} "
        f"({', '.join(paths)}); the file was changed outside tierstore or the disk returned bad data",
        paths[0] if len(paths) == 1 else ",".join(paths), e.offset, e.length)


def _aligned(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor of `nbytes` at an ALIGN-aligned address (O_DIRECT reads go straight into it)."""
    if nbytes >= 1 << 20:
        return aligned_empty(nbytes, lock=False)
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    skip = -raw.data_ptr() % ALIGN
    return raw[skip:skip + nbytes]


def block_corruption(files: ExtentFiles, e: Extent, k: int, got: int, what: str) -> CorruptionError:
    """The error of block k of extent `e` ([Note: block checksums]) read back with crc32c `got`."""
    assert e.blocks is not None
    at, n = e.offset + k * CRC_BLOCK, min(CRC_BLOCK, e.length - k * CRC_BLOCK)
    paths = files.paths(e.file, at, n)
    return CorruptionError(
        f"{what}: checksum mismatch (crc32c {got:#010x}, expected {e.blocks[k]:#010x}) reading block {k} "
        f"({n} bytes at offset {at}) of extent file {EXTENT_FILE.format(e.file)} ({', '.join(paths)}); the "
        "file was changed outside tierstore or the disk returned bad data",
        paths[0] if len(paths) == 1 else ",".join(paths), at, n)


def truncation(files: ExtentFiles, e: Extent, what: str) -> CorruptionError | None:
    """A CorruptionError when extent `e` reaches past the end of a part of its extent file (a read of it
    comes back short), else None -- also when a part's size cannot be had (a filesystem shut down after an
    error answers fstat with EIO too): the read's own error then stands ([Note: read errors])."""
    for part, phys, _within, length in files.list[e.file].map(e.offset, e.alloc):
        try:
            size = os.fstat(part.fd).st_size  # bytes
        except OSError:
            return None
        if size < phys + length:
            return CorruptionError(
                f"{what}: the extent file {part.path} ends at byte {size}, inside this tensor's {e.length} "
                f"bytes at offset {e.offset} of extent file {EXTENT_FILE.format(e.file)}: the file was "
                "truncated outside tierstore; restore it from a backup, or delete the tensor",
                part.path, e.offset, e.length)
    return None


def read_error(files: ExtentFiles, e: Extent, what: str, exc: BaseException) -> BaseException:
    """What a failed read of extent `e` (`exc`) raises.

    [Note: read errors]
    Every way out of a failed read of the persistent tier is a TierstoreIOError naming the file, the offset
    and the length: the CorruptionError of a truncated extent file when that is the cause, else the read's
    own error -- one the engine raised already is one; a plain OSError (from anything the read path calls)
    is made one, naming the extent. Looking for the cause never raises in its place: a filesystem that
    answered the read with EIO may answer fstat with EIO as well. Errors that are not I/O errors (a closed
    store's MisuseError) pass as they are."""
    cut = truncation(files, e, what)
    if cut is not None:
        return cut
    if isinstance(exc, OSError) and not isinstance(exc, TierstoreIOError):
        paths = ", ".join(files.paths(e.file, e.offset, e.length))
        return io_error(exc.errno or errno.EIO, f"{what}: reading {e.length} bytes at offset {e.offset} of "
                        f"extent file {EXTENT_FILE.format(e.file)} ({paths})", paths, e.offset, e.length)
    return exc


def check_readable(files: ExtentFiles, e: Extent, what: str) -> None:
    """Raise the CorruptionError of a damaged extent (its file was found truncated at open)."""
    if e.damaged:
        raise truncation(files, e, what) or CorruptionError(
            f"{what}: its extent {e!r} reached past the end of its extent file when the store was opened; "
            "restore the store's files from a backup, or delete the tensor", None, e.offset, e.length)


class ExtentReader:
    """Reads extents of `files` into caller tensors through `engine` (and `pool` buffers where needed)."""

    def __init__(self, engine: Engine, pool: BufferPool, space: ExtentSpace, files: ExtentFiles,
                 writer: ExtentWriter, stats: TierStats):
        self.engine = engine
        self.pool = pool
        self.space = space
        self.files = files
        self.writer = writer
        self.stats = stats

    def read_many(self, items: list[tuple[Extent, torch.Tensor, str]]) -> list[BaseException | None]:
        """See NvmeTier.read_many and [Note: how reads are issued]."""
        errors: list[BaseException | None] = [None] * len(items)
        bb = self.pool.buffer_bytes
        small: list[int] = []  # indices into items
        big: list[int] = []
        began: list[Extent] = []
        for i, (e, out, what) in enumerate(items):
            if e.length == 0:
                continue
            if out.numel() != e.length or out.element_size() != 1 or out.device.type != "cpu" \
                    or not out.is_contiguous():
                raise TierstoreValueError(f"{what}: reads go into a contiguous uint8 CPU tensor of {e.length} "
                                          f"elements; got {out.dtype} {tuple(out.shape)} on {out.device}")
            try:
                check_readable(self.files, e, what)
                self.space.begin_read(e)
            except BaseException as exc:
                errors[i] = exc
                continue
            began.append(e)
            (small if e.alloc <= bb // 2 else big).append(i)
        t0 = time.perf_counter()
        try:
            for i in small + big:
                try:
                    self.writer.wait_written(items[i][0])
                except BaseException as exc:
                    errors[i] = exc
            small = [i for i in small if errors[i] is None]
            big = [i for i in big if errors[i] is None]
            runs = [[small[k] for k in run] for run in plan_runs([items[i][0] for i in small], bb)]
            with profile_range("tierstore::nvme_read"):
                self._read_runs(items, runs, errors)
                self._read_big(items, big, errors)
        finally:
            for e in began:
                self.space.end_read(e)
            moved = sum(items[i][0].length for i in small + big if errors[i] is None)  # bytes
            self.stats.add("out", moved, time.perf_counter() - t0)
        return errors

    def read_ranges(self, e: Extent, ranges: list[tuple[int, int, int]], out: torch.Tensor, what: str) -> int:
        """Copy each (start, nbytes, dst) byte range of extent `e`'s payload to out[dst:dst + nbytes] (a
        contiguous uint8 CPU tensor), reading and verifying only the blocks that cover them ([Note: range
        reads]). Returns the bytes read from the file. Raises CorruptionError / the I/O error."""
        for a, n, d in ranges:
            if a < 0 or n < 0 or a + n > e.length or d < 0 or d + n > out.numel():
                raise TierstoreValueError(f"{what}: range of {n} bytes at {a} is outside the extent's {e.length} "
                                          f"bytes or the output's {out.numel()}")
        ranges = [r for r in ranges if r[1]]
        if not ranges or e.length == 0:
            return 0
        check_readable(self.files, e, what)
        self.space.begin_read(e)
        t0 = time.perf_counter()
        moved = 0
        try:
            self.writer.wait_written(e)
            if e.blocks is None:  # one crc32c for the whole payload: stream it whole
                moved = self._stream_ranges(e, ranges, out, what)
                return moved
            moved = self._read_blocks(e, ranges, out, what)
            return moved
        finally:
            self.space.end_read(e)
            self.stats.add("out", moved, time.perf_counter() - t0)

    def _read_blocks(self, e: Extent, ranges: list[tuple[int, int, int]], out: torch.Tensor, what: str) -> int:
        """read_ranges of an extent with block crcs: the blocks covering `ranges` in groups of half of
        RANGE_SCRATCH bytes, each read as one batch into one of two buffers while the group before is verified
        and copied out. Returns the bytes read."""
        need = sorted({k for a, n, _d in ranges for k in range(a // CRC_BLOCK, (a + n - 1) // CRC_BLOCK + 1)})
        per = max(1, RANGE_SCRATCH // CRC_BLOCK // 2)  # blocks per group
        groups = [need[g:g + per] for g in range(0, len(need), per)]
        bufs = [_aligned(len(groups[0]) * CRC_BLOCK) for _ in groups[:2]]
        dst, moved = out.data_ptr(), 0

        def end_of(k: int) -> int:  # bytes of block k as read: only the extent's last block is short
            return align_up(min(CRC_BLOCK, e.length - k * CRC_BLOCK))

        def submit(gi: int):
            """Start reading group gi into its buffer: (its blocks' places in the buffer, the batch's future)."""
            group, buf = groups[gi], bufs[gi % 2]
            # the group's blocks back to back (the extent's last block, if here, is last here too);
            # consecutive blocks are one request of at most RANGE_SPAN bytes
            pos = {k: i * CRC_BLOCK for i, k in enumerate(group)}
            reqs: list[tuple[torch.Tensor, int]] = []
            first = prev = group[0]
            for k in group[1:] + [None]:
                if k is not None and k == prev + 1 and (k - first + 1) * CRC_BLOCK <= RANGE_SPAN:
                    prev = k
                    continue
                reqs.append((buf[pos[first]:pos[prev] + end_of(prev)], e.offset + first * CRC_BLOCK))
                first = prev = k  # type: ignore[assignment]  # None only past the end
            try:
                return pos, self.engine.read_many(self.files.list[e.file], reqs)
            except BaseException as exc:
                raise read_error(self.files, e, what, exc) from None
        pending = [submit(0)]
        try:
            for gi, group in enumerate(groups):
                pos, io = pending[0]
                if gi + 1 < len(groups):
                    pending.append(submit(gi + 1))  # into the other buffer, while this group is checked
                try:
                    io.result()
                except BaseException as exc:
                    raise read_error(self.files, e, what, exc) from None
                finally:
                    pending.pop(0)
                moved += pos[group[-1]] + end_of(group[-1])
                base = bufs[gi % 2].data_ptr()
                for k in group:
                    got = crc_at(base + pos[k], min(CRC_BLOCK, e.length - k * CRC_BLOCK))
                    if got != e.blocks[k]:  # type: ignore[index]  # an extent with block crcs
                        raise block_corruption(self.files, e, k, got, what)
                lo_k, hi_k = group[0], group[-1]
                for a, n, d in ranges:  # a range's blocks inside the group are consecutive in buf: one copy
                    lo, hi = max(a, lo_k * CRC_BLOCK), min(a + n, (hi_k + 1) * CRC_BLOCK)
                    if lo < hi:
                        k = lo // CRC_BLOCK
                        ctypes.memmove(dst + d + (lo - a), base + pos[k] + lo % CRC_BLOCK, hi - lo)
        finally:
            for _pos, io in pending:
                io.exception()  # wait: the kernel may still write into the buffer
        return moved

    def _stream_ranges(self, e: Extent, ranges: list[tuple[int, int, int]], out: torch.Tensor, what: str) -> int:
        """read_ranges of an extent without block crcs ([Note: range reads]): all of it read through pool
        buffers, chunk by chunk in order, its crc32c (and block crcs) folded in, the ranges copied out of
        each chunk; no memory but the pool's. Returns the bytes read."""
        bb = self.pool.buffer_bytes  # bytes per chunk
        sf = self.files.list[e.file]
        acc = BlockCrcs()
        todo = sorted(ranges)  # by start: a chunk copies from the ranges from todo[first] on
        first = 0
        dst = out.data_ptr()
        window: deque = deque()  # (start, bytes, pool buffer, io future), oldest first

        def finish_oldest() -> None:
            nonlocal first
            a, take, buf, io = window.popleft()
            try:
                try:
                    io.result()
                except BaseException as exc:
                    raise read_error(self.files, e, what, exc) from None
                acc.feed(buf.addr, take)
                end = a + take
                while first < len(todo) and todo[first][0] + todo[first][1] <= a:
                    first += 1
                for k in range(first, len(todo)):
                    start, n, d = todo[k]
                    if start >= end:
                        break
                    lo, hi = max(start, a), min(start + n, end)
                    if lo < hi:
                        ctypes.memmove(dst + d + (lo - start), buf.addr + (lo - a), hi - lo)
            finally:
                buf.release()
        try:
            for a in range(0, e.length, bb):
                buf = self._lease_or_finish(window, finish_oldest)
                try:
                    io = self.engine.read(sf, buf.tensor(torch.uint8, min(bb, e.alloc - a)), e.offset + a)
                except BaseException as exc:
                    buf.release()
                    raise read_error(self.files, e, what, exc) from None
                window.append((a, min(bb, e.length - a), buf, io))
            while window:
                finish_oldest()
        finally:
            while window:
                _a, _t, buf, io = window.popleft()
                io.exception()  # wait: the kernel may still write into the buffer
                buf.release()
        crc, blocks = acc.finish()
        if crc != e.crc:
            raise corruption(self.files, e, crc, what)
        if blocks is not None and e.blocks is None:
            e.blocks = blocks  # verified by the whole crc32c: later range reads read only their blocks
        return e.length

    def _lease_or_finish(self, window: deque, finish) -> Buffer:
        """A pool buffer; while none is free, finish the oldest read of `window` (freeing its buffer)."""
        buf = self.pool.try_lease()
        while buf is None:
            if window:
                finish()
                buf = self.pool.try_lease()
            else:
                buf = self.writer.lease()
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
                    errors[i] = errors[i] or read_error(self.files, e, what, exc)
                    return
                if errors[i] is not None:
                    return
                dst = out.data_ptr() + a
                if buf is not None:
                    ctypes.memmove(dst, buf.addr, take)
                crcs[i] = crc_at(dst, take, crcs[i])  # [Note: one pass over the data, while it is in cache]
                if a + take == e.length and crcs[i] != e.crc:
                    errors[i] = corruption(self.files, e, crcs[i], what)
            finally:
                if buf is not None:
                    buf.release()
        # [Note: results are read through the pool]: result memory goes through pool buffers, faulted in ahead
        result = {i: RESULTS.holds(items[i][1].data_ptr()) for i in idx}
        direct = {i: items[i][1].data_ptr() % ALIGN == 0 and not result[i] for i in idx}
        ranges = [(items[i][1].data_ptr() + a, min(bb, items[i][0].length - a)) for i in idx
                  if direct[i] or result[i] for a in range(0, items[i][0].length, bb)]
        prefault = Prefault(ranges) if sum(n for _a, n in ranges) >= PREFAULT_MIN else None
        k = 0  # chunks of `ranges` submitted
        try:
            for i in idx:
                e, out, what = items[i]
                sf = self.files.list[e.file]
                for a in range(0, e.length, bb):
                    take = min(bb, e.length - a)
                    if direct[i]:
                        while len(window) >= max_direct:
                            finish_oldest()
                        if prefault is not None:
                            prefault.wait(k)
                        k += 1
                        buf, target = None, out[a:a + take]
                    else:
                        k += result[i]  # populated ahead, not waited for: the copy out faults what is not yet
                        buf = self._lease_or_finish(window, finish_oldest)
                        target = buf.tensor(torch.uint8, align_up(take))
                    try:
                        io = self.engine.read(sf, target, e.offset + a)
                    except BaseException as exc:
                        if buf is not None:
                            buf.release()
                        errors[i] = errors[i] or read_error(self.files, e, what, exc)
                        break
                    window.append((i, a, take, buf, io))
            while window:
                finish_oldest()
        finally:
            if prefault is not None:
                prefault.close()
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
                        cut = truncation(self.files, e, what)
                        if cut is None and len(run) > 1:
                            alone.append(i)
                        else:
                            errors[i] = cut or read_error(self.files, e, what, exc)
                    return
                for i in run:
                    e, out, what = items[i]
                    dst = out.data_ptr()
                    ctypes.memmove(dst, buf.addr + (e.offset - start), e.length)
                    got = crc_at(dst, e.length)
                    if got != e.crc:
                        errors[i] = corruption(self.files, e, got, what)
            finally:
                buf.release()
        try:
            for run in runs:
                first, last = items[run[0]][0], items[run[-1]][0]
                length = last.offset + last.alloc - first.offset
                buf = self._lease_or_finish(window, finish_oldest)
                try:
                    io = self.engine.read(self.files.list[first.file], buf.tensor(torch.uint8, length),
                                          first.offset)
                except BaseException as exc:
                    buf.release()
                    for i in run:
                        errors[i] = read_error(self.files, items[i][0], items[i][2], exc)
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
