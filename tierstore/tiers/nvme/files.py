"""The extent files of an nvme tier: opening them, which part files hold which bytes, and what awaits fsync."""
from __future__ import annotations

import os

from ...io import Engine, StripedFile
from ...io.files import fsync_dir
from .extents import EXTENT_FILE, Extent


class ExtentFiles:
    """Extent file k is `EXTENT_FILE.format(k)` in every one of `dirs`, striped (see [Note: extent files, not
    one file per tensor] in tiers/nvme/__init__.py). `list[k]` is extent file k once opened; `dirty` the
    files written since their last fsync; `dirs_unsynced` whether a file was created since the directories'."""

    def __init__(self, dirs: list[str], engine: Engine, stripe_unit: int, read_only: bool):
        self.dirs = dirs
        self.engine = engine
        self.stripe_unit = stripe_unit  # bytes
        self.read_only = read_only
        self.list: list[StripedFile] = []
        self.dirty: set[int] = set()
        self.dirs_unsynced = False

    def open_existing(self) -> None:
        """Open the extent files present in every directory (creating nothing: a manifest naming a file
        beyond them is refused by ExtentSpace.check)."""
        k = 0
        while all(os.path.lexists(os.path.join(d, EXTENT_FILE.format(k))) for d in self.dirs):
            self.get(k)
            k += 1

    def get(self, f: int) -> StripedFile:
        """Extent file `f`, opened (and created, with those before it, unless read-only) if it is not yet."""
        while len(self.list) <= f:
            name = EXTENT_FILE.format(len(self.list))
            new = not all(os.path.lexists(os.path.join(d, name)) for d in self.dirs)
            self.list.append(self.engine.open_striped(self.dirs, name, "r" if self.read_only else "c",
                                                      stripe_unit=self.stripe_unit))
            if new:
                self.dirs_unsynced = True  # the new names must be durable before a manifest names them
        return self.list[f]

    def total_bytes(self) -> int:
        """The bytes of every part of every extent file opened so far."""
        return sum(p.size() for sf in self.list for p in sf.parts)

    def paths(self, f: int, offset: int | None = None, length: int | None = None) -> list[str]:
        """The part files holding bytes of extent file `f` (those holding [offset, offset+length) if given)."""
        sf = self.get(f)
        if offset is None or not length:
            return [p.path for p in sf.parts]
        return sorted({part.path for part, *_ in sf.map(offset, length)})

    def mark_damaged(self, extents: list[Extent]) -> None:
        """Mark each extent reaching past the end of a part of its (open) extent file damaged.

        An extent file cut short damages the tensors past the cut, not the store: they are refused when read
        (check_readable), before anything is allocated for them; the others stay readable."""
        top: dict[int, int] = {}  # extent file -> the end of its last extent
        for e in extents:
            if e.alloc and e.offset + e.alloc > top.get(e.file, 0):
                top[e.file] = e.offset + e.alloc
        sizes: dict[int, list[int]] = {}  # extent file -> size of each part, bytes, where some part is short
        for f, end in top.items():
            sf = self.list[f]
            got = [p.size() for p in sf.parts]
            if any(got[k] < need for k, need in part_needs(sf, 0, end)):  # else no extent of it reaches past
                sizes[f] = got
        if not sizes:
            return
        for e in extents:
            if e.alloc and e.file in sizes:
                sf = self.list[e.file]
                e.damaged = any(sizes[e.file][k] < need for k, need in part_needs(sf, e.offset, e.offset + e.alloc))

    def take_unsynced(self) -> tuple[set[int], bool]:
        """The files and directories to fsync, forgotten here (give them back with keep_unsynced on failure)."""
        dirty, self.dirty = self.dirty, set()
        dirs, self.dirs_unsynced = self.dirs_unsynced, False
        return dirty, dirs

    def keep_unsynced(self, dirty: set[int], dirs: bool) -> None:
        self.dirty |= dirty
        self.dirs_unsynced = self.dirs_unsynced or dirs

    def fsync(self, dirty: set[int], dirs: bool) -> None:
        for f in sorted(dirty):
            self.engine.fsync(self.list[f])
        if dirs:
            for d in self.dirs:
                fsync_dir(d)

    def close(self) -> None:
        for sf in self.list:
            self.engine.close_file(sf)


def part_ranges(sf: StripedFile, start: int, stop: int):
    """(part, physical start, physical stop) covering logical bytes [start, stop) of striped file `sf`,
    whole stripes each (one range per part)."""
    su, n = sf.stripe_unit, len(sf.parts)
    first, last = start // su, (stop + su - 1) // su  # stripes [first, last)
    for k, part in enumerate(sf.parts):
        lo = (first - k + n - 1) // n if first > k else 0  # first stripe index on part k at or after `first`
        hi = (last - k + n - 1) // n if last > k else 0
        if hi > lo:
            yield part, lo * su, hi * su


def part_needs(sf: StripedFile, start: int, stop: int):
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
