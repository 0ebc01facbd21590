"""The forms of offloaded inference's weights: how a bucket is stored (in the compute dtype, bf16 / fp16, or int8's
block-wise encoding) and how what is read is turned back into the compute dtype. See inference.py.

[Note: converting the weights back]
A bucket stored in another dtype than the compute dtype is converted on the thread that read it, once per bucket
per forward -- per generated token, for every weight of the model -- so the conversion is on the path of every
token and is kept to one pass over the bytes, into memory that is already faulted in:
- the result goes into the store's recycled result memory ([Note: result memory] in tiers/host.py), not a fresh
  allocation: a fresh mapping per bucket faults in every page anew each token, which on this machine cost as much
  as the conversion itself;
- int8 buckets are stored as the int8 codec's encoded bytes in a plain uint8 tensor (the store sees no codec) and
  dequantized here straight into the result by tierstore.quant's native kernel (vectorised, threaded). Through
  the store's codec path the bytes were copied out, decoded into a new array and copied twice more: measured on
  a 4 Mi-element bucket, 52 ms against 8 ms read and decoded this way.
The store checksums the encoded bytes either way; the codec's header is checked when they are parsed.
"""
from __future__ import annotations

import functools

import torch

from ...tiers.host import result_empty


@functools.cache
def int8_codec():
    from ...quant import codec_for
    return codec_for("int8", dtype=torch.float32)


def stored_form(value: torch.Tensor, weights_dtype) -> torch.Tensor:
    """A bucket's values (flat, the compute dtype) as they go into the store: `weights_dtype` (None: as they are),
    or for 'int8' the codec's encoding as uint8 bytes."""
    if weights_dtype == "int8":
        from ...quant.codecs import encoded_nbytes
        codec = int8_codec()
        out = torch.empty(encoded_nbytes("int8", value.numel(), codec.block_size), dtype=torch.uint8)
        codec.encode_into(value.to(torch.float32), out)
        return out
    return value.to(weights_dtype or value.dtype)


def to_compute(stored: torch.Tensor, dtype: torch.dtype, numel: int, weights_dtype) -> torch.Tensor:
    """`stored` (what stored_form gave, read back) as `numel` values of `dtype`: itself when it is that already,
    else a new tensor in recycled result memory ([Note: converting the weights back])."""
    if weights_dtype != "int8" and stored.dtype == dtype:
        return stored
    out = result_empty(numel * dtype.itemsize).view(dtype)
    if weights_dtype == "int8":
        from ...quant.quantized import dequantize
        dequantize(int8_codec().parse(stored.numpy()), out=out)
    else:
        out.copy_(stored)
    return out
