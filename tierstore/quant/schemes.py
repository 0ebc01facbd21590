"""The quantization schemes: one ``Scheme`` record each, in one registry every user looks up.

[Note: scheme registry]
A scheme is everything the layer needs to know to quantize with it, store it and step with it, in one frozen
record: its name and id (the id is the scheme byte of the codec format and ``tsq_job.scheme`` in
native/quant.c), code bits per element, whether it represents negative values, its dynamic code map (None
for a linear scheme), its torch kernel (the reference the native kernel is held to byte for byte, and the
only kernel of a scheme without a native one), whether tsq_quantize / tsq_dequantize implement it, which
moment of tsq_adamw_step its codes can hold, and which numcodecs codec (id and the config fields that pick
it) stores it. quantize / dequantize, the packed layout (packed.py), the codecs, the 8-bit optimizer
states, the collectives, the ZeRO optimizer and ``tierstore bench quant`` read these fields; none of them
compares scheme names.

Adding a scheme is ``register(Scheme(...))`` with its torch kernel: quantize, dequantize, error_bound, the
codec (``codec_for(name)``, config ``{"id": "tierstore.blockquant", "scheme": name, ...}``), the Store and
the collectives work with it at once. A native kernel is optional (``native=True`` once native/quant.c
handles the id); so is a fused AdamW slot. Ids 0-4 are the built-in schemes below and are part of the
stored format: never reuse or renumber one.

The torch kernel works on whole blocks: ``encode(x, absmax)`` takes fp32 ``x`` of shape (blocks, block)
and the per-block absmax (fp32, (blocks,)) and returns the stored code of every element, an integer tensor
of the same shape with values in [0, 2**bits); ``decode(codes, absmax)`` maps them back to fp32. How codes
sit in bytes (one per byte, or two per byte for 4 bits) is the packed layout's business, not the kernel's.
"""
from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

from ..errors import TierstoreValueError
from . import blockwise, dynamic

#: the codec of schemes registered after the built-in ones (config {"scheme": name})
GENERIC_CODEC_ID = "tierstore.blockquant"
#: code widths the packed layout stores (packed.py): one code per byte, or two per byte
CODE_BITS = (4, 8)
#: moments of the fused AdamW kernel (tsq_adamw_step): "m" = a signed dynamic map with the sign in bit 7,
#: "v" = an unsigned dynamic map that never sends a value > 0 to code 0 ([Note: zero-point], dynamic.py)
FUSED_ADAMW_SLOTS = ("m", "v")


@dataclass(frozen=True)
class Scheme:
    """One quantization scheme. See [Note: scheme registry]."""

    name: str
    id: int  # 0..255: the codec header's scheme byte and native/quant.c's tsq_job.scheme
    bits: int  # code bits per element, 8 or 4
    signed: bool  # whether it represents negative values (False: inputs must be >= 0)
    encode: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # torch kernel: (x, absmax) -> stored codes
    decode: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # torch kernel: (codes, absmax) -> fp32
    error_bound: float  # max |x - x^| / (block absmax)
    code_map: Callable[[], dynamic.DynamicTables] | None = None  # dynamic map tables; None for a linear scheme
    native: bool = False  # tsq_quantize / tsq_dequantize (native/quant.c) implement scheme id `id`
    fused_adamw: str | None = None  # the moment tsq_adamw_step can keep in these codes: "m", "v" or None
    codec_id: str = GENERIC_CODEC_ID  # numcodecs codec id that stores it
    # (key, value) pairs of that codec's config that pick this scheme; the None default is replaced in __post_init__
    codec_config: tuple = field(default=None)  # type: ignore[arg-type]

    def __post_init__(self):
        if self.codec_config is None:
            object.__setattr__(self, "codec_config", (("scheme", self.name),) if self.codec_id == GENERIC_CODEC_ID
                               else ())

    def codes_nbytes(self, numel: int) -> int:
        """Bytes of codes for ``numel`` elements."""
        return (numel * self.bits + 7) // 8


_REGISTRY: dict[str, Scheme] = {}
#: name -> Scheme, read-only; follows register() / unregister()
SCHEMES = types.MappingProxyType(_REGISTRY)


def register(scheme: Scheme) -> Scheme:
    """Add ``scheme`` to the registry; a name or id already taken, or a field out of range, is refused."""
    if not isinstance(scheme, Scheme):
        raise TierstoreValueError(f"register() takes a Scheme record, not {type(scheme).__name__}")
    if scheme.name in _REGISTRY:
        raise TierstoreValueError(f"scheme {scheme.name!r} is already registered; pick another name")
    taken = {s.id: s.name for s in _REGISTRY.values()}
    if not 0 <= scheme.id <= 255 or scheme.id in taken:
        raise TierstoreValueError(f"scheme id {scheme.id} of {scheme.name!r} is out of 0..255 or taken (by "
                                  f"{taken.get(scheme.id)!r}); ids in use: {sorted(taken)}")
    if scheme.bits not in CODE_BITS:
        raise TierstoreValueError(f"scheme {scheme.name!r} has bits={scheme.bits}; the packed layout stores "
                                  f"codes of {' or '.join(map(str, CODE_BITS))} bits")
    if scheme.fused_adamw not in (None, *FUSED_ADAMW_SLOTS):
        raise TierstoreValueError(f"scheme {scheme.name!r} has fused_adamw={scheme.fused_adamw!r}; use None, "
                                  f"'m' or 'v'")
    if scheme.fused_adamw is not None and (scheme.code_map is None or scheme.bits != 8):
        raise TierstoreValueError(f"scheme {scheme.name!r}: the fused AdamW kernel steps 8-bit dynamic-map codes "
                                  f"only; give it a code_map or set fused_adamw=None")
    same = for_codec(scheme.codec_id, **dict(scheme.codec_config))
    if same is not None:
        raise TierstoreValueError(f"scheme {scheme.name!r}: codec {scheme.codec_id!r} with config "
                                  f"{dict(scheme.codec_config)} already stores {same.name!r}; leave codec_id and "
                                  f"codec_config at their defaults")
    _REGISTRY[scheme.name] = scheme
    return scheme


def unregister(name: str) -> None:
    """Remove a scheme registered with register() (tests, plugins); data stored with it can no longer be read."""
    _REGISTRY.pop(name, None)


def get(scheme: str | Scheme) -> Scheme:
    """The record of a scheme name (a Scheme is returned as it is)."""
    if isinstance(scheme, Scheme):
        return scheme
    s = _REGISTRY.get(scheme)
    if s is None:
        raise TierstoreValueError(f"scheme={scheme!r} is not known; use one of {sorted(_REGISTRY)} or register() "
                                  f"it first (tierstore.quant.schemes)")
    return s


def by_id(scheme_id: int) -> Scheme | None:
    """The scheme with this id, or None."""
    return next((s for s in _REGISTRY.values() if s.id == scheme_id), None)


def for_codec(codec_id: str, **config) -> Scheme | None:
    """The scheme that the codec ``codec_id`` with these config fields stores, or None."""
    for s in _REGISTRY.values():
        if s.codec_id == codec_id and dict(s.codec_config) == config:
            return s
    return None


def fused_adamw_pair(m: str | Scheme, v: str | Scheme) -> bool:
    """Whether tsq_adamw_step can step first moments in ``m`` codes and second moments in ``v`` codes."""
    return get(m).fused_adamw == "m" and get(v).fused_adamw == "v"


# -- the built-in schemes -----------------------------------------------------------------------------------
def _linear_encode(x: torch.Tensor, absmax: torch.Tensor, name: str) -> torch.Tensor:
    q = blockwise.encode_reference(x, absmax, name)
    return q & 0xFF if name == "int8" else q + 8  # int8: two's complement byte; int4: q + 8 in a nibble


def _linear_decode(codes: torch.Tensor, absmax: torch.Tensor, name: str) -> torch.Tensor:
    c = codes.to(torch.int32)
    q = torch.where(c > 127, c - 256, c) if name == "int8" else c - 8
    return blockwise.decode_reference(q, absmax, name)


def _dynamic_encode(x: torch.Tensor, absmax: torch.Tensor, signed: bool, rounding: str) -> torch.Tensor:
    return dynamic.encode_reference(x, absmax, signed, rounding)


def _dynamic_decode(codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    return dynamic.decode_reference(codes.to(torch.uint8), absmax, signed)


for _name, _id, _bits, _codec in (("int8", 0, 8, "tierstore.block_int8"), ("int4", 1, 4, "tierstore.block_int4")):
    register(Scheme(_name, _id, _bits, True, partial(_linear_encode, name=_name), partial(_linear_decode, name=_name),
                    blockwise.error_bound(_name), native=True, codec_id=_codec))
for _name, _id, _signed, _rounding in (("dyn8s", 2, True, "nearest"), ("dyn8u", 3, False, "nearest"),
                                       ("dyn8v", 4, False, "bounded")):
    register(Scheme(_name, _id, 8, _signed, partial(_dynamic_encode, signed=_signed, rounding=_rounding),
                    partial(_dynamic_decode, signed=_signed), dynamic.error_bound(_signed, _rounding),
                    code_map=partial(dynamic.build_tables, _signed, _rounding), native=True,
                    fused_adamw="m" if _signed else "v", codec_id="tierstore.dynamic8",
                    codec_config=(("signed", _signed), ("rounding", _rounding))))
