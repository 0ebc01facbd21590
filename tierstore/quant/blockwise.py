"""Linear symmetric block-wise quantization: int8, and int4 packed two per byte (qwZ / qgZ in ZeRO++).

Per block: absmax = max |x|; int8 codes q = round_half_even(x * (127 / absmax)) in [-127, 127] (-128 is never
produced, so the grid is symmetric), decoded x^ = q * (absmax / 127). int4: the same with 7 in place of 127
and q + 8 stored in a nibble (0 is never produced; the stored code is schemes.py's, the nibble packing
packed.py's). All in fp32; ``127 / absmax`` and ``absmax / 127`` are true fp32 divisions, computed once
per block.

Error bound: |x - x^| <= absmax / 254 (int8), absmax / 14 (int4), per block, up to fp32 rounding of the
product x * inv (a relative 2^-24, which the tests allow for).

The functions here are the torch reference: the specification the native kernel (native/quant.c) is held
to byte for byte. Callers use tierstore.quant.quantize / dequantize, which pick the native kernel.
"""
from __future__ import annotations

import torch

LEVELS = {"int8": 127, "int4": 7}


def error_bound(scheme: str) -> float:
    """max |x - x^| / absmax of a block."""
    return 0.5 / LEVELS[scheme]


def _ratio(num: torch.Tensor | float, den: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    num = num if isinstance(num, torch.Tensor) else torch.full_like(like, num)
    den = den if isinstance(den, torch.Tensor) else torch.full_like(like, den)
    return num / den  # elementwise IEEE division, as the C kernel does


def encode_reference(x: torch.Tensor, absmax: torch.Tensor, scheme: str) -> torch.Tensor:
    """Signed integer codes (int32, shape of x = (blocks, block)) for fp32 ``x`` and its per-block ``absmax``."""
    lv = LEVELS[scheme]
    inv = torch.where(absmax > 0, _ratio(float(lv), absmax, absmax), torch.zeros_like(absmax))
    return torch.round(x * inv[:, None]).clamp_(-lv, lv).to(torch.int32)


def decode_reference(q: torch.Tensor, absmax: torch.Tensor, scheme: str) -> torch.Tensor:
    return q.to(torch.float32) * _ratio(absmax, float(LEVELS[scheme]), absmax)[:, None]
