"""The residency layer: every move of a tensor between tiers -- put, the one read path every read goes
through (get, get_many, prefetch, resident, read rows), offload, drop, update, the steps of a flush.

With placement.py it alone owns placement: the lock, each tensor's copies / versions / pins / committed
extent (a `Placement` record per name), the per-tier least-recently-used orders and budgets, spill and
demotion, the fallback after a failed write.
Store (above) keeps names' validation, the store's lifecycle, flush orchestration and the public API;
TieredTensor is a handle that asks this layer. Below are the tiers, called through the contracts of
tiers/base.py and known by their capabilities ([Note: tiers are known by their capabilities]).
The table of placements, the budgets and spill are placement.py ([Note: copies and versions] and
[Note: budgets and spill] there).

[Note: locking]
One re-entrant lock guards the tensors' metadata, budgets and moves between memory tiers, and writes to the
persistent tier (a memcpy into a staging buffer for small tensors). Reads from the persistent tier run
without it, so a prefetch on a worker thread does not stall other threads; a read returns the value the
tensor had when it began (the extent it reads is not reused until it ends), and a read whose extent was
already freed when it began is retried on the current one. Store.flush() holds the lock while it snapshots
the tensors and marks their extents as named by a manifest, then releases it for the waiting and fsyncs.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .encoding import IDENTITY, as_bytes, codec_config, copy_host, decode, nbytes_of, out_bytes
from .errors import MisuseError, TierFullError, TierstoreIOError, TierstoreValueError, prefixed
from .io.pool import physical_memory
from .placement import Placement, Placements, check_out, log, reading
from .rows import row_index
from .tiers import MEMORY_TIERS, TIERS, profile_range, tier_index, tier_info
from .tiers.host import check_result_fits, result_empty

__all__ = ["Placement", "Residency", "check_out", "reading"]


class Residency(Placements):
    """Every tensor's placement (placement.Placements) and every move between tiers: put, the one read path
    (get, get_many, prefetch, resident, read_rows), offload, drop, update and the steps of a flush."""

    # -- put --------------------------------------------------------------------------------------------------
    def put(self, name: str, value: torch.Tensor, tier: str | None, codec,
            lend: Callable[[], None] | None = None) -> Placement:
        """Place `value` under `name` (on `tier`, or the fastest with room), replacing what the name held.
        `lend`: see Store.put; called exactly once, also when this raises."""
        loan = [lend] if lend is not None else []
        try:
            return self._put(name, value, tier, codec, loan)
        finally:
            if loan:  # not lent to a write: the value was copied, or nothing was stored
                loan.pop()()

    def _put(self, name: str, value: torch.Tensor, tier: str | None, codec, loan: list) -> Placement:
        self._check_copy_fits(name, value, tier, codec)
        with self.lock:
            self.check_open()
            p = Placement(name, value.shape, value.dtype, codec)
            if tier is not None and tier_info(tier).memory and not self._tiers[tier].budget.fits_at_all(p.nbytes):
                raise self._full_error(tier, p)
            placed = None
            try:
                for tr in ([tier] if tier is not None else TIERS):
                    if tier_info(tr).persistent:
                        self._write_disk(p, value, loan)
                    elif self._make_room(tr, p.nbytes, exclude=p):
                        self._place_memory(p, tr, value)
                    else:
                        continue
                    placed = tr
                    break
            except TierstoreIOError as e:  # no room reserved on disk (for it or a tensor spilled for it)
                self._discard(p)
                raise prefixed(e, f"put({name!r}) did not store the value (the store keeps what it held under "
                                  "that name, if anything)") from None
            if placed is None:
                raise self._full_error(tier, p)
            old = self._table.get(name)
            if old is not None:
                p.committed = old.committed
                if old.committed is not None:
                    meta = old.committed_meta or (old.shape, old.dtype, old.codec)
                    if (meta[0], meta[1], codec_config(meta[2])) != (p.shape, p.dtype, codec_config(p.codec)):
                        p.committed_meta = meta
                self._discard(old)
            self._table[name] = p
            return p

    def _check_copy_fits(self, name: str, value: torch.Tensor, tier: str | None, codec) -> None:
        """Refuse, before any allocation, a put whose copy of `value` can never exist in host memory.

        Every placement but two makes one contiguous host copy of all the tensor's bytes: the host tier's
        copy, or the staging copy the persistent tier encodes and writes from. The exceptions are a copy on
        a real accelerator, and a contiguous CPU tensor written as it is (identity codec) to the persistent
        tier. An expanded view (`torch.zeros(1).expand(2**40)`) holds 4 bytes and names 4 TiB."""
        nbytes = value.numel() * value.element_size()  # bytes, decoded
        if tier is not None and tier_info(tier).persistent and value.device.type == "cpu" and \
                value.is_contiguous() and codec in (None, IDENTITY):
            return
        if tier in (None, self._accel.name) and self._accel.device.type != "cpu" and \
                self._accel.budget.fits_at_all(nbytes):
            return
        memory = physical_memory()
        if memory is not None and nbytes > memory:
            raise TierFullError(
                f"put({name!r}): the tensor ({tuple(value.shape)} {value.dtype}) needs a contiguous copy of "
                f"{nbytes} bytes in host memory, more than this machine has ({memory} bytes); it is "
                f"{'an expanded or strided view' if not value.is_contiguous() else 'too large'}. Store it in "
                "pieces under several names, or store what it was made from (e.g. the tensor before expand())")

    # -- the one read path --------------------------------------------------------------------------------
    def read(self, keys: list, device=None, outs: list | None = None, *, by_name: bool) -> list[torch.Tensor]:
        """The current values of `keys` (names when by_name, else Placements: a deleted one raises
        MisuseError) as tensors the caller owns: on `device` (default: where the fastest copy is; the
        persistent tier -> CPU), or written into outs[i] (a tensor of that shape and dtype; a contiguous CPU
        one is read into directly) and returned. Reads of persistent-only values are coalesced.

        A read by name resolves the name again when the value it began to read is replaced before the read
        could start ([Note: a read by name sees the old or the new value] in store.py)."""
        outs = outs if outs is not None else [None] * len(keys)
        got = self._read_current(keys, outs, device, by_name)
        result = []
        for (p, value, fresh), out in zip(got, outs):
            if out is None:
                if device is None or torch.device(device) == value.device:
                    result.append(value if fresh else value.clone())
                else:
                    result.append(value.to(device, copy=True))
                continue
            direct = out_bytes(out) if p.codec is IDENTITY else None
            if direct is None or value.data_ptr() != out.data_ptr():
                if direct is not None and value.device.type == "cpu" and value.is_contiguous():
                    copy_host(direct, as_bytes(value))
                else:
                    out.copy_(value)
            result.append(out)
        return result

    def _read_current(self, keys: list, outs: list, device,
                      by_name: bool) -> list[tuple[Placement, torch.Tensor, bool]]:
        """For each key, (its placement, its value, fresh): a memory copy (not ours: fresh=False) or a new CPU
        tensor read from the persistent tier -- into out's bytes when they can take it (fresh=True). Reads
        run without the lock; each returns the value the tensor had when it began (its extent is held and
        checksummed). Retries only a read whose extent was freed before it could begin."""
        n = len(keys)
        got: list[Any] = [None] * n
        pending = list(range(n))
        disk = self._disk_name
        while pending:
            batch: list[list[Any]] = []  # [i, placement, extent, version at pin, buffer]
            try:
                with self.lock:
                    for i in pending:
                        p = self.lookup(keys[i]) if by_name else keys[i]
                        self.check(p)
                        if outs[i] is not None:
                            check_out(p, outs[i], device)
                        mem = self._memory_copy(p)
                        if mem is not None:
                            self._touch(p)
                            got[i] = (p, mem, False)
                            continue
                        ext = p.copies.get(disk)
                        if ext is None:
                            self._fastest(p)  # raises: lost
                        assert ext is not None  # _fastest raised otherwise
                        self._disk.check_readable(ext, f"tensor {p.name!r}")
                        if outs[i] is None or p.codec is not IDENTITY:  # [Note: memory for a result]
                            check_result_fits(max(ext.length, p.nbytes), reading(p))
                        p.pins += 1
                        batch.append([i, p, ext, p.version, None])
                for item in batch:  # the caller's result (or out=), not a host-tier copy
                    i, p, ext = item[0], item[1], item[2]
                    into = out_bytes(outs[i]) if outs[i] is not None and p.codec is IDENTITY else None
                    item[4] = into if into is not None and ext.length == p.nbytes else \
                        result_empty(ext.length, reading(p))
                errors = self._disk.read_many([(ext, buf, f"tensor {p.name!r}") for _i, p, ext, _v, buf in batch]) \
                    if batch else []
            finally:
                with self.lock:
                    for _i, p, _e, version, _b in batch:
                        p.pins -= 1
                        if p.version == version and not p.deleted:
                            self._touch(p)
            retry, first_error = [], None
            for (i, p, ext, version, buf), err in zip(batch, errors):
                if err is None:
                    # The value as it was when the read began, whatever happened since: its extent could not be
                    # reused while the read held it, and its crc32c was checked. Retrying here instead would
                    # starve a reader of a tensor rewritten faster than it can be read.
                    got[i] = (p, buf, True)
                    continue
                if isinstance(err, MisuseError):
                    with self.lock:
                        if p.version != version or p.deleted:
                            retry.append(i)  # replaced while we read: try again
                            continue
                else:
                    self._after_read_error(p, ext, err)
                first_error = first_error or err
            if first_error is not None:
                raise first_error
            pending = retry
        for i, (p, value, fresh) in enumerate(got):
            if fresh:
                got[i] = (p, decode(p.codec, value, p.shape, p.dtype, p.name, self._staging.empty), True)
        return got

    def read_rows(self, name: str, rows, device=None) -> torch.Tensor:
        """Rows `rows` (a slice, or a 1-D sequence / integer tensor of row indices) along dim 0 of tensor
        `name`, as a new tensor on `device` (default: where the fastest copy is; nvme -> CPU). A memory copy
        is indexed; an nvme-only raw value is read range by range, only the checksummed blocks covering the
        rows ([Note: range reads] in tiers/nvme/reads.py); an encoded one (codec=) is read whole and indexed.
        A read by name: like get(), the old or the new value when a put() replaces it meanwhile."""
        disk = self._disk_name
        while True:
            with self.lock:
                p = self.lookup(name)
                self.check(p)
                index = row_index(rows, p.shape, name)
                count = index[1] - index[0] if isinstance(index, tuple) else len(index)  # rows returned
                check_result_fits(count * nbytes_of(p.shape[1:], p.dtype), reading(p, count))
                mem = self._memory_copy(p)
                if mem is not None:
                    self._touch(p)
                    value = mem[index[0]:index[1]] if isinstance(index, tuple) else mem[index.to(mem.device)]
                    return value.to(device or value.device, copy=True)
                ext = p.copies.get(disk)
                if ext is None:
                    self._fastest(p)  # raises: lost
                assert ext is not None  # _fastest raised otherwise
                whole = p.codec is not IDENTITY or ext.length != p.nbytes
                if not whole:
                    self._disk.check_readable(ext, f"tensor {p.name!r}")
                    p.pins += 1
                    version = p.version
            if whole:  # encoded bytes have no row layout: decode all of it
                value = self.read([name], None, by_name=True)[0]
                value = value[index[0]:index[1]] if isinstance(index, tuple) else value[index]
                return value.to(device or value.device, copy=True)
            row = nbytes_of(p.shape[1:], p.dtype)  # bytes
            if isinstance(index, tuple):
                nrows, order, ranges = index[1] - index[0], None, [(index[0] * row, (index[1] - index[0]) * row, 0)]
            else:
                uniq, order = torch.unique(index, sorted=True, return_inverse=True)
                nrows, ranges = len(uniq), []
                for r in uniq.tolist():  # consecutive rows -> one range
                    if ranges and ranges[-1][0] + ranges[-1][1] == r * row:
                        a, n, d = ranges[-1]
                        ranges[-1] = (a, n + row, d)
                    else:
                        ranges.append((r * row, row, len(ranges) and ranges[-1][2] + ranges[-1][1]))
            buf = result_empty(nrows * row, reading(p, nrows))
            try:
                self._disk.read_ranges(ext, ranges, buf, f"tensor {p.name!r}")
            except MisuseError:
                with self.lock:
                    if p.version != version or p.deleted:
                        continue  # replaced while we read: read the new value
                raise
            except BaseException as err:
                self._after_read_error(p, ext, err)
                raise
            finally:
                with self.lock:
                    p.pins -= 1
                    if p.version == version and not p.deleted:
                        self._touch(p)
            value = buf.view(p.dtype).view(nrows, *p.shape[1:])
            if order is not None:
                value = value[order]
            return value.to(device or value.device, copy=device is not None)

    # -- moves ----------------------------------------------------------------------------------------------
    def bring_to(self, p: Placement, tier: str) -> None:
        """Make sure memory tier `tier` holds a copy of p (spilling others to make room)."""
        if tier_info(tier).persistent:
            raise TierstoreValueError("prefetch/resident move tensors up to 'device' or 'host'; to write a "
                                      "tensor down use offload('nvme')")
        while True:
            with self.lock:
                self.check(p)
                if tier in p.copies:
                    self._touch(p)
                    return
                version = p.version
            [(_p, value, _fresh)] = self._read_current([p], [None], None, False)
            with self.lock:
                self.check(p)
                if p.version != version:
                    continue
                if tier in p.copies:
                    return
                if not self._make_room(tier, p.nbytes, exclude=p):
                    raise self._full_error(tier, p)
                self._place_memory(p, tier, value)
                return

    @contextmanager
    def resident(self, p: Placement, tier: str, *, writeback: bool) -> Iterator[torch.Tensor]:
        """p's copy on memory tier `tier`, pinned (never spilled) inside the block; with writeback, written to
        every other tier holding a copy on exit."""
        if writeback:
            self.check_writable(f"resident({p.name!r}, writeback=True)")
        while True:
            self.bring_to(p, tier)
            with self.lock:
                if tier in p.copies:
                    p.pins += 1
                    x: torch.Tensor = p.copies[tier]
                    break
        try:
            yield x
        finally:
            with self.lock:
                p.pins -= 1
                if writeback and not p.deleted and p.copies.get(tier) is x:
                    p.version += 1
                    for other in list(p.copies):
                        if other == tier:
                            continue
                        if tier_info(other).persistent:
                            try:
                                self._write_disk(p, x)
                            except TierstoreIOError as e:  # x is kept (and written by the next flush)
                                log.warning("tensor %r: its nvme copy was dropped, not rewritten (%s)",
                                            p.name, e)
                        else:
                            with profile_range("tierstore::writeback"):
                                p.copies[other].copy_(x)

    def offload(self, p: Placement, tier: str, keep: bool) -> None:
        """Write a copy of p down to `tier`; unless keep, drop the faster copies once it is there."""
        with self.lock:
            self.check(p)
            if tier not in p.copies:
                if tier_info(tier).persistent:
                    self._write_disk(p, p.copies[self._fastest(p)])  # a memory copy: tier is not in p.copies
                else:
                    if not self._make_room(tier, p.nbytes, exclude=p):
                        raise self._full_error(tier, p)
                    self._place_memory(p, tier, p.copies[self._fastest(p)])
            if not keep:
                if p.pins:
                    raise MisuseError(f"tensor {p.name!r} is in use (inside resident()); the copy on {tier} "
                                      "was written, but faster copies are kept: leave the block first")
                for t in TIERS[:tier_index(tier)]:
                    if t in p.copies:
                        self._remove(p, t)

    def drop(self, p: Placement, tier: str) -> None:
        """Free p's copy on `tier`, keeping the others. The only copy cannot be dropped."""
        with self.lock:
            self.check(p)
            if tier not in p.copies:
                raise MisuseError(f"tensor {p.name!r} has no copy on {tier!r} to drop (it is on "
                                  f"{sorted(p.copies, key=tier_index)})")
            if len(p.copies) == 1:
                raise MisuseError(f"the copy of {p.name!r} on {tier!r} is its only one; offload it first "
                                  f"(t.offload('nvme')) or delete it with store.delete({p.name!r})")
            if p.pins and tier_info(tier).memory:
                raise MisuseError(f"tensor {p.name!r} is in use (inside resident() or being moved); drop "
                                  "it after the block")
            self._remove(p, tier)

    def update(self, p: Placement, value: torch.Tensor) -> None:
        """Replace p's value (same shape and dtype, checked by the caller): memory copies are overwritten in
        place, the persistent copy is rewritten when it is the only one, else dropped (rewritten at flush)."""
        with self.lock:
            self.check(p)
            p.version += 1
            mem = [t for t in MEMORY_TIERS if t in p.copies]
            with profile_range("tierstore::update"):
                for t in mem:
                    p.copies[t].copy_(value)
            if self._disk_name in p.copies:
                if mem:
                    self._remove(p, self._disk_name)
                else:
                    try:
                        self._write_disk(p, value)
                    except TierstoreIOError as e:  # no room reserved: the previous value is intact
                        raise prefixed(e, f"update() of tensor {p.name!r} did not store the new value (the "
                                          "tensor keeps its previous one)") from None

    # -- flush steps (called by Store.flush, [Note: crash safety] in store.py) -----------------------------
    def flush_begin(self) -> tuple[list, list, list]:
        """Write every value with no persistent copy yet; snapshot the persistent copies and protect them.
        Returns (fates of values that could not be written: (placement, 'kept', error), the snapshot
        [(placement, extent)], the extents newly protected)."""
        disk = self._disk_name
        with self.lock:
            self.check_open()
            fates: list[tuple[Placement, str, BaseException]] = []
            for p in list(self._table.values()):
                mem = self._memory_copy(p)
                if disk not in p.copies and mem is not None:
                    try:
                        self._write_disk(p, mem)
                    except TierstoreIOError as e:  # no room reserved: the memory copy still holds it
                        fates.append((p, "kept", e))
            snapshot = [(p, p.copies[disk]) for p in self._table.values() if disk in p.copies]
            protected = self._disk.protect([e for _p, e in snapshot])
        return fates, snapshot, protected

    def flush_failed(self, snapshot: list, protected: list, fates: list) -> list:
        """After the writes were waited for: when some failed (or `fates` has some), unprotect and fall back
        for each failed one; returns every fate (empty when all were written)."""
        failed = [(p, e, e.written.exception()) for p, e in snapshot
                  if e.written is not None and e.written.exception() is not None]
        if not failed and not fates:
            for _p, e in snapshot:
                e.written = None
            return []
        with self.lock:
            self._disk.unprotect(protected)
            return fates + [(p, self.write_failed(p, e, err), err) for p, e, err in failed]

    def sync_failed(self, snapshot: list, protected: list, fates: list, err: BaseException) -> list:
        """An fsync of the flush failed: every write no durable manifest names yet -- `protected`, those
        written since the last flush that succeeded -- counts as failed, whether it completed or not
        ([Note: when a flush fails] in store.py); unprotect and fall back for each. Returns every fate."""
        untrusted = {id(e) for e in protected}
        with self.lock:
            self._disk.unprotect(protected)
            return fates + [(p, self.write_failed(p, e, err), err) for p, e in snapshot if id(e) in untrusted]

    def unprotect(self, protected: list) -> None:
        with self.lock:
            self._disk.unprotect(protected)

    def flush_committed(self, snapshot: list) -> None:
        """The manifest naming `snapshot` was renamed into place."""
        with self.lock:
            for p, e in snapshot:
                p.committed = e
                p.committed_meta = None

    def flush_done(self, snapshot: list) -> None:
        """That manifest is durable: the space of versions it does not name may be reused."""
        with self.lock:
            self._disk.commit_done([e for _p, e in snapshot])
