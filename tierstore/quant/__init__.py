"""Block-wise quantizers: linear int8/int4 and dynamic 8-bit maps, their numcodecs codecs, the 8-bit
optimizer-state policy and quantized collectives (qwZ / qgZ). See docs/quant.md.

Imports only torch, numpy, numcodecs and tierstore.errors / tierstore._native (nothing from io/ or the store).
The codecs are registered with numcodecs when ``tierstore.quant.codecs`` is imported (this package does).
Schemes are records in one registry (``tierstore.quant.schemes``, [Note: scheme registry]); quantized bytes
have one layout (``tierstore.quant.packed``, [Note: packed layout]).
"""
from __future__ import annotations

from .codecs import BlockInt4, BlockInt8, BlockQuant, Dynamic8, codec_for  # registers the codecs with numcodecs
from .dynamic import build_tables, magnitudes
from .layout import DEFAULT_BLOCK, MAX_BLOCK, MIN_BLOCK, num_blocks
from .packed import codes_nbytes
from .quantized import Quantized, dequantize, empty_quantized, error_bound, quantize
from .schemes import SCHEMES, Scheme, register

__all__ = [
    "BlockInt4", "BlockInt8", "BlockQuant", "Dynamic8", "codec_for", "DEFAULT_BLOCK", "MAX_BLOCK", "MIN_BLOCK",
    "SCHEMES", "Scheme", "Quantized", "build_tables", "codes_nbytes", "dequantize", "empty_quantized", "error_bound",
    "magnitudes", "num_blocks", "quantize", "register",
]
