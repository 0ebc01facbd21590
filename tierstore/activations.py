"""Activation offload: the tensors autograd saves for backward go through a Store to the host or nvme tier.

    with tierstore.ActivationOffload("nvme", paths=["/nvme0/act"]) as act:
        for x, y in data:
            with act:                       # the hooks are on inside the block (re-enter it every step)
                loss = loss_fn(model(x), y)
            loss.backward()                 # saved tensors come back, read ahead in reverse pack order
    # or with ZeRO-3: OffloadConfig(activation_offload="nvme") (see docs/activations.md)

``mode='all'`` offloads every saved tensor that qualifies; ``mode='checkpoint'`` only the inputs that
torch.utils.checkpoint keeps for its recomputation (both the reentrant and the non-reentrant variant), as
DeepSpeed's ``cpu_checkpointing`` does. Everything else stays in memory, untouched.

[Note: what is offloaded]
A saved tensor stays in memory (returned as it is) when it is smaller than ``min_bytes`` (unless
``small_batch_bytes`` batches it: [Note: small saves batched]), an
``nn.Parameter`` or a view of one (ZeRO-3's gathered parameters are views of its buckets, which the hooks
release and gather again on their own: [Note: gather and release] in zero/hooks/coordinator.py), a tensor subclass,
sparse, quantized, conjugated or negated, saved while a backward runs (a recomputation: it is used right
away), outside ``mode``, or when offloading it would take the bytes held by the store past ``budget_bytes``.
What is offloaded is written by a background thread: the tensor is held until its bytes are in the store,
then let go, so its memory is freed as soon as the forward no longer uses it.


[Note: saved tensors and versions]
torch does not check the version counter of a tensor that went through saved-tensor hooks, so this module
does: the pack records ``tensor._version`` and a weak reference; the unpack raises torch's usual
"modified by an inplace operation" error when the tensor is alive and its version moved (kept tensors
included). A tensor modified in place after the write finished whose every Python reference is gone can
no longer be observed, and the stored value is the one that was saved, which is what backward needs.
The same tensor saved twice (the same object at the same version, or another view of the same storage
span, alive, at the same version) is stored once: both saves share one record.

[Note: lifetime of a saved activation]
The record the pack returns is held by autograd's saved variable. The store's copy lives until autograd
lets the record go -- right after the node that used it ran, in a backward without ``retain_graph`` --
or until ``close()``. So ``retain_graph=True`` and double backward (``create_graph=True``) work: a second
unpack reads the value again; a tensor saved and never unpacked (its graph dropped without backward, or a
branch the backward did not reach) is freed when its graph goes. The memory the read brought back is
handed to autograd and not kept. A record unpacked after ``close()`` raises MisuseError.

[Note: read ahead]
The records of offloaded tensors are kept in pack order. When backward unpacks the record at position p,
the records below p are read on a worker thread, from p - 1 down, until ``prefetch_bytes`` are read and not
yet unpacked: backward runs (nearly) in the reverse order of the forward, so those are the next ones it
needs. A record's bytes leave that window when backward unpacks it, before the next reads start (counted
until its read returns, a window of one tensor would start the next read only every other unpack). A
record whose write has not finished yet is not read: its tensor is still in memory and is used
as it is (the write is cancelled or its result discarded). With ZeRO-3 the ``backward_begin`` event of its
hooks ([Note: hook events] in zero/hooks/events.py) starts the reads before the first unpack.

[Note: per-save bookkeeping]
With every activation offloaded, what stays in memory until backward grows with depth, one layer at a time:
autograd's own graph (~20 KiB per GPT block of tierstore/gpt.py, torch's), the saved tensors kept for being
small (~14 KiB per block there: layer-norm statistics, the attention's log-sum-exp) and the records of the
offloaded ones -- ours and the store's (docs/activations.md has the measurement). A record keeps only what
backward needs: the write's future (a Condition with its lock and deque, ~1.5 KiB, more than the rest of
the record) is let go once the write is done, and at the end of the forward (``__exit__``, or
``wait_writes``) the futures of finished writes and the dedupe keys of tensors already gone are dropped:
such a key can never match again ([Note: saved tensors and versions]). What is left is ~1.5 KiB of Python
objects per offloaded tensor, about half of it the store's (its placement and extent).

[Note: small saves batched]
With ``small_batch_bytes`` > 0, a saved tensor that would stay in memory only for being smaller than
``min_bytes`` is instead copied, at the pack, into the batch being filled for its device (each at a 64-byte
aligned offset, as its span: [Note: exact round trip] in activation_records.py); a full batch -- and every
batch at the end of the forward -- is offloaded as one record, like any saved tensor (read ahead, freed
when its last member is). So a GPT block's layer-norm statistics and log-sum-exp (2-4 KiB each) leave
memory without a store record and a 4 KiB write each. Backward reads a batch once, when its first member is
unpacked, and keeps the bytes until every member alive then has been unpacked (a second backward reads it
again). The copy is taken at the pack, so an in-place change after it cannot reach the stored value; the
unpack still checks the version of a member still alive. Batches are not compressed. Off by default: small
tensors stay in memory, and batching pays a copy per small save.
"""
from __future__ import annotations

import itertools
import logging
import os
import shutil
import sys
import tempfile
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from . import activation_args
from .activation_records import (
    ActivationStats,
    Batch,
    Kept,
    Member,
    Saved,
    checkpoint_codes,
    param_or_view,
    span_of,
)
from .errors import MisuseError
from .store import Store

__all__ = ["MODES", "ActivationOffload", "ActivationStats"]

log = logging.getLogger("tierstore.activations")

MODES, TIERS = activation_args.MODES, activation_args.TIERS
_BF16 = activation_args.BF16
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


class ActivationOffload:
    """Saved tensors for backward on the host or nvme tier. See the module docstring and docs/activations.md.

    tier: 'host' (page-locked memory: frees accelerator memory) or 'nvme' (files under `paths`).
    paths: directories for the nvme tier (default: a temporary directory, removed at close); ignored with
        `store`. store: an open Store to use instead of one of our own (its names starting with `prefix`).
    mode: 'all' or 'checkpoint' ([Note: what is offloaded]).
    budget_bytes: the most bytes held in the store at once (None: no limit); past it tensors stay in memory.
    min_bytes: smaller tensors stay in memory (bytes), unless `small_batch_bytes` batches them.
    small_batch_bytes: 0 (default: small tensors stay in memory), or the bytes of a batch into which small saved
        tensors are copied, offloaded as one record when full ([Note: small saves batched]).
    prefetch_bytes: bytes read ahead of backward ([Note: read ahead]).
    write_behind_bytes: bytes of saved tensors waiting for their write at most; past it the forward waits for the
        oldest write (so the memory of the tensors in flight stays bounded when the disk is slower than compute).
    compress: None (exact), 'bf16' or a quantization scheme name of tierstore.quant ('int8', 'dyn8s', ...):
        floating tensors stored on the nvme tier in fewer bytes, lossy (docs/activations.md has the error).
    pinned_bytes: the page-locked staging budget of our own store (bytes).
    """

    def __init__(self, tier: str = "nvme", *, paths: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
                 store: Store | None = None, mode: str = "all", budget_bytes: int | None = None,
                 min_bytes: int = 64 << 10, prefetch_bytes: int = 16 << 20, write_behind_bytes: int = 16 << 20,
                 compress: str | None = None, pinned_bytes: int = 16 << 20, prefix: str = "act/",
                 small_batch_bytes: int = 0):
        # every argument checked before anything is created
        given = activation_args.check(tier, paths, store, mode, budget_bytes, min_bytes, prefetch_bytes,
                                      write_behind_bytes, compress, pinned_bytes, prefix, small_batch_bytes)
        self._codec = None
        self.tier = tier
        self.mode = mode
        self.budget_bytes = budget_bytes
        self.min_bytes = min_bytes
        self.small_batch_bytes = small_batch_bytes
        self.prefetch_bytes = prefetch_bytes
        self.write_behind_bytes = write_behind_bytes
        self.compress = compress
        self._prefix = prefix
        self._tmp: str | None = None
        self._own_store = store is None
        if store is None:
            if given is None:
                self._tmp = tempfile.mkdtemp(prefix="tierstore-act-")
                given = [self._tmp]
            try:
                store = Store(given, budgets={"host": None if tier == "host" else 0, "device": 0,
                                              "pinned": pinned_bytes}, lock_memory=tier == "host", workers=1)
            except BaseException:  # what only trying tells (the page-lock limit): our own directory goes
                if self._tmp is not None:
                    shutil.rmtree(self._tmp, ignore_errors=True)
                raise
        self.store = store
        self._lock = threading.RLock()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="tierstore-act-write")
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="tierstore-act-read")
        self._ids = itertools.count()
        self._order: list[weakref.ref] = []  # offloaded records in pack order ([Note: read ahead])
        self._low: int | None = None  # lowest position whose read was considered in this backward
        self._ahead_bytes = 0  # bytes read ahead and not yet unpacked
        self._by_storage: dict[tuple, weakref.ref] = {}
        self._batches: dict[torch.device, Batch] = {}  # the batch being filled, per device
        self._live = 0
        self._pending: list[tuple[Future, int]] = []  # writes in flight, oldest first, with their bytes
        self._pending_bytes = 0
        self._held = 0
        self._peak = 0
        self._counts = dict.fromkeys(("packed", "offloaded", "offloaded_bytes", "kept", "kept_over_budget",
                                      "batched", "deduplicated", "unpacked", "prefetch_hits", "unwritten_hits",
                                      "misses"), 0)
        self._contexts: list = []
        self._closed = False
        self._ckpt_codes, (self._apply_code, self._ckpt_fn) = checkpoint_codes()
        self._subscription = None
        self._attached_ctx = False
        self._error: BaseException | None = None

    # -- the hooks ------------------------------------------------------------------------------------------
    def __enter__(self) -> ActivationOffload:
        if self._closed:
            raise MisuseError("this ActivationOffload is closed; make a new one")
        ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        ctx.__enter__()
        self._contexts.append(ctx)
        with self._lock:
            self._low = None  # a new forward: the next backward starts reading from the top
        return self

    def __exit__(self, *exc) -> None:
        if not self._contexts:
            raise MisuseError("ActivationOffload.__exit__ without a matching __enter__")
        self._contexts.pop().__exit__(*exc)
        self._tidy()

    def _tidy(self) -> None:
        """Let go of what the forward needed and backward does not ([Note: per-save bookkeeping]): the futures of
        finished writes, and the dedupe keys of records whose saved tensor is gone (a save shares a record only
        while that tensor is alive: [Note: saved tensors and versions])."""
        with self._lock:
            if self._closed:
                return
            for device in list(self._batches):
                self._seal(device)  # the forward is over: no more small saves for these batches
            while self._pending and self._pending[0][0].done():
                self._pending_bytes -= self._pending.pop(0)[1]
            dead = [k for k, r in self._by_storage.items() if (rec := r()) is None or rec.freed or rec.ref() is None]
            for k in dead:
                del self._by_storage[k]

    def _in_checkpoint_inputs(self) -> bool:
        """True when torch.utils.checkpoint is saving its inputs (the caller's frames say so)."""
        f: Any = sys._getframe(3)  # 0: here, 1: _keep_reason, 2: _pack, 3: who saves
        for _ in range(4):
            if f is None:
                return False
            if f.f_code in self._ckpt_codes:
                return True
            if f.f_code is self._apply_code and self._ckpt_fn is not None and \
                    f.f_locals.get("cls") is self._ckpt_fn:
                return True
            f = f.f_back
        return False

    def _keep_reason(self, t: torch.Tensor) -> str | None:
        if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
            return "subclass"
        if t.layout != torch.strided or t.is_quantized or t.is_conj() or t.is_neg() or t.device.type == "meta":
            return "layout"
        if param_or_view(t):
            return "parameter"
        if torch._C._current_graph_task_id() != -1:
            return "backward"
        if self.mode == "checkpoint" and not self._in_checkpoint_inputs():
            return "mode"
        if t.numel() * t.element_size() < self.min_bytes:
            return "small"
        return None

    def _pack(self, t: torch.Tensor):
        with self._lock:
            if self._error is not None:
                e, self._error = self._error, None  # a write failed; its tensor (and the others') is in memory
                log.error("writing a saved activation to the %s tier failed; the tensors not written stay in "
                          "memory", self.tier)
                raise e
            self._counts["packed"] += 1
            reason = "closed" if self._closed else self._keep_reason(t)
            if reason == "small" and self.small_batch_bytes and t.numel():
                if self.budget_bytes is not None and self._held + self.small_batch_bytes > self.budget_bytes:
                    self._counts["kept"] += 1
                    self._counts["kept_over_budget"] += 1
                    return Kept(t)
                return self._pack_small(t)
            if reason is not None:
                self._counts["kept"] += 1
                return Kept(t)
            flat, stride = span_of(t.detach())  # no autograd history for our own views and copies
            skey = (flat.untyped_storage().data_ptr(), flat.storage_offset(), flat.numel(), t.dtype, t.shape,
                    stride, t._version)
            old = self._by_storage.get(skey)
            rec = old() if old is not None else None
            if rec is not None and not rec.freed and not rec.modified:
                src = rec.ref()
                if src is not None and src.untyped_storage().data_ptr() == skey[0] and src._version == t._version:
                    self._counts["deduplicated"] += 1
                    return rec
            nbytes = flat.numel() * flat.element_size()
            if self.budget_bytes is not None and self._held + nbytes > self.budget_bytes:
                self._counts["kept"] += 1
                self._counts["kept_over_budget"] += 1
                return Kept(t)
            rec, waits = self._offload(t, flat, stride)
            self._by_storage[skey] = weakref.ref(rec)
        self._wait(waits)
        return rec

    def _offload(self, t: torch.Tensor, flat: torch.Tensor, stride) -> tuple[Saved, list]:
        """A record for `flat` (the span of `t`), its write started (lock held); the writes to wait for."""
        nbytes = flat.numel() * flat.element_size()
        rec = Saved(self, f"{self._prefix}{next(self._ids)}", t)
        rec.stride = stride
        rec.span = flat.numel()
        rec.nbytes = nbytes
        rec.data = flat
        rec.pos = len(self._order)
        self._order.append(weakref.ref(rec))
        self._live += 1
        self._held += nbytes
        self._peak = max(self._peak, self._held)
        self._counts["offloaded"] += 1
        self._counts["offloaded_bytes"] += nbytes
        self._low = None
        rec.write = self._writer.submit(self._write, rec)
        self._pending.append((rec.write, nbytes))
        self._pending_bytes += nbytes
        waits = []
        while self._pending and (self._pending[0][0].done() or self._pending_bytes > self.write_behind_bytes):
            fut, n = self._pending.pop(0)
            self._pending_bytes -= n
            waits.append(fut)
        return rec, waits

    @staticmethod
    def _wait(waits: list) -> None:
        for fut in waits:  # back-pressure, outside the lock: the writer takes it when it finishes
            if not fut.cancelled():
                fut.exception()  # waits; an error is raised by the next pack (self._error)

    def _pack_small(self, t: torch.Tensor) -> Member:
        """Copy a small saved tensor into the batch of its device (lock held). [Note: small saves batched]"""
        flat, stride = span_of(t.detach())
        raw = flat.view(torch.uint8)
        n = raw.numel()
        b = self._batches.get(t.device)
        if b is None or b.buf is None or b.fill + n > b.buf.numel():
            if b is not None:
                self._seal(t.device)
            b = self._batches[t.device] = Batch(torch.empty(max(self.small_batch_bytes, n), dtype=torch.uint8,
                                                             device=t.device))
        assert b.buf is not None
        off = b.fill
        b.buf[off:off + n].copy_(raw)
        b.fill = (off + n + 63) // 64 * 64  # every member starts 64-byte aligned: any dtype can view it
        b.members += 1
        self._counts["batched"] += 1
        return Member(self, b, off, n, t, stride)

    def _seal(self, device: torch.device) -> None:
        """Offload the batch being filled on `device` as one record (lock held; its write is not waited for)."""
        b = self._batches.pop(device, None)
        if b is None or b.buf is None:
            return
        flat = b.buf[:min(b.fill, b.buf.numel())]
        b.buf = None
        if b.members:
            b.saved, _ = self._offload(flat, flat, None)

    def _encode(self, rec: Saved, flat: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if self.compress is None or rec.dtype not in _FLOATS:
            return flat.view(torch.uint8), None
        if self.compress == _BF16:
            rec.stored_dtype = torch.bfloat16
            return flat.to(torch.bfloat16), None
        from .quant.codecs import codec_for
        rec.stored_dtype = rec.dtype
        return flat, codec_for(self.compress, dtype=rec.dtype)

    def _write(self, rec: Saved) -> None:
        """On the writer thread: the record's bytes into the store, then its tensor let go."""
        with self._lock:
            flat = rec.data
            if flat is None or rec.freed:
                rec.write = None
                return
        try:
            value, codec = self._encode(rec, flat)
            self.store.put(rec.key, value, self.tier, codec=codec)
        except BaseException as e:  # the tensor is kept (rec.data); the next pack raises it
            with self._lock:
                self._error = e
                rec.write = None
            raise
        with self._lock:
            rec.write = None  # done: the future (a Condition, a lock, a deque: ~1.5 KiB) is not kept for backward
            src = rec.ref()
            if src is not None and src._version != rec.version:
                rec.modified = True  # changed while we wrote: unpack raises (it is alive)
            if rec.freed:
                self._delete(rec.key)
                return
            rec.written = True
            rec.data = None

    def _delete(self, key: str) -> None:
        try:
            if not self.store._closed and key in self.store:
                self.store.delete(key)
        except Exception:  # a release must not raise into autograd's destructor path
            log.exception("deleting saved activation %s failed", key)

    def _release(self, rec: Saved) -> None:
        """The record's last reference went ([Note: lifetime of a saved activation])."""
        with self._lock:
            if rec.freed:
                return
            rec.freed = True
            self._live -= 1
            self._held -= rec.nbytes
            if rec.read is not None:  # read ahead and never used
                rec.read.cancel()
                self._ahead_bytes -= rec.nbytes
            rec.read = None
            rec.data = None
            if rec.written:
                self._delete(rec.key)
            elif rec.write is not None and rec.write.cancel():
                pass  # never written
            if self._live == 0:
                self._order.clear()
                self._by_storage.clear()
                self._low = None

    def _check_version(self, t_version: int | None, rec_version: int, size, dtype) -> None:
        if t_version is not None and t_version != rec_version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"[{dtype}{list(size)}] is at version {t_version}; expected version {rec_version} instead "
                "(saved through tierstore.ActivationOffload). Hint: do not modify a tensor in place after an "
                "operation saved it for backward, or clone it first.")

    def _unpack(self, packed) -> torch.Tensor:
        if isinstance(packed, Kept):
            self._check_version(packed.tensor._version, packed.version, packed.tensor.shape, packed.tensor.dtype)
            return packed.tensor
        if isinstance(packed, Member):
            return self._unpack_small(packed)
        rec: Saved = packed
        src = rec.ref()
        self._check_version(src._version if src is not None else None, rec.version, rec.size, rec.dtype)
        if rec.modified:
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"[{rec.dtype}{list(rec.size)}] changed while tierstore.ActivationOffload wrote it (saved at version "
                f"{rec.version}). Hint: do not modify a tensor in place after an operation saved it for backward")
        return self._restore(rec, self._fetch(rec))

    def _unpack_small(self, m: Member) -> torch.Tensor:
        src = m.ref()
        self._check_version(src._version if src is not None else None, m.version, m.size, m.dtype)
        b = m.batch
        with self._lock:
            if self._closed:
                raise MisuseError("a small saved activation is used by a backward after its ActivationOffload was "
                                  "closed (its value is gone); close it only after the backward")
            buf = b.buf if b.saved is None else b.cache  # still being filled, or read for an earlier member
        if buf is None:
            assert b.saved is not None
            buf = self._fetch(b.saved)
            with self._lock:
                b.cache, b.left = buf, b.members
        with self._lock:
            if b.saved is not None:
                b.left -= 1
                if b.left <= 0:  # every member alive at the read had it: read again if a second backward asks
                    b.cache = None
        return self._restore(m, buf[m.offset:m.offset + m.nbytes])

    def _fetch(self, rec: Saved) -> torch.Tensor:
        """The flat span of an offloaded record: from memory while its write is pending, else read (ahead)."""
        with self._lock:
            if self._closed:
                raise MisuseError(f"saved activation {rec.key!r} is used by a backward after its ActivationOffload "
                                  "was closed (its value is gone); close it only after the backward")
            self._counts["unpacked"] += 1
            flat = rec.data
            if flat is not None:  # still in memory: its write is pending (or running)
                self._counts["unwritten_hits"] += 1
            read = rec.read
            rec.read = None
            if read is not None:  # consumed now: its bytes leave the window before the next reads are started
                self._ahead_bytes -= rec.nbytes
            self._read_ahead(rec.pos)
        if flat is None:
            if read is not None:
                self._counts["prefetch_hits"] += 1
                flat = read.result()
            else:
                self._counts["misses"] += 1
                flat = self._read(rec)
        return flat

    def _read(self, rec: Saved) -> torch.Tensor:
        """The record's flat span, as it was saved, on the CPU (on the reader thread, or inline on a miss)."""
        if self.compress is not None and rec.dtype in _FLOATS:
            value = self.store.get(rec.key)
            return value.to(rec.dtype) if value.dtype != rec.dtype else value
        out = torch.empty(rec.nbytes, dtype=torch.uint8)
        return self.store.get(rec.key, out=out).view(rec.dtype)

    def _read_ahead(self, pos: int) -> None:
        """Start the reads of the records below `pos` (lock held). [Note: read ahead]"""
        j = min(pos, self._low if self._low is not None else len(self._order)) - 1
        while j >= 0 and self._ahead_bytes < self.prefetch_bytes:
            rec = self._order[j]()
            if rec is not None and not rec.freed and rec.read is None and rec.written and rec.data is None:
                rec.read = self._reader.submit(self._read, rec)
                self._ahead_bytes += rec.nbytes
            j -= 1
        self._low = j + 1

    def _restore(self, rec: Saved | Member, flat: torch.Tensor) -> torch.Tensor:
        if flat.dtype != rec.dtype:
            flat = flat.view(rec.dtype) if flat.dtype == torch.uint8 else flat.to(rec.dtype)
        if flat.device != rec.device:
            flat = flat.to(rec.device, non_blocking=True)  # accelerator only: tests/test_accelerator.py
        if rec.stride is None:
            return flat.view(rec.size)
        return flat.as_strided(rec.size, rec.stride, flat.storage_offset())

    # -- ZeRO-3 events ([Note: hook events] in zero/hooks/events.py) --------------------------------------------------
    def attach(self, coordinator) -> None:
        """Follow a ZeRO-3 ParamCoordinator (``opt.coordinator``): the hooks are on during each forward of its
        model (forward_begin .. forward_end) and the reads start at backward_begin. See [Note: attached to
        ZeRO-3]."""
        if self._subscription is not None:
            raise MisuseError("this ActivationOffload already follows a ZeRO-3 coordinator")
        self._subscription = coordinator.subscribe(self)

    def forward_begin(self) -> None:
        """Enter the hooks for this forward of the attached model.

        [Note: attached to ZeRO-3]
        Attached, the hooks are entered at the coordinator's ``forward_begin`` and left at its ``forward_end``
        (both on the main thread, around the model's forward only: a loss computed after it is not offloaded).
        A forward that raised never sent ``forward_end``: the next ``forward_begin`` or an aborted
        ``backward_end`` leaves the hooks it entered first, so they never pile up."""
        self._leave_forward()
        self.__enter__()
        self._attached_ctx = True

    def forward_end(self) -> None:
        self._leave_forward()

    def _leave_forward(self) -> None:
        if self._attached_ctx:
            self._attached_ctx = False
            self.__exit__(None, None, None)

    def backward_begin(self, entries: int) -> None:
        self._leave_forward()
        with self._lock:
            self._low = None
            self._read_ahead(len(self._order))

    def backward_end(self, aborted: bool) -> None:
        self._leave_forward()

    def wait_writes(self) -> None:
        """Wait for every write started so far (and the deletes of records freed while they were written)."""
        self._writer.submit(lambda: None).result()
        self._tidy()

    # -- lifetime and stats --------------------------------------------------------------------------------------
    def stats(self) -> ActivationStats:
        with self._lock:
            return ActivationStats(**self._counts, held_bytes=self._held, peak_held_bytes=self._peak)

    def close(self) -> None:
        """Free every offloaded tensor (a backward that still needs one raises) and the store. Idempotent."""
        if self._closed:
            return
        if self._subscription is not None:
            self._subscription.remove()
            self._leave_forward()
        with self._lock:
            self._closed = True
            self._batches.clear()
            for ref in self._order:
                rec = ref()
                if rec is not None:
                    rec.data = None
                    if rec.write is not None:
                        rec.write.cancel()
        self._writer.shutdown(wait=True)
        self._reader.shutdown(wait=True)
        with self._lock:
            for ref in self._order:
                rec = ref()
                if rec is not None and not rec.freed:
                    rec.owner = None
                    rec.freed = True
                    self._delete(rec.key)
            self._order.clear()
            self._by_storage.clear()
        if self._own_store:
            self.store.close(flush=False)
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def __del__(self):
        if not getattr(self, "_closed", True):
            try:
                self.close()
            except Exception:
                pass

    def __repr__(self) -> str:
        return (f"ActivationOffload(tier={self.tier!r}, mode={self.mode!r}, held={self._held} bytes, "
                f"closed={self._closed})")
