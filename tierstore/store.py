"""Store: named tensors on three tiers with byte budgets, spill, crash-safe persistence and zarr export.

    with tierstore.Store(["/nvme0/ts", "/nvme1/ts"], budgets={"host": 8 << 30}) as store:
        store.put("w", torch.randn(4096, 4096))      # fastest tier with room
        store.tensor("w").offload("nvme").result()   # async write down
        with store.tensor("w").resident() as w: ...  # a plain torch.Tensor inside the block
        store.flush()                                # durable: data + fsync, then the manifest
    store = tierstore.Store.open(["/nvme0/ts", "/nvme1/ts"])   # later, any process

The store is the top of four layers, and a tensor's way from put() to disk and back only goes down them:
Store (names, lifecycle: open / close / directory locks / read-only, flush orchestration, the public API)
-> Residency (residency.py: which tier holds which copy, budgets, spill, the one read path; TieredTensor is a
handle on it) -> the tiers (tiers/, known by their capabilities) -> io/. The manifest's format is
manifest.py, zarr export and import zarr_io.py, codecs and dtypes encoding.py.

[Note: crash safety]
`flush()` (1) writes every tensor whose current value has no nvme copy yet, (2) waits for every write and
fsyncs the extent files (and the directories when files were created), (3) writes the manifest to
``manifest.json.tmp``, fsyncs it, renames it over ``manifest.json`` and fsyncs the directory, and only
then (4) lets the allocator reuse the space of versions the new manifest no longer names. A crash before
the rename leaves the previous manifest, whose extents were never overwritten (copy-on-write, see
[Note: space is never reused before the manifest stops pointing at it] in tiers/nvme/extents.py); a crash after
it leaves the new one, whose data was durable before it was written. Every extent's crc32c is checked on
read, and the manifest carries a crc32c of its own body.

[Note: when a flush fails]
Before the manifest rename nothing the previous flush named was touched (copy-on-write), so a failed flush
leaves the previous flush standing; what the error must say is what became of the values put since.
A value whose space could not be reserved (a full disk, see [Note: space is reserved when it is
allocated] in tiers/nvme/writes.py) still has its memory copy: a later flush() stores it. A value whose only copy
was a write that failed (an EIO) is gone: its tensor is back at its last flushed value, or removed if never
flushed, and the error names it without advising a retry. After the rename, a failed directory fsync
leaves it unknown which manifest a crash would leave: both are kept intact -- the new extents stay
protected and the previous ones pending free -- until a later flush succeeds.
A failed fsync of the extent files (or of their directories) counts as a failed write for every value
written since the last flush that succeeded: after it the kernel may drop the pages it could not write back
and a retried fsync then succeeds without them (on the buffered fallback), or the device's cache may not
have kept what O_DIRECT handed it. Which pages were lost is unknown, so none of those writes is trusted:
values with a memory copy are written again by the next flush, the others are back at their last flushed
value (or removed), and the error names each -- a retried flush never declares durable what it cannot
vouch for.

"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from . import zarr_io
from .errors import MisuseError, TierstoreIOError, TierstoreValueError, advice, io_error
from .io import BufferPool, Engine, Tuning
from .io.files import fsync_dir, own_open, remove_own
from .manifest import (
    MANIFEST,
    STORED_DTYPES,
    VERSION,
    gc_paused,
    manifest_limit,
    parse_body,
    read_manifest,
    tensor_entry,
    write_manifest,
)
from .residency import Placement, Residency
from .store_args import check_flag, check_sizes, store_budgets, store_paths
from .tensor import TieredTensor
from .tiers import TIERS, DeviceTier, HostTier, NvmeTier, profile_range, tier_info
from .tiers.device import to_dlpack_tensor

__all__ = ["LOCKFILE", "MANIFEST", "STORED_DTYPES", "Store", "read_manifest"]

log = logging.getLogger("tierstore.store")

LOCKFILE = "tierstore.lock"


class Store:
    """Named tensors on device / host / nvme tiers. See the module docstring and docs/store.md.

    paths: directory or directories (one per NVMe drive) the extent files are striped over; created if
    missing. budgets: bytes per name (None = no limit; a name left out keeps its default, see
    [Note: one budget per tier name] in store_args.py): "device" (accelerator memory; the CPU stands in when
    there is no accelerator; default 0), "host" (page-locked host copies; 256 MiB), "pinned" (the page-locked
    staging pool all NVMe I/O streams through; 64 MiB), "nvme" (bytes of extents; no limit). The keywords
    device_budget= / host_budget= / pinned_budget= / nvme_budget= are deprecated spellings of it.
    io_tuning: the path of what `tierstore tune DIR` recommended (or a tierstore.io.Tuning): it fills in
    backend, queue_depth, buffer_bytes, stripe_unit (a new store only) and workers where they are left at
    their defaults, and the engine's block size (see [Note: a tuning file only fills in defaults] in io/tuning.py).
    """

    def __init__(self, paths: str | os.PathLike | Iterable[str | os.PathLike], *,
                 budgets: Mapping[str, int | None] | None = None, device: torch.device | str | None = None,
                 backend: str = "auto", buffer_bytes: int = 4 << 20,
                 queue_depth: int = 32, extent_file_bytes: int = 16 << 30, stripe_unit: int = 1 << 20,
                 workers: int = 2, lock_memory: bool = True, io_tuning: str | os.PathLike | Tuning | None = None,
                 _must_exist: bool = False, _read_only: bool = False,
                 _fresh: bool = False, _bounce_bytes: int = 32 << 20, **deprecated: Any):
        self._closed = True  # until fully open
        self._read_only = _read_only
        self._lockfds: list[int] = []
        self.paths = store_paths(paths)
        block_size = 1 << 20  # bytes: the engine's request block
        if io_tuning is not None:
            tuning = Tuning.coerce(io_tuning)
            fresh = not os.path.lexists(os.path.join(self.paths[0], MANIFEST))
            knobs = tuning.fill(Store.__init__, {"backend": backend, "queue_depth": queue_depth, "workers": workers,
                                                 "buffer_bytes": buffer_bytes, "stripe_unit": stripe_unit},
                                layout=fresh)
            backend, queue_depth, workers = knobs["backend"], knobs["queue_depth"], knobs["workers"]
            buffer_bytes, stripe_unit, block_size = knobs["buffer_bytes"], knobs["stripe_unit"], tuning.block_size
        limits = store_budgets(budgets, deprecated)
        check_sizes(buffer_bytes=buffer_bytes, queue_depth=queue_depth,
                    extent_file_bytes=extent_file_bytes, stripe_unit=stripe_unit, workers=workers)
        check_flag("lock_memory", lock_memory)
        if _must_exist and not os.path.lexists(os.path.join(self.paths[0], MANIFEST)):
            raise TierstoreValueError(f"no tierstore in {self.paths[0]} (no {MANIFEST}); create one with "
                                      "Store(paths) and flush() it")
        try:  # in memory first, the disk second ([Note: a refused Store leaves the disk as it was])
            self._flush_lock = threading.Lock()
            pinned = limits["pinned"]
            assert pinned is not None  # store_budgets refuses None for the pool
            self._pool = BufferPool(pinned, buffer_bytes, lock=lock_memory)
            # _bounce_bytes: the engine's bounce buffers, resident once registered with io_uring; a store whose
            # reads and writes are aligned or go through its pool needs few ([Note: the inference budget])
            self._engine = Engine(backend, queue_depth, block_size, pool=self._pool, bounce_bytes=_bounce_bytes)
            self._device = DeviceTier(limits[DeviceTier.name], device)
            self._host = HostTier(limits[HostTier.name], lock=lock_memory)
            if not _read_only:
                for p in self.paths:
                    _make_dir(p)
            self._lockfds = _lock_dirs(self.paths, shared=_read_only)
            self._nvme = NvmeTier(self.paths, self._engine, self._pool, budget_bytes=limits[NvmeTier.name],
                                  extent_file_bytes=extent_file_bytes, stripe_unit=stripe_unit,
                                  read_only=_read_only)
            self._tiers = {t.name: t for t in (self._device, self._host, self._nvme)}  # registry name -> tier
            self._workers = workers
            self._res = Residency(self._tiers, accelerator=self._device, staging=self._host, workers=workers,
                                  read_only=_read_only, where=self.paths[0])
            self._generation = 0
            self._flushes = 0
            self._flush_seconds = 0.0
            self._closed = False
            if not _read_only:
                # A crash during a flush leaves a .tmp (the previous manifest stands); `_fresh` (a new run of
                # the optimizer over its old directories) starts empty. Done here, under the locks, so a
                # second opener of a directory in use touches nothing.
                stale = [os.path.join(self.paths[0], MANIFEST + ".tmp")]
                if _fresh:
                    stale += [os.path.join(p, name) for p in self.paths for name in (MANIFEST, MANIFEST + ".tmp")]
                for leftover in stale:
                    remove_own(leftover)
                _make_manifest_durable(self.paths[0])
            with gc_paused():  # [Note: opening costs what the tensors need] in manifest.py
                self._load(read_manifest(self.paths[0], manifest_limit(self._nvme.file_bytes())))
        except BaseException:
            self._teardown()
            raise

    @classmethod
    def open(cls, paths, *, mode: str = "w", **kwargs) -> Store:
        """Open an existing store (every tensor of its last completed flush). Same directories, same order.

        mode: 'w' (default) to read and change it, holding every directory exclusively; 'r' to only read it
        (read-only media too): a shared lock, so any number of read-only opens coexist but none with a
        writer; put/update/delete/flush/offload/writeback raise MisuseError, and close() flushes nothing."""
        if mode not in ("r", "w"):
            raise TierstoreValueError(f"mode={mode!r}: use 'w' (read and write) or 'r' (read-only)")
        return cls(paths, _must_exist=True, _read_only=mode == "r", **kwargs)

    @property
    def read_only(self) -> bool:
        """True when opened with Store.open(paths, mode='r')."""
        return self._read_only

    def _load(self, body: dict | None) -> None:
        """Adopt the tensors of a manifest body, every field checked against the extent files on disk first
        ([Note: the manifest is untrusted input] in manifest.py)."""
        if body is None:
            return
        where = os.path.join(self.paths[0], MANIFEST)
        generation, entries = parse_body(body, where, len(self.paths), self._nvme.stripe_unit)
        self._res.adopt(entries, where)
        self._generation = generation

    # -- lifecycle checks ---------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise MisuseError("the store is closed; open it again with tierstore.Store.open(paths)")

    def _check_writable(self, what: str) -> None:
        self._check_open()
        self._res.check_writable(what)

    def _handle(self, p: Placement) -> TieredTensor:
        return TieredTensor(self._res, p)

    def _flush_error(self, fates: list[tuple[Placement, str, BaseException]],
                     fsync: BaseException | None = None) -> TierstoreIOError:
        """The error of a flush whose writes failed, or whose `fsync` failed: names the tensors whose new value
        was lost and those a later flush stores (see [Note: when a flush fails])."""
        err = fsync or fates[0][2]
        code = getattr(err, "errno", None) or errno.EIO
        told = os.strerror(code) if getattr(err, "errno", None) else f"{type(err).__name__}: {err}"  # not an I/O error
        lost = [(t, f) for t, f, _e in fates if f in ("reverted", "removed")]
        kept = [t for t, f, _e in fates if f == "kept"]

        def names(ts) -> str:
            text = ", ".join(repr(t.name) for t in ts[:8])
            return text + (f" and {len(ts) - 8} more" if len(ts) > 8 else "")
        what = (f"made durable (fsync of {getattr(err, 'filename', None) or 'the extent files'}: "
                f"{os.strerror(code)}; written since the last flush that succeeded, so none is trusted)"
                if fsync is not None else f"written ({told})")
        parts = [f"flush failed: {len(fates)} tensor(s) could not be {what}",
                 "Nothing flushed before is lost"]
        if lost:
            reverted = [t for t, f in lost if f == "reverted"]
            removed = [t for t, f in lost if f == "removed"]
            text = f"The new values of {len(lost)} tensor(s) existed only in the failed write and are gone"
            if reverted:
                text += f"; back at their last flushed value: {names(reverted)}"
            if removed:
                text += f"; never flushed, so removed from the store: {names(removed)}"
            parts.append(text + "; put or update them again")
        cause = advice(code) if getattr(err, "errno", None) else ""
        if kept:
            parts.append(f"Still held in memory, stored by the next flush() that succeeds: {names(kept)}"
                         f"{'; ' + cause + ', then' if cause else ';'} call flush() again")
        elif cause:
            parts.append(cause[0].upper() + cause[1:])
        msg = ". ".join(parts)
        return TierstoreIOError(code, msg, getattr(err, "filename", None), getattr(err, "offset", None),
                                getattr(err, "length", None))

    # -- public API --------------------------------------------------------------------------------------
    def put(self, name: str, value, tier: str | None = None, *, codec=None,
            lend: Callable[[], None] | None = None) -> TieredTensor:
        """Store a copy of `value` (torch tensor on any device, numpy array, DLPack object) under `name`,
        replacing any tensor of that name. tier: 'device', 'host', 'nvme' or None (fastest with room).

        lend: a callable to lend `value` instead of having it copied -- you promise to leave it unchanged
        until the store calls `lend()`, which it does exactly once (also when put raises), as soon as it no
        longer needs the memory. Written to nvme, a 4 KiB-aligned CPU tensor larger than half a pool buffer
        (aligned_empty, a BufferPool buffer) then goes to disk from its own memory after put returns, with
        no copy; anything else is copied as usual and `lend()` is called before put returns. For a writer
        that recycles its buffers anyway (see [Note: lent tensors] in tiers/nvme/writes.py)."""
        try:
            if not isinstance(name, str) or not name:
                raise TierstoreValueError(f"name={name!r} must be a non-empty string")
            if tier is not None:
                tier_info(tier)
            if codec is not None and not all(hasattr(codec, a) for a in ("encode", "decode", "get_config")):
                raise TierstoreValueError(f"codec={codec!r} needs encode/decode/get_config (a numcodecs Codec)")
            if lend is not None and not callable(lend):
                raise TierstoreValueError(f"lend={lend!r} must be a callable (called once the store no longer "
                                          "needs the value's memory) or None")
            self._check_writable(f"put({name!r})")
            value = to_dlpack_tensor(value)
        except BaseException:
            if callable(lend):
                lend()
            raise
        return self._handle(self._res.put(name, value, tier, codec, lend))

    def tensor(self, name: str) -> TieredTensor:
        """The TieredTensor handle of `name` (KeyError if absent)."""
        self._check_open()
        return self._handle(self._res.lookup(name))

    __getitem__ = tensor

    def get(self, name: str, device: torch.device | str | None = None, *,
            out: torch.Tensor | None = None, rows=None) -> torch.Tensor:
        """A copy of tensor `name` as a plain torch.Tensor (see TieredTensor.get; out= reads into your tensor).

        rows: only these rows along dim 0 -- a slice (``rows=slice(1000, 2000)``), row indices (a list of
        ints or a 1-D integer tensor, in any order, repeats allowed) or a bool mask with one value per row;
        the result has shape (number of rows selected, *shape[1:]). Anything else (floats, bools mixed with
        ints, a mask of another length) is refused ([Note: what rows accepts] in rows.py). On the nvme tier
        only the checksummed 256 KiB blocks covering them are read ([Note: range reads] in
        tiers/nvme/reads.py); a memory copy is indexed. A value larger than this machine's memory is refused
        before anything is allocated ([Note: memory for a result] in tiers/host.py).

        [Note: a read by name sees the old or the new value]
        A put() of the same name while the read runs replaces the handle the read started from, which then
        refuses (a replaced handle is stale: MisuseError). A read by name is not bound to that handle: it
        reads the tensor that has the name now, so it returns the old or the new value, never an error
        (KeyError when the name was deleted meanwhile)."""
        self._check_open()
        if rows is not None:
            if out is not None:
                raise TierstoreValueError("get(..., rows=...) returns a new tensor of those rows; out= is for "
                                          "whole tensors: leave one of them out")
            return self._res.read_rows(name, rows, device)
        return self._res.read([name], device, [out], by_name=True)[0]

    def get_many(self, names: Iterable[str], device: torch.device | str | None = None, *,
                 out=None) -> dict[str, torch.Tensor]:
        """Like get() for many tensors, returned as a dict name -> tensor (not a list); reads of nvme-only
        tensors are coalesced into large requests and overlapped. out: tensors to read into, a mapping name ->
        tensor or a sequence in the order of `names` (see TieredTensor.get); the result maps each name to its
        out tensor then."""
        names = list(names)
        outs: dict[str, torch.Tensor] = {}
        if out is not None:
            if isinstance(out, dict):
                outs = dict(out)
            else:
                out = list(out)
                if len(out) != len(names):
                    raise TierstoreValueError(f"out= has {len(out)} tensors for {len(names)} names: give one per "
                                              "name, in the same order (or a dict name -> tensor)")
                outs = dict(zip(names, out))
        self._check_open()
        unique = list(dict.fromkeys(names))
        values = self._res.read(unique, device, [outs.get(n) for n in unique], by_name=True)
        return dict(zip(unique, values))

    def __contains__(self, name: object) -> bool:
        self._check_open()
        return self._res.holds(name)

    def keys(self) -> list[str]:
        self._check_open()
        return self._res.names()

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.keys())

    def delete(self, name: str) -> None:
        """Remove `name`; its space is reused after the next flush (the last flushed manifest still names it)."""
        self._check_writable(f"delete({name!r})")
        self._res.delete(name)

    __delitem__ = delete

    def synchronize(self) -> None:
        """Wait until every write submitted to the nvme tier so far has reached its file -- lent tensors are
        then back with their owners -- for timing work that writes (as torch.cuda.synchronize). Nothing is
        made durable (flush() does that); small tensors still packed in a staging buffer stay there."""
        self._check_open()
        self._nvme.wait_writes()

    def flush(self) -> None:
        """Make every tensor put so far durable (see [Note: crash safety]). On an I/O error it raises a
        TierstoreIOError saying which new values were lost and which a later flush() stores, and what to do
        for that errno (see [Note: when a flush fails])."""
        self._check_writable("flush()")
        t0 = time.perf_counter()
        with self._flush_lock, profile_range("tierstore::flush"):
            self._check_open()
            fates, snapshot, protected = self._res.flush_begin()
            renamed = False
            try:
                try:
                    self._nvme.sync()
                except TierstoreIOError as e:  # an fsync failed ([Note: when a flush fails])
                    fates = self._res.sync_failed(snapshot, protected, fates, e)
                    protected = []  # unprotected by sync_failed
                    if not fates:
                        raise
                    raise self._flush_error(fates, fsync=e) from e
                fates = self._res.flush_failed(snapshot, protected, fates)
                if fates:
                    protected = []  # unprotected by flush_failed
                    raise self._flush_error(fates)
                self._write_manifest(snapshot)
                renamed = True
                self._res.flush_committed(snapshot)
                try:
                    fsync_dir(self.paths[0])
                except OSError as e:
                    code = e.errno or errno.EIO
                    raise TierstoreIOError(
                        code, f"flush: the new manifest is in place but making it durable failed (fsync of the "
                        f"directory: {os.strerror(code)}). After a crash a reopen finds either this flush or the "
                        "previous one, so the space of both is kept (never reused) until a flush() succeeds. "
                        f"{advice(code) or 'Check the disk'}, then call flush() again", self.paths[0]) from None
            except BaseException:
                if not renamed:  # the previous manifest stands: this one's extents need no protection
                    self._res.unprotect(protected)
                raise
            self._res.flush_done(snapshot)
        self._flushes += 1
        self._flush_seconds += time.perf_counter() - t0

    def _write_manifest(self, snapshot: list[tuple[Placement, Any]]) -> None:
        """Write the manifest naming `snapshot` (see manifest.write_manifest); one more generation."""
        tensors = {}
        for p, e in snapshot:
            cached = p.manifest_entry
            if cached is None or cached[0] is not e:
                cached = p.manifest_entry = (e, tensor_entry(p.shape, p.dtype, p.nbytes, p.codec, e))
            tensors[p.name] = cached[1]
        write_manifest(self.paths[0], tensors, generation=self._generation + 1, ndirs=len(self.paths),
                       stripe_unit=self._nvme.stripe_unit, nfiles=len(self._nvme.files),
                       limit=manifest_limit(self._nvme.file_bytes()))
        self._generation += 1

    @property
    def generation(self) -> int:
        """The number of the last completed flush in this store's life on disk (0 before the first): a flush
        that returned normally adds one; Store.open() starts from the one its manifest records."""
        return self._generation

    def stats(self) -> dict:
        """Bytes and seconds moved into ('in') and out of ('out') each tier, budgets, tensor counts; under 'io'
        the I/O knobs the store runs with (after io_tuning): backend, queue_depth, block_size, buffer_bytes,
        pinned_bytes (the pool: budgets['pinned']), bounce_bytes (the engine's bounce buffers), stripe_unit,
        workers."""
        with self._res.lock:
            out: dict[str, Any] = {}
            for t in TIERS:
                tobj = self._tiers[t]
                d = tobj.stats.as_dict()
                d["budget"] = tobj.budget.limit
                d["used"] = tobj.budget.used  # bytes
                d["tensors"] = self._res.tier_count(t)
                out[t] = d
            out["tensors"] = len(self._res.names())
            out["flushes"] = self._flushes
            out["flush_seconds"] = self._flush_seconds
            out["pool_waits"] = self._pool.waits
            out["backend"] = self._engine.backend
            eng = self._engine.stats()
            out["io"] = {"backend": self._engine.backend, "queue_depth": self._engine.queue_depth,  # the knobs
                         "block_size": self._engine.block_size, "buffer_bytes": self._pool.buffer_bytes,
                         "pinned_bytes": self._pool.nbytes, "stripe_unit": self._nvme.stripe_unit,
                         "bounce_bytes": eng["bounce_buffers"] * eng["bounce_buffer_bytes"],
                         "workers": self._workers}
            return out

    # -- zarr ---------------------------------------------------------------------------------------
    def export_zarr(self, path: str | os.PathLike, *, compressor=None, chunk_bytes: int = 64 << 20) -> None:
        """Write every tensor to a zarr v3 group at `path` (one array per tensor, readable by plain zarr).

        compressor: None, a name ('zstd', 'blosc', 'gzip', 'lz4', 'zlib'), a numcodecs codec object (e.g.
        numcodecs.Zstd(level=5)) or a zarr codec. Dtypes numpy lacks (bfloat16, float8) are stored as
        same-width unsigned integers; the array attribute 'torch_dtype' names the real one. `path` is a new
        path, an empty directory or a zarr group (replaced); an existing file, or a directory holding anything
        else, is refused (TierstoreValueError) before anything is written."""
        self._check_open()
        path = zarr_io.export_target(path)
        if self._read_only:
            target = os.path.realpath(path)
            for d in self.paths:
                if os.path.commonpath([target, os.path.realpath(d)]) == os.path.realpath(d):
                    self._check_writable(f"export_zarr({os.fspath(path)!r}) into the store's directory {d}")
        zarr_io.write_group(path, self.keys(), lambda name: self.get(name, "cpu"), version=VERSION,
                            compressor=compressor, chunk_bytes=chunk_bytes)

    @classmethod
    def import_zarr(cls, path: str | os.PathLike, paths, *, tier: str | None = None, **kwargs) -> Store:
        """A new Store at `paths` holding every array of the zarr group at `path` (flushed)."""
        arrays = zarr_io.read_group(path)
        store = cls(paths, **kwargs)
        try:
            for name, t in arrays:
                store.put(name, t, tier)
            store.flush()
        except BaseException:
            store.close(flush=False)
            raise
        return store

    # -- lifetime -------------------------------------------------------------------------------------------
    def close(self, *, flush: bool = True) -> None:
        """Flush (unless flush=False) and release files, memory and threads. Idempotent."""
        if self._closed:
            return
        try:
            if flush and not self._read_only:
                self.flush()
        finally:
            with self._res.lock:
                self._closed = self._res.closed = True
            self._teardown()

    def _teardown(self) -> None:
        res = self.__dict__.get("_res")
        if res is not None:
            res.closed = True
        for step in ("_res", "_nvme", "_engine", "_pool"):
            obj = self.__dict__.pop(step, None)
            if obj is None:
                continue
            try:
                obj.shutdown() if step == "_res" else obj.close()
            except Exception:
                log.exception("closing %s failed", step)
        self._closed = True
        fds, self._lockfds = getattr(self, "_lockfds", []), []
        for fd in fds:
            os.close(fd)  # releases its flock

    def __enter__(self) -> Store:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(flush=exc_type is None)

    def __del__(self):
        if not getattr(self, "_closed", True):
            try:
                self.close(flush=False)
            except Exception:
                pass

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self)} tensors"
        return f"Store({self.paths}, {state})"


# -- opening: arguments, directories, locks ---------------------------------------------------------------
def _make_dir(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        hints: dict[int | None, str] = {  # by e.errno (None for an OSError raised without one)
            errno.EROFS: "the filesystem is read-only: open an existing store there with Store.open(paths, mode='r')",
            errno.EACCES: "give a directory this user can write to",
            errno.EPERM: "give a directory this user can write to",
            errno.ENOSPC: "the disk is full: free space or use another disk"}
        hint = hints.get(e.errno, "check the path")
        raise TierstoreIOError(e.errno or errno.EIO, f"cannot create the store directory {path}: {e.strerror}; "
                               f"{hint}", path) from None


def _lock_dirs(paths: list[str], *, shared: bool) -> list[int]:
    """flock LOCKFILE in every directory of a store: exclusively, or shared for a read-only open. Returns the
    open descriptors (closing them releases the locks); on any failure, releases those taken and raises.

    [Note: every directory is locked, in one order]
    A store writes extent files into every directory it stripes over, so each directory is locked, not only
    the first: a Store([b]) must not open while Store([a, b]) writes into b. The locks are taken in the order
    of the directories' real paths, never blocking: two stores over overlapping directory sets then meet
    at the same first shared directory, one gets it and the other fails at once, holding nothing."""
    fds: list[int] = []
    try:
        for d in sorted({os.path.realpath(p) for p in paths}):
            where = os.path.join(d, LOCKFILE)
            try:  # [Note: tierstore's own files]: a symlink, FIFO or device there is refused, never followed
                fd = own_open(where, os.O_RDWR | os.O_CREAT, what="create the lock file")
            except TierstoreIOError as e:
                if e.errno in (errno.ELOOP, errno.EINVAL):  # not a lock file tierstore made: refused
                    raise
                if not shared:
                    raise TierstoreIOError(e.errno, f"cannot create the lock file {where}: "
                                           f"{os.strerror(e.errno)}; a read-only store can be opened with "
                                           "Store.open(paths, mode='r')", where) from None
                try:  # read-only media: lock the lock file if there is one, else nobody can write here either
                    fd = own_open(where, os.O_RDONLY, what="open the lock file")
                except TierstoreIOError as e2:
                    if e2.errno == errno.ENOENT:
                        continue
                    raise
            try:
                fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                held = "open for writing" if shared else "open"
                raise MisuseError(f"another Store has {d} {held} (in this or another process; {where} is "
                                  "locked); close it first") from None
            fds.append(fd)
    except BaseException:
        for fd in fds:
            os.close(fd)  # releases its flock
        raise
    return fds


def _make_manifest_durable(directory: str) -> None:
    """Before a writable open trusts the manifest it finds: fsync it and its directory entry.

    A flush whose directory fsync failed after the rename leaves a manifest that may not survive a crash
    ([Note: when a flush fails]); that flush kept both generations' extents. A later open of the store in
    the same boot would adopt the new manifest and reuse the old generation's space -- and a crash then
    could bring back the old manifest, naming overwritten bytes. Making the manifest durable first closes
    that window; when it fails the open fails, with the errno's advice, having written nothing."""
    path = os.path.join(directory, MANIFEST)
    try:
        fd = own_open(path, os.O_RDONLY, what="open the manifest")
    except TierstoreIOError as e:
        if e.errno == errno.ENOENT:
            return
        raise
    try:
        os.fsync(fd)
        fsync_dir(directory)
    except OSError as e:
        code = e.errno or errno.EIO
        raise io_error(code, f"making the manifest {path} durable before opening the store for writing", path,
                       None, None, "or open it read-only: Store.open(paths, mode='r')") from None
    finally:
        os.close(fd)
