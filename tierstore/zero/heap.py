"""Freed weights go back to the system: what zero.Init and offloaded inference call after dropping tensors of a
model they stream through memory.

[Note: freed weights go back to the system]
Building a model under Init, initialising it scope by scope and filling an inference store each allocate a
module's (or a bucket's) tensors, write them to the store and free them, module after module. glibc serves a
large block with its own mmap, unmapped on free -- until a free of such a block raises that threshold (up to
32 MiB), after which blocks of a layer's size come from its heap, and freed ones stay resident there: the
process's RSS then grows by about a layer for every layer streamed through memory, the whole model's worth,
while what is alive stays one module. So the code that drops streamed tensors reports their bytes here, and
once ``TRIM_EVERY`` bytes were dropped since the last time, ``malloc_trim(0)`` returns the heap's free pages
to the system (glibc keeps the blocks' bookkeeping; a later block of the size reuses them). Resident memory
then follows live memory plus at most about ``TRIM_EVERY``. No allocator setting of the process changes (a
program may fix glibc's thresholds itself, as the benchmarks do: [Note: resident memory follows live memory]
in tierstore/gpt.py). Where the C library has no ``malloc_trim`` (not glibc) nothing is done.
"""
from __future__ import annotations

import ctypes
import threading

TRIM_EVERY = 64 << 20  # bytes dropped between two trims

_lock = threading.Lock()
_dropped = 0  # bytes reported since the last trim


def _load_trim():
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


_malloc_trim = _load_trim()


def trim() -> None:
    """Return the heap's free pages to the system now (a program's steady loop: once per forward of an offloaded
    model, [Note: the inference budget] in zero/inference/offload.py)."""
    global _dropped
    if _malloc_trim is not None:
        with _lock:
            _dropped = 0
        _malloc_trim(0)


def dropped(nbytes: int) -> None:
    """`nbytes` of tensors were just freed; return the heap's free pages to the system once ``TRIM_EVERY``
    bytes were ([Note: freed weights go back to the system])."""
    global _dropped
    if _malloc_trim is None or nbytes <= 0:
        return
    with _lock:
        _dropped += nbytes
        if _dropped < TRIM_EVERY:
            return
        _dropped = 0
    _malloc_trim(0)

