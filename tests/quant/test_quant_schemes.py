"""The scheme registry and the packed layout: a scheme is one record (+ its kernel), quantized bytes have one
layout. A toy scheme registered here runs through quantize, the codec, a Store and bench quant untouched."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from numcodecs import get_codec

from tierstore.errors import TierstoreValueError
from tierstore.quant import (
    SCHEMES,
    Quantized,
    _native,
    codec_for,
    collectives,
    dequantize,
    error_bound,
    packed,
    quantize,
    schemes,
)
from tierstore.quant.codecs import HEADER_NBYTES, BlockQuant
from tierstore.quant.schemes import Scheme


# -- two toy schemes, in torch only: nothing else in the package knows them --------------------------------
def _off8_encode(x, absmax):  # linear int8 in offset binary: q + 128
    inv = torch.where(absmax > 0, 127.0 / absmax, torch.zeros_like(absmax))
    return torch.round(x * inv[:, None]).clamp_(-127, 127).to(torch.int32) + 128


def _off8_decode(codes, absmax):
    return (codes.to(torch.float32) - 128) * (absmax / 127.0)[:, None]


def _u4_encode(x, absmax):  # unsigned linear 4-bit: round(x * 15 / absmax)
    inv = torch.where(absmax > 0, 15.0 / absmax, torch.zeros_like(absmax))
    return torch.round(x * inv[:, None]).clamp_(0, 15).to(torch.int32)


def _u4_decode(codes, absmax):
    return codes.to(torch.float32) * (absmax / 15.0)[:, None]


TOYS = [Scheme("toy_off8", 200, 8, True, _off8_encode, _off8_decode, 0.5 / 127),
        Scheme("toy_u4", 201, 4, False, _u4_encode, _u4_decode, 0.5 / 15)]


@pytest.fixture(params=TOYS, ids=lambda s: s.name)
def toy(request):
    s = schemes.register(request.param)
    yield s
    schemes.unregister(s.name)


def _data(n, signed, seed=0):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 3
    return x if signed else x.abs()


def _within_bound(x, y, scheme, bs):
    pad = torch.zeros(-(-x.numel() // bs) * bs)
    pad[:x.numel()] = x.abs()
    amax = pad.view(-1, bs).amax(1).repeat_interleave(bs)[:x.numel()]
    return bool(((y - x).abs() <= (error_bound(scheme) + 2 ** -20) * amax).all())


def test_toy_scheme_quantizes_with_its_torch_kernel(toy):
    x = _data(1001, toy.signed)  # odd: a 4-bit scheme leaves the last high nibble 0
    q = quantize(x, toy.name, 128)  # backend "auto": no native kernel, so its torch kernel
    assert q.scheme == toy.name and q.codes.numel() == toy.codes_nbytes(1001) == (1001 * toy.bits + 7) // 8
    assert _within_bound(x, dequantize(q), toy.name, 128)
    codes = toy.encode(torch.cat([x, torch.zeros(23)]).view(-1, 128), q.absmax).reshape(-1)[:1001]
    if toy.bits == 8:
        assert torch.equal(q.codes, codes.to(torch.uint8))
    else:  # element i in byte i // 2, even i in the low nibble
        assert torch.equal(q.codes[:500] & 15, codes[0:1000:2].to(torch.uint8))
        assert torch.equal(q.codes[:500] >> 4, codes[1:1000:2].to(torch.uint8))
        assert q.codes[500] >> 4 == 0 and q.codes[500] & 15 == codes[1000]
    part = q.narrow(128, 1001 - 128)
    assert torch.equal(dequantize(part), dequantize(q)[128:])
    with pytest.raises(TierstoreValueError, match="no native kernel"):
        quantize(x, toy.name, 128, backend="native")


def test_toy_scheme_round_trips_through_its_codec_and_a_store(toy, tmp_path):
    from tierstore.store import Store

    codec = codec_for(toy.name, 128)
    assert isinstance(codec, BlockQuant) and codec.scheme == toy.name
    cfg = json.loads(json.dumps(codec.get_config()))
    assert cfg == {"id": "tierstore.blockquant", "block_size": 128, "dtype": "float32", "scheme": toy.name}
    assert get_codec(cfg) == codec
    x = _data(5000, toy.signed, seed=1)
    enc = codec.encode(x.numpy())
    assert enc[4] == toy.id  # the scheme byte of the header
    # the codec's bytes are the header, then the packed buffer
    buf = torch.empty(packed.nbytes(toy.name, 5000, 128), dtype=torch.uint8)
    quantize(x, toy.name, 128, out=Quantized.packed(buf, toy.name, 5000, 128))
    assert enc[HEADER_NBYTES:] == buf.numpy().tobytes()
    y = torch.from_numpy(np.asarray(codec.decode(enc)).copy())
    assert _within_bound(x, y, toy.name, 128)
    with Store(tmp_path) as s:
        s.put("w", x, "nvme", codec=codec)
        assert torch.equal(s.get("w"), y)
    with Store.open(tmp_path) as s:  # the manifest's codec config finds the registered scheme again
        assert torch.equal(s.get("w"), y)


def test_bench_quant_runs_every_registered_scheme(toy, capsys):
    from tierstore.cli import main

    rc = main(["bench", "quant", "--numel", "4096", "--blocks", "256", "--rounds", "1", "--no-step",
               "--no-torch-reference", "--json", "-"])
    assert rc == 0
    out = capsys.readouterr().out
    body = json.loads(out[out.index("{"):])
    assert {c["scheme"] for c in body["cases"]} >= set(SCHEMES) and toy.name in SCHEMES


def test_registry_refuses_what_it_cannot_store():
    s = TOYS[0]
    with pytest.raises(TierstoreValueError, match="already registered"):
        schemes.register(Scheme("int8", 200, 8, True, s.encode, s.decode, 0.1))
    with pytest.raises(TierstoreValueError, match="taken"):
        schemes.register(Scheme("toy_dup", 2, 8, True, s.encode, s.decode, 0.1))
    with pytest.raises(TierstoreValueError, match="bits"):
        schemes.register(Scheme("toy_3", 202, 3, True, s.encode, s.decode, 0.1))
    with pytest.raises(TierstoreValueError, match="fused AdamW"):
        schemes.register(Scheme("toy_m", 203, 8, True, s.encode, s.decode, 0.1, fused_adamw="m"))
    with pytest.raises(TierstoreValueError, match="already stores 'dyn8s'"):
        schemes.register(Scheme("toy_c", 204, 8, True, s.encode, s.decode, 0.1, codec_id="tierstore.dynamic8",
                                codec_config=(("signed", True), ("rounding", "nearest"))))
    with pytest.raises(TierstoreValueError, match="not known"):
        codec_for("toy_never_registered")
    assert not {"toy_dup", "toy_3", "toy_m", "toy_c"} & set(SCHEMES)
    odd = schemes.register(Scheme("toy_foreign", 205, 8, True, s.encode, s.decode, 0.1, codec_id="other.codec"))
    try:
        with pytest.raises(TierstoreValueError, match="not one of tierstore's"):
            codec_for(odd.name)
    finally:
        schemes.unregister(odd.name)


def test_builtin_records_pin_the_stored_ids_and_codecs():
    """Ids and codec configs are part of stored data (codec header, manifests): they never change."""
    assert {n: s.id for n, s in SCHEMES.items() if s.id < 200} == {"int8": 0, "int4": 1, "dyn8s": 2, "dyn8u": 3,
                                                                    "dyn8v": 4}
    assert [codec_for(n).get_config() for n in ("int8", "int4", "dyn8s", "dyn8u", "dyn8v")] == [
        {"id": "tierstore.block_int8", "block_size": 256, "dtype": "float32"},
        {"id": "tierstore.block_int4", "block_size": 256, "dtype": "float32"},
        {"id": "tierstore.dynamic8", "block_size": 256, "dtype": "float32", "signed": True},
        {"id": "tierstore.dynamic8", "block_size": 256, "dtype": "float32", "signed": False},
        {"id": "tierstore.dynamic8", "block_size": 256, "dtype": "float32", "signed": False, "rounding": "bounded"}]
    assert all(SCHEMES[n].native for n in ("int8", "int4", "dyn8s", "dyn8u", "dyn8v"))


def test_fused_adamw_pairs_come_from_the_records():
    assert schemes.fused_adamw_pair("dyn8s", "dyn8v") and schemes.fused_adamw_pair("dyn8s", "dyn8u")
    assert not schemes.fused_adamw_pair("dyn8v", "dyn8s") and not schemes.fused_adamw_pair("int8", "dyn8v")
    if _native.available():
        p, g = torch.zeros(512), torch.ones(512)
        c, a = torch.zeros(512, dtype=torch.uint8), torch.zeros(2)
        with pytest.raises(TierstoreValueError, match="cannot step"):
            _native.adamw_step(p, g, c, a, c.clone(), a.clone(), 256, "int8", step=1.0, lr=1e-3, beta1=0.9,
                               beta2=0.999, eps=1e-8, weight_decay=0.0, maximize=False)


def test_packed_layout_is_absmax_then_codes():
    n, bs = 300, 64  # 5 blocks, the last partial
    for name, codes in (("int8", 300), ("int4", 150), ("dyn8s", 300)):
        assert packed.nbytes(name, n, bs) == 4 * 5 + codes == collectives.payload_nbytes(name, n, bs)
        buf = torch.empty(packed.nbytes(name, n, bs), dtype=torch.uint8)
        q = Quantized.packed(buf, name, n, bs)
        quantize(torch.linspace(-1, 1, n), name, bs, out=q)
        assert q.absmax.data_ptr() == buf.data_ptr() and q.codes.data_ptr() == buf.data_ptr() + 20
        assert torch.equal(buf[:20].view(torch.float32), q.absmax) and q.absmax[0] == 1.0
    with pytest.raises(TierstoreValueError, match="301 bytes"):
        Quantized.packed(torch.empty(300, dtype=torch.uint8), "int8", 281, bs)
    odd = torch.empty(packed.nbytes("int8", n, bs) + 1, dtype=torch.uint8)[1:]  # starts off a 4-byte boundary
    odd.copy_(torch.arange(odd.numel()).to(torch.uint8))
    with pytest.raises(TierstoreValueError, match="4-byte boundary"):
        Quantized.packed(odd, "int8", n, bs)
    ro = Quantized.packed(odd, "int8", n, bs, readonly=True)  # read-only: the absmax is copied to align it
    assert ro.absmax.data_ptr() % 4 == 0 and ro.absmax.view(torch.uint8).tolist() == list(range(20))


def test_collectives_take_any_signed_scheme_and_refuse_unsigned_ones():
    # checked before any process group is touched
    with pytest.raises(TierstoreValueError, match="no negative values"):
        collectives.reduce_scatter_quantized(torch.ones(8), scheme="dyn8u")
    with pytest.raises(TierstoreValueError, match="no negative values"):
        collectives.all_gather_quantized(torch.ones(8), scheme="dyn8v")
