"""Locate and load the native libraries built from ``native/*.c`` (see setup.py).

They are loaded with ctypes.CDLL, which releases the GIL around every foreign call: a thread blocked in
io_uring_enter() never stops the others.
"""
from __future__ import annotations

import ctypes
import importlib.util
from functools import cache


class NativeMissingError(ImportError):
    pass


@cache
def load(name: str) -> ctypes.CDLL:
    """Load ``tierstore._native_<name>``; raises NativeMissingError with the fix when it was not built."""
    spec = importlib.util.find_spec(f"tierstore._native_{name}")
    if spec is None or spec.origin is None:
        raise NativeMissingError(
            f"tierstore's native library '_native_{name}' is not built; reinstall with "
            "`pip install -e .` (needs gcc and the Python headers)")
    return ctypes.CDLL(spec.origin)
