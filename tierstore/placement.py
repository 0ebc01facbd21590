"""Where each tensor's copies are: the Placement record, the table of them, the per-tier LRU orders and
budgets, spill and demotion, and the fallback after a failed write.

This is the bookkeeping half of the residency layer; residency.py builds put, the one read path and every
move on it ([Note: locking] in residency.py says what runs under `lock`).

[Note: copies and versions]
`Placement.copies` maps tier -> copy (a torch.Tensor on a memory tier, an Extent on the persistent tier);
every copy in it holds the current value. `update()` and write-back bump `version`, so a read that ran
without the lock (persistent-tier reads do, to let other threads work) can tell that its result went
stale. `pins` counts resident() blocks and reads or moves in progress: a pinned tensor is never spilled.

[Note: budgets and spill]
`put(tier=None)` places a tensor on the fastest tier whose budget can hold it at all, making room by
spilling that tier's least recently used tensors one tier down (a tensor that already has a copy lower
down is simply dropped). Tensors inside `resident()` blocks or being moved are never spilled. Only when no
tier can take it is TierFullError raised, naming every budget.

"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from .encoding import IDENTITY, encode, nbytes_of
from .errors import MisuseError, TierFullError, TierstoreIOError, TierstoreValueError
from .tiers import (
    MEMORY_TIERS,
    PERSISTENT_TIERS,
    TIERS,
    MemoryTier,
    PersistentTier,
    tier_index,
    tier_info,
)
from .tiers.device import DeviceTier

log = logging.getLogger("tierstore.store")


class Placement:
    """One named value and where its copies are. Owned by Residency; read its fields, never set them."""

    __slots__ = ("name", "shape", "dtype", "nbytes", "codec", "copies", "committed", "committed_meta", "pins",
                 "version", "deleted", "manifest_entry")

    def __init__(self, name: str, shape, dtype: torch.dtype, codec=None, nbytes: int | None = None):
        self.name = name
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.nbytes = nbytes_of(self.shape, dtype) if nbytes is None else nbytes  # bytes, decoded
        self.codec = codec if codec is not None else IDENTITY
        self.copies: dict[str, Any] = {}
        self.committed: Any = None  # the extent the last durable manifest names
        # shape, dtype and codec of the bytes at `committed` when they are not this value's own (a put() that
        # replaced a flushed tensor of another shape, dtype or codec): a revert to them restores those too
        self.committed_meta: tuple | None = None
        self.pins = 0  # resident() blocks, reads and moves in progress: not evictable while > 0
        self.version = 0
        self.deleted = False
        self.manifest_entry: tuple[Any, dict] | None = None  # (extent, its manifest entry), kept by Store.flush



class Placements:
    """The table of every tensor's Placement over `tiers` (name -> tier object, every name of the registry):
    its copies, the budgets they are charged to, spill, and the fallback after a failed write. Residency
    (residency.py) builds every move and read on it.

    accelerator: the memory tier whose copies live on the accelerator (it copies them out to the CPU);
    staging: the memory tier whose copies are CPU memory (encoding and decoding happen in its memory).
    where: the store's first directory, named in errors."""

    def __init__(self, tiers: dict[str, Any], *, accelerator: DeviceTier, staging: MemoryTier, workers: int,
                 read_only: bool, where: str):
        if set(tiers) != set(TIERS):
            raise TierstoreValueError(f"tiers {sorted(tiers)} do not match the registry's {TIERS}")
        for name, obj in tiers.items():
            contract = PersistentTier if tier_info(name).persistent else MemoryTier
            if not isinstance(obj, contract):
                raise TierstoreValueError(f"the {name} tier ({type(obj).__name__}) does not keep the "
                                          f"{contract.__name__} contract of tiers/base.py")
        self.lock = threading.RLock()
        self._tiers = tiers
        (self._disk_name,) = PERSISTENT_TIERS  # the one tier whose copies a manifest names
        self._disk: PersistentTier = tiers[self._disk_name]
        self._accel = accelerator
        self._staging = staging
        self._lru: dict[str, OrderedDict] = {t: OrderedDict() for t in TIERS}
        self._table: dict[str, Placement] = {}
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tierstore-move")
        self.read_only = read_only
        self.closed = False
        self._where = where

    # -- lifecycle (decided by Store, checked here) ----------------------------------------------------
    def check_open(self) -> None:
        if self.closed:
            raise MisuseError("the store is closed; open it again with tierstore.Store.open(paths)")

    def check_writable(self, what: str) -> None:
        self.check_open()
        if self.read_only:
            raise MisuseError(f"{what}: the store at {self._where} was opened read-only (Store.open(paths, "
                              "mode='r')) and changes nothing; open it with mode='w' to change it")

    def check(self, p: Placement) -> None:
        """Refuse a handle whose value was deleted or replaced, or a closed store."""
        if p.deleted:
            raise MisuseError(f"tensor {p.name!r} was deleted from (or replaced in) the store; get the "
                              f"current one with store.tensor({p.name!r}) or put it again")
        self.check_open()

    def submit(self, fn: Callable, *args) -> Future:
        self.check_open()
        return self._executor.submit(fn, *args)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)

    # -- names ------------------------------------------------------------------------------------------
    def lookup(self, name: str) -> Placement:
        with self.lock:
            self.check_open()
            try:
                return self._table[name]
            except KeyError:
                raise KeyError(f"no tensor named {name!r} in the store") from None

    def names(self) -> list[str]:
        with self.lock:
            self.check_open()
            return list(self._table)

    def holds(self, name: object) -> bool:
        with self.lock:
            self.check_open()
            return name in self._table

    def delete(self, name: str) -> None:
        with self.lock:
            self.check_writable(f"delete({name!r})")
            p = self._table.pop(name, None)
            if p is None:
                raise KeyError(f"no tensor named {name!r} in the store")
            self._discard(p)

    def adopt(self, entries, where: str) -> None:
        """Take the tensors of a manifest read at open (manifest.Entry records, their fields checked): each
        extent is checked against the files, then held as the tensor's only, committed copy."""
        self._disk.check_extents([e.extent for e in entries], where,
                                 lambda i: f"tensors[{entries[i].name!r}].extent")
        disk, lru, table = self._disk_name, self._lru[self._disk_name], self._table
        with self.lock:
            for e in entries:
                p = Placement(e.name, e.shape, e.dtype, e.codec, e.nbytes)
                p.copies[disk] = p.committed = e.extent
                lru[p] = None
                table[e.name] = p
        self._disk.adopt([e.extent for e in entries])

    # -- state --------------------------------------------------------------------------------------------
    def tiers_of(self, p: Placement) -> frozenset[str]:
        with self.lock:
            return frozenset(p.copies)

    def dirty(self, p: Placement) -> bool:
        with self.lock:
            ext = p.copies.get(self._disk_name)
            return ext is None or ext is not p.committed

    def encoded_nbytes(self, p: Placement) -> int | None:
        with self.lock:
            ext = p.copies.get(self._disk_name)
            return None if ext is None else ext.length

    def tier_count(self, tier: str) -> int:
        with self.lock:
            return len(self._lru[tier])

    def tier_for(self, device) -> str:
        """The memory tier a `device=` argument names: a tier name, the accelerator's device, or 'cpu'."""
        if device is None:
            return self._accel.name
        if isinstance(device, str) and device in MEMORY_TIERS:
            return device
        dev = torch.device(device)
        acc = self._accel.device
        if dev == acc or (dev.index is None and dev.type == acc.type):
            return self._accel.name
        if dev.type == "cpu":
            return self._staging.name
        raise TierstoreValueError(f"device={device!r}: this store's device tier is {acc}; pass "
                                  "'device', 'host', that device or 'cpu'")

    # -- copies (lock held) ---------------------------------------------------------------------------------
    def _fastest(self, p: Placement) -> str:
        for t in TIERS:
            if t in p.copies:
                return t
        raise MisuseError(f"tensor {p.name!r} has no copy on any tier (it was lost after a failed write)")

    def _memory_copy(self, p: Placement) -> torch.Tensor | None:
        for t in MEMORY_TIERS:
            if t in p.copies:
                return p.copies[t]
        return None

    def _install(self, p: Placement, tier: str, copy) -> None:
        old = p.copies.get(tier)
        if old is not None and old is not copy:
            self._free_copy(p, tier, old)
        p.copies[tier] = copy
        self._lru[tier][p] = None
        self._lru[tier].move_to_end(p)

    def _free_copy(self, p: Placement, tier: str, copy) -> None:
        if tier_info(tier).persistent:
            self._disk.free(copy)
        else:
            self._tiers[tier].budget.give(p.nbytes)

    def _remove(self, p: Placement, tier: str) -> None:
        copy = p.copies.pop(tier)
        self._lru[tier].pop(p, None)
        self._free_copy(p, tier, copy)

    def _discard(self, p: Placement) -> None:
        for tier in list(p.copies):
            self._remove(p, tier)
        p.deleted = True

    def _touch(self, p: Placement) -> None:
        for t in p.copies:
            lru = self._lru[t]
            if p in lru:
                lru.move_to_end(p)

    def _place_memory(self, p: Placement, tier: str, value: torch.Tensor) -> None:
        """Install a copy of `value` on memory tier `tier`; room must have been made."""
        tobj = self._tiers[tier]
        copy = tobj.copy_in(value)
        tobj.budget.take(p.nbytes)
        self._install(p, tier, copy)

    def _write_disk(self, p: Placement, src: torch.Tensor, loan: list | None = None) -> None:
        """Write `src` (the current value, any device) as the persistent copy. When no space can be reserved
        for it (TierstoreIOError, nothing written) a persistent copy that a memory copy has overtaken is
        dropped -- the memory copy holds the value, the next flush writes it -- and the error is raised.
        `loan`: put()'s lend callback, in a list; taken out of it when the disk writes from `src` itself."""
        cpu = src if src.device.type == "cpu" else self._accel.copy_out(src, self._staging.empty(
            tuple(src.shape), src.dtype))
        data = encode(p.codec, cpu.contiguous(), p.nbytes)
        # [Note: lent tensors] in tiers/nvme/writes.py
        lend = loan.pop() if loan and data.data_ptr() == src.data_ptr() else None
        try:
            ext = self._disk.write(data, f"tensor {p.name!r}", lend)
        except TierstoreIOError:
            if self._disk_name in p.copies and self._memory_copy(p) is not None:
                self._remove(p, self._disk_name)  # stale: resident(writeback=True) changed the memory copy
            raise
        self._install(p, self._disk_name, ext)

    # -- budgets and spill (lock held; [Note: budgets and spill]) ----------------------------------------------
    def budgets_text(self) -> str:
        parts = []
        for t in TIERS:
            b = self._tiers[t].budget
            lim = "unlimited" if b.limit is None else str(b.limit)
            parts.append(f"{t!r}: {lim} ({b.used} used)")
        return "budgets={" + ", ".join(parts) + "}"

    def _full_error(self, tier: str | None, p: Placement) -> TierFullError:
        where = f"on the {tier} tier" if tier else "on any tier"
        return TierFullError(f"no room for {p.name!r} ({p.nbytes} bytes) {where}: {self.budgets_text()}; "
                             "everything that could be spilled was. Raise a budget, put it on a slower tier, "
                             "or delete tensors")

    def _make_room(self, tier: str, nbytes: int, exclude: Placement | None = None) -> bool:
        """Spill LRU tensors of memory tier `tier` down until `nbytes` fit. False if impossible."""
        b = self._tiers[tier].budget
        if not b.fits_at_all(nbytes):
            return False
        if b.room() >= nbytes:
            return True
        for victim in list(self._lru[tier]):
            if b.room() >= nbytes:
                break
            if victim is exclude or victim.pins:
                continue
            self._demote(victim, tier)
        return b.room() >= nbytes

    def _demote(self, v: Placement, tier: str) -> None:
        lower = TIERS[tier_index(tier) + 1:]
        dest = next((lt for lt in lower if lt in v.copies), None)
        if dest is None:
            for lt in lower:
                if tier_info(lt).persistent:
                    self._write_disk(v, v.copies[tier])
                    dest = lt
                    break
                if self._make_room(lt, v.nbytes, exclude=v):
                    self._place_memory(v, lt, v.copies[tier])
                    dest = lt
                    break
        self._remove(v, tier)
        log.debug("spilled %r (%d bytes) from %s to %s to make room (%s)", v.name, v.nbytes, tier, dest,
                  self.budgets_text())

    # -- a failed write (lock held) --------------------------------------------------------------------
    def write_failed(self, p: Placement, ext, err: BaseException) -> str:
        """The write of `ext`, p's persistent copy, failed: fall back to what is still valid. Returns what
        became of p's value: 'replaced' (a newer value took its place meanwhile), 'kept' (a memory copy holds
        it; the next flush writes it again), 'reverted' (it existed only in the failed write: the name is back
        at its last flushed value) or 'removed' (it existed only there and was never flushed: the name is gone)."""
        disk = self._disk_name
        if p.copies.get(disk) is not ext:
            return "replaced"
        self._remove(p, disk)
        if self._memory_copy(p) is not None:
            return "kept"
        committed = p.committed
        if committed is not None and committed is not ext:
            self._disk.unfree(committed)
            if p.committed_meta is not None:  # the flushed bytes are of another shape/dtype/codec: restore
                shape, dtype, codec = p.committed_meta  # the value they belong to, not p's metadata over them
                p.deleted = True
                p = self._table[p.name] = Placement(p.name, shape, dtype, codec)
                p.committed = committed
            p.copies[disk] = committed
            self._lru[disk][p] = None
            p.version += 1
            log.error("tensor %r: writing its new value failed (%s); it is back at its last flushed value",
                      p.name, err)
            return "reverted"
        if self._table.get(p.name) is p:
            del self._table[p.name]
        p.deleted = True
        log.error("tensor %r: writing it failed (%s) and no other copy existed; it was never flushed and "
                  "is gone", p.name, err)
        return "removed"

    def wait_written(self, p: Placement) -> None:
        """Wait until the write of p's persistent copy, if one is in flight, has finished; a failed write
        raises its error, after falling back as a read of it would (write_failed)."""
        with self.lock:
            self.check(p)
            ext = p.copies.get(self._disk_name)
        if ext is None:
            return
        try:
            self._disk.wait_written(ext)
        except BaseException as err:
            self._after_read_error(p, ext, err)
            raise

    def _after_read_error(self, p: Placement, ext, err: BaseException) -> None:
        w = ext.written
        if w is not None and w.done() and w.exception() is not None:  # its write failed
            with self.lock:
                self.write_failed(p, ext, err)


def check_out(p: Placement, out, device=None) -> None:
    """Refuse an out= tensor that cannot receive p's value."""
    if not isinstance(out, torch.Tensor):
        raise TierstoreValueError(f"out= for {p.name!r} must be a torch.Tensor of shape {tuple(p.shape)} "
                                  f"and dtype {p.dtype}; got a {type(out).__name__}")
    if tuple(out.shape) != tuple(p.shape) or out.dtype != p.dtype:
        raise TierstoreValueError(
            f"out= for {p.name!r} needs shape {tuple(p.shape)} and dtype {p.dtype}; got "
            f"{tuple(out.shape)} {out.dtype}. Allocate it with torch.empty({tuple(p.shape)}, dtype={p.dtype})")
    if device is not None and torch.device(device) != out.device:
        if not (torch.device(device).type == out.device.type and torch.device(device).index is None):
            raise TierstoreValueError(f"device={device!r} but out= is on {out.device}: the value goes where "
                                      "out is; leave device out")


def reading(p: Placement, rows: int | None = None) -> str:
    """What a read of p (or of `rows` rows of it) is, for errors."""
    part = f"{rows} rows of " if rows is not None else ""
    return f"reading {part}tensor {p.name!r} ({tuple(p.shape)} {p.dtype})"

