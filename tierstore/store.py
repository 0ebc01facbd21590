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

[Note: when a flush fails]
Before the manifest rename nothing the previous flush named was touched (copy-on-write), so a failed flush
leaves the previous flush standing; what the error must say is what became of the values put since.
A value whose space could not be reserved (a full disk, see [Note: space is reserved when it is
allocated] in tiers/nvme.py) still has its memory copy: a later flush() stores it. A value whose only copy
was a write that failed (an EIO) is gone: its tensor is back at its last flushed value, or removed if never
flushed, and the error names it without advising a retry. After the rename, a failed directory fsync
leaves it unknown which manifest a crash would leave: both are kept intact -- the new extents stay
protected and the previous ones pending free -- until a later flush succeeds.

[Note: the manifest is untrusted input]
The crc32c catches damage, not a manifest someone wrote on purpose (they compute it too). So `Store.open`
checks every field before it creates, allocates or reads anything: types and ranges, shape x dtype itemsize
== nbytes (== the extent's length for raw bytes), a known dtype, a codec that decodes to numbers (numcodecs'
pickle and object codecs are refused: decoding them would unpickle or build Python objects), 4 KiB-aligned
extents of align_up(length) bytes inside extent files that exist in every directory, no two extents
overlapping, and ndirs / stripe_unit as opened. A malformed manifest is a CorruptionError naming the file
and the field. An extent reaching past the end of its (truncated) file damages that tensor only: reading
it is a CorruptionError naming it, raised before any memory is allocated for it. The version is also written inside the checksummed body
(manifests from before that keep it outside only, and still open).

[Note: budgets and spill]
`put(tier=None)` places a tensor on the fastest tier whose budget can hold it at all, making room by
spilling that tier's least recently used tensors one tier down (a tensor that already has a copy lower
down is simply dropped). Tensors inside `resident()` blocks or being moved are never spilled. Only when no
tier can take it is TierFullError raised, naming every budget.

[Note: locking]
One re-entrant lock guards the tensors' metadata, budgets and moves between memory tiers, and writes to the
nvme tier (a memcpy into a staging buffer for small tensors). Reads from the nvme tier run without it, so
a prefetch on a worker thread does not stall other threads; a read returns the value the tensor had when
it began (the extent it reads is not reused until it ends), and a read whose extent was already freed
when it began is retried on the current one. flush() holds the lock while it snapshots the tensors and marks their extents as named by a
manifest, then releases it for the waiting and fsyncs.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import math
import os
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterable, Iterator

import crc32c
import torch

from .errors import (CorruptionError, MisuseError, TierFullError, TierstoreIOError, TierstoreValueError, advice,
                     io_error, prefixed)
from .io import BufferPool, Engine
from .tensor import (IDENTITY, TieredTensor, codec_config, codec_from_config, dtype_from_name, dtype_name,
                     out_bytes, to_numpy)
from .tiers import TIERS, DeviceTier, Extent, HostTier, NvmeTier, profile_range, tier_index
from .tiers.nvme import EXTENT_FILE
from .tiers.device import to_dlpack_tensor
from .tiers.host import result_empty
from .io.files import fsync_dir
from .io.pool import physical_memory

log = logging.getLogger("tierstore.store")

MANIFEST = "manifest.json"
LOCKFILE = "tierstore.lock"
FORMAT = "tierstore-manifest"
VERSION = 1
STORED_DTYPES: dict[str, torch.dtype] = {  # dtypes a manifest (and a checkpoint record) may name
    n: getattr(torch, n) for n in (
        "float64", "float32", "float16", "bfloat16", "complex64", "complex128", "int64", "int32", "int16", "int8",
        "uint8", "uint16", "uint32", "uint64", "bool", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
        "float8_e5m2fnuz") if isinstance(getattr(torch, n, None), torch.dtype)}
OBJECT_CODECS = ("pickle", "json2", "msgpack2", "vlen-utf8", "vlen-bytes", "vlen-array")  # numcodecs ids


def _manifest_crc(body: dict) -> int:
    return crc32c.crc32c(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def _corrupt(path: str, field: str, what: str) -> CorruptionError:
    return CorruptionError(f"the manifest {path}: field {field}: {what}; it is damaged or was not written by "
                           "tierstore: restore it from a backup", path)


def read_manifest(directory: str) -> dict | None:
    """The manifest body in `directory`, None when there is none. CorruptionError when unreadable; the fields
    are checked by Store._load ([Note: the manifest is untrusted input])."""
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise CorruptionError(f"the manifest {path} is not valid ({e}); restore it from a backup", path) from None
    body = doc.get("body") if isinstance(doc, dict) else None
    if not isinstance(body, dict) or doc.get("format") != FORMAT:
        raise CorruptionError(f"the manifest {path} is not a {FORMAT!r} document (or its body is not a dict); "
                              "restore it from a backup", path)
    if type(doc.get("crc32c")) is not int or _manifest_crc(body) != doc["crc32c"]:
        raise CorruptionError(f"the manifest {path} fails its checksum; restore it from a backup", path)
    version = doc.get("version")
    if "version" in body and body["version"] != version:  # written under the checksum since it was added
        raise _corrupt(path, "version", f"{version!r} outside the checksummed body, {body['version']!r} inside")
    if type(version) is not int or version < 1:
        raise _corrupt(path, "version", f"{version!r} is not a version")
    if version > VERSION:
        raise TierstoreValueError(f"{path} has format version {version}; this tierstore reads "
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
                 workers: int = 2, lock_memory: bool = True, _must_exist: bool = False, _read_only: bool = False,
                 _fresh: bool = False):
        self._closed = True  # until fully open
        self._read_only = _read_only
        self._lockfds: list[int] = []
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        self.paths = [os.path.abspath(os.fspath(p)) for p in paths]
        if not self.paths:
            raise TierstoreValueError("paths is empty: give at least one directory for the nvme tier")
        if len({os.path.realpath(p) for p in self.paths}) != len(self.paths):
            raise TierstoreValueError(f"paths={self.paths} names a directory twice")
        _check_sizes(host_budget=host_budget, device_budget=device_budget, nvme_budget=nvme_budget,
                     pinned_budget=pinned_budget, buffer_bytes=buffer_bytes, queue_depth=queue_depth,
                     extent_file_bytes=extent_file_bytes, stripe_unit=stripe_unit, workers=workers)
        for i, p in enumerate(self.paths):
            if os.path.exists(p) and not os.path.isdir(p):
                raise TierstoreValueError(f"paths[{i}]={p!r} is a file, not a directory: give a directory (it is "
                                          "created if missing) for the extent files")
        if _must_exist and not os.path.exists(os.path.join(self.paths[0], MANIFEST)):
            raise TierstoreValueError(f"no tierstore in {self.paths[0]} (no {MANIFEST}); create one with "
                                      "Store(paths) and flush() it")
        if not _read_only:
            for p in self.paths:
                _make_dir(p)
        self._lockfds = _lock_dirs(self.paths, shared=_read_only)
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
                                  extent_file_bytes=extent_file_bytes, stripe_unit=stripe_unit,
                                  read_only=_read_only)
            self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tierstore-move")
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
                    if os.path.exists(leftover):
                        os.unlink(leftover)
            self._load(read_manifest(self.paths[0]))
        except BaseException:
            self._teardown()
            raise

    @classmethod
    def open(cls, paths, *, mode: str = "w", **kwargs) -> "Store":
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
        ([Note: the manifest is untrusted input])."""
        if body is None:
            return
        where = os.path.join(self.paths[0], MANIFEST)
        for f in ("generation", "ndirs", "stripe_unit"):
            if type(body.get(f)) is not int or body[f] < (0 if f == "generation" else 1):
                raise _corrupt(where, f, f"{body.get(f)!r} is not a positive integer")
        if body["ndirs"] != len(self.paths) or body["stripe_unit"] != self._nvme.stripe_unit:
            raise TierstoreValueError(
                f"{where} describes a store striped over {body['ndirs']} directories with stripe_unit="
                f"{body['stripe_unit']}; open it with the same directories in the same order and that stripe_unit")
        files = body.get("extent_files")
        if not isinstance(files, list) or files != [EXTENT_FILE.format(k) for k in range(len(files))]:
            raise _corrupt(where, "extent_files", "not the list extents-0000.bin, extents-0001.bin ...")
        tensors = body.get("tensors")
        if not isinstance(tensors, dict):
            raise _corrupt(where, "tensors", "not a map of names to tensors")
        parsed = []
        for name, d in tensors.items():
            field = f"tensors[{name!r}]"
            if not name or not isinstance(d, dict):
                raise _corrupt(where, field, "not a named tensor")
            shape, dt = d.get("shape"), STORED_DTYPES.get(str(d.get("dtype")))
            if not isinstance(shape, list) or len(shape) > 64 or not all(type(n) is int and 0 <= n < 1 << 62
                                                                         for n in shape):
                raise _corrupt(where, f"{field}.shape", f"{str(shape)[:80]} is not a shape")
            if dt is None:
                raise _corrupt(where, f"{field}.dtype", f"{str(d.get('dtype'))[:40]!r} is not a dtype the store holds")
            nbytes = math.prod(shape) * dt.itemsize  # bytes
            if d.get("nbytes") != nbytes or type(d["nbytes"]) is not int:
                raise _corrupt(where, f"{field}.nbytes", f"{d.get('nbytes')!r} is not {shape} x {dt.itemsize} bytes")
            codec = self._manifest_codec(d.get("codec"), where, f"{field}.codec")
            ext = Extent.from_json(d.get("extent"), where, f"{field}.extent")
            if codec is IDENTITY and ext.length != nbytes:
                raise _corrupt(where, f"{field}.extent.length", f"{ext.length} bytes hold {nbytes} raw bytes")
            parsed.append((name, shape, dt, codec, ext))
        self._nvme.check_extents([(f"tensors[{n!r}].extent", e) for n, *_r, e in parsed], where)
        self._generation = body["generation"]
        for name, shape, dt, codec, ext in parsed:
            t = TieredTensor(self, name, shape, dt, codec)
            t._copies["nvme"] = ext
            t._committed = ext
            self._lru["nvme"][t] = None
            self._tensors[name] = t
        self._nvme.adopt([e for *_r, e in parsed])

    @staticmethod
    def _manifest_codec(config, where: str, field: str):
        """The codec a manifest entry names; codecs that decode to Python objects (numcodecs' pickle codec
        unpickles) are refused."""
        if config is None:
            return IDENTITY
        if not isinstance(config, dict) or not isinstance(config.get("id"), str):
            raise _corrupt(where, field, f"{str(config)[:80]} is not a codec configuration")
        if config["id"] in OBJECT_CODECS:
            raise _corrupt(where, field, f"codec {config['id']!r} decodes to Python objects (or unpickles); a "
                           "store never uses it")
        try:
            return codec_from_config(config)
        except (ValueError, TypeError, KeyError) as e:
            if "not available" in str(e) or "codec not" in str(e):
                raise TierstoreValueError(f"{where}: {field} names codec {config['id']!r}, which is not "
                                          f"registered: import the package that provides it first") from None
            raise _corrupt(where, field, f"{type(e).__name__}: {e}") from None

    # -- helpers used by TieredTensor -----------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise MisuseError("the store is closed; open it again with tierstore.Store.open(paths)")

    def _check_writable(self, what: str) -> None:
        self._check_open()
        if self._read_only:
            raise MisuseError(f"{what}: the store at {self.paths[0]} was opened read-only (Store.open(paths, "
                              "mode='r')) and changes nothing; open it with mode='w' to change it")

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

    def _write_failed(self, t: TieredTensor, ext: Extent, err: BaseException) -> str:
        """The write of `ext`, t's nvme copy, failed (lock held): fall back to what is still valid. Returns what
        became of t's value: 'replaced' (a newer value took its place meanwhile), 'kept' (a memory copy holds
        it; the next flush writes it again), 'reverted' (it existed only in the failed write: t is back at its
        last flushed value) or 'removed' (it existed only there and t was never flushed: t is gone)."""
        if t._copies.get("nvme") is not ext:
            return "replaced"
        t._remove("nvme")
        if t._memory_copy() is not None:
            return "kept"
        committed = t._committed
        if committed is not None and committed is not ext:
            self._nvme.unfree(committed)
            if t._committed_meta is not None:  # the flushed bytes are of another shape/dtype/codec: restore
                shape, dtype, codec = t._committed_meta  # the tensor they belong to, not t's metadata over them
                t._deleted = True
                t = self._tensors[t.name] = TieredTensor(self, t.name, shape, dtype, codec)
                t._committed = committed
            t._copies["nvme"] = committed
            self._lru["nvme"][t] = None
            t._version += 1
            log.error("tensor %r: writing its new value failed (%s); it is back at its last flushed value",
                      t.name, err)
            return "reverted"
        if self._tensors.get(t.name) is t:
            del self._tensors[t.name]
        t._deleted = True
        log.error("tensor %r: writing it failed (%s) and no other copy existed; it was never flushed and "
                  "is gone", t.name, err)
        return "removed"

    def _flush_error(self, fates: list[tuple[TieredTensor, str, BaseException]]) -> TierstoreIOError:
        """The error of a flush whose writes failed: names the tensors whose new value was lost and those a
        later flush stores (see [Note: when a flush fails])."""
        err = fates[0][2]
        code = getattr(err, "errno", None) or errno.EIO
        lost = [(t, f) for t, f, _e in fates if f in ("reverted", "removed")]
        kept = [t for t, f, _e in fates if f == "kept"]

        def names(ts) -> str:
            text = ", ".join(repr(t.name) for t in ts[:8])
            return text + (f" and {len(ts) - 8} more" if len(ts) > 8 else "")
        parts = [f"flush failed: {len(fates)} tensor(s) could not be written ({os.strerror(code)})",
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
        cause = advice(code)
        if kept:
            parts.append(f"Still held in memory, stored by the next flush() that succeeds: {names(kept)}"
                         f"{'; ' + cause + ', then' if cause else ';'} call flush() again")
        elif cause:
            parts.append(cause[0].upper() + cause[1:])
        msg = ". ".join(parts)
        return TierstoreIOError(code, msg, getattr(err, "filename", None), getattr(err, "offset", None),
                                getattr(err, "length", None))

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
        self._check_writable(f"put({name!r})")
        value = to_dlpack_tensor(value)
        self._check_copy_fits(name, value, tier, codec)
        with self._lock:
            self._check_open()
            t = TieredTensor(self, name, value.shape, value.dtype, codec)
            if tier is not None and tier != "nvme" and not self._tier(tier).budget.fits_at_all(t.nbytes):
                raise self._full_error(tier, t)
            placed = None
            try:
                for tr in ([tier] if tier is not None else TIERS):
                    if tr == "nvme":
                        t._write_nvme(value)
                    elif self._make_room(tr, t.nbytes, exclude=t):
                        t._place_memory(tr, value)
                    else:
                        continue
                    placed = tr
                    break
            except TierstoreIOError as e:  # no room reserved on disk (for it or a tensor spilled for it)
                self._discard(t)
                raise prefixed(e, f"put({name!r}) did not store the value (the store keeps what it held under "
                                  "that name, if anything)") from None
            if placed is None:
                raise self._full_error(tier, t)
            old = self._tensors.get(name)
            if old is not None:
                t._committed = old._committed
                if old._committed is not None:
                    meta = old._committed_meta or (old.shape, old.dtype, old.codec)
                    if (meta[0], meta[1], codec_config(meta[2])) != (t.shape, t.dtype, codec_config(t.codec)):
                        t._committed_meta = meta
                self._discard(old)
            self._tensors[name] = t
            return t

    def _check_copy_fits(self, name: str, value: torch.Tensor, tier: str | None, codec) -> None:
        """Refuse, before any allocation, a put whose copy of `value` can never exist in host memory.

        Every placement but two makes one contiguous host copy of all the tensor's bytes: the host tier's
        copy, or the staging copy the nvme tier encodes and writes from. The exceptions are a device-tier
        copy on a real accelerator, and a contiguous CPU tensor written as it is (identity codec) to nvme.
        An expanded view (`torch.zeros(1).expand(2**40)`) holds 4 bytes and names 4 TiB."""
        nbytes = value.numel() * value.element_size()  # bytes, decoded
        if tier == "nvme" and value.device.type == "cpu" and value.is_contiguous() and codec in (None, IDENTITY):
            return
        if tier in (None, "device") and self._device.device.type != "cpu" and \
                self._device.budget.fits_at_all(nbytes):
            return
        memory = physical_memory()
        if memory is not None and nbytes > memory:
            raise TierFullError(
                f"put({name!r}): the tensor ({tuple(value.shape)} {value.dtype}) needs a contiguous copy of "
                f"{nbytes} bytes in host memory, more than this machine has ({memory} bytes); it is "
                f"{'an expanded or strided view' if not value.is_contiguous() else 'too large'}. Store it in "
                "pieces under several names, or store what it was made from (e.g. the tensor before expand())")

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
        """A copy of tensor `name` as a plain torch.Tensor (see TieredTensor.get; out= reads into your tensor).

        [Note: a read by name sees the old or the new value]
        A put() of the same name while the read runs replaces the handle the read started from, which then
        refuses (a replaced handle is stale: MisuseError). A read by name is not bound to that handle: it
        reads the tensor that has the name now, so it returns the old or the new value, never an error
        (KeyError when the name was deleted meanwhile)."""
        while True:
            t = self.tensor(name)
            try:
                return t.get(device, out=out)
            except MisuseError:
                with self._lock:
                    if self._closed or not t._deleted:
                        raise

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
                    self._nvme.check_readable(ext, f"tensor {t.name!r}")
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
            self._check_open()
            return name in self._tensors

    def keys(self) -> list[str]:
        with self._lock:
            self._check_open()
            return list(self._tensors)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        with self._lock:
            self._check_open()
            return len(self._tensors)

    def delete(self, name: str) -> None:
        """Remove `name`; its space is reused after the next flush (the last flushed manifest still names it)."""
        with self._lock:
            self._check_writable(f"delete({name!r})")
            t = self._tensors.pop(name, None)
            if t is None:
                raise KeyError(f"no tensor named {name!r} in the store")
            self._discard(t)

    __delitem__ = delete

    def flush(self) -> None:
        """Make every tensor put so far durable (see [Note: crash safety]). On an I/O error it raises a
        TierstoreIOError saying which new values were lost and which a later flush() stores, and what to do
        for that errno (see [Note: when a flush fails])."""
        self._check_writable("flush()")
        t0 = time.perf_counter()
        with self._flush_lock, profile_range("tierstore::flush"):
            with self._lock:
                self._check_open()
                fates: list[tuple[TieredTensor, str, BaseException]] = []
                for t in list(self._tensors.values()):
                    if "nvme" not in t._copies and t._memory_copy() is not None:
                        try:
                            t._write_nvme(t._memory_copy())
                        except TierstoreIOError as e:  # no room reserved: the memory copy still holds it
                            fates.append((t, "kept", e))
                snapshot = [(t, t._copies["nvme"]) for t in self._tensors.values() if "nvme" in t._copies]
                protected = self._nvme.protect([e for _t, e in snapshot])
            renamed = False
            try:
                self._nvme.sync()
                failed = [(t, e, e.written.exception()) for t, e in snapshot
                          if e.written is not None and e.written.exception() is not None]
                if failed or fates:
                    with self._lock:
                        self._nvme.unprotect(protected)
                        protected = []
                        fates += [(t, self._write_failed(t, e, err), err) for t, e, err in failed]
                    raise self._flush_error(fates)
                for _t, e in snapshot:
                    e.written = None
                self._write_manifest(snapshot)
                renamed = True
                with self._lock:
                    for t, e in snapshot:
                        t._committed = e
                        t._committed_meta = None
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
                    with self._lock:
                        self._nvme.unprotect(protected)
                raise
            with self._lock:
                self._nvme.commit_done([e for _t, e in snapshot])
        self._flushes += 1
        self._flush_seconds += time.perf_counter() - t0

    def _write_manifest(self, snapshot: list[tuple[TieredTensor, Extent]]) -> None:
        """Write the manifest naming `snapshot` to a temporary file, fsync it and rename it over the last one
        (the directory fsync that makes the rename durable is the caller's). Raises with nothing renamed."""
        tensors = {}
        for t, e in snapshot:
            cached = t._manifest_entry
            if cached is None or cached[0] is not e:
                cached = t._manifest_entry = (e, {"shape": list(t.shape), "dtype": dtype_name(t.dtype),
                                                  "nbytes": t.nbytes, "codec": codec_config(t.codec),
                                                  "extent": e.to_json()})
            tensors[t.name] = cached[1]
        body = {
            "version": VERSION,  # under the checksum (manifests before it have the version outside only)
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
            except OSError as e:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise io_error(e.errno or errno.EIO, "flush: writing the manifest", tmp, None, None,
                               "nothing was renamed, the previous flush stands and every unflushed value is still "
                               "held: once that is fixed, call flush() again") from None
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

        self._check_open()
        if self._read_only:
            target = os.path.realpath(os.fspath(path))
            for d in self.paths:
                if os.path.commonpath([target, os.path.realpath(d)]) == os.path.realpath(d):
                    self._check_writable(f"export_zarr({os.fspath(path)!r}) into the store's directory {d}")
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
            if flush and not self._read_only:
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
        fds, self._lockfds = getattr(self, "_lockfds", []), []
        for fd in fds:
            os.close(fd)  # releases its flock

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


# -- opening: arguments, directories, locks ---------------------------------------------------------------
def _check_sizes(**sizes) -> None:
    """Every budget/size argument is an int (budgets may be None), none negative, the counts positive."""
    may_be_none = {"host_budget", "device_budget", "nvme_budget"}
    positive = {"pinned_budget", "buffer_bytes", "queue_depth", "extent_file_bytes", "stripe_unit", "workers"}
    for name, v in sizes.items():
        if v is None and name in may_be_none:
            continue
        count = name in ("queue_depth", "workers")
        unit = "" if count else " bytes"
        if isinstance(v, bool) or not isinstance(v, int):
            what = "an int" if count else "an int number of bytes (e.g. 1 << 30 for 1 GiB)"
            none = " or None (no limit)" if name in may_be_none else ""
            raise TierstoreValueError(f"{name}={v!r} must be {what}{none}, not a {type(v).__name__}")
        if v < 0 or (v == 0 and name in positive):
            raise TierstoreValueError(f"{name}={v} must be {'>= 1' if name in positive else '>= 0'}{unit}")


def _make_dir(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        hint = {errno.EROFS: "the filesystem is read-only: open an existing store there with "
                             "Store.open(paths, mode='r')",
                errno.EACCES: "give a directory this user can write to",
                errno.EPERM: "give a directory this user can write to",
                errno.ENOSPC: "the disk is full: free space or use another disk"}.get(e.errno, "check the path")
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
            try:
                fd = os.open(where, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as e:
                if not shared:
                    raise TierstoreIOError(e.errno or errno.EIO, f"cannot create the lock file {where}: "
                                           f"{e.strerror}; a read-only store can be opened with "
                                           "Store.open(paths, mode='r')", where) from None
                try:  # read-only media: lock the lock file if there is one, else nobody can write here either
                    fd = os.open(where, os.O_RDONLY | os.O_CLOEXEC)
                except FileNotFoundError:
                    continue
                except OSError as e2:
                    raise TierstoreIOError(e2.errno or errno.EIO, f"cannot open the lock file {where}: "
                                           f"{e2.strerror}", where) from None
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
