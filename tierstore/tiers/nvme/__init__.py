"""The NVMe tier: tensors in a few large extent files, striped over every configured directory.

[Note: extent files, not one file per tensor]
DeepSpeed writes one file per tensor, named after Python ids: thousands of files, stale files after a
crash, and small I/O for small tensors. Here a tier owns a few *extent files* (``extents-0000.bin`` ...),
each one StripedFile over all directories (RAID-0, `stripe_unit` bytes per stripe, so every drive gets
its share of every large tensor). A tensor's encoded bytes occupy one *extent*: a 4 KiB-aligned range
``[offset, offset + alloc)`` of one extent file, found by `ExtentAllocator` (first fit in the free spans
of each file, else the end of a file; a new extent file when a file reaches `extent_file_bytes`). Every
extent carries the crc32c of its `length` payload bytes, checked on every read.

The parts, each below the one before it:
- `extents`: `Extent`, `ExtentAllocator` and `ExtentSpace` -- allocation, the budget and the copy-on-write
  commit protocol, state only (no I/O);
- `files`: `ExtentFiles` -- opening the extent files, which part files hold which bytes, what awaits fsync;
- `writes`: `ExtentWriter` -- small tensors packed, large ones streamed, disk space reserved;
- `reads`: `ExtentReader` -- small extents coalesced, large ones chunked, checksums and short reads checked;
- here: `NvmeTier`, the tier the store uses, which hands each call to one of them.
"""
from __future__ import annotations

import os
from collections.abc import Callable

import torch

from ...errors import MisuseError
from ...io import BufferPool, Engine, StripedFile
from ..base import TierStats, profile_range
from .extents import EXTENT_FILE, Extent, ExtentAllocator, ExtentSpace, align_up
from .files import ExtentFiles
from .reads import ExtentReader, check_readable
from .writes import ExtentWriter

__all__ = ["EXTENT_FILE", "Extent", "ExtentAllocator", "ExtentSpace", "NvmeTier", "align_up"]


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
        self.space = ExtentSpace(extent_file_bytes, budget_bytes)
        self.alloc = self.space.alloc
        self.budget = self.space.budget  # counts allocated (aligned) bytes
        self.stats = TierStats("nvme")
        self._lock = self.space.lock
        self._files = ExtentFiles(self.dirs, engine, stripe_unit, read_only)
        self._writer = ExtentWriter(engine, pool, self.space, self._files, self.stats)
        self._reader = ExtentReader(engine, pool, self.space, self._files, self._writer, self.stats)
        self.closed = False
        self._files.open_existing()

    # -- files ------------------------------------------------------------------------------------
    @property
    def files(self) -> list[StripedFile]:
        """The extent files opened so far, extent file k at index k."""
        return self._files.list

    def file_bytes(self) -> int:
        """The bytes of the extent files opened so far, every part in every directory together."""
        return self._files.total_bytes()

    def file_paths(self, f: int, offset: int | None = None, length: int | None = None) -> list[str]:
        """The part files holding bytes of extent file `f` (those holding [offset, offset+length) if given)."""
        return self._files.paths(f, offset, length)

    # -- space: the commit protocol (see [Note: space is never reused before the manifest stops pointing at
    # it] in extents.py) ---------------------------------------------------------------------------------
    def free(self, e: Extent) -> None:
        """Give back an extent's space: now, after its write/reads finish, or after the next commit."""
        self.space.free(e)

    def unfree(self, e: Extent) -> None:
        """Undo free() of a committed extent (a failed write reverts a tensor to its committed version)."""
        self.space.unfree(e)

    def protect(self, extents: list[Extent]) -> list[Extent]:
        """A manifest naming `extents` is about to be written: from now on freeing them only makes them pending.
        Returns those newly protected, for unprotect() when the manifest is not written after all."""
        return self.space.protect(extents)

    def unprotect(self, extents: list[Extent]) -> None:
        self.space.unprotect(extents)

    def commit_done(self, live: list[Extent]) -> None:
        """The manifest naming exactly `live` is durable: free the pending extents it no longer names."""
        self.space.commit_done(live)

    def check_extents(self, extents: list[Extent], path: str, field: Callable[[int], str] | None = None) -> None:
        """Before adopt(): every extent a manifest at `path` names lies inside an extent file that exists and
        no two overlap (CorruptionError names extent i as `field(i)`); one reaching past the end of a part
        file (a truncated file) is marked damaged. Creates, reads and allocates nothing."""
        self.space.check(extents, path, len(self._files.list), field or (lambda i: f"extents[{i}]"))
        self._files.mark_damaged(extents)

    def adopt(self, extents: list[Extent]) -> None:
        """Reopen: the manifest's extents (checked by check_extents) are the only used space."""
        self.space.adopt(extents)

    # -- writes ----------------------------------------------------------------------------------
    def write(self, src: torch.Tensor, what: str = "a tensor", lend: Callable[[], None] | None = None) -> Extent:
        """Start writing the bytes of `src` (a contiguous CPU tensor, any dtype); returns its extent at once.

        The copy is taken before returning, so `src` may change afterwards -- unless it is lent (`lend`, see
        [Note: lent tensors] in writes.py: `lend()` is called exactly once, also when this raises).
        `extent.written` resolves when the bytes are in the file (not yet durable: see sync()). The extent's
        disk space is reserved before returning: a full disk raises TierstoreIOError (ENOSPC) here, naming
        `what`, with nothing written (see [Note: space is reserved when it is allocated] in writes.py)."""
        try:
            self._check()
            if self.read_only:
                raise MisuseError("the nvme tier was opened read-only (Store.open(paths, mode='r')); open the "
                                  "store with mode='w' to write")
        except BaseException:
            if lend is not None:
                lend()
            raise
        return self._writer.write(src, what, lend)

    def seal(self) -> None:
        """Write what is staged now (normally done when the buffer is full or the data is needed)."""
        self._writer.seal()

    # -- reads -------------------------------------------------------------------------------------
    def check_readable(self, e: Extent, what: str) -> None:
        """Raise the CorruptionError of a damaged extent (its file was found truncated at open); call before
        allocating memory for a read of `e`."""
        check_readable(self._files, e, what)

    def begin_read(self, e: Extent) -> None:
        self.space.begin_read(e)

    def end_read(self, e: Extent) -> None:
        self.space.end_read(e)

    def read(self, e: Extent, out: torch.Tensor, what: str) -> None:
        """Read extent `e` into `out` (contiguous uint8 CPU tensor of e.length elements), check its crc32c.

        `what` names the tensor in errors. Raises CorruptionError on a checksum mismatch."""
        err = self.read_many([(e, out, what)])[0]
        if err is not None:
            raise err

    def read_many(self, items: list[tuple[Extent, torch.Tensor, str]]) -> list[BaseException | None]:
        """Read many extents, each into its `out` (contiguous uint8 CPU tensor of e.length elements).
        Returns one error (or None) per item, in order: a corrupt tensor does not stop the others (see
        [Note: how reads are issued] in reads.py)."""
        self._check()
        return self._reader.read_many(items)

    def read_ranges(self, e: Extent, ranges: list[tuple[int, int, int]], out: torch.Tensor, what: str) -> int:
        """Copy (start, nbytes, dst) byte ranges of extent `e` into `out`, reading only the checksummed blocks
        covering them ([Note: range reads] in reads.py); returns the bytes read."""
        self._check()
        return self._reader.read_ranges(e, ranges, out, what)

    # -- durability -------------------------------------------------------------------------------
    def wait_writes(self) -> None:
        """Wait for every write submitted so far to reach its file (what is staged stays staged; nothing is
        fsynced). Errors of individual writes stay on their extents' futures."""
        self._writer.wait_all()

    def wait_written(self, e: Extent) -> None:
        """Wait until `e`'s bytes are in its file (writing them now if staged); raise the write's error."""
        self._check()
        self._writer.wait_written(e)

    def sync(self) -> None:
        """Write what is staged, wait for every write, fsync the files written to (and the directories when
        files were created). Errors of individual writes stay on their extents' futures; an fsync error
        raises."""
        with self._lock:
            self._writer.seal()
            dirty, dirs = self._files.take_unsynced()
        self._writer.wait_all()
        with profile_range("tierstore::fsync"):
            try:
                self._files.fsync(dirty, dirs)
            except BaseException:
                with self._lock:
                    self._files.keep_unsynced(dirty, dirs)
                raise

    def _check(self) -> None:
        if self.closed:
            raise MisuseError("the nvme tier is closed (its store was closed); open the store again")

    def close(self) -> None:
        if self.closed:
            return
        self._writer.drop_staging()
        self._writer.wait_all()
        self.closed = True
        self._files.close()
