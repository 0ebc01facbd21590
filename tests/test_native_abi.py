"""The ctypes bindings agree with the C headers that declare the native ABI (native/*.h): every declared
function is bound with the same argument and result types, every constant has the same value, and the
structs Python lays out by hand have the offsets the compiler gave them."""
from __future__ import annotations

import ctypes as C
import os
import re

import pytest

from tierstore.io import _uring

NATIVE = os.path.join(os.path.dirname(__file__), "..", "native")

# C type (as written in the headers, spaces normalised) -> the ctypes type a binding must declare
_SCALARS = {"void": None, "int": C.c_int, "unsigned": C.c_uint, "uint64_t": C.c_uint64, "int64_t": C.c_int64,
            "int32_t": C.c_int32, "uint32_t": C.c_uint32}
_PROTO = re.compile(r"^\s*([A-Za-z_][\w\s\*]*?)\s*\b(ts_\w+)\s*\(([^)]*)\)\s*;", re.M)
_DEFINE = re.compile(r"^#define\s+(TS_\w+)\s+(\d+)\s*$", re.M)


def _strip_comments(text: str) -> str:
    return re.sub(r"/\*.*?\*/", "", text, flags=re.S)


def _ctype(decl: str):
    """The ctypes type for a C parameter or result declaration (name removed)."""
    decl = " ".join(decl.replace("const ", "").replace("*", " * ").split())
    stars = decl.count("*")
    base = decl.replace("*", "").strip()
    if stars == 0:
        return _SCALARS[base]
    if stars == 1 and base in _SCALARS and base != "void":
        return C.POINTER(_SCALARS[base])
    if stars == 2:
        return C.POINTER(C.c_void_p)  # an array of addresses, or where one is written back
    return C.c_void_p  # struct pointers and void *: opaque addresses


def _param_type(param: str):
    param = param.strip()
    name = re.search(r"(\w+)\s*$", param)
    return _ctype(param[:name.start()] if name and param[:name.start()].strip() else param)


def header_functions(path: str) -> dict[str, tuple[object, list]]:
    """name -> (result ctype, [argument ctypes]) of every `ts_*` prototype in a header."""
    out = {}
    for ret, name, params in _PROTO.findall(_strip_comments(open(path).read())):
        params = params.strip()
        args = [] if params in ("", "void") else [_param_type(p) for p in params.split(",")]
        out[name] = (_ctype(ret), args)
    return out


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is b
    if hasattr(a, "_type_") and hasattr(b, "_type_") and issubclass(a, C._Pointer) and issubclass(b, C._Pointer):
        return _same(a._type_, b._type_)
    return C.sizeof(a) == C.sizeof(b) and a._type_ == b._type_


def test_uring_bindings_match_the_header():
    lib = _uring.lib()
    declared = header_functions(os.path.join(NATIVE, "uring.h"))
    assert len(declared) >= 15, declared  # the parser found the prototypes
    for name, (ret, args) in declared.items():
        fn = getattr(lib, name)
        assert _same(fn.restype, ret), f"{name}: restype {fn.restype} but uring.h returns {ret}"
        bound = fn.argtypes
        assert bound is not None and len(bound) == len(args), f"{name}: {bound} vs uring.h {args}"
        for k, (b, a) in enumerate(zip(bound, args)):
            assert _same(b, a), f"{name} argument {k}: bound as {b}, uring.h says {a}"


def test_uring_constants_match_the_header():
    defines = dict(_DEFINE.findall(open(os.path.join(NATIVE, "uring.h")).read()))
    assert {"TS_READ", "TS_WRITE", "TS_FAULT_EIO"} <= set(defines)
    for name, value in defines.items():
        assert getattr(_uring, name.removeprefix("TS_")) == int(value), name


def test_ts_io_layout_is_the_compilers():
    out = (C.c_uint64 * 16)()
    n = _uring.lib().ts_io_layout(out, 16)
    assert n == 1 + len(_uring.IO_DTYPE.names)
    assert out[0] == _uring.IO_DTYPE.itemsize
    for k, field in enumerate(_uring.IO_DTYPE.names):
        assert out[1 + k] == _uring.IO_DTYPE.fields[field][1], field
    assert _uring.lib().ts_io_layout(out, 2) < 0  # too small: -EINVAL, nothing written past n


@pytest.mark.parametrize("decl, want", [("int", C.c_int), ("const struct ts_io *", C.c_void_p),
                                        ("uint64_t *", C.POINTER(C.c_uint64)),
                                        ("void **", C.POINTER(C.c_void_p)), ("void", None),
                                        ("struct ts_ring **", C.POINTER(C.c_void_p))])
def test_header_type_mapping(decl, want):
    assert _same(_ctype(decl), want)


def test_a_binding_that_disagrees_is_caught(monkeypatch):
    """The check can fail: a binding declared with a narrower argument than the header says is reported."""
    lib = _uring.lib()
    monkeypatch.setattr(lib.ts_inject, "argtypes", [C.c_void_p, C.c_uint32, C.c_int])
    with pytest.raises(AssertionError, match="ts_inject argument 1"):
        test_uring_bindings_match_the_header()
