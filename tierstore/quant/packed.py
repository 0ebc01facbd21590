"""The packed quantized buffer: one block-quantized tensor in one contiguous uint8 buffer, no header.

[Note: packed layout]
For ``n`` elements in blocks of ``block_size`` (B = ceil(n / block_size) blocks) of a scheme with ``bits``
code bits per element:

    offset  size             field
    0       4*B              absmax, float32 little-endian, one per block
    4*B     ceil(n*bits/8)   codes: 8 bits: one byte per element; 4 bits: element i in byte i // 2, even i
                             in the low nibble, a tensor of odd length leaves the last high nibble 0

absmax comes first so that it stays 4-byte aligned whatever n is (the codes need no alignment); sizes follow
from (scheme, n, block_size) alone, so the buffer carries no header. This is the one layout of quantized
bytes in the package: the codec format v1 is a 20-byte header followed by exactly this (20 is a multiple of
4, absmax stays aligned), the collectives (qwZ / qgZ) send it, and the ZeRO optimizer stores 8-bit states in
it and steps them in place with the fused kernel (views of absmax and codes, Quantized.packed()).
"""
from __future__ import annotations

import torch

from ..errors import TierstoreValueError
from .layout import num_blocks
from .schemes import Scheme, get

ABSMAX_ITEMSIZE = 4  # bytes per block: one float32


def codes_nbytes(scheme: str | Scheme, numel: int) -> int:
    """Bytes of codes for ``numel`` elements."""
    return get(scheme).codes_nbytes(numel)


def codes_offset(block_size: int, numel: int) -> int:
    """Byte offset of the codes in a packed buffer (= bytes of absmax)."""
    return ABSMAX_ITEMSIZE * num_blocks(numel, block_size)


def nbytes(scheme: str | Scheme, numel: int, block_size: int) -> int:
    """Bytes of one packed buffer."""
    return codes_offset(block_size, numel) + codes_nbytes(scheme, numel)


def code_byte(scheme: str | Scheme, element: int) -> int:
    """Byte of the codes that holds ``element``'s code (its low nibble for an even element of a 4-bit scheme)."""
    return element * get(scheme).bits // 8


def split(buf: torch.Tensor, scheme: str | Scheme, numel: int, block_size: int, *,
          readonly: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(absmax float32 view, codes uint8 view) of a packed buffer of exactly nbytes() bytes; no copy, except
    that ``readonly=True`` copies the absmax of a buffer that does not start on a 4-byte boundary (a writable
    buffer must start on one: a copy would drop the writes)."""
    need = nbytes(scheme, numel, block_size)
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() != need:
        raise TierstoreValueError(f"a packed buffer of {numel} elements ({get(scheme).name}, block {block_size}) is "
                                  f"a 1-d uint8 tensor of {need} bytes; got {buf.dtype}, shape {tuple(buf.shape)}")
    off = codes_offset(block_size, numel)
    absmax = buf[:off]
    if buf.data_ptr() % ABSMAX_ITEMSIZE:
        if not readonly:
            raise TierstoreValueError(f"a packed buffer to write must start on a {ABSMAX_ITEMSIZE}-byte boundary "
                                      f"(its float32 absmax comes first); this one starts at address "
                                      f"{buf.data_ptr():#x}: allocate it with torch.empty, or copy it")
        absmax = absmax.clone()
    return absmax.view(torch.float32), buf[off:]


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Stored codes (integers in [0, 2**bits), flat) -> the bytes of the codes field."""
    c = codes.reshape(-1).to(torch.uint8)
    if bits == 8:
        return c
    if c.numel() % 2:
        c = torch.cat([c, torch.zeros(1, dtype=torch.uint8, device=c.device)])  # the padding nibble is 0
    pairs = c.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def unpack_codes(raw: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """The bytes of the codes field -> ``numel`` stored codes (int32, flat)."""
    if bits == 8:
        return raw[:numel].to(torch.int32)
    lo = (raw & 15).to(torch.int32)
    hi = (raw >> 4).to(torch.int32)
    return torch.stack([lo, hi], dim=1).reshape(-1)[:numel]
