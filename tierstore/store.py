"""Store: named tensors on three tiers with byte budgets, spill, crash-safe persistence and zarr export.

    with tierstore.Store(["/nvme0/ts", "/nvme1/ts"], host_budget=8 << 30) as store:
        store.put("w", torch.randn(4096, 4096))      # fastest tier with room
        store.tensor("w").offload("nvme").result()   # async write down
        with store.tensor("w").resident() as w: ...  # a plain torch.Tensor inside the block
        store.flush()                                # durable: data + fsync, then the manifest
    store = tierstore.Store.open(["/nvme0/ts", "/nvme1/ts"])   # later, any process

[Note: crash safety]
`flush()` (1) writes every tensor whose current value has no nvme copy yet, (2) waits for every write and
fsyncs the extent files (and the directories when files were created), (3) writes the manifest to
``manifest.json.tmp``, fsyncs it, renames it over ``manifest.json`` and fsyncs the directory, and only
then (4) lets the allocator reuse the space of versions the new manifest no longer names. A crash before
the rename leaves the previous manifest, whose extents were never overwritten (copy-on-write, see
[Note: space is never reused before the manifest stops pointing at it] in tiers/nvme.py); a crash after
it leaves the new one, whose data was durable before it was written. Every extent's crc32c is checked on
read, and the manifest carries a crc32c of its own body.

[Note: budgets and spill]
`put(tier=None)` places a tensor on the fastest tier whose budget can hold it at all, making room by
spilling that tier's least recently used tensors one tier down (a tensor that already has a copy lower
down is simply dropped). Tensors inside `resident()` blocks or being moved are never spilled. Only when no
tier can take it is TierFullError raised, naming every budget.

[Note: locking]
One re-entrant lock guards the tensors' metadata, budgets and moves between memory tiers, and writes to the
nvme tier (a memcpy into a staging buffer for small tensors). Reads from the nvme tier run without it, so
a prefetch on a worker thread does not stall other threads; a read that finds the tensor changed meanwhile
is retried. flush() holds the lock while it snapshots the tensors and marks their extents as named by a
manifest, then releases it for the waiting and fsyncs.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterable, Iterator

import crc32c
import torch

from .errors import CorruptionError, MisuseError, TierFullError, TierstoreIOError, TierstoreValueError
from .io import BufferPool, Engine
from .tensor import (IDENTITY, TieredTensor, codec_config, codec_from_config, dtype_from_name, dtype_name,
                     out_bytes, to_numpy)
from .tiers import TIERS, DeviceTier, Extent, HostTier, NvmeTier, profile_range, tier_index
from .tiers.device import to_dlpack_tensor
from .tiers.host import result_empty
from .io.files import fsync_dir

log = logging.getLogger("tierstore.store")

MANIFEST = "manifest.json"
LOCKFILE = "tierstore.lock"
FORMAT = "tierstore-manifest"
VERSION = 1


def _manifest_crc(body: dict) -> int:
    return crc32c.crc32c(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def read_manifest(directory: str) -> dict | None:
    """The manifest body in `directory`, None when there is none. CorruptionError when unreadable."""
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(raw)
        body = doc["body"]
        ok = doc.get("format") == FORMAT and _manifest_crc(body) == doc["crc32c"]
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptionError(f"the manifest {path} is not valid ({e}); restore it from a backup", path) from None
    if not ok:
        raise CorruptionError(f"the manifest {path} fails its checksum; restore it from a backup", path)
    if doc.get("version", 0) > VERSION:
        raise TierstoreValueError(f"{path} has format version {doc['version']}; this tierstore reads "
                                  f"<= {VERSION}: upgrade tierstore")
    return body


class Store:
    """Named tensors on device / host / nvme tiers. See the module docstring and docs/store.md.

    paths: directory or directories (one per NVMe drive) the extent files are striped over; created if
    missing. Budgets are bytes (None = no limit): device_budget (accelerator memory; the CPU stands in when
    there is no accelerator), host_budget (page-locked host copies), pinned_budget (the page-locked staging
    pool all NVMe I/O streams through), nvme_budget (bytes of extents).
    """

    def __init__(self, paths: str | os.PathLike | Iterable[str | os.PathLike], *, host_budget: int | None = 256 << 20,
                 device_budget: int | None = 0, pinned_budget: int = 64 << 20, nvme_budget: int | None = None,
                 device: torch.device | str | None = None, backend: str = "auto", buffer_bytes: int = 4 << 20,
                 queue_depth: int = 32, extent_file_bytes: int = 16 << 30, stripe_unit: int = 1 << 20,
                 workers: int = 2, lock_memory: bool = True, _must_exist: bool = False):
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        self.paths = [os.path.abspath(os.fspath(p)) for p in paths]
        if not self.paths:
            raise TierstoreValueError("paths is empty: give at least one directory for the nvme tier")
        if len(set(self.paths)) != len(self.paths):
            raise TierstoreValueError(f"paths={self.paths} names a directory twice")
        if _must_exist and not os.path.exists(os.path.join(self.paths[0], MANIFEST)):
            raise TierstoreValueError(f"no tierstore in {self.paths[0]} (no {MANIFEST}); create one with "
                                      "Store(paths) and flush() it")
        for p in self.paths:
            os.makedirs(p, exist_ok=True)
        self._closed = True  # until fully open
        self._lockfd = os.open(os.path.join(self.paths[0], LOCKFILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(self._lockfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lockfd)
            raise MisuseError(f"another Store has {self.paths[0]} open (in this or another process); close it "
                              "first") from None
        try:
            self._lock = threading.RLock()
            self._flush_lock = threading.Lock()
            self._tensors: dict[str, TieredTensor] = {}
            self._lru: dict[str, OrderedDict] = {t: OrderedDict() for t in TIERS}
            self._pool = BufferPool(pinned_budget, buffer_bytes, lock=lock_memory)
            self._engine = Engine(backend, queue_depth, pool=self._pool)
            self._device = DeviceTier(device_budget, device)
            self._host = HostTier(host_budget, lock=lock_memory)
            self._nvme = NvmeTier(self.paths, self._engine, self._pool, budget_bytes=nvme_budget,
                                  extent_file_bytes=extent_file_bytes, stripe_unit=stripe_unit)
            self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tierstore-move")
            self._generation = 0
            self._flushes = 0
            self._flush_seconds = 0.0
            self._closed = False
            for leftover in [os.path.join(self.paths[0], MANIFEST + ".tmp")]:
                if os.path.exists(leftover):  # a crash during a flush; the previous manifest stands
                    os.unlink(leftover)
            self._load(read_manifest(self.paths[0]))
        except BaseException:
            self._teardown()
            raise

    @classmethod
    def open(cls, paths, **kwargs) -> "Store":
        """Open an existing store (every tensor of its last completed flush). Same directories, same order."""
        return cls(paths, _must_exist=True, **kwargs)

    def _load(self, body: dict | None) -> None:
        if body is None:
            return
        where = os.path.join(self.paths[0], MANIFEST)
        if body["ndirs"] != len(self.paths) or body["stripe_unit"] != self._nvme.stripe_unit:
            raise TierstoreValueError(
                f"{where} describes a store striped over {body['ndirs']} directories with stripe_unit="
                f"{body['stripe_unit']}; open it with the same directories in the same order and that stripe_unit")
        self._generation = body["generation"]
        extents = []
        for name, d in body["tensors"].items():
            t = TieredTensor(self, name, d["shape"], dtype_from_name(d["dtype"]), codec_from_config(d.get("codec")))
            ext = Extent.from_json(d["extent"])
            t._copies["nvme"] = ext
            t._committed = ext
            self._lru["nvme"][t] = None
            self._tensors[name] = t
            extents.append(ext)
        self._nvme.adopt(extents)

    # -- helpers used by TieredTensor -----------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise MisuseError("the store is closed; open it again with tierstore.Store.open(paths)")

    def _tier(self, name: str):
        return {"device": self._device, "host": self._host, "nvme": self._nvme}[name]

    def _tier_for(self, device) -> str:
        if device is None:
            return "device"
        if isinstance(device, str) and device in ("device", "host"):
            return device
        dev = torch.device(device)
        if dev == self._device.device or (dev.index is None and dev.type == self._device.device.type):
            return "device"
        if dev.type == "cpu":
            return "host"
        raise TierstoreValueError(f"device={device!r}: this store's device tier is {self._device.device}; pass "
                                  "'device', 'host', that device or 'cpu'")

    def _submit(self, fn, *args) -> Future:
        self._check_open()
        return self._executor.submit(fn, *args)

    def _budgets_text(self) -> str:
        parts = []
        for t in TIERS:
            b = self._tier(t).budget
            lim = "unlimited" if b.limit is None else str(b.limit)
            parts.append(f"{t}_budget={lim} ({b.used} used)")
        return ", ".join(parts)

    def _full_error(self, tier: str | None, t: TieredTensor) -> TierFullError:
        where = f"on the {tier} tier" if tier else "on any tier"
        return TierFullError(f"no room for {t.name!r} ({t.nbytes} bytes) {where}: {self._budgets_text()}; "
                             "everything that could be spilled was. Raise a budget, put it on a slower tier, "
                             "or delete tensors")

    def _make_room(self, tier: str, nbytes: int, exclude: TieredTensor | None = None) -> bool:
        """Spill LRU tensors of memory tier `tier` down until `nbytes` fit (lock held). False if impossible."""
        b = self._tier(tier).budget
        if not b.fits_at_all(nbytes):
            return False
        if b.room() >= nbytes:
            return True
        for victim in list(self._lru[tier]):
            if b.room() >= nbytes:
                break
            if victim is exclude or victim._pins:
                continue
            self._demote(victim, tier)
        return b.room() >= nbytes

    def _demote(self, v: TieredTensor, tier: str) -> None:
        lower = TIERS[tier_index(tier) + 1:]
        dest = next((lt for lt in lower if lt in v._copies), None)
        if dest is None:
            for lt in lower:
                if lt == "nvme":
                    v._write_nvme(v._copies[tier])
                    dest = lt
                    break
                if self._make_room(lt, v.nbytes, exclude=v):
                    v._place_memory(lt, v._copies[tier])
                    dest = lt
                    break
        v._remove(tier)
        log.debug("spilled %r (%d bytes) from %s to %s to make room (%s)", v.name, v.nbytes, tier, dest,
                  self._budgets_text())

    def _write_failed(self, t: TieredTensor, ext: Extent, err: BaseException) -> None:
        """The write of `ext`, t's nvme copy, failed (lock held): fall back to what is still valid."""
        if t._copies.get("nvme") is not ext:
            return
        t._remove("nvme")
        if t._memory_copy() is not None:
            return  # rewritten by the next flush
        if t._committed is not None and t._committed is not ext:
            self._nvme.unfree(t._committed)
            t._copies["nvme"] = t._committed
            self._lru["nvme"][t] = None
            t._version += 1
            log.error("tensor %r: writing its new value failed (%s); it is back at its last flushed value",
                      t.name, err)
        else:
            if self._tensors.get(t.name) is t:
                del self._tensors[t.name]
            t._deleted = True
            log.error("tensor %r: writing it failed (%s) and no other copy existed; it was never flushed and "
                      "is gone", t.name, err)

    # -- public API --------------------------------------------------------------------------------------
    def put(self, name: str, value, tier: str | None = None, *, codec=None) -> TieredTensor:
        """Store a copy of `value` (torch tensor on any device, numpy array, DLPack object) under `name`,
        replacing any tensor of that name. tier: 'device', 'host', 'nvme' or None (fastest with room)."""
        if not isinstance(name, str) or not name:
            raise TierstoreValueError(f"name={name!r} must be a non-empty string")
        if tier is not None:
            tier_index(tier)
        if codec is not None and not all(hasattr(codec, a) for a in ("encode", "decode", "get_config")):
            raise TierstoreValueError(f"codec={codec!r} needs encode/decode/get_config (a numcodecs Codec)")
        value = to_dlpack_tensor(value)
        with self._lock:
            self._check_open()
            t = TieredTensor(self, name, value.shape, value.dtype, codec)
            if tier is not None and tier != "nvme" and not self._tier(tier).budget.fits_at_all(t.nbytes):
                raise self._full_error(tier, t)
            placed = None
            for tr in ([tier] if tier is not None else TIERS):
                if tr == "nvme":
                    t._write_nvme(value)
                elif self._make_room(tr, t.nbytes, exclude=t):
                    t._place_memory(tr, value)
                else:
                    continue
                placed = tr
                break
            if placed is None:
                raise self._full_error(tier, t)
            old = self._tensors.get(name)
            if old is not None:
                t._committed = old._committed
                self._discard(old)
            self._tensors[name] = t
            return t

    def _discard(self, t: TieredTensor) -> None:
        for tier in list(t._copies):
            t._remove(tier)
        t._deleted = True

    def tensor(self, name: str) -> TieredTensor:
        """The TieredTensor handle of `name` (KeyError if absent)."""
        with self._lock:
            self._check_open()
            try:
                return self._tensors[name]
            except KeyError:
                raise KeyError(f"no tensor named {name!r} in the store") from None

    __getitem__ = tensor

    def get(self, name: str, device: torch.device | str | None = None, *,
            out: torch.Tensor | None = None) -> torch.Tensor:
        """A copy of tensor `name` as a plain torch.Tensor (see TieredTensor.get; out= reads into your tensor)."""
        return self.tensor(name).get(device, out=out)

    def get_many(self, names: Iterable[str], device: torch.device | str | None = None, *,
                 out=None) -> dict[str, torch.Tensor]:
        """Like get() for many tensors; reads of nvme-only tensors are coalesced into large requests and
        overlapped. out: tensors to read into, a mapping name -> tensor or a sequence in the order of
        `names` (see TieredTensor.get); the result maps each name to its out tensor then."""
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
        result: dict[str, torch.Tensor] = {}
        batch = []
        with self._lock:
            self._check_open()
            for n in names:
                t = self.tensor(n)
                o = outs.get(n)
                if o is not None:
                    t._check_out(o, device)
                ext = t._copies.get("nvme")
                if t._memory_copy() is None and ext is not None and ext.length:
                    t._pins += 1
                    direct = out_bytes(o) if o is not None and t.codec is IDENTITY else None
                    batch.append((t, ext, t._version, o, direct))
        try:
            bufs = [direct if direct is not None else result_empty(ext.length) for _t, ext, _v, _o, direct in batch]
            errors = self._nvme.read_many([(ext, b, f"tensor {t.name!r}")
                                           for (t, ext, _v, _o, _d), b in zip(batch, bufs)])
        finally:
            with self._lock:
                for t, *_rest in batch:
                    t._pins -= 1
        first_error = None
        with self._lock:
            for (t, ext, v, o, direct), buf, err in zip(batch, bufs, errors):
                if err is None and v == t._version and not t._deleted:
                    t._touch()
                    if direct is not None:
                        result[t.name] = o
                        continue
                    val = t._decode(buf)
                    if o is not None:
                        o.copy_(val)
                        val = o
                    result[t.name] = val if device is None or o is not None else val.to(device)
                elif err is not None and not isinstance(err, MisuseError):
                    w = ext.written
                    if w is not None and w.done() and w.exception() is not None:  # its write failed
                        self._write_failed(t, ext, err)
                    first_error = first_error or err
        if first_error is not None:
            raise first_error
        for n in names:
            if n not in result:
                result[n] = self.get(n, device, out=outs.get(n))
        return result

    def __contains__(self, name: object) -> bool:
        with self._lock:
            return name in self._tensors

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._tensors)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        with self._lock:
            return len(self._tensors)

    def delete(self, name: str) -> None:
        """Remove `name`; its space is reused after the next flush (the last flushed manifest still names it)."""
        with self._lock:
            self._check_open()
            t = self._tensors.pop(name, None)
            if t is None:
                raise KeyError(f"no tensor named {name!r} in the store")
            self._discard(t)

    __delitem__ = delete

    def flush(self) -> None:
        """Make every tensor put so far durable (see [Note: crash safety]). On an I/O error (disk full ...)
        it raises, the previous flush stays what a reopen finds, and a later flush() retries."""
        t0 = time.perf_counter()
        with self._flush_lock, profile_range("tierstore::flush"):
            with self._lock:
                self._check_open()
                for t in list(self._tensors.values()):
                    if "nvme" not in t._copies and t._memory_copy() is not None:
                        t._write_nvme(t._memory_copy())
                snapshot = [(t, t._copies["nvme"]) for t in self._tensors.values() if "nvme" in t._copies]
                protected = self._nvme.protect([e for _t, e in snapshot])
            try:
                self._nvme.sync()
                failed = [(t, e, e.written.exception()) for t, e in snapshot
                          if e.written is not None and e.written.exception() is not None]
                if failed:
                    with self._lock:
                        self._nvme.unprotect(protected)
                        protected = []
                        for t, e, err in failed:
                            self._write_failed(t, e, err)
                    t_, e_, err = failed[0]
                    names = ", ".join(repr(t.name) for t, _e, _x in failed[:5])
                    more = f" and {len(failed) - 5} more" if len(failed) > 5 else ""
                    raise TierstoreIOError(
                        getattr(err, "errno", None) or 5,
                        f"flush failed: writing {len(failed)} tensor(s) ({names}{more}) failed: {err}. Nothing "
                        "flushed before is lost; free space (or fix the disk) and call flush() again",
                        getattr(err, "filename", None), getattr(err, "offset", None), getattr(err, "length", None))
                for _t, e in snapshot:
                    e.written = None
                self._write_manifest(snapshot)
            except BaseException:
                with self._lock:
                    self._nvme.unprotect(protected)
                raise
            with self._lock:
                for t, e in snapshot:
                    t._committed = e
                self._nvme.commit_done([e for _t, e in snapshot])
        self._flushes += 1
        self._flush_seconds += time.perf_counter() - t0

    def _write_manifest(self, snapshot: list[tuple[TieredTensor, Extent]]) -> None:
        tensors = {}
        for t, e in snapshot:
            cached = t._manifest_entry
            if cached is None or cached[0] is not e:
                cached = t._manifest_entry = (e, {"shape": list(t.shape), "dtype": dtype_name(t.dtype),
                                                  "nbytes": t.nbytes, "codec": codec_config(t.codec),
                                                  "extent": e.to_json()})
            tensors[t.name] = cached[1]
        body = {
            "generation": self._generation + 1, "ndirs": len(self.paths), "stripe_unit": self._nvme.stripe_unit,
            "extent_files": [f"extents-{k:04d}.bin" for k in range(len(self._nvme.files))],
            "tensors": tensors,
        }
        # Serialised once, by json's C encoder (json.dump to a file takes the pure-Python path): the body in
        # the canonical form its crc32c covers, wrapped as the document (see read_manifest).
        body_text = json.dumps(body, sort_keys=True, separators=(",", ":"))
        text = (f'{{"format":{json.dumps(FORMAT)},"version":{VERSION},'
                f'"crc32c":{crc32c.crc32c(body_text.encode())},"body":{body_text}}}')
        final = os.path.join(self.paths[0], MANIFEST)
        tmp = final + ".tmp"
        with profile_range("tierstore::manifest"):
            try:
                with open(tmp, "w") as f:
                    f.write(text)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, final)
                fsync_dir(self.paths[0])
            except OSError as e:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise TierstoreIOError(e.errno or 5, f"writing the manifest failed: {e.strerror}; the previous "
                                       "flush stands. Free space and call flush() again", tmp) from None
        self._generation += 1

    @property
    def generation(self) -> int:
        """The number of the last completed flush in this store's life on disk (0 before the first): a flush
        that returned normally adds one; Store.open() starts from the one its manifest records."""
        return self._generation

    def stats(self) -> dict:
        """Bytes and seconds moved into ('in') and out of ('out') each tier, budgets, tensor counts."""
        with self._lock:
            out: dict[str, Any] = {}
            for t in TIERS:
                tobj = self._tier(t)
                d = tobj.stats.as_dict()
                d["budget"] = tobj.budget.limit
                d["used"] = tobj.budget.used  # bytes
                d["tensors"] = len(self._lru[t])
                out[t] = d
            out["tensors"] = len(self._tensors)
            out["flushes"] = self._flushes
            out["flush_seconds"] = self._flush_seconds
            out["pool_waits"] = self._pool.waits
            out["backend"] = self._engine.backend
            return out

    # -- zarr ---------------------------------------------------------------------------------------
    def export_zarr(self, path: str | os.PathLike, *, compressor=None, chunk_bytes: int = 64 << 20) -> None:
        """Write every tensor to a zarr v3 group at `path` (one array per tensor, readable by plain zarr).

        compressor: None, a name ('zstd', 'blosc', 'gzip', 'lz4', 'zlib'), a numcodecs codec object (e.g.
        numcodecs.Zstd(level=5)) or a zarr codec. Dtypes numpy lacks (bfloat16, float8) are stored as
        same-width unsigned integers; the array attribute 'torch_dtype' names the real one."""
        import zarr

        compressors = _zarr_compressors(compressor)
        root = zarr.open_group(os.fspath(path), mode="w", zarr_format=3)
        root.attrs["tierstore"] = {"version": VERSION}
        used: set[str] = set()
        for i, name in enumerate(sorted(self.keys())):
            value = self.get(name, "cpu").contiguous()
            arr = to_numpy(value)
            key = name if _zarr_name_ok(name) and name not in used else f"tensor_{i}"
            used.add(key)
            a = root.create_array(key, shape=arr.shape, dtype=arr.dtype, chunks=_chunks(arr.shape, arr.itemsize,
                                  chunk_bytes), compressors=compressors, fill_value=0,
                                  attributes={"tierstore_name": name, "torch_dtype": dtype_name(value.dtype)})
            if arr.size:
                a[...] = arr

    @classmethod
    def import_zarr(cls, path: str | os.PathLike, paths, *, tier: str | None = None, **kwargs) -> "Store":
        """A new Store at `paths` holding every array of the zarr group at `path` (flushed)."""
        import zarr

        root = zarr.open_group(os.fspath(path), mode="r")
        store = cls(paths, **kwargs)
        try:
            for key, arr in _all_arrays(root):
                data = arr[...]
                name = arr.attrs.get("tierstore_name", key)
                tdt = arr.attrs.get("torch_dtype")
                t = torch.from_numpy(data.copy()) if data.ndim else torch.tensor(data[()])
                if tdt is not None and dtype_from_name(tdt) != t.dtype:
                    t = t.view(dtype_from_name(tdt))
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
            if flush:
                self.flush()
        finally:
            with self._lock:
                self._closed = True
            self._teardown()

    def _teardown(self) -> None:
        for step in ("_executor", "_nvme", "_engine", "_pool"):
            obj = self.__dict__.pop(step, None)
            if obj is None:
                continue
            try:
                obj.shutdown(wait=True) if step == "_executor" else obj.close()
            except Exception:
                log.exception("closing %s failed", step)
        self._closed = True
        if getattr(self, "_lockfd", None) is not None:
            os.close(self._lockfd)  # releases the flock
            self._lockfd = None

    def __enter__(self) -> "Store":
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


_NAME_RE = re.compile(r"[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)*")


def _zarr_name_ok(name: str) -> bool:
    return bool(_NAME_RE.fullmatch(name)) and not any(s in (".", "..") or s.startswith("__")
                                                       for s in name.split("/"))


def _chunks(shape: tuple, itemsize: int, chunk_bytes: int) -> tuple:
    if not shape:
        return ()
    chunks = [max(1, s) for s in shape]
    row = itemsize
    for s in chunks[1:]:
        row *= s
    chunks[0] = max(1, min(chunks[0], chunk_bytes // max(1, row)))
    return tuple(chunks)


def _zarr_compressors(compressor):
    if compressor is None:
        return None
    from zarr.codecs import numcodecs as zn

    names = {"zstd": zn.Zstd, "blosc": zn.Blosc, "gzip": zn.GZip, "lz4": zn.LZ4, "zlib": zn.Zlib, "bz2": zn.BZ2,
             "lzma": zn.LZMA}
    if isinstance(compressor, str):
        if compressor not in names:
            raise TierstoreValueError(f"compressor={compressor!r}; choose one of {sorted(names)} or pass a codec")
        return [names[compressor]()]
    if hasattr(compressor, "get_config") and not hasattr(compressor, "to_dict"):  # a numcodecs (v2) codec
        cfg = dict(compressor.get_config())
        cid = cfg.pop("id")
        if cid not in names:
            raise TierstoreValueError(f"numcodecs codec {cid!r} is not a compressor zarr v3 can wrap here; use "
                                      f"one of {sorted(names)}")
        return [names[cid](**cfg)]
    return [compressor]


def _all_arrays(group, prefix: str = ""):
    for key, member in group.members():
        full = f"{prefix}{key}"
        if hasattr(member, "shape"):
            yield full, member
        else:
            yield from _all_arrays(member, full + "/")
