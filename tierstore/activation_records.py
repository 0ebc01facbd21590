"""The records of activation offload: what the pack hook returns for each saved tensor (kept in memory,
offloaded, or a member of a small-saves batch), how a tensor's bytes are laid out for the store, and the
counts an ActivationOffload reports. The hooks that make and use them are activations.py.

[Note: exact round trip]
What goes to the store is the tensor's bytes, as uint8: a contiguous tensor as it is; a non-overlapping
dense one (a transpose, a permutation) as its span of storage, restored with the same strides; an
overlapping or gapped view as its span when that is at most twice its elements (restored with the same
strides), else as a contiguous copy (restored contiguous: the same values, other strides). So the values
and dtypes (bool and integers included) come back bit for bit, and with the same strides wherever the
span is stored, which keeps kernels that pick a path by stride on the same path: gradients are
``torch.equal`` to torch's own. Compression (``compress='bf16'`` or a block-quantization scheme of
"""
from __future__ import annotations

import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ActivationStats:
    """What an ActivationOffload did since it was made (``act.stats()``)."""

    packed: int  # saved tensors seen by the pack hook
    offloaded: int  # ... written to the store
    offloaded_bytes: int  # bytes of those tensors (before compression)
    kept: int  # ... kept in memory ([Note: what is offloaded])
    kept_over_budget: int  # ... of which because budget_bytes was reached
    batched: int  # small saved tensors copied into a shared batch, offloaded as one ([Note: small saves batched])
    deduplicated: int  # saves that shared the record of an earlier save of the same tensor
    unpacked: int  # unpacks of offloaded records
    prefetch_hits: int  # ... whose read was started ahead (read ahead, [Note: read ahead])
    unwritten_hits: int  # ... whose tensor was still in memory (its write not finished)
    misses: int  # ... read when backward asked for them
    held_bytes: int  # bytes held in the store now
    peak_held_bytes: int  # the most bytes held in the store at once


class Kept:
    """A saved tensor kept in memory, with the version it had (torch checks none with hooks)."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.version = tensor._version


class Saved:
    """One offloaded tensor: its layout, where it is, and what is in flight for it."""

    __slots__ = ("__weakref__", "owner", "key", "pos", "size", "stride", "span", "dtype", "stored_dtype", "device",
                 "version", "ref", "nbytes", "data", "write", "read", "written", "freed", "modified")

    def __init__(self, owner: Any, key: str, t: torch.Tensor):
        self.owner = owner
        self.key = key
        self.pos = -1  # index in the owner's pack order
        self.size = tuple(t.shape)
        self.dtype = t.dtype
        self.stored_dtype = t.dtype
        self.device = t.device
        self.version = t._version
        self.ref = weakref.ref(t)
        self.stride: tuple[int, ...] | None = None  # None: restored contiguous
        self.span = 0  # elements stored
        self.nbytes = 0  # bytes stored (before compression)
        self.data: torch.Tensor | None = None  # the flat span while its write is pending
        self.write: Future | None = None
        self.read: Future | None = None
        self.written = False
        self.freed = False
        self.modified = False

    def __del__(self):
        owner = self.owner
        if owner is not None:
            owner._release(self)


class Batch:
    """Small saved tensors copied side by side into one buffer, offloaded as one record once it is full."""

    __slots__ = ("buf", "fill", "saved", "members", "cache", "left")

    def __init__(self, buf: torch.Tensor):
        self.buf: torch.Tensor | None = buf  # uint8, while it is being filled
        self.fill = 0  # bytes used
        self.saved: Saved | None = None  # the record of buf[:fill], once sealed
        self.members = 0  # live Member records
        self.cache: torch.Tensor | None = None  # the bytes read back, while members still unpack them
        self.left = 0  # unpacks still to serve from `cache`: the live members when it was read


class Member:
    """One small saved tensor inside a Batch: its bytes at `offset`, its layout, the version it had."""

    __slots__ = ("owner", "batch", "offset", "nbytes", "size", "stride", "dtype", "device", "version", "ref")

    def __init__(self, owner: Any, batch: Batch, offset: int, nbytes: int, t: torch.Tensor,
                 stride: tuple[int, ...] | None):
        self.owner: Any | None = owner
        self.batch = batch
        self.offset = offset
        self.nbytes = nbytes
        self.size = tuple(t.shape)
        self.stride = stride
        self.dtype = t.dtype
        self.device = t.device
        self.version = t._version
        self.ref = weakref.ref(t)

    def __del__(self):
        owner = self.owner
        if owner is not None:
            with owner._lock:
                self.batch.members -= 1


def span_of(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...] | None]:
    """(flat contiguous tensor to store, strides to restore it with -- None: contiguous). [Note: exact round trip]"""
    if t.is_contiguous():
        return t.reshape(-1), None
    n = t.numel()
    extent = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))  # elements from the first to the last
    if extent <= 2 * n:  # dense (extent == n) or a modest span: keep the strides
        return t.as_strided((extent,), (1,), t.storage_offset()), tuple(t.stride())
    return t.contiguous().reshape(-1), None


def param_or_view(t: torch.Tensor) -> bool:
    while t is not None:
        if isinstance(t, torch.nn.Parameter):
            return True
        t = t._base  # type: ignore[assignment]
    return False


def checkpoint_codes() -> tuple[set, Any]:
    """The code objects on the stack while torch.utils.checkpoint saves its inputs (both variants)."""
    import inspect

    import torch.utils.checkpoint as tuc
    codes = set()
    frame_cls = getattr(tuc, "_CheckpointFrame", None)
    if frame_cls is not None and hasattr(frame_cls, "save_inputs"):
        codes.add(frame_cls.save_inputs.__code__)  # non-reentrant: _make_saved_tensor in save_inputs
    apply = inspect.unwrap(torch.autograd.Function.apply.__func__)  # type: ignore[attr-defined]
    return codes, (apply.__code__, getattr(tuc, "CheckpointFunction", None))
