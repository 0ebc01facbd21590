"""numcodecs codecs for the block quantizers, so a quantized tensor can be stored by the Store (as a
TieredTensor's codec) or in a zarr array (zarr format 2: pass the codec as the compressor).

[Note: encoded format, version 1]
Little-endian, a 20-byte header, then the packed buffer of packed.py ([Note: packed layout]: the per-block
absmax, then the codes):

    offset  size  field
    0       3     magic b"TSQ"
    3       1     format version (1)
    4       1     scheme id (Scheme.id: 0 int8, 1 int4, 2 dyn8 signed, 3 dyn8 unsigned, 4 dyn8 unsigned
                  bounded rounding, others as registered; schemes.py)
    5       1     element dtype id (0 float32, 1 bfloat16, 2 float16)
    6       2     reserved, 0
    8       4     block size (elements)
    12      8     element count n
    20      4*B   absmax, float32, B = ceil(n / block size)
    20+4B   C     codes: n bytes (4-bit schemes: ceil(n / 2), element i in byte i // 2, even i in the low nibble)

Which codec stores a scheme is in its Scheme record (codec_id, codec_config): the built-in schemes keep the
codec ids they were stored with (tierstore.block_int8, tierstore.block_int4, tierstore.dynamic8 with
signed / rounding), a registered scheme uses tierstore.blockquant with its name in the config.
The shape is not stored (the Store's manifest and zarr's metadata hold it). Golden bytes of every scheme are
committed under tests/fixtures/quant/ so that the format cannot change silently. A change is a new version.
"""
from __future__ import annotations

import struct
import warnings

import numpy as np
import torch
from numcodecs.abc import Codec
from numcodecs.compat import ensure_contiguous_ndarray, ensure_ndarray
from numcodecs.registry import register_codec

from ..errors import CorruptionError, TierstoreValueError
from . import packed
from .layout import DEFAULT_BLOCK, DTYPE_NAMES, DTYPES, DTYPES_BY_NAME, check_block_size
from .quantized import Quantized, dequantize, empty_quantized, quantize
from .schemes import GENERIC_CODEC_ID, for_codec, get

MAGIC = b"TSQ"
VERSION = 1
_HEADER = struct.Struct("<3sBBBHIQ")  # magic, version, scheme, dtype, reserved, block size, n
HEADER_NBYTES = _HEADER.size  # bytes
_NP_VIEW = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: np.uint16}


def encoded_nbytes(scheme: str, numel: int, block_size: int) -> int:
    """Bytes of one encoded tensor."""
    return HEADER_NBYTES + packed.nbytes(scheme, numel, block_size)


def _as_tensor(buf, dtype: torch.dtype) -> torch.Tensor:
    arr = ensure_contiguous_ndarray(buf).reshape(-1).view(np.uint8)
    if arr.nbytes % (torch.finfo(dtype).bits // 8):
        raise TierstoreValueError(f"buffer of {arr.nbytes} bytes is not a whole number of {dtype} elements")
    with warnings.catch_warnings():  # read-only input (bytes) is only read: encode never writes to it
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(arr.view(_NP_VIEW[dtype]))
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t


class _BlockQuantCodec(Codec):
    """Shared encode/decode; subclasses fix the scheme. Lossy: decode(encode(x)) is within error_bound()."""

    codec_id: str = ""
    scheme: str = ""

    def __init__(self, block_size: int = DEFAULT_BLOCK, dtype: str = "float32"):
        check_block_size(block_size)
        if dtype not in DTYPES_BY_NAME:
            raise TierstoreValueError(f"dtype={dtype!r} is not supported; use one of {sorted(DTYPES_BY_NAME)}")
        self.block_size = block_size  # elements
        self.dtype = dtype  # of the decoded elements (encode reads the buffer as this dtype)

    def _torch_dtype(self) -> torch.dtype:
        return DTYPES_BY_NAME[self.dtype]

    def encode(self, buf) -> bytes:
        x = _as_tensor(buf, self._torch_dtype())
        n = x.numel()
        out = bytearray(encoded_nbytes(self.scheme, n, self.block_size))
        self.encode_into(x, out)
        return bytes(out)

    def encode_into(self, x: torch.Tensor, out) -> int:
        """Encode tensor ``x`` into the writable buffer ``out`` (encoded_nbytes() bytes, e.g. a pinned host
        buffer), allocating nothing; returns the bytes written."""
        n = x.numel()
        if x.dtype != self._torch_dtype():
            raise TierstoreValueError(f"x has dtype {x.dtype}; this codec was configured with dtype={self.dtype!r}")
        need = encoded_nbytes(self.scheme, n, self.block_size)
        raw = torch.frombuffer(out, dtype=torch.uint8) if not isinstance(out, torch.Tensor) else out.view(-1)
        if raw.numel() < need:
            raise TierstoreValueError(f"out holds {raw.numel()} bytes; encoding {n} elements needs {need}")
        raw[:HEADER_NBYTES].copy_(torch.frombuffer(bytearray(_HEADER.pack(
            MAGIC, VERSION, get(self.scheme).id, DTYPES[x.dtype], 0, self.block_size, n)), dtype=torch.uint8))
        q = Quantized.packed(raw[HEADER_NBYTES: need], self.scheme, n, self.block_size, x.dtype)
        quantize(x, self.scheme, self.block_size, out=q)
        return need

    def parse(self, buf) -> Quantized:
        """The Quantized view (no copy) of an encoded buffer; raises CorruptionError when it is not one of ours."""
        arr = ensure_ndarray(buf).reshape(-1).view(np.uint8)
        with warnings.catch_warnings():  # read-only bytes: we only ever read through this view
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(arr)
        if raw.numel() < HEADER_NBYTES:
            raise CorruptionError(f"encoded buffer of {raw.numel()} bytes is shorter than the {HEADER_NBYTES}-byte "
                                  f"header")
        magic, version, scheme_id, dtype_id, _, block, n = _HEADER.unpack(raw[:HEADER_NBYTES].numpy().tobytes())
        if magic != MAGIC or version != VERSION:
            raise CorruptionError(f"not a tierstore quantized buffer (magic {magic!r}, version {version}); "
                                  f"expected {MAGIC!r} version {VERSION}")
        if scheme_id != get(self.scheme).id or block != self.block_size:
            raise CorruptionError(f"buffer holds scheme id {scheme_id}, block {block}; this codec decodes "
                                  f"{self.scheme!r}, block {self.block_size}")
        dtype = {v: k for k, v in DTYPES.items()}.get(dtype_id)
        need = encoded_nbytes(self.scheme, n, block)
        if dtype is None or raw.numel() != need:
            raise CorruptionError(f"encoded buffer is {raw.numel()} bytes for {n} elements (expected {need}) or "
                                  f"has an unknown dtype id {dtype_id}")
        # readonly: a buffer from an arbitrary offset gets its absmax copied to align the floats
        return Quantized.packed(raw[HEADER_NBYTES:], self.scheme, n, block, dtype, readonly=True)

    def decode(self, buf, out=None):
        q = self.parse(buf)
        if out is not None:
            t = _as_tensor(out, q.dtype)
            dequantize(q, out=t)
            return out
        t = dequantize(q)
        return t.view(torch.uint16).numpy() if q.dtype == torch.bfloat16 else t.numpy()

    def get_config(self) -> dict:
        return {"id": self.codec_id, "block_size": self.block_size, "dtype": self.dtype}

    @classmethod
    def from_config(cls, config: dict):
        config = dict(config)
        config.pop("id", None)
        return cls(**config)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(block_size={self.block_size}, dtype={self.dtype!r})"

    def __eq__(self, other) -> bool:
        return type(self) is type(other) and self.get_config() == other.get_config()

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.get_config().items())))


class BlockInt8(_BlockQuantCodec):
    """Linear symmetric int8 with per-block absmax; |x - x^| <= absmax / 254."""

    codec_id = "tierstore.block_int8"
    scheme = "int8"


class BlockInt4(_BlockQuantCodec):
    """Linear symmetric int4, two per byte, per-block absmax; |x - x^| <= absmax / 14."""

    codec_id = "tierstore.block_int4"
    scheme = "int4"


class Dynamic8(_BlockQuantCodec):
    """Dynamic 8-bit map (signed: first moments; unsigned: second moments, never maps v > 0 to 0).

    ``rounding`` (unsigned only): "nearest" (scheme dyn8u) or "bounded" (dyn8v: never under-estimates by more
    than a factor 1 + 9/256; [Note: bounded rounding of second moments] in dynamic.py). The config carries
    "rounding" only when it is not "nearest", so configs written before it existed read back unchanged."""

    codec_id = "tierstore.dynamic8"

    def __init__(self, block_size: int = DEFAULT_BLOCK, dtype: str = "float32", signed: bool = True,
                 rounding: str = "nearest"):
        super().__init__(block_size, dtype)
        self.signed = bool(signed)
        s = for_codec(self.codec_id, signed=self.signed, rounding=rounding)
        if s is None:
            raise TierstoreValueError(f"rounding={rounding!r} is not available with signed={self.signed}; use "
                                      f"'nearest', or 'bounded' with signed=False")
        self.rounding = rounding
        self.scheme = s.name

    def get_config(self) -> dict:
        cfg = {**super().get_config(), "signed": self.signed}
        if self.rounding != "nearest":
            cfg["rounding"] = self.rounding
        return cfg

    def __repr__(self) -> str:
        return (f"Dynamic8(block_size={self.block_size}, dtype={self.dtype!r}, signed={self.signed}, "
                f"rounding={self.rounding!r})")


class BlockQuant(_BlockQuantCodec):
    """Any registered scheme by name (the codec of schemes registered after the built-in ones; schemes.py).

    A reader must register the scheme before it decodes (or reopens a Store holding it)."""

    codec_id = GENERIC_CODEC_ID

    def __init__(self, block_size: int = DEFAULT_BLOCK, dtype: str = "float32", scheme: str = ""):
        super().__init__(block_size, dtype)
        s = get(scheme)
        if s.codec_id != self.codec_id:
            raise TierstoreValueError(f"scheme {s.name!r} is stored by codec {s.codec_id!r}; use codec_for({s.name!r})")
        self.scheme = s.name

    def get_config(self) -> dict:
        return {**super().get_config(), "scheme": self.scheme}

    def __repr__(self) -> str:
        return f"BlockQuant(block_size={self.block_size}, dtype={self.dtype!r}, scheme={self.scheme!r})"


_CODECS = {cls.codec_id: cls for cls in (BlockInt8, BlockInt4, Dynamic8, BlockQuant)}
for _cls in _CODECS.values():
    register_codec(_cls)


def codec_for(scheme: str, block_size: int = DEFAULT_BLOCK, dtype: torch.dtype = torch.float32) -> _BlockQuantCodec:
    """The codec object for a registered scheme name ('int8', 'int4', 'dyn8s', 'dyn8u', 'dyn8v', ...)."""
    name = DTYPE_NAMES.get(dtype)
    if name is None:
        raise TierstoreValueError(f"dtype={dtype} is not supported; use float32, bfloat16 or float16")
    s = get(scheme)
    cls = _CODECS.get(s.codec_id)
    if cls is None:
        raise TierstoreValueError(f"scheme {s.name!r} names codec {s.codec_id!r}, which is not one of tierstore's "
                                  f"({sorted(_CODECS)}); register it with codec_id left at its default")
    return cls(block_size, name, **dict(s.codec_config))


__all__ = ["BlockInt4", "BlockInt8", "BlockQuant", "Dynamic8", "HEADER_NBYTES", "codec_for", "encoded_nbytes",
           "empty_quantized"]
