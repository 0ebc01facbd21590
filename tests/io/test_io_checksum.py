"""tierstore.io.checksum: crc32c of host memory by address."""
from __future__ import annotations

import ctypes
import random

import crc32c
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore.io.checksum import crc_at, memory_at


def test_crc_at_is_crc32c_of_the_bytes_and_folds_chunks_in_order():
    t = torch.arange(10_000, dtype=torch.int32)
    raw = t.numpy().tobytes()
    addr, n = t.data_ptr(), len(raw)
    assert crc_at(addr, n) == crc32c.crc32c(raw)
    folded = 0
    for a in range(0, n, 4096):
        folded = crc_at(addr + a, min(4096, n - a), folded)
    assert folded == crc32c.crc32c(raw) and crc_at(addr, 0, folded) == folded


def test_memory_at_is_a_read_only_view():
    t = torch.arange(16, dtype=torch.uint8)
    mv = memory_at(t.data_ptr(), 16)
    assert bytes(mv) == bytes(range(16)) and mv.readonly
    with pytest.raises(TypeError):
        mv[0] = 1


# -- native/crc.c ([Note: crc32c by folding]) ----------------------------------------------------------------
@pytest.fixture(scope="module")
def native():
    from tierstore.io import checksum
    return checksum.lib()


def _impl_or_skip(native, name: str) -> int:
    from tierstore.io.checksum import IMPLS
    impl = IMPLS[name]
    if not native.ts_crc32c_impls() >> impl & 1:
        pytest.skip(f"this CPU does not run the {name} crc32c (native/crc.c picks what it has)")
    return impl


_BUF = bytes(random.Random(7).getrandbits(8) for _ in range(1 << 15))


@pytest.mark.parametrize("name", ["table", "avx512"])
@settings(max_examples=400, deadline=None)
@given(off=st.integers(0, 63),
       n=st.one_of(st.integers(0, 80), st.integers(0, 1100), st.integers(0, (1 << 15) - 64)),
       value=st.one_of(st.just(0), st.integers(0, 2**32 - 1)))
def test_every_implementation_is_the_crc32c_package(native, name, off, n, value):
    impl = _impl_or_skip(native, name)
    buf = ctypes.create_string_buffer(_BUF, len(_BUF))
    got = native.ts_crc32c_with(impl, value, ctypes.addressof(buf) + off, n)
    assert got == crc32c.crc32c(_BUF[off:off + n], value)


@pytest.mark.parametrize("name", ["table", "avx512"])
def test_large_buffers_and_chained_pieces(native, name):
    impl = _impl_or_skip(native, name)
    t = torch.randint(0, 256, (9 << 20 | 77,), dtype=torch.uint8)  # 9 MiB and a tail
    want = crc32c.crc32c(t.numpy())
    assert native.ts_crc32c_with(impl, 0, t.data_ptr(), t.numel()) == want
    got, at = 0, 0
    for piece in (1, 255, 256, 511, 512, 4096, 1 << 20, 3 << 20):  # across every threshold of the code
        got = native.ts_crc32c_with(impl, got, t.data_ptr() + at, piece)
        at += piece
    assert native.ts_crc32c_with(impl, got, t.data_ptr() + at, t.numel() - at) == want


def test_crc_at_uses_the_fastest_and_falls_back_to_the_package(native, monkeypatch):
    from tierstore.io import checksum
    assert native.ts_crc32c_impls() >> native.ts_crc32c_best() & 1
    assert checksum.implementation() == ("crc32c package" if native.ts_crc32c_best() == checksum.IMPLS["table"] else
                                         next(k for k, v in checksum.IMPLS.items() if v == native.ts_crc32c_best()))
    t = torch.arange(100_000, dtype=torch.int32)
    want = crc32c.crc32c(t.numpy())
    assert crc_at(t.data_ptr(), t.nbytes) == want
    monkeypatch.setattr(checksum, "_native_crc", None)  # the library not built: the crc32c package
    assert checksum.crc_at(t.data_ptr(), t.nbytes) == want and checksum.crc_at(t.data_ptr(), 0, 5) == 5
