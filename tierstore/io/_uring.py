"""ctypes bindings of native/uring.c, declared in native/uring.h (tests/io/test_native_abi.py checks these
against it). Every call returns 0 / a count or -errno."""
from __future__ import annotations

import ctypes as C

import numpy as np

from .._native import load

READ, WRITE = 0, 1
FAULT_NONE, FAULT_EIO, FAULT_SHORT, FAULT_ENOSPC = 0, 1, 2, 3

_P = C.c_void_p

# struct ts_io in native/uring.h: one request of a batch.
IO_DTYPE = np.dtype([("id", np.uint64), ("op", np.int32), ("fd", np.int32), ("fixed_file", np.int32),
                     ("buf_index", np.int32), ("addr", np.uint64), ("len", np.uint64), ("off", np.uint64)])
assert IO_DTYPE.itemsize == 48


_typed = False  # argtypes/restype set on the (cached) library


def lib() -> C.CDLL:
    global _typed
    lib = load("uring")
    if not _typed:
        lib.ts_ring_create.argtypes = [C.c_uint, C.POINTER(_P)]
        lib.ts_ring_create.restype = C.c_int
        lib.ts_ring_destroy.argtypes = [_P]
        lib.ts_ring_destroy.restype = None
        lib.ts_ring_depth.argtypes = [_P]
        lib.ts_ring_depth.restype = C.c_uint
        lib.ts_submit_many.argtypes = [_P, _P, C.c_uint]
        lib.ts_submit_many.restype = C.c_int
        lib.ts_wake.argtypes = [_P]
        lib.ts_wake.restype = C.c_int
        lib.ts_inject.argtypes = [_P, C.c_uint64, C.c_int]
        lib.ts_inject.restype = None
        lib.ts_reaper_start.argtypes = [_P]
        lib.ts_reaper_start.restype = C.c_int
        lib.ts_reaper_stop.argtypes = [_P]
        lib.ts_reaper_stop.restype = C.c_int
        lib.ts_collect.argtypes = [_P, C.POINTER(C.c_uint64), C.POINTER(C.c_int64), C.c_int, C.c_int,
                                   C.POINTER(C.c_int)]
        lib.ts_collect.restype = C.c_int
        lib.ts_register_buffers.argtypes = [_P, C.POINTER(_P), C.POINTER(C.c_uint64), C.c_uint]
        lib.ts_register_buffers.restype = C.c_int
        lib.ts_unregister_buffers.argtypes = [_P]
        lib.ts_unregister_buffers.restype = C.c_int
        lib.ts_register_file_table.argtypes = [_P, C.c_uint]
        lib.ts_register_file_table.restype = C.c_int
        lib.ts_update_file.argtypes = [_P, C.c_uint, C.c_int]
        lib.ts_update_file.restype = C.c_int
        lib.ts_probe.argtypes = []
        lib.ts_probe.restype = C.c_int
        lib.ts_io_layout.argtypes = [C.POINTER(C.c_uint64), C.c_uint]
        lib.ts_io_layout.restype = C.c_int
        _typed = True
    return lib


def probe() -> int:
    """0 when io_uring can be set up here, else -errno (ImportError when the library is not built)."""
    return lib().ts_probe()
