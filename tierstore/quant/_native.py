"""ctypes binding of native/quant.c (``tierstore._native_quant``). One call = one whole tensor."""
from __future__ import annotations

import ctypes
import os

import torch

from .. import _native
from ..errors import TierstoreValueError
from .dynamic import build_tables
from .layout import DTYPES, DYNAMIC, SCHEME_IDS

#: tensors smaller than this run on one thread (starting threads costs ~20 us)
THREAD_MIN_NUMEL = 1 << 16  # elements


class _Job(ctypes.Structure):
    _fields_ = [
        ("scheme", ctypes.c_int32), ("dtype", ctypes.c_int32), ("n", ctypes.c_int64), ("block", ctypes.c_int64),
        ("x", ctypes.c_void_p), ("codes", ctypes.c_void_p), ("absmax", ctypes.c_void_p),
        ("mids", ctypes.c_void_p), ("lut", ctypes.c_void_p), ("values", ctypes.c_void_p),
        ("lut_shift", ctypes.c_int32), ("lut_base", ctypes.c_int32), ("lut_size", ctypes.c_int32),
        ("nthreads", ctypes.c_int32),
    ]


_lib = None


def available() -> bool:
    """Whether the native kernels are built (the torch reference is used otherwise)."""
    global _lib
    if _lib is None:
        try:
            lib = _native.load("quant")
        except ImportError:
            _lib = False
            return False
        for fn in (lib.tsq_quantize, lib.tsq_dequantize):
            fn.argtypes = [ctypes.POINTER(_Job)]
            fn.restype = ctypes.c_int
        _lib = lib
    return _lib is not False


def default_threads(numel: int) -> int:
    if numel < THREAD_MIN_NUMEL:
        return 1
    return max(1, min(torch.get_num_threads(), os.cpu_count() or 1))


def _job(scheme: str, x: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, block: int,
         nthreads: int | None) -> _Job:
    j = _Job(scheme=SCHEME_IDS[scheme], dtype=DTYPES[x.dtype], n=x.numel(), block=block, x=x.data_ptr(),
             codes=codes.data_ptr(), absmax=absmax.data_ptr(),
             nthreads=nthreads if nthreads is not None else default_threads(x.numel()))
    if scheme in DYNAMIC:
        t = build_tables(*DYNAMIC[scheme])  # cached: the arrays outlive the call
        j.mids, j.lut, j.values = t.mids.ctypes.data, t.lut.ctypes.data, t.values.ctypes.data
        j.lut_shift, j.lut_base, j.lut_size = 15, t.lut_base, t.lut_size
    return j


def _check(rc: int, what: str) -> None:
    if rc < 0:
        raise OSError(-rc, f"native {what} failed: {os.strerror(-rc)}")
    if rc > 0:
        raise TierstoreValueError(f"x holds NaN or Inf in {rc} block(s); a block-wise quantizer needs finite "
                                  f"values (check for overflow before quantizing)")


def quantize(scheme: str, x: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, block: int,
             nthreads: int | None = None) -> None:
    j = _job(scheme, x, codes, absmax, block, nthreads)
    _check(_lib.tsq_quantize(ctypes.byref(j)), "quantize")


def dequantize(scheme: str, codes: torch.Tensor, absmax: torch.Tensor, out: torch.Tensor, block: int,
               nthreads: int | None = None) -> None:
    j = _job(scheme, out, codes, absmax, block, nthreads)
    _check(_lib.tsq_dequantize(ctypes.byref(j)), "dequantize")
