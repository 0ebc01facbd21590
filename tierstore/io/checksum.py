"""crc32c of host memory in place, by address: the checksum of every extent and checkpoint record.

native/crc.c computes it where the CPU has VPCLMULQDQ ([Note: crc32c by folding] there: 1.75x the crc32c
package's speed out of cache and 1.9x in cache on an AMD EPYC, `make bench-micro`); elsewhere, or where the
native library is not built, the crc32c package does (the same values)."""
from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import cache

import crc32c

from .._native import NativeMissingError, load

_FromMemory = ctypes.pythonapi.PyMemoryView_FromMemory
_FromMemory.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int]
_FromMemory.restype = ctypes.py_object

#: TS_CRC_* in native/crc.h, by name
IMPLS = {"table": 0, "avx512": 1}


def memory_at(addr: int, nbytes: int) -> memoryview:
    """A read-only memoryview of `nbytes` of host memory at `addr` (the caller keeps the memory alive)."""
    return _FromMemory(addr, nbytes, 0x100)  # PyBUF_READ


@cache
def lib() -> ctypes.CDLL:
    """native/crc.c with its functions typed as native/crc.h declares them (NativeMissingError if not built)."""
    lib = load("crc")
    lib.ts_crc32c.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_uint64]
    lib.ts_crc32c.restype = ctypes.c_uint32
    lib.ts_crc32c_with.argtypes = [ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_uint64]
    lib.ts_crc32c_with.restype = ctypes.c_uint32
    for name in ("ts_crc32c_impls", "ts_crc32c_best"):
        getattr(lib, name).argtypes = []
        getattr(lib, name).restype = ctypes.c_int
    return lib


def _best() -> int | None:
    """native/crc.c's implementation for this CPU, or None where the crc32c package is as fast or faster: the
    library is not built, or only its table runs here (the package has the CPU's crc32 instruction)."""
    try:
        best = lib().ts_crc32c_best()
    except NativeMissingError:
        return None
    return None if best == IMPLS["table"] else best


def implementation() -> str:
    """Which code computes the checksums here: 'avx512' (native/crc.c) or 'crc32c package'."""
    best = _best()
    return "crc32c package" if best is None else next(name for name, v in IMPLS.items() if v == best)


def _package_crc_at(addr: int, nbytes: int, value: int = 0) -> int:
    return crc32c.crc32c(memory_at(addr, nbytes), value) if nbytes else value


_native_crc: Callable[[int, int, int], int] | None = None if _best() is None else lib().ts_crc32c


def crc_at(addr: int, nbytes: int, value: int = 0) -> int:
    """crc32c of `nbytes` of host memory at `addr`, continuing from `value` (the GIL is released meanwhile).

    [Note: one pass over the data, while it is in cache]
    Writes compute the checksum on the staging copy right after the memmove that made it; reads compute it
    on each chunk of the destination right after that chunk arrived (and, through a bounce buffer, right
    after the memmove out of it), overlapped with the chunks still in flight. No pass over a whole large
    tensor happens after its I/O."""
    if _native_crc is None:
        return _package_crc_at(addr, nbytes, value)
    return _native_crc(value, addr, nbytes) if nbytes else value
