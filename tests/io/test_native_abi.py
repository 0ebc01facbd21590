"""The ctypes bindings agree with the C headers that declare the native ABI (native/*.h): every declared
function is bound with the same argument and result types, every constant has the same value, and the
structs Python lays out by hand have the fields, offsets and sizes the compiler gave them."""
from __future__ import annotations

import ctypes as C
import os
import re

import pytest
import torch

from tierstore.io import _uring, checksum
from tierstore.quant import _native as _quant
from tierstore.quant import layout, schemes

NATIVE = os.path.join(os.path.dirname(__file__), "..", "..", "native")

# C type (as written in the headers, spaces normalised) -> the ctypes type a binding must declare
_SCALARS = {"void": None, "int": C.c_int, "unsigned": C.c_uint, "uint64_t": C.c_uint64, "int64_t": C.c_int64,
            "int32_t": C.c_int32, "uint32_t": C.c_uint32}
_PROTO = re.compile(r"^\s*([A-Za-z_][\w\s\*]*?)\s*\b(tsq?_\w+)\s*\(([^)]*)\)\s*;", re.M)
_DEFINE = re.compile(r"^#define\s+(TSQ?_\w+)\s+(\d+)\s*$", re.M)
_STRUCT = re.compile(r"struct\s+(\w+)\s*\{(.*?)\}", re.S)


def _strip_comments(text: str) -> str:
    return re.sub(r"/\*.*?\*/", "", text, flags=re.S)


def _header(name: str) -> str:
    with open(os.path.join(NATIVE, name)) as f:
        return _strip_comments(f.read())


def _ctype(decl: str, structs: dict | None = None):
    """The ctypes type for a C parameter or result declaration (name removed). `structs` maps a struct's C name
    to the ctypes Structure that mirrors it: a pointer to one must be bound as a pointer to that Structure."""
    decl = " ".join(decl.replace("const ", "").replace("struct ", "").replace("*", " * ").split())
    stars = decl.count("*")
    base = decl.replace("*", "").strip()
    if stars == 0:
        return _SCALARS[base]
    if stars == 1 and base in _SCALARS and base != "void":
        return C.POINTER(_SCALARS[base])
    if stars == 1 and structs and base in structs:
        return C.POINTER(structs[base])
    if stars == 2:
        return C.POINTER(C.c_void_p)  # an array of addresses, or where one is written back
    return C.c_void_p  # struct pointers and void *: opaque addresses


def _param_type(param: str, structs: dict | None = None):
    param = param.strip()
    name = re.search(r"(\w+)\s*$", param)
    return _ctype(param[:name.start()] if name and param[:name.start()].strip() else param, structs)


def header_functions(header: str, structs: dict | None = None) -> dict[str, tuple[object, list]]:
    """name -> (result ctype, [argument ctypes]) of every `ts_*` / `tsq_*` prototype in a header."""
    out = {}
    for ret, name, params in _PROTO.findall(_header(header)):
        params = params.strip()
        args = [] if params in ("", "void") else [_param_type(p, structs) for p in params.split(",")]
        out[name] = (_ctype(ret, structs), args)
    return out


def header_structs(header: str) -> dict[str, list[str]]:
    """struct name -> its field names in declaration order (`int32_t a, b;` declares two)."""
    out = {}
    for name, body in _STRUCT.findall(_header(header)):
        fields = []
        for decl in filter(None, (d.strip() for d in body.split(";"))):
            fields += [re.search(r"(\w+)\s*$", d).group(1) for d in decl.split(",")]
        out[name] = fields
    return out


def header_defines(header: str) -> dict[str, int]:
    return {name: int(value) for name, value in _DEFINE.findall(_header(header))}


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is b
    if hasattr(a, "_type_") and hasattr(b, "_type_") and issubclass(a, C._Pointer) and issubclass(b, C._Pointer):
        return _same(a._type_, b._type_)
    if issubclass(a, C.Structure) or issubclass(b, C.Structure):
        return a is b  # a struct pointer is bound to the Structure mirroring that struct (check_layout)
    return C.sizeof(a) == C.sizeof(b) and a._type_ == b._type_


def check_bindings(lib: C.CDLL, header: str, structs: dict | None = None, at_least: int = 1) -> None:
    declared = header_functions(header, structs)
    assert len(declared) >= at_least, declared  # the parser found the prototypes
    for name, (ret, args) in declared.items():
        fn = getattr(lib, name)
        assert _same(fn.restype, ret), f"{name}: restype {fn.restype} but {header} returns {ret}"
        bound = fn.argtypes
        assert bound is not None and len(bound) == len(args), f"{name}: {bound} vs {header} {args}"
        for k, (b, a) in enumerate(zip(bound, args)):
            assert _same(b, a), f"{name} argument {k}: bound as {b}, {header} says {a}"


def check_layout(layout_fn, struct: type[C.Structure], header_fields: list[str]) -> None:
    """`layout_fn` writes sizeof, then (offset, size) per field (quant.h); the Structure must agree field by field."""
    names = [f[0] for f in struct._fields_]
    assert names == header_fields, f"{struct.__name__} fields {names} but the header declares {header_fields}"
    out = (C.c_uint64 * 128)()
    n = layout_fn(out, 128)
    assert n == 1 + 2 * len(names), n
    assert out[0] == C.sizeof(struct), f"sizeof: C {out[0]}, ctypes {C.sizeof(struct)}"
    for k, name in enumerate(names):
        field = getattr(struct, name)
        assert (out[1 + 2 * k], out[2 + 2 * k]) == (field.offset, field.size), \
            f"{struct.__name__}.{name}: C (offset, size) {(out[1 + 2 * k], out[2 + 2 * k])}, ctypes " \
            f"{(field.offset, field.size)}"
    assert layout_fn(out, n - 1) < 0  # too small: -EINVAL


def test_crc_bindings_and_constants_match_the_header():
    check_bindings(checksum.lib(), "crc.h", at_least=4)
    assert {f"TS_CRC_{k.upper()}": v for k, v in checksum.IMPLS.items()} == header_defines("crc.h")


def test_uring_bindings_match_the_header():
    check_bindings(_uring.lib(), "uring.h", at_least=15)


def test_uring_constants_match_the_header():
    defines = header_defines("uring.h")
    assert {"TS_READ", "TS_WRITE", "TS_FAULT_EIO"} <= set(defines)
    for name, value in defines.items():
        assert getattr(_uring, name.removeprefix("TS_")) == value, name


def test_ts_io_layout_is_the_compilers():
    assert list(_uring.IO_DTYPE.names) == header_structs("uring.h")["ts_io"]
    out = (C.c_uint64 * 16)()
    n = _uring.lib().ts_io_layout(out, 16)
    assert n == 1 + len(_uring.IO_DTYPE.names)
    assert out[0] == _uring.IO_DTYPE.itemsize
    for k, field in enumerate(_uring.IO_DTYPE.names):
        assert out[1 + k] == _uring.IO_DTYPE.fields[field][1], field
    assert _uring.lib().ts_io_layout(out, 2) < 0  # too small: -EINVAL, nothing written past n


needs_quant = pytest.mark.skipif(not _quant.available(), reason="tierstore._native_quant not built")
_QUANT_STRUCTS = {"tsq_job": _quant._Job, "tsq_adamw_job": _quant._AdamWJob}


@needs_quant
def test_quant_bindings_match_the_header():
    check_bindings(_quant.lib(), "quant.h", _QUANT_STRUCTS, at_least=5)


def test_quant_constants_match_the_python_values_they_mirror():
    mirrors = {"TSQ_INT8": schemes.get("int8").id, "TSQ_INT4": schemes.get("int4").id,
               "TSQ_DYN_SIGNED": schemes.get("dyn8s").id, "TSQ_DYN_UNSIGNED": schemes.get("dyn8u").id,
               "TSQ_DYN_UNSIGNED_BOUNDED": schemes.get("dyn8v").id, "TSQ_F32": layout.DTYPES[torch.float32],
               "TSQ_BF16": layout.DTYPES[torch.bfloat16], "TSQ_F16": layout.DTYPES[torch.float16],
               "TSQ_MAX_BLOCK": layout.MAX_BLOCK}
    assert header_defines("quant.h") == mirrors  # a new constant in the header is named here with its mirror


@needs_quant
@pytest.mark.parametrize("struct, layout_fn", [("tsq_job", "tsq_job_layout"),
                                               ("tsq_adamw_job", "tsq_adamw_job_layout")])
def test_quant_job_layouts_are_the_compilers(struct, layout_fn):
    check_layout(getattr(_quant.lib(), layout_fn), _QUANT_STRUCTS[struct], header_structs("quant.h")[struct])


@pytest.mark.parametrize("decl, want", [("int", C.c_int), ("const struct ts_io *", C.c_void_p),
                                        ("uint64_t *", C.POINTER(C.c_uint64)),
                                        ("void **", C.POINTER(C.c_void_p)), ("void", None),
                                        ("struct ts_ring **", C.POINTER(C.c_void_p)),
                                        ("const tsq_job *", C.POINTER(_quant._Job))])
def test_header_type_mapping(decl, want):
    assert _same(_ctype(decl, _QUANT_STRUCTS), want)


def test_header_struct_fields_are_parsed():
    fields = header_structs("quant.h")["tsq_adamw_job"]
    assert fields[8:11] == ["m_mids", "m_values", "m_lut"]  # `const float *m_mids, *m_values; const int32_t *m_lut;`
    assert fields[14:19] == ["lut_shift", "m_lut_base", "m_lut_size", "v_lut_base", "v_lut_size"]


def test_a_binding_that_disagrees_is_caught(monkeypatch):
    """The check can fail: a binding declared with a narrower argument than the header says is reported."""
    lib = _uring.lib()
    monkeypatch.setattr(lib.ts_inject, "argtypes", [C.c_void_p, C.c_uint32, C.c_int])
    with pytest.raises(AssertionError, match="ts_inject argument 1"):
        test_uring_bindings_match_the_header()


@needs_quant
def test_a_struct_that_disagrees_is_caught():
    """The layout check can fail: a Structure with one field narrower than the header's is reported."""
    class Narrow(C.Structure):
        _fields_ = [(n, C.c_int32 if n == "n" else t) for n, t in _quant._Job._fields_]

    with pytest.raises(AssertionError, match="Narrow.n: C"):
        check_layout(_quant.lib().tsq_job_layout, Narrow, header_structs("quant.h")["tsq_job"])


@needs_quant
def test_a_struct_binding_that_disagrees_is_caught(monkeypatch):
    lib = _quant.lib()
    monkeypatch.setattr(lib.tsq_quantize, "argtypes", [C.POINTER(_quant._AdamWJob)])
    with pytest.raises(AssertionError, match="tsq_quantize argument 0"):
        test_quant_bindings_match_the_header()
