"""How a tensor's value is encoded at rest: codecs, dtype names, and flat byte views of tensors.

The lowest layer of the store (imports only torch, numpy and errors): the residency layer encodes with it
before writing to a persistent tier, the manifest names codecs and dtypes with it, zarr export maps dtypes.

[Note: codecs]
A codec says how a tensor is encoded at rest. Identity (raw bytes) is the default and has a fast path.
Any numcodecs-style object works: `encode(ndarray) -> bytes-like`, `decode(bytes) -> ndarray-like`,
`get_config() -> dict` with an "id", rebuilt by `numcodecs.get_codec(config)` (so a quantized codec
registered with numcodecs is stored in the manifest and found again on reopen). Dtypes numpy lacks
(bfloat16, float8) are handed to codecs as same-width unsigned integers.
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable

import numpy as np
import torch

from .errors import CorruptionError, TierstoreValueError

_NUMPY_SAME_WIDTH = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class IdentityCodec:
    """Raw bytes: what is stored is the tensor's memory."""

    codec_id = "identity"

    def get_config(self) -> dict:
        return {"id": "identity"}

    def encode(self, buf):
        return buf

    def decode(self, buf, out=None):
        return buf

    def __repr__(self) -> str:
        return "IdentityCodec()"


IDENTITY = IdentityCodec()


def codec_from_config(config: dict | None):
    if not config or config.get("id") == "identity":
        return IDENTITY
    import numcodecs

    return numcodecs.get_codec(dict(config))


def codec_config(codec) -> dict | None:
    return None if codec is None or codec is IDENTITY else codec.get_config()


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise TierstoreValueError(f"unknown dtype {name!r} in the manifest (written by a newer torch?)")
    return dt


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a contiguous CPU tensor; dtypes numpy lacks become same-width unsigned ints."""
    try:
        return t.numpy()
    except TypeError:
        return t.view(torch.uint8).numpy().view(_NUMPY_SAME_WIDTH[t.element_size()]).reshape(tuple(t.shape))


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 view (no copy)."""
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def out_bytes(out: torch.Tensor) -> torch.Tensor | None:
    """The bytes of `out` as a flat uint8 view when a persistent tier can read straight into it (contiguous,
    CPU)."""
    if out.device.type == "cpu" and out.is_contiguous():
        return as_bytes(out)
    return None


def copy_host(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[:] = src for contiguous uint8 CPU tensors of one size, as a memmove (no torch thread pool)."""
    if src.numel():
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel())


def nbytes_of(shape, dtype: torch.dtype) -> int:
    n = dtype.itemsize  # bytes per element
    for s in shape:
        n *= s
    return n


def encode(codec, cpu: torch.Tensor, nbytes: int) -> torch.Tensor:
    """Contiguous CPU tensor of `nbytes` decoded bytes -> contiguous CPU tensor of the bytes kept at rest.

    [Note: a zero-size tensor has no encoding]
    It is stored as zero bytes whatever its codec, and decoded without the codec: numcodecs' Zstd and
    Blosc cannot decode what they encode for an empty array, and Zlib decodes it to a 1-byte array.
    Shape and dtype come from the manifest, so nothing is lost."""
    if codec is IDENTITY or nbytes == 0:
        return cpu  # its memory as it is (a persistent tier takes bytes: no uint8 view needed)
    enc = codec.encode(to_numpy(cpu))
    arr = np.frombuffer(memoryview(enc).cast("B"), dtype=np.uint8)
    return torch.from_numpy(arr.copy())


def decode(codec, data: torch.Tensor, shape: torch.Size, dtype: torch.dtype, name: str,
           empty: Callable[[tuple, torch.dtype], torch.Tensor]) -> torch.Tensor:
    """uint8 tensor read back -> CPU tensor of `shape`/`dtype` (`empty` allocates it when the codec decodes
    into new memory). `name` names the tensor in errors."""
    nbytes = nbytes_of(shape, dtype)  # bytes
    if nbytes == 0:  # [Note: a zero-size tensor has no encoding]
        return torch.empty(shape, dtype=dtype)
    if codec is IDENTITY:
        return data.view(dtype).view(shape)
    try:  # the bytes passed their crc32c: a codec that cannot decode them is not the one that wrote them
        dec = codec.decode(data.numpy().tobytes())
        raw = np.ascontiguousarray(np.asarray(dec)).reshape(-1).view(np.uint8)
    except Exception as e:
        raise CorruptionError(f"codec {codec!r} cannot decode the stored bytes of {name!r} "
                              f"({type(e).__name__}: {e}); the manifest names another codec than the one "
                              "that wrote them: restore it from a backup") from None
    if raw.nbytes != nbytes:
        raise TierstoreValueError(f"codec {codec!r} decoded {raw.nbytes} bytes for {name!r}; expected {nbytes}")
    out = empty(tuple(shape), dtype)
    as_bytes(out).copy_(torch.from_numpy(raw.copy()))
    return out
