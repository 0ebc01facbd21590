"""numcodecs codecs: config round trip through JSON, registry, golden bytes, zarr arrays, corruption."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from numcodecs import get_codec

from tierstore.errors import CorruptionError
from tierstore.quant import BlockInt4, BlockInt8, Dynamic8, build_tables, codec_for, error_bound

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "quant", "golden_v1.json")
CODECS = [BlockInt8(64), BlockInt4(128, "float16"), Dynamic8(256, signed=True), Dynamic8(8192, "bfloat16", False),
          Dynamic8(256, signed=False, rounding="bounded")]


@pytest.mark.parametrize("codec", CODECS, ids=repr)
def test_config_round_trips_through_json_and_registry(codec):
    cfg = json.loads(json.dumps(codec.get_config()))
    assert cfg["id"].startswith("tierstore.")
    again = get_codec(cfg)
    assert type(again) is type(codec) and again == codec and again.get_config() == codec.get_config()


def test_golden_bytes_never_change():
    """Format v1 pinned: encoding the committed inputs gives the committed bytes, and decoding them the
    committed values. If this fails, the format changed: bump VERSION in codecs.py instead."""
    with open(FIXTURE) as f:
        golden = json.load(f)
    assert golden["format_version"] == 1 and len(golden["cases"]) >= 7
    for case in golden["cases"]:
        codec = get_codec(dict(case["config"]))
        raw = np.frombuffer(bytes.fromhex(case["input_hex"]), dtype=np.uint8)
        assert codec.encode(raw).hex() == case["encoded_hex"], case["config"]
        dec = np.asarray(codec.decode(bytes.fromhex(case["encoded_hex"])))
        assert dec.tobytes().hex() == case["decoded_hex"], case["config"]
    for name, signed in (("signed", True), ("unsigned", False)):
        assert build_tables(signed).values.tobytes().hex() == golden["maps_float32_hex"][name]


@pytest.mark.parametrize("codec", CODECS, ids=repr)
def test_encode_decode_within_bound_and_into_out(codec):
    rng = np.random.default_rng(0)
    x = (rng.standard_t(3, 5000) * 10).astype(np.float32)
    if codec.get_config().get("signed") is False:
        x = np.abs(x)
    t = torch.from_numpy(x).to({"float32": torch.float32, "float16": torch.float16,
                                "bfloat16": torch.bfloat16}[codec.dtype])
    raw = t.view(torch.int16 if t.element_size() == 2 else torch.int32).numpy()
    enc = codec.encode(raw)
    dec = torch.from_numpy(np.asarray(codec.decode(enc)).copy())
    dec = dec.view(torch.bfloat16) if codec.dtype == "bfloat16" else dec
    out = np.empty_like(raw)
    codec.decode(enc, out=out)
    assert out.tobytes() == np.asarray(codec.decode(enc)).tobytes()
    xf, yf = t.float(), dec.float()
    bs = codec.block_size
    pad = torch.zeros(-(-x.size // bs) * bs)
    pad[:x.size] = xf.abs()
    amax = pad.view(-1, bs).amax(1).repeat_interleave(bs)[:x.size]
    rounding = {"float32": 2 ** -21, "float16": 2 ** -10, "bfloat16": 2 ** -7}[codec.dtype]  # output dtype
    assert ((yf - xf).abs() <= (error_bound(codec.scheme) + rounding) * amax).all()


def test_rounding_field():
    assert Dynamic8(256, signed=False).get_config() == {"id": "tierstore.dynamic8", "block_size": 256,
                                                         "dtype": "float32", "signed": False}  # as before
    assert Dynamic8(256, signed=False, rounding="bounded").scheme == "dyn8v"
    assert codec_for("dyn8v").get_config()["rounding"] == "bounded"
    from tierstore.errors import TierstoreValueError
    with pytest.raises(TierstoreValueError, match="rounding"):
        Dynamic8(256, signed=True, rounding="bounded")
    with pytest.raises(TierstoreValueError, match="rounding"):
        Dynamic8(256, signed=False, rounding="up")


def test_zarr_array_with_codec():
    zarr = pytest.importorskip("zarr")
    x = np.random.default_rng(1).standard_normal((50, 70)).astype(np.float32)
    codec = codec_for("int8", 256)
    z = zarr.create_array(store={}, shape=x.shape, chunks=(20, 70), dtype="f4", zarr_format=2, compressors=codec,
                          filters=None)
    z[:] = x
    y = z[:]
    assert y.shape == x.shape and np.abs(y - x).max() <= np.abs(x).max() / 254 * (1 + 1e-6)
    assert z.metadata.compressor == codec


def test_corrupt_or_foreign_buffers_raise():
    c = BlockInt8(64)
    enc = bytearray(c.encode(np.ones(100, dtype=np.float32)))
    with pytest.raises(CorruptionError, match="magic"):
        c.decode(b"XXXX" + bytes(enc[4:]))
    with pytest.raises(CorruptionError, match="expected"):
        c.decode(bytes(enc[:-1]))
    with pytest.raises(CorruptionError, match="shorter"):
        c.decode(bytes(enc[:10]))
    with pytest.raises(CorruptionError, match="scheme"):
        BlockInt4(64).decode(bytes(enc))


def test_encoded_size_is_what_the_format_says():
    from tierstore.quant.codecs import HEADER_NBYTES, encoded_nbytes

    assert HEADER_NBYTES == 20
    assert len(BlockInt4(64).encode(np.ones(129, dtype=np.float32))) == encoded_nbytes("int4", 129, 64) == 20 + 12 + 65
