"""How a block-quantized tensor is cut into blocks, and the checks every entry point shares.

A tensor of ``n`` elements (any shape, flattened in C order) is cut into blocks of ``block_size`` elements;
the last block may be partial. Each block has one fp32 ``absmax`` (the largest magnitude in it) and one code
per element, of its scheme's width (schemes.py); how absmax and codes sit in bytes is packed.py's
[Note: packed layout].
"""
from __future__ import annotations

import torch

from ..errors import TierstoreValueError

MIN_BLOCK = 64  # elements
MAX_BLOCK = 8192  # elements (native/quant.c keeps one block of fp32 scratch on the stack)
DEFAULT_BLOCK = 256  # elements

#: element dtypes the kernels read and write, with their ids in native/quant.c
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
DTYPES_BY_NAME = {v: k for k, v in DTYPE_NAMES.items()}


def check_block_size(block_size: int) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or not (
            MIN_BLOCK <= block_size <= MAX_BLOCK) or block_size % 2:
        raise TierstoreValueError(
            f"block_size={block_size!r} is not allowed; use an even number of elements from {MIN_BLOCK} to "
            f"{MAX_BLOCK} (256 is the default)")
    return block_size


def check_dtype(dtype: torch.dtype, what: str) -> torch.dtype:
    if dtype not in DTYPES:
        raise TierstoreValueError(f"{what} has dtype {dtype}; quantizers accept float32, bfloat16 and float16 "
                                  f"(convert with .float() first)")
    return dtype


def num_blocks(numel: int, block_size: int) -> int:
    """Blocks (absmax values) for ``numel`` elements."""
    return -(-numel // block_size)


_CPU = torch.device("cpu")


def check_buffer(t: torch.Tensor, what: str, dtype: torch.dtype, numel: int,
                 device: torch.device = _CPU) -> torch.Tensor:
    """An out= buffer: right dtype, contiguous, on ``device``, exactly ``numel`` elements."""
    if not isinstance(t, torch.Tensor):
        raise TierstoreValueError(f"{what} must be a torch.Tensor, not {type(t).__name__}")
    if t.dtype != dtype or t.numel() != numel or not t.is_contiguous() or t.device != device:
        raise TierstoreValueError(
            f"{what} must be a contiguous {dtype} tensor of {numel} elements on {device}; got {t.dtype}, "
            f"{t.numel()} elements, contiguous={t.is_contiguous()}, device={t.device}")
    return t
