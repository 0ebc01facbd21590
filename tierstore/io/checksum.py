"""crc32c of host memory in place, by address: the checksum of every extent and checkpoint record."""
from __future__ import annotations

import ctypes

import crc32c

_FromMemory = ctypes.pythonapi.PyMemoryView_FromMemory
_FromMemory.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int]
_FromMemory.restype = ctypes.py_object


def memory_at(addr: int, nbytes: int) -> memoryview:
    """A read-only memoryview of `nbytes` of host memory at `addr` (the caller keeps the memory alive)."""
    return _FromMemory(addr, nbytes, 0x100)  # PyBUF_READ


def crc_at(addr: int, nbytes: int, value: int = 0) -> int:
    """crc32c of `nbytes` of host memory at `addr`, continuing from `value` (the crc32c package releases the
    GIL for large inputs).

    [Note: one pass over the data, while it is in cache]
    Writes compute the checksum on the staging copy right after the memmove that made it; reads compute it
    on each chunk of the destination right after that chunk arrived (and, through a bounce buffer, right
    after the memmove out of it), overlapped with the chunks still in flight. No pass over a whole large
    tensor happens after its I/O."""
    return crc32c.crc32c(memory_at(addr, nbytes), value) if nbytes else value
