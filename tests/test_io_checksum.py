"""tierstore.io.checksum: crc32c of host memory by address."""
from __future__ import annotations

import crc32c
import pytest
import torch

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
