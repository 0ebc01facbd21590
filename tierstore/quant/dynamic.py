"""Dynamic 8-bit maps (Dettmers et al., "8-bit Optimizers via Block-wise Quantization", ICLR 2022, sec. 2/3).

[Note: the dynamic map]
The paper's dynamic tree format spends a code's bits on an exponent and a linear fraction: after the sign
bit (signed map only), a run of ``e`` zero bits says "this value is in decade 10^-e", a single 1 bit ends
the run (the indicator), and the ``F`` bits after it quantize the fraction linearly over the decade
[0.1, 1]. Short exponent runs leave many fraction bits (fine steps near the block's absmax), long runs
reach far down (1e-6 for the signed map) with few. Our construction, from that description:

    magnitude code c (width W = 7 bits signed, 8 bits unsigned), c > 0:
        e = W - bit_length(c)          leading zeros: the decade
        F = W - e - 1                  bits after the indicator
        k = c - 2**F                   the fraction bits as an integer, 0 .. 2**F - 1
        value(c) = 10**-e * (0.1 + 0.9 * (k + 1) / 2**F)
    value(0) = 0

Each decade's grid is the right end points of 2**F equal steps over [0.1, 1] x 10^-e, so the top code is
exactly 1.0 (a block's absmax element comes back exact) and the bottom of one decade meets the top of the
next: values increase strictly with the magnitude code, the table is sorted and an encoder can search it.
(bitsandbytes' create_dynamic_map takes the mid points of those steps instead and appends 1.0 by hand.)

- Signed map (first moments, m): byte = sign << 7 | magnitude code over W = 7 bits; 127 positive and 127
  negative values, smallest nonzero 1e-6, top decade step 0.9/64. Code 0x80 ("-0") decodes to 0 and is
  never produced.
- Unsigned map (second moments, v >= 0): no sign bit; it becomes one more fraction bit: W = 8, 255
  positive values, smallest 1e-7, top decade step 0.9/128 (half the signed map's error near absmax).

Encoding is nearest-value against the fp32 table: r = |x| * (1 / absmax) in fp32, code = the number of
fp32 midpoints (between consecutive table values, computed in float64 and rounded to fp32) strictly below
r, so a value exactly on a midpoint goes to the smaller magnitude. Error bound: half the largest gap times
absmax: 0.9/64/2 = 0.00703125 x absmax (signed), 0.9/128/2 = 0.003515625 x absmax (unsigned).

[Note: zero-point]
Exact nearest rounding sends a second moment v < (smallest value / 2) x absmax to code 0, and Adam's
update m / (sqrt(v) + eps) then explodes for that element (Li et al., "Memory Efficient Optimizers with
4-bit States", arXiv 2309.01507, sec. 4.1). With gradients whose scale varies 1e4x inside one block, v
varies 1e8x, past the map's reach. The unsigned encoder therefore never sends v > 0 to code 0: such a
value gets code 1 (1e-7 x absmax) instead. That overestimates a tiny v, which only shrinks its update; the
error stays <= 1e-7 x absmax, inside the bound above. The signed map keeps exact nearest rounding: a first
moment rounded to 0 gives a zero update, which is harmless.

[Note: bounded rounding of second moments]
Never sending v > 0 to code 0 is not enough. The map is coarse in its low decades: the step just above a
decade's smallest code is 1.5-5.5x relative (e.g. 1e-7 -> 5.5e-7 at the bottom), so nearest rounding can
under-estimate a small v by ~2x, 8-bit EMA rounding then keeps it there (beta2 = 0.999 moves v by 0.1% a
step, far less than half a gap), and m / sqrt(v) is inflated by ~1.4x.
The scheme ``dyn8v`` (rounding="bounded", used for exp_avg_sq) rounds to nearest except that it never
under-estimates by more than a factor 1 + DELTA, DELTA = 9/256: the code boundary between codes c and c + 1
is min(midpoint, value(c) x (1 + DELTA)) instead of the midpoint, so

    v / (1 + DELTA) <= v^   and   |v - v^| <= 0.003515625 x absmax      (both up to fp32 rounding)

and quantization can inflate no Adam step by more than sqrt(1 + DELTA) = 1.0174. DELTA = 9/256 is exactly
the worst relative under-estimate nearest rounding makes in the top decade (half a gap, 0.9/256, at 0.1):
the top decade keeps plain nearest rounding and the absolute bound of ``dyn8u``; only the coarse low
decades round upward. Pure rounding up (DELTA = 0) would bias every v upward and so shrink every step.
Code 0 is still reached only by v == 0 (its boundary is min(mid, 0 x (1 + DELTA)) = 0).

[Note: two-level LUT]
Searching 255 code boundaries per element is the slow part of encoding. The native kernel instead looks up
the fp32 bit pattern of r: bucket = (bits(r) >> 15) - base (the exponent and the top 8 mantissa bits, i.e.
buckets 1/256 of a binade wide). No bucket holds two boundaries (build_tables() checks it; the tightest spot
is the unsigned map's top decade: steps of 0.00703 against buckets of at most 0.0039), so one int32 entry
per bucket says everything: entry = below << 16 | t, ``below`` = the number of boundaries below the bucket's
lower end, ``t`` = the low 15 bits of the boundary inside the bucket (0x7FFF when there is none). Within a
bucket all floats share their upper 17 bits, so "boundary < r" is "low15(r) > t", and
code = below + (low15(r) > t): one gather per element, no dependent second load. Values below the first
bucket clamp to bucket 0, which is given no boundary (below every boundary: bounded rounding's boundary at
0 is the zero-point rule's job), values above 1 to the last bucket (above every boundary, t = 0x7FFF).
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from functools import cache

import numpy as np
import torch

LUT_MANTISSA_BITS = 8
LUT_SHIFT = 23 - LUT_MANTISSA_BITS
#: dyn8v: the most a second moment may be under-estimated, as a relative factor 1 + DELTA
#: ([Note: bounded rounding of second moments]); half the top decade's gap over its smallest value
BOUNDED_DELTA = 9 / 256
ROUNDINGS = ("nearest", "bounded")


def magnitudes(width: int) -> np.ndarray:
    """The map's magnitudes in float64, indexed by magnitude code (0 .. 2**width - 1), increasing."""
    out = np.zeros(1 << width, dtype=np.float64)
    for c in range(1, 1 << width):
        e = width - c.bit_length()  # leading zero bits: the decade
        f = width - e - 1  # fraction bits after the indicator
        k = c - (1 << f)
        out[c] = 10.0 ** -e * (0.1 + 0.9 * (k + 1) / (1 << f))
    return out


@dataclass(frozen=True)
class DynamicTables:
    """Everything the encoder and decoder need for one map (numpy arrays the native kernel reads)."""

    signed: bool
    values: np.ndarray  # float32[256]: byte code -> value in [-1, 1]
    mids: np.ndarray  # float32[magnitude codes]: boundary above each magnitude code (the midpoint for nearest
    #                   rounding, min(midpoint, value x (1 + BOUNDED_DELTA)) for bounded); the last is +inf
    lut: np.ndarray  # int32[lut_size]: bucket -> codes below the bucket << 16 | low 15 bits of the boundary in it
    lut_base: int
    half_gap: float  # max |x - x^| / absmax for this map
    rounding: str = "nearest"

    @property
    def lut_size(self) -> int:
        return int(self.lut.shape[0])


def _f2u(f: float) -> int:
    return struct.unpack("<I", struct.pack("<f", f))[0]


def _u2f(u: int) -> float:
    return struct.unpack("<f", struct.pack("<I", u))[0]


@cache
def build_tables(signed: bool, rounding: str = "nearest") -> DynamicTables:
    """The signed (first-moment) or unsigned (second-moment) map and its lookup tables. See [Note: the dynamic map].

    ``rounding="bounded"`` (unsigned only): see [Note: bounded rounding of second moments]."""
    if rounding not in ROUNDINGS or (signed and rounding != "nearest"):
        raise ValueError(f"rounding={rounding!r} is not available for the {'signed' if signed else 'unsigned'} map")
    mag = magnitudes(7 if signed else 8)
    if signed:
        values = np.concatenate([mag, -mag]).astype(np.float32)
        values[128] = 0.0  # "-0": never produced, decodes to 0
    else:
        values = mag.astype(np.float32)
    mids64 = (mag[:-1] + mag[1:]) / 2
    if rounding == "bounded":
        mids64 = np.minimum(mids64, mag[:-1] * (1 + BOUNDED_DELTA))
    mids = np.concatenate([mids64.astype(np.float32), np.array([np.inf], dtype=np.float32)])
    # [Note: two-level LUT]
    emin = math.floor(math.log2(float(mids[mids > 0][0]))) - 1  # bounded rounding: mids[0] == 0
    base = _f2u(2.0 ** emin) >> LUT_SHIFT
    top = _f2u(1.0) >> LUT_SHIFT  # the bucket starting at 1.0 is the last one
    size = top - base + 1
    lo = np.array([0.0] + [_u2f((base + b) << LUT_SHIFT) for b in range(1, size)], dtype=np.float32)
    hi = np.concatenate([lo[1:], np.array([np.inf], dtype=np.float32)])
    lut = np.searchsorted(mids, lo, side="left")  # midpoints strictly below lo
    nxt = np.minimum(lut + 1, len(mids) - 1)
    ok = (lut == len(mids) - 1) | (mids[nxt] >= hi)
    if not ok.all():  # pragma: no cover - a property of the construction, checked on every build
        raise AssertionError("dynamic map LUT buckets hold two midpoints; raise LUT_MANTISSA_BITS")
    nxt_bits = mids[np.minimum(lut, len(mids) - 1)].view(np.uint32).astype(np.int64)
    inside = (nxt_bits >> LUT_SHIFT) == base + np.arange(size)  # the next boundary lies in this bucket
    inside[0] = False  # bucket 0 also takes every r below it: no boundary (see the note)
    low_mask = (1 << LUT_SHIFT) - 1
    packed = (lut.astype(np.int64) << 16) | np.where(inside, nxt_bits & low_mask, low_mask)
    # max |x - x^|: the larger side of any code's rounding interval [boundary below, boundary above]
    lower = np.concatenate([[0.0], mids64])
    upper = np.concatenate([mids64, [1.0]])
    err = float(np.maximum(mag - lower, upper - mag).max())
    return DynamicTables(signed=signed, values=values, mids=mids, lut=packed.astype(np.int32), lut_base=base,
                         half_gap=err, rounding=rounding)


@cache
def _torch_tables(signed: bool, rounding: str = "nearest",
                  device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    t = build_tables(signed, rounding)
    return torch.from_numpy(t.values.copy()).to(device), torch.from_numpy(t.mids[:-1].copy()).to(device)


def encode_reference(x: torch.Tensor, absmax: torch.Tensor, signed: bool, rounding: str = "nearest") -> torch.Tensor:
    """Codes for ``x`` (fp32, shape (blocks, block)) with per-block ``absmax`` (fp32, (blocks,)); torch only.

    The specification the native kernel must match byte for byte (tests hold them equal)."""
    _, mids = _torch_tables(signed, rounding, x.device)
    inv = torch.where(absmax > 0, torch.ones_like(absmax) / absmax, torch.zeros_like(absmax))
    r = x.abs() * inv[:, None]
    codes = torch.bucketize(r, mids, right=False)  # number of midpoints strictly below r
    if signed:
        codes = codes | ((x < 0) & (codes != 0)).to(codes.dtype) << 7
    else:
        codes = torch.where((codes == 0) & (r > 0), torch.ones_like(codes), codes)  # [Note: zero-point]
    return codes.to(torch.uint8)


def decode_reference(codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    """fp32 values for ``codes`` (uint8, (blocks, block)) with per-block ``absmax``; torch only."""
    values, _ = _torch_tables(signed, "nearest", codes.device)
    return values[codes.long()] * absmax[:, None]


def error_bound(signed: bool, rounding: str = "nearest") -> float:
    """max |x - x^| / absmax of a block (half the map's largest gap; the same for bounded rounding)."""
    return build_tables(signed, rounding).half_gap
