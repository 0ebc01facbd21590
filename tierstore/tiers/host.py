"""The host tier: tensors in page-locked host memory under a byte budget.

[Note: host memory layout]
Copies of at least `ALIGNED_MIN` bytes get their own 4 KiB-aligned, page-locked mapping, so the NVMe tier
can read and write them with O_DIRECT straight from/to the tensor (no bounce buffer) and an accelerator
can DMA from them. Smaller copies come from torch's allocator (a mapping per 100-byte tensor would waste a
page each); the engine handles their unaligned I/O. With CUDA present, torch's pinned allocator is used
instead (it registers the memory with the driver). Page-locking beyond `ulimit -l` is refused by the
kernel for non-root users: the tier then keeps working unlocked and says so once in the log.
"""
from __future__ import annotations

import ctypes
import logging
import mmap

import torch

from ..io.pool import advise_huge_pages
from .base import Budget, TierStats, profile_range

log = logging.getLogger("tierstore.tiers")

ALIGN = 4096  # bytes
ALIGNED_MIN = 64 << 10  # bytes: smaller host copies use torch's allocator
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_lock_warned = False


def aligned_empty(nbytes: int, *, lock: bool = True, huge: bool = True) -> torch.Tensor:
    """A uint8 CPU tensor of `nbytes` at a 4 KiB-aligned address (page-locked when `lock` and allowed; advised
    for transparent huge pages when `huge`)."""
    global _lock_warned
    if nbytes < ALIGNED_MIN:
        return torch.empty(nbytes, dtype=torch.uint8)
    if lock and torch.cuda.is_available():  # CUDA-only branch: let the driver pin it
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(mm, dtype=torch.uint8)  # keeps `mm` alive; unmapped (and unlocked) with the tensor
    if huge:
        advise_huge_pages(t.data_ptr(), nbytes)  # fewer page faults and fewer pages per O_DIRECT request
    if lock and _libc.mlock(t.data_ptr(), nbytes) != 0 and not _lock_warned:
        _lock_warned = True
        log.warning("host tier: page-locking failed (errno %d, `ulimit -l` too low?); host copies stay "
                    "pageable. Raise the limit (`ulimit -l unlimited`) for faster device copies.",
                    ctypes.get_errno())
    return t


def result_empty(nbytes: int) -> torch.Tensor:
    """Memory for a tensor handed to the caller (get()): torch's allocator, whose recycled heap spares the
    page faults a fresh mapping costs, except for large tensors, which get a 4 KiB-aligned mapping so the
    nvme tier reads them with O_DIRECT straight into place, faulted in ahead of the reads and on small pages
    (see [Note: fresh memory] in tiers/nvme/reads.py)."""
    if nbytes >= RESULT_ALIGNED_MIN:
        return aligned_empty(nbytes, lock=False, huge=False)
    return torch.empty(nbytes, dtype=torch.uint8)


RESULT_ALIGNED_MIN = 8 << 20  # bytes


class HostTier:
    """Page-locked host memory under a byte budget."""

    name = "host"

    def __init__(self, budget_bytes: int | None, *, lock: bool = True):
        self.budget = Budget("host", budget_bytes)
        self.lock = lock
        self.stats = TierStats("host")

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised host tensor (aligned and locked when large)."""
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        return aligned_empty(nbytes, lock=self.lock).view(dtype).view(shape)

    def copy_in(self, src: torch.Tensor) -> torch.Tensor:
        """A new host tensor holding `src` (from any device, any layout)."""
        nbytes = src.numel() * src.element_size()
        with profile_range("tierstore::to_host"), self.stats.timing("in", nbytes):
            dst = self.empty(tuple(src.shape), src.dtype)
            dst.copy_(src)
        return dst

    def copy_out(self, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        """Copy the host tensor `src` into the CPU tensor `dst`; returns `dst`."""
        nbytes = src.numel() * src.element_size()
        with profile_range("tierstore::from_host"), self.stats.timing("out", nbytes):
            dst.copy_(src)
        return dst

    def __repr__(self) -> str:
        return f"HostTier({self.budget})"
