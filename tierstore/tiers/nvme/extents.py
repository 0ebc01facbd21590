"""Extents, the free space of the extent files, and the copy-on-write commit protocol -- state only, no I/O.

[Note: space is never reused before the manifest stops pointing at it]
Crash safety rests on copy-on-write: a new version of a tensor always goes to free space, and the space
of a version named by the last durable manifest (`committed`) is only *pending* free until the next
manifest is durable (`commit_done()`). Space whose write is still in flight, or that a reader is still
reading, is freed only when that I/O has finished, so two requests never race on the same bytes.
"""
from __future__ import annotations

import bisect
import struct
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

from ...errors import CorruptionError, MisuseError, TierFullError, TierstoreValueError
from ...io import ALIGN
from ...io.checksum import crc_at
from ..base import Budget

EXTENT_FILE = "extents-{:04d}.bin"
CRC_BLOCK = 256 << 10  # bytes of payload each block crc32c covers ([Note: block checksums])

# [Note: block checksums]
# An extent longer than CRC_BLOCK carries, besides the crc32c of its whole payload, the crc32c of each
# CRC_BLOCK-byte block of it (the last one shorter), so a read of a range (Store.get(name, rows=...)) reads and
# verifies only the blocks covering it. Writes compute the block crcs in their one pass over the data and
# derive the whole crc from them (crc_combine), so there is no second pass. Extents of at most CRC_BLOCK
# bytes, and those of manifests written before block crcs, have the whole crc only: a range read of one reads
# the whole extent. The granularity is a trade: a range read reads whole blocks (a lookup of rows scattered
# over a table reads every block one of them falls in), while each block costs 4 bytes in the manifest (8 hex
# digits: 256 KiB blocks put 256 KiB of text per 8 GiB of extents into every manifest write) and one crc32c call
# when written.
_POLY = 0x82F63B78  # crc32c (Castagnoli), reflected


def _mult(a: int, b: int) -> int:
    """a x b modulo the crc32c polynomial (reflected bit order)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if a & (m - 1) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


_X2N = [1 << 30]  # x^(2^k) modulo the polynomial
for _k in range(1, 32):
    _X2N.append(_mult(_X2N[-1], _X2N[-1]))


def _x8n(n: int) -> int:
    """x^(8 n) modulo the polynomial: the operator that appends n zero bytes."""
    p, k = 1 << 31, 3
    while n:
        if n & 1:
            p = _mult(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


_BLOCK_OP = _x8n(CRC_BLOCK)
# the map crc -> _mult(_BLOCK_OP, crc) is linear over GF(2): one table per byte of crc
_BLOCK_TABLES = [[_mult(_BLOCK_OP, b << (8 * i)) for b in range(256)] for i in range(4)]


def crc_combine(crc1: int, crc2: int, len2: int) -> int:
    """The crc32c of A + B from crc32c(A), crc32c(B) and len(B)."""
    if len2 == CRC_BLOCK:
        t0, t1, t2, t3 = _BLOCK_TABLES
        return t0[crc1 & 255] ^ t1[(crc1 >> 8) & 255] ^ t2[(crc1 >> 16) & 255] ^ t3[crc1 >> 24] ^ crc2
    return _mult(_x8n(len2), crc1) ^ crc2


class BlockCrcs:
    """Accumulates the block crcs of a payload fed in pieces of any size ([Note: block checksums])."""

    __slots__ = ("blocks", "cur", "fill", "total")

    def __init__(self) -> None:
        self.blocks: list[int] = []
        self.cur = 0
        self.fill = 0  # bytes of the current block
        self.total = 0  # bytes fed

    def feed(self, addr: int, n: int) -> None:
        self.total += n
        while n:
            take = min(n, CRC_BLOCK - self.fill)
            self.cur = crc_at(addr, take, self.cur)
            self.fill += take
            addr += take
            n -= take
            if self.fill == CRC_BLOCK:
                self.blocks.append(self.cur)
                self.cur = self.fill = 0

    def finish(self) -> tuple[int, tuple[int, ...] | None]:
        """(crc32c of everything fed, the block crcs or None when it fits one block)."""
        blocks = self.blocks + ([self.cur] if self.fill else [])
        if len(blocks) <= 1:
            return (blocks[0] if blocks else 0), None
        whole = blocks[0]
        for b in blocks[1:-1]:
            whole = crc_combine(whole, b, CRC_BLOCK)
        whole = crc_combine(whole, blocks[-1], self.fill or CRC_BLOCK)
        return whole, tuple(blocks)


def block_crcs(addr: int, n: int) -> tuple[int, tuple[int, ...] | None]:
    """BlockCrcs of `n` bytes of host memory at `addr`: (whole crc32c, block crcs or None)."""
    if n <= CRC_BLOCK:
        return crc_at(addr, n), None
    acc = BlockCrcs()
    acc.feed(addr, n)
    return acc.finish()


def align_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Extent:
    """Where one tensor's encoded bytes live: `length` payload bytes at `offset` of extent file `file`,
    `alloc` bytes reserved (4 KiB multiple). `written` is the pending write's future (None once known
    done); `committed` is True while the last durable manifest names this extent."""

    __slots__ = ("file", "offset", "length", "alloc", "crc", "blocks", "written", "committed", "readers", "freed",
                 "damaged")

    def __init__(self, file: int, offset: int, length: int, alloc: int, crc: int, written: Future | None = None,
                 blocks: tuple[int, ...] | None = None):
        self.file = file
        self.offset = offset  # bytes, logical offset in the striped extent file
        self.length = length  # bytes of payload
        self.alloc = alloc  # bytes reserved (aligned)
        self.crc = crc
        self.blocks = blocks  # crc32c of each CRC_BLOCK bytes, or None ([Note: block checksums])
        self.written = written
        self.committed = False
        self.readers = 0
        self.freed = False
        self.damaged = False  # reaches past the end of its extent file (found at open): reads are refused

    def to_json(self) -> dict:
        d: dict = {"file": self.file, "offset": self.offset, "length": self.length, "alloc": self.alloc,
                   "crc32c": self.crc}
        if self.blocks is not None:
            d["block_crc32c"] = {"block": CRC_BLOCK, "crcs": struct.pack(f"<{len(self.blocks)}I", *self.blocks).hex()}
        return d

    @classmethod
    def from_json(cls, d, path: str | None = None, field: str | Callable[[], str] = "extent") -> Extent:
        """The extent a manifest entry describes, its fields checked (types, ranges, alignment; whether it lies
        inside the extent files is ExtentSpace.check's). CorruptionError names `path` and `field` (or what
        `field()` returns: a caller's field name is then built only for an error)."""
        def bad(what: str) -> CorruptionError:
            name = field() if callable(field) else field
            return CorruptionError(f"the manifest {path}: field {name}: {what}; it is damaged or was not "
                                   "written by tierstore: restore it from a backup", path)
        keys = ("file", "offset", "length", "alloc", "crc32c")
        try:
            f, off, length, alloc, crc = d["file"], d["offset"], d["length"], d["alloc"], d["crc32c"]
        except (TypeError, KeyError, IndexError):
            f = off = length = alloc = crc = None
        if not (type(d) is dict and type(f) is int and type(off) is int and type(length) is int
                and type(alloc) is int and type(crc) is int) or min(f, off, length, alloc, crc) < 0:
            raise bad(f"{str(d)[:120]} is not {{{', '.join(keys)}}} of non-negative integers")
        e = cls(f, off, length, alloc, crc)
        if crc >= 1 << 32:
            raise bad(f"crc32c {crc} is not 32 bits")
        if off % ALIGN or alloc != (length + ALIGN - 1) // ALIGN * ALIGN or (length == 0 and (f or off or crc)):
            raise bad(f"{e!r} is not a {ALIGN}-byte aligned extent of align_up(length) bytes")
        b = d.get("block_crc32c")
        if b is not None:
            nblocks = -(-e.length // CRC_BLOCK)
            crcs = b.get("crcs") if isinstance(b, dict) else None
            try:
                if not isinstance(b, dict) or b.get("block") != CRC_BLOCK or not isinstance(crcs, str) \
                        or len(crcs) != 8 * nblocks or nblocks < 2:
                    raise ValueError
                e.blocks = struct.unpack(f"<{nblocks}I", bytes.fromhex(crcs))
            except ValueError:
                raise bad(f"block_crc32c is not {{block: {CRC_BLOCK}, crcs: 8 hex digits (a little-endian crc32c) "
                          f"per block of the {e.length} bytes}}") from None
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


class ExtentSpace:
    """Who may use which bytes of the extent files: the allocator, the byte budget (it counts extents, not
    staging regions), and when freed space may be reused (see [Note: space is never reused before the
    manifest stops pointing at it]). State only: it opens, reads and writes nothing; a write still in flight
    is an unfinished `Extent.written` future. `lock` guards it and is the nvme tier's lock."""

    def __init__(self, file_bytes: int, budget_bytes: int | None = None):
        self.alloc = ExtentAllocator(file_bytes)
        self.budget = Budget("nvme", budget_bytes)  # counts allocated (aligned) bytes
        self.lock = threading.RLock()
        self._late: deque[Extent] = deque()  # freed while their write was in flight, now written
        self._pending_free: list[Extent] = []  # committed extents freed since the last commit

    # -- space ------------------------------------------------------------------------------------------
    def charge(self, nbytes: int) -> None:
        """Count `nbytes` of extents against the budget; TierFullError when they do not fit."""
        if self.budget.limit is not None and self.budget.used + nbytes > self.budget.limit:
            raise TierFullError(f"the nvme tier is full: {self.budget.used} of budgets['nvme']={self.budget.limit} "
                                f"bytes used, {nbytes} more needed; raise budgets['nvme'] or delete tensors")
        self.budget.take(nbytes)

    def allocate(self, nbytes: int, account: bool = True) -> tuple[int, int]:
        """(file, offset) of `nbytes` (4 KiB multiple) of free space, charged to the budget if `account`."""
        with self.lock:
            self._drain_late()
            if account:
                self.charge(nbytes)
            return self.alloc.alloc(nbytes)

    def release(self, f: int, off: int, nbytes: int, account: bool = True) -> None:
        """Space no extent will ever read again is free now (an unused staging tail, a failed allocation)."""
        with self.lock:
            self.alloc.free(f, off, nbytes)
            if account:
                self.budget.give(nbytes)

    def _drain_late(self) -> None:
        while self._late:
            e = self._late.popleft()
            self.release(e.file, e.offset, e.alloc)

    def _release_when_written(self, e: Extent) -> None:
        w = e.written
        if w is not None and not w.done():
            w.add_done_callback(lambda _f: self._late.append(e))  # freed at the next allocation
        else:
            self.release(e.file, e.offset, e.alloc)

    # -- the commit protocol ----------------------------------------------------------------------------
    def free(self, e: Extent) -> None:
        """Give back an extent's space: now, after its write/reads finish, or after the next commit."""
        with self.lock:
            if e.freed or e.alloc == 0:
                e.freed = True
                return
            e.freed = True
            if e.committed:
                self._pending_free.append(e)
            elif e.readers:
                pass  # the last reader frees it (end_read)
            else:
                self._release_when_written(e)

    def unfree(self, e: Extent) -> None:
        """Undo free() of a committed extent (a failed write reverts a tensor to its committed version)."""
        with self.lock:
            if e in self._pending_free:
                self._pending_free.remove(e)
            e.freed = False

    def protect(self, extents: list[Extent]) -> list[Extent]:
        """A manifest naming `extents` is about to be written: from now on freeing them only makes them pending
        (their space must not be reused while that manifest may become durable). Returns those newly
        protected, for unprotect() when the manifest is not written after all."""
        with self.lock:
            new = [e for e in extents if not e.committed and e.alloc]
            for e in new:
                e.committed = True
            return new

    def unprotect(self, extents: list[Extent]) -> None:
        """The manifest protect() returned `extents` for was not written: they are plain extents again."""
        with self.lock:
            for e in extents:
                e.committed = False
                if e in self._pending_free:
                    self._pending_free.remove(e)
                    e.freed = False
                    self.free(e)

    def commit_done(self, live: list[Extent]) -> None:
        """The manifest naming exactly `live` is durable: free the pending extents it no longer names."""
        with self.lock:
            ids = {id(e) for e in live}
            pend, self._pending_free = self._pending_free, []
            for e in pend:
                if id(e) in ids:  # freed while the manifest naming it was written: wait for the next one
                    self._pending_free.append(e)
                    continue
                e.committed = False
                e.freed = False
                self.free(e)

    def pending_free(self) -> list[Extent]:
        """The freed extents a durable manifest may still name (their space is not reusable yet)."""
        with self.lock:
            return list(self._pending_free)

    # -- readers ----------------------------------------------------------------------------------------
    def begin_read(self, e: Extent) -> None:
        """A read of `e` starts: its space stays allocated until end_read(). MisuseError if it was freed."""
        with self.lock:
            if e.freed and not e.committed:
                raise MisuseError(f"{e!r} was freed; the tensor was deleted or replaced")
            e.readers += 1

    def end_read(self, e: Extent) -> None:
        with self.lock:
            e.readers -= 1
            if e.readers == 0 and e.freed and not e.committed:
                self._release_when_written(e)

    # -- reopen -----------------------------------------------------------------------------------------
    def check(self, extents: list[Extent], path: str, nfiles: int, field: Callable[[int], str]) -> None:
        """Every extent a manifest at `path` names lies in one of the `nfiles` extent files that exist, and no
        two overlap; else CorruptionError naming extent i as `field(i)`."""
        spans = []
        for i, e in enumerate(extents):
            if not e.alloc:
                continue
            if e.file >= nfiles:
                raise CorruptionError(
                    f"the manifest {path}: field {field(i)}.file: extent file {EXTENT_FILE.format(e.file)} does "
                    f"not exist in every directory (this store has {nfiles}); restore the store's files or "
                    "the manifest from a backup", path)
            spans.append((e.file, e.offset, e.alloc, i))
        spans.sort()
        for (f, a, an, ia), (g, b, _bn, ib) in zip(spans, spans[1:]):
            if f == g and a + an > b:
                raise CorruptionError(f"the manifest {path}: field {field(ib)}: its extent overlaps that of "
                                      f"{field(ia)}; the manifest is damaged: restore it from a backup", path)

    def adopt(self, extents: list[Extent]) -> None:
        """Reopen: the manifest's extents (checked by check()) are the only used space."""
        with self.lock:
            self.alloc.rebuild([(e.file, e.offset, e.alloc) for e in extents])
            self.budget.used = sum(e.alloc for e in extents)
