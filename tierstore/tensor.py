"""TieredTensor: one named tensor, the tiers holding a valid copy of it, and moves between them.

A TieredTensor belongs to a Store (store.py), which owns the tiers, the lock, the worker threads that run
asynchronous moves, and the least-recently-used order used to spill. Memory tiers (device, host) hold the
tensor decoded, in its own shape and dtype; the nvme tier holds its *encoded* bytes (see Codecs).

[Note: codecs]
A codec says how a tensor is encoded at rest. Identity (raw bytes) is the default and has a fast path.
Any numcodecs-style object works: `encode(ndarray) -> bytes-like`, `decode(bytes) -> ndarray-like`,
`get_config() -> dict` with an "id", rebuilt by `numcodecs.get_codec(config)` (so a quantized codec
registered with numcodecs is stored in the manifest and found again on reopen). Dtypes numpy lacks
(bfloat16, float8) are handed to codecs as same-width unsigned integers.

[Note: copies and versions]
`_copies` maps tier -> copy (a torch.Tensor on device/host, an Extent on nvme); every copy in it holds the
current value. `update()` and write-back bump `_version`, so a read that ran without the store's lock
(nvme reads do, to let other threads work) can tell that its result went stale and retry.
"""
from __future__ import annotations

import ctypes
import logging
from concurrent.futures import Future
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np
import torch

from .errors import CorruptionError, MisuseError, TierstoreIOError, TierstoreValueError, prefixed
from .tiers import TIERS, Extent, profile_range, tier_index
from .tiers.host import result_empty

if TYPE_CHECKING:
    from .store import Store

log = logging.getLogger("tierstore.store")

_NUMPY_SAME_WIDTH = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class IdentityCodec:
    """Raw bytes: what is stored is the tensor's memory."""

    codec_id = "identity"

    def get_config(self) -> dict:
        return {"id": "identity"}

    def encode(self, buf):
        return buf

    def decode(self, buf, out=None):
        return buf

    def __repr__(self) -> str:
        return "IdentityCodec()"


IDENTITY = IdentityCodec()


def codec_from_config(config: dict | None):
    if not config or config.get("id") == "identity":
        return IDENTITY
    import numcodecs

    return numcodecs.get_codec(dict(config))


def codec_config(codec) -> dict | None:
    return None if codec is None or codec is IDENTITY else codec.get_config()


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise TierstoreValueError(f"unknown dtype {name!r} in the manifest (written by a newer torch?)")
    return dt


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a contiguous CPU tensor; dtypes numpy lacks become same-width unsigned ints."""
    try:
        return t.numpy()
    except TypeError:
        return t.view(torch.uint8).numpy().view(_NUMPY_SAME_WIDTH[t.element_size()]).reshape(tuple(t.shape))


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 view (no copy)."""
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def out_bytes(out: torch.Tensor) -> torch.Tensor | None:
    """The bytes of `out` as a flat uint8 view when the nvme tier can read straight into it (contiguous, CPU)."""
    if out.device.type == "cpu" and out.is_contiguous():
        return as_bytes(out)
    return None


def copy_host(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[:] = src for contiguous uint8 CPU tensors of one size, as a memmove (no torch thread pool)."""
    if src.numel():
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel())


def _nbytes(shape, dtype: torch.dtype) -> int:
    n = dtype.itemsize  # bytes per element
    for s in shape:
        n *= s
    return n


class TieredTensor:
    """A named tensor held by a Store on one or more tiers. Get handles with `store.tensor(name)`."""

    def __init__(self, store: "Store", name: str, shape, dtype: torch.dtype, codec=None):
        self._store = store
        self.name = name
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.nbytes = _nbytes(self.shape, dtype)  # bytes, decoded
        self.codec = codec if codec is not None else IDENTITY
        self._copies: dict[str, Any] = {}
        self._committed: Extent | None = None  # the version the last durable manifest names
        # shape, dtype and codec of the bytes at _committed when they are not this handle's own (a put() that
        # replaced a flushed tensor of another shape, dtype or codec): a revert to them restores those too
        self._committed_meta: tuple | None = None
        self._pins = 0  # resident() blocks and moves in progress: not evictable while > 0
        self._version = 0
        self._deleted = False
        self._manifest_entry: tuple[Extent, dict] | None = None  # (extent, its manifest entry), reused by flush()

    # -- state --------------------------------------------------------------------------------------
    @property
    def tiers(self) -> frozenset[str]:
        """The tiers holding a valid copy."""
        with self._store._lock:
            return frozenset(self._copies)

    @property
    def dirty(self) -> bool:
        """True when the current value is not yet durable (flush() has work to do for it)."""
        with self._store._lock:
            ext = self._copies.get("nvme")
            return ext is None or ext is not self._committed

    @property
    def encoded_nbytes(self) -> int | None:
        """Bytes the nvme copy occupies (None without one)."""
        with self._store._lock:
            ext = self._copies.get("nvme")
            return None if ext is None else ext.length

    def _check(self) -> None:
        if self._deleted:
            raise MisuseError(f"tensor {self.name!r} was deleted from (or replaced in) the store; get the "
                              f"current one with store.tensor({self.name!r}) or put it again")
        self._store._check_open()

    def _fastest(self) -> str:
        for t in TIERS:
            if t in self._copies:
                return t
        raise MisuseError(f"tensor {self.name!r} has no copy on any tier (it was lost after a failed write)")

    def __repr__(self) -> str:
        return (f"TieredTensor({self.name!r}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"tiers={sorted(self._copies, key=tier_index)}, dirty={self.dirty})")

    # -- encoding ------------------------------------------------------------------------------------
    def _encode(self, cpu: torch.Tensor) -> torch.Tensor:
        """Contiguous CPU tensor -> contiguous CPU tensor whose bytes go to the nvme tier.

        [Note: a zero-size tensor has no encoding]
        It is stored as zero bytes whatever its codec, and decoded without the codec: numcodecs' Zstd and
        Blosc cannot decode what they encode for an empty array, and Zlib decodes it to a 1-byte array.
        Shape and dtype come from the manifest, so nothing is lost."""
        if self.codec is IDENTITY or self.nbytes == 0:
            return cpu  # its memory as it is (the nvme tier takes bytes: no uint8 view needed)
        enc = self.codec.encode(to_numpy(cpu))
        arr = np.frombuffer(memoryview(enc).cast("B"), dtype=np.uint8)
        return torch.from_numpy(arr.copy())

    def _decode(self, data: torch.Tensor) -> torch.Tensor:
        """uint8 tensor read from nvme -> CPU tensor of self.shape/dtype."""
        if self.nbytes == 0:  # [Note: a zero-size tensor has no encoding]
            return torch.empty(self.shape, dtype=self.dtype)
        if self.codec is IDENTITY:
            return data.view(self.dtype).view(self.shape)
        try:  # the bytes passed their crc32c: a codec that cannot decode them is not the one that wrote them
            dec = self.codec.decode(data.numpy().tobytes())
            raw = np.ascontiguousarray(np.asarray(dec)).reshape(-1).view(np.uint8)
        except Exception as e:
            raise CorruptionError(f"codec {self.codec!r} cannot decode the stored bytes of {self.name!r} "
                                  f"({type(e).__name__}: {e}); the manifest names another codec than the one "
                                  "that wrote them: restore it from a backup") from None
        if raw.nbytes != self.nbytes:
            raise TierstoreValueError(f"codec {self.codec!r} decoded {raw.nbytes} bytes for {self.name!r}; "
                                      f"expected {self.nbytes}")
        out = self._store._host.empty(tuple(self.shape), self.dtype)
        as_bytes(out).copy_(torch.from_numpy(raw.copy()))
        return out

    # -- internal moves (store lock held) ---------------------------------------------------------------
    def _write_nvme(self, src: torch.Tensor) -> None:
        """Write `src` (current value, any tier) as the nvme copy. When no space can be reserved for it
        (TierstoreIOError, nothing written) an nvme copy that a memory copy has overtaken is dropped -- the
        memory copy holds the value, the next flush writes it -- and the error is raised."""
        cpu = src if src.device.type == "cpu" else self._store._device.copy_out(src, self._store._host.empty(
            tuple(src.shape), src.dtype))
        try:
            ext = self._store._nvme.write(self._encode(cpu.contiguous()), f"tensor {self.name!r}")
        except TierstoreIOError:
            if "nvme" in self._copies and self._memory_copy() is not None:
                self._remove("nvme")  # stale: resident(writeback=True) changed the memory copy in place
            raise
        self._install("nvme", ext)

    def _install(self, tier: str, copy) -> None:
        old = self._copies.get(tier)
        if old is not None and old is not copy:
            self._free_copy(tier, old)
        self._copies[tier] = copy
        self._store._lru[tier][self] = None
        self._store._lru[tier].move_to_end(self)

    def _free_copy(self, tier: str, copy) -> None:
        if tier == "nvme":
            self._store._nvme.free(copy)
        else:
            self._store._tier(tier).budget.give(self.nbytes)

    def _remove(self, tier: str) -> None:
        copy = self._copies.pop(tier)
        self._store._lru[tier].pop(self, None)
        self._free_copy(tier, copy)

    def _memory_copy(self) -> torch.Tensor | None:
        for t in ("device", "host"):
            if t in self._copies:
                return self._copies[t]
        return None

    def _place_memory(self, tier: str, value: torch.Tensor) -> None:
        """Install a copy of `value` on memory tier `tier`; room must have been made."""
        tobj = self._store._tier(tier)
        copy = tobj.copy_in(value)
        tobj.budget.take(self.nbytes)
        self._install(tier, copy)

    def _touch(self) -> None:
        for t in self._copies:
            lru = self._store._lru[t]
            if self in lru:
                lru.move_to_end(self)

    # -- reading ---------------------------------------------------------------------------------------
    def _read_value(self, into: torch.Tensor | None = None) -> tuple[torch.Tensor, bool]:
        """The current value as a tensor (a memory copy, or a fresh CPU tensor read from nvme) and whether it is
        fresh (ours to keep). Runs nvme reads without the store lock; retries only when the extent was freed
        before the read could begin (replaced or updated meanwhile).
        `into`: contiguous uint8 CPU memory of nbytes to read an identity-coded nvme copy into (get(out=))."""
        store = self._store
        while True:
            with store._lock:
                self._check()
                mem = self._memory_copy()
                if mem is not None:
                    self._touch()
                    return mem, False
                ext = self._copies.get("nvme")
                if ext is None:
                    self._fastest()  # raises: lost
                version = self._version
                self._pins += 1
            try:
                store._nvme.check_readable(ext, f"tensor {self.name!r}")
                # the caller's result (or out=), not a host-tier copy
                data = into if into is not None and ext.length == self.nbytes else result_empty(ext.length)
                try:
                    store._nvme.read(ext, data, f"tensor {self.name!r}")
                except MisuseError:
                    with store._lock:
                        if self._version != version or self._deleted:
                            continue  # replaced while we read: try again
                    raise
                except Exception as e:
                    w = ext.written
                    if w is not None and w.done() and w.exception() is not None:  # its write failed
                        with store._lock:
                            store._write_failed(self, ext, e)
                    raise
            finally:
                with store._lock:
                    self._pins -= 1
                    if self._version == version and not self._deleted:
                        self._touch()
            # The value as it was when the read began, whatever happened since: its extent could not be reused
            # while the read held it, and its crc32c was checked. Retrying here instead would starve a reader
            # of a tensor rewritten faster than it can be read ([Note: a read by name sees the old or the new
            # value] in store.py).
            return self._decode(data), True

    def _read_to(self, device: torch.device | None) -> torch.Tensor:
        value, fresh = self._read_value()
        if device is None or torch.device(device) == value.device:
            return value if fresh else value.clone()
        return value.to(device, copy=True)

    def _bring_to(self, tier: str) -> None:
        """Make sure memory tier `tier` holds a copy (spilling others to make room)."""
        store = self._store
        if tier == "nvme":
            raise TierstoreValueError("prefetch/resident move tensors up to 'device' or 'host'; to write a "
                                      "tensor down use offload('nvme')")
        while True:
            with store._lock:
                self._check()
                if tier in self._copies:
                    self._touch()
                    return
                version = self._version
            value, _fresh = self._read_value()
            with store._lock:
                self._check()
                if self._version != version:
                    continue
                if tier in self._copies:
                    return
                if not store._make_room(tier, self.nbytes, exclude=self):
                    raise store._full_error(tier, self)
                self._place_memory(tier, value)
                return

    # -- public API ------------------------------------------------------------------------------------
    def get(self, device: torch.device | str | None = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """A copy of the value as a plain tensor (on `device`, default: where the fastest copy is; nvme -> cpu).

        out: a tensor of this shape and dtype to receive the value (returned). A trainer that reads the same
        tensors every step should pass one: freshly allocated memory costs page faults, which on a VM
        can be slower than the disk. A contiguous CPU `out` is read into directly (O_DIRECT when it is 4 KiB
        aligned, else through pool buffers); `device=`, if given, must be out's device."""
        if out is None:
            return self._read_to(device)
        self._check_out(out, device)
        direct = out_bytes(out) if self.codec is IDENTITY else None
        value, _fresh = self._read_value(direct)
        if direct is None or value.data_ptr() != out.data_ptr():
            if direct is not None and value.device.type == "cpu" and value.is_contiguous():
                copy_host(direct, as_bytes(value))
            else:
                out.copy_(value)
        return out

    def _check_out(self, out, device=None) -> None:
        if not isinstance(out, torch.Tensor):
            raise TierstoreValueError(f"out= for {self.name!r} must be a torch.Tensor of shape {tuple(self.shape)} "
                                      f"and dtype {self.dtype}; got a {type(out).__name__}")
        if tuple(out.shape) != tuple(self.shape) or out.dtype != self.dtype:
            raise TierstoreValueError(
                f"out= for {self.name!r} needs shape {tuple(self.shape)} and dtype {self.dtype}; got "
                f"{tuple(out.shape)} {out.dtype}. Allocate it with torch.empty({tuple(self.shape)}, dtype={self.dtype})")
        if device is not None and torch.device(device) != out.device:
            if not (torch.device(device).type == out.device.type and torch.device(device).index is None):
                raise TierstoreValueError(f"device={device!r} but out= is on {out.device}: the value goes where "
                                          "out is; leave device out")

    def prefetch(self, tier: str = "device") -> Future:
        """Start moving a copy up to `tier` ('device' or 'host'); the future resolves to this TieredTensor."""
        tier_index(tier)
        self._check()
        return self._store._submit(self._prefetch_job, tier)

    def _prefetch_job(self, tier: str) -> "TieredTensor":
        self._bring_to(tier)
        return self

    @contextmanager
    def resident(self, device: torch.device | str | None = None, *, writeback: bool = False) -> Iterator[torch.Tensor]:
        """`with t.resident(device) as x:` x is the tier's copy as a plain torch.Tensor, not evicted inside
        the block. `device`: 'device' / 'host' / a torch device (default: the store's device). With
        writeback=True changes made to x are written to every other tier holding a copy on exit; without
        it, treat x as read-only."""
        tier = self._store._tier_for(device)
        store = self._store
        if writeback:
            store._check_writable(f"resident({self.name!r}, writeback=True)")
        while True:
            self._bring_to(tier)
            with store._lock:
                if tier in self._copies:
                    self._pins += 1
                    x = self._copies[tier]
                    break
        try:
            yield x
        finally:
            with store._lock:
                self._pins -= 1
                if writeback and not self._deleted and self._copies.get(tier) is x:
                    self._version += 1
                    for other in list(self._copies):
                        if other == tier:
                            continue
                        if other == "nvme":
                            try:
                                self._write_nvme(x)
                            except TierstoreIOError as e:  # x is kept (and written by the next flush)
                                log.warning("tensor %r: its nvme copy was dropped, not rewritten (%s)",
                                            self.name, e)
                        else:
                            with profile_range("tierstore::writeback"):
                                self._copies[other].copy_(x)

    def offload(self, tier: str = "nvme", *, keep: bool = False) -> Future:
        """Start writing a copy down to `tier` ('host' or 'nvme'); unless keep=True, the faster copies are
        dropped once it is there. The future resolves to this TieredTensor. An nvme copy is readable at once
        and durable after store.flush()."""
        if tier_index(tier) == 0:
            raise TierstoreValueError("offload moves down to 'host' or 'nvme'; to move up use prefetch('device')")
        self._check()
        self._store._check_writable(f"offload of {self.name!r}")
        return self._store._submit(self._offload_job, tier, keep)

    def _offload_job(self, tier: str, keep: bool) -> "TieredTensor":
        store = self._store
        with store._lock:
            self._check()
            if tier not in self._copies:
                if tier == "nvme":
                    self._write_nvme(self._memory_copy())
                else:
                    if not store._make_room(tier, self.nbytes, exclude=self):
                        raise store._full_error(tier, self)
                    self._place_memory(tier, self._copies[self._fastest()])
            if not keep:
                if self._pins:
                    raise MisuseError(f"tensor {self.name!r} is in use (inside resident()); the copy on {tier} "
                                      "was written, but faster copies are kept: leave the block first")
                for t in TIERS[:tier_index(tier)]:
                    if t in self._copies:
                        self._remove(t)
        return self

    def drop(self, tier: str) -> None:
        """Free the copy on `tier`, keeping the others. The only copy cannot be dropped."""
        tier_index(tier)
        with self._store._lock:
            self._check()
            if tier not in self._copies:
                raise MisuseError(f"tensor {self.name!r} has no copy on {tier!r} to drop (it is on "
                                  f"{sorted(self._copies, key=tier_index)})")
            if len(self._copies) == 1:
                raise MisuseError(f"the copy of {self.name!r} on {tier!r} is its only one; offload it first "
                                  f"(t.offload('nvme')) or delete it with store.delete({self.name!r})")
            if self._pins and tier != "nvme":
                raise MisuseError(f"tensor {self.name!r} is in use (inside resident() or being moved); drop "
                                  "it after the block")
            self._remove(tier)

    def update(self, value) -> None:
        """Replace the value (same shape and dtype): memory copies are overwritten in place, the nvme copy is
        rewritten when it is the only one, else dropped (and rewritten at flush)."""
        from .tiers.device import to_dlpack_tensor

        self._store._check_writable(f"update of {self.name!r}")
        value = to_dlpack_tensor(value)
        if tuple(value.shape) != tuple(self.shape) or value.dtype != self.dtype:
            raise TierstoreValueError(
                f"update() of {self.name!r} needs shape {tuple(self.shape)} and dtype {self.dtype}; got "
                f"{tuple(value.shape)} {value.dtype}. To change shape or dtype, store.put({self.name!r}, ...) again")
        with self._store._lock:
            self._check()
            self._version += 1
            mem = [t for t in ("device", "host") if t in self._copies]
            with profile_range("tierstore::update"):
                for t in mem:
                    self._copies[t].copy_(value)
            if "nvme" in self._copies:
                if mem:
                    self._remove("nvme")
                else:
                    try:
                        self._write_nvme(value)
                    except TierstoreIOError as e:  # no room reserved: the previous value is intact
                        raise prefixed(e, f"update() of tensor {self.name!r} did not store the new value (the "
                                          "tensor keeps its previous one)") from None
