"""Peak resident memory of this process, from /proc (Linux): what a test of "memory per layer" measures."""
from __future__ import annotations

import ctypes

from tierstore.bench._common import proc_status


def peak_growth(fn) -> tuple[int, object]:
    """Bytes the process's peak RSS rose above its RSS before fn() (peak reset via /proc/self/clear_refs),
    and fn()'s result."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = proc_status("VmRSS")
    out = fn()
    return proc_status("VmHWM") - before, out


def rss_follows_live_memory() -> None:
    """glibc raises its mmap threshold after the first large free, then keeps freed blocks in the heap, so RSS
    would count memory that is free; a fixed threshold (M_MMAP_THRESHOLD) makes RSS follow live memory. Call
    it first thing in the fresh process that measures."""
    ctypes.CDLL(None).mallopt(-3, 128 << 10)
