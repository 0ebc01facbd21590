"""ctypes binding of native/quant.c (``tierstore._native_quant``), declared in native/quant.h
(tests/io/test_native_abi.py checks these against it). One call = one whole tensor."""
from __future__ import annotations

import ctypes
import math
import os

import torch

from .. import _native
from ..errors import TierstoreValueError
from .layout import DTYPES
from .schemes import Scheme, fused_adamw_pair, get

#: tensors smaller than this run on one thread (starting threads would cost more than it saves)
THREAD_MIN_NUMEL = 1 << 16  # elements


# tsq_job in native/quant.h
class _Job(ctypes.Structure):
    _fields_ = [
        ("scheme", ctypes.c_int32), ("dtype", ctypes.c_int32), ("n", ctypes.c_int64), ("block", ctypes.c_int64),
        ("x", ctypes.c_void_p), ("codes", ctypes.c_void_p), ("absmax", ctypes.c_void_p),
        ("mids", ctypes.c_void_p), ("lut", ctypes.c_void_p), ("values", ctypes.c_void_p),
        ("lut_shift", ctypes.c_int32), ("lut_base", ctypes.c_int32), ("lut_size", ctypes.c_int32),
        ("nthreads", ctypes.c_int32),
    ]


# tsq_adamw_job in native/quant.h
class _AdamWJob(ctypes.Structure):
    _fields_ = [
        ("n", ctypes.c_int64), ("block", ctypes.c_int64), ("param", ctypes.c_void_p), ("grad", ctypes.c_void_p),
        ("m_codes", ctypes.c_void_p), ("m_absmax", ctypes.c_void_p), ("v_codes", ctypes.c_void_p),
        ("v_absmax", ctypes.c_void_p),
        ("m_mids", ctypes.c_void_p), ("m_values", ctypes.c_void_p), ("m_lut", ctypes.c_void_p),
        ("v_mids", ctypes.c_void_p), ("v_values", ctypes.c_void_p), ("v_lut", ctypes.c_void_p),
        ("lut_shift", ctypes.c_int32), ("m_lut_base", ctypes.c_int32), ("m_lut_size", ctypes.c_int32),
        ("v_lut_base", ctypes.c_int32), ("v_lut_size", ctypes.c_int32),
        ("maximize", ctypes.c_int32), ("lerp_small", ctypes.c_int32),
        ("decay", ctypes.c_float), ("w1", ctypes.c_float), ("one_minus_w1", ctypes.c_float),
        ("beta2", ctypes.c_float), ("w2", ctypes.c_float), ("bc2_sqrt", ctypes.c_float), ("eps", ctypes.c_float),
        ("step_size", ctypes.c_float), ("nthreads", ctypes.c_int32), ("isa", ctypes.c_int32),
    ]


_lib: ctypes.CDLL | None = None
_missing: ImportError | None = None  # why the library could not be loaded (kept: find_spec is not free)


def lib() -> ctypes.CDLL:
    """The kernels' library with its functions typed as native/quant.h declares them; ImportError (with the fix)
    when it is not built."""
    global _lib, _missing
    if _lib is None:
        if _missing is not None:
            raise _missing
        try:
            lib = _native.load("quant")
        except ImportError as e:
            _missing = e
            raise
        for fn in (lib.tsq_quantize, lib.tsq_dequantize):
            fn.argtypes = [ctypes.POINTER(_Job)]
            fn.restype = ctypes.c_int
        lib.tsq_adamw_step.argtypes = [ctypes.POINTER(_AdamWJob)]
        lib.tsq_adamw_step.restype = ctypes.c_int
        for fn in (lib.tsq_job_layout, lib.tsq_adamw_job_layout):
            fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_uint]
            fn.restype = ctypes.c_int
        _lib = lib
    return _lib


def available() -> bool:
    """Whether the native kernels are built (the torch reference is used otherwise)."""
    try:
        lib()
    except ImportError:
        return False
    return True


def default_threads(numel: int) -> int:
    if numel < THREAD_MIN_NUMEL:
        return 1
    return max(1, min(torch.get_num_threads(), os.cpu_count() or 1))


def _job(scheme: str | Scheme, x: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, block: int,
         nthreads: int | None) -> _Job:
    s = get(scheme)
    if not s.native:
        raise TierstoreValueError(f"scheme {s.name!r} has no native kernel (its Scheme record says native=False); "
                                  f"use backend='torch' or 'auto'")
    j = _Job(scheme=s.id, dtype=DTYPES[x.dtype], n=x.numel(), block=block, x=x.data_ptr(),
             codes=codes.data_ptr(), absmax=absmax.data_ptr(),
             nthreads=nthreads if nthreads is not None else default_threads(x.numel()))
    if s.code_map is not None:
        t = s.code_map()  # cached: the arrays outlive the call
        j.mids, j.lut, j.values = t.mids.ctypes.data, t.lut.ctypes.data, t.values.ctypes.data
        j.lut_shift, j.lut_base, j.lut_size = 15, t.lut_base, t.lut_size
    return j


def _check(rc: int, what: str) -> None:
    if rc < 0:
        raise OSError(-rc, f"native {what} failed: {os.strerror(-rc)}")
    if rc > 0:
        raise TierstoreValueError(f"x holds NaN or Inf in {rc} block(s); a block-wise quantizer needs finite "
                                  f"values (check for overflow before quantizing)")


def quantize(scheme: str | Scheme, x: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, block: int,
             nthreads: int | None = None) -> None:
    j = _job(scheme, x, codes, absmax, block, nthreads)
    _check(lib().tsq_quantize(ctypes.byref(j)), "quantize")


def dequantize(scheme: str | Scheme, codes: torch.Tensor, absmax: torch.Tensor, out: torch.Tensor, block: int,
               nthreads: int | None = None) -> None:
    j = _job(scheme, out, codes, absmax, block, nthreads)
    _check(lib().tsq_dequantize(ctypes.byref(j)), "dequantize")


def adamw_step(param: torch.Tensor, grad: torch.Tensor, m_codes: torch.Tensor, m_absmax: torch.Tensor,
               v_codes: torch.Tensor, v_absmax: torch.Tensor, block: int, v_scheme: str | Scheme, *, step: float,
               lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, maximize: bool,
               nthreads: int | None = None, isa: int = -1, m_scheme: str | Scheme = "dyn8s") -> None:
    """One fused AdamW step on fp32 ``param`` / ``grad`` (contiguous, n elements) with m in ``m_scheme`` and v in
    ``v_scheme`` codes (schemes whose records name them for the "m" / "v" slot, schemes.fused_adamw_pair),
    updated in place. ``step`` is the step number after incrementing (1 on the first step). Constants are
    computed in double and rounded to fp32 as torch's fused kernel does. ``isa`` caps the instruction set for tests
    (-1: what the CPU has; 0: the portable C loops; 1: AVX-512F; 2: AVX-512 VBMI), all giving the same bytes."""
    import numpy as np

    if not fused_adamw_pair(m_scheme, v_scheme):
        raise TierstoreValueError(f"the fused AdamW kernel cannot step m in {get(m_scheme).name!r} and v in "
                                  f"{get(v_scheme).name!r} codes; use adamw_step_8bit(backend='torch')")
    n = param.numel()
    m_map, v_map = get(m_scheme).code_map, get(v_scheme).code_map
    assert m_map is not None and v_map is not None  # fused_adamw_pair: both are dynamic maps
    tm, tv = m_map(), v_map()
    w1 = np.float32(1.0 - beta1)
    j = _AdamWJob(
        n=n, block=block, param=param.data_ptr(), grad=grad.data_ptr(), m_codes=m_codes.data_ptr(),
        m_absmax=m_absmax.data_ptr(), v_codes=v_codes.data_ptr(), v_absmax=v_absmax.data_ptr(),
        m_mids=tm.mids.ctypes.data, m_values=tm.values.ctypes.data, m_lut=tm.lut.ctypes.data,
        v_mids=tv.mids.ctypes.data, v_values=tv.values.ctypes.data, v_lut=tv.lut.ctypes.data,
        lut_shift=15, m_lut_base=tm.lut_base, m_lut_size=tm.lut_size, v_lut_base=tv.lut_base,
        v_lut_size=tv.lut_size, maximize=int(bool(maximize)), lerp_small=int(abs(w1) < np.float32(0.5)),
        decay=1.0 - lr * weight_decay, w1=float(w1), one_minus_w1=float(np.float32(1.0) - w1), beta2=beta2,
        w2=1.0 - beta2, bc2_sqrt=math.sqrt(1.0 - beta2 ** step), eps=eps, step_size=lr / (1.0 - beta1 ** step),
        nthreads=nthreads if nthreads is not None else default_threads(n), isa=isa)
    rc = lib().tsq_adamw_step(ctypes.byref(j))
    if rc > 0:
        raise TierstoreValueError(f"the AdamW step made m or v NaN or Inf in {rc} block(s) (their 8-bit codes are "
                                  f"now unspecified); check the gradients for NaN/Inf before stepping")
    _check(rc, "adamw_step")
