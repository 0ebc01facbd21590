"""Store.get(name, rows=...): a slice or row indices along dim 0, read from the nvme tier as only the
checksummed blocks covering them ([Note: range reads], [Note: block checksums]); equal to indexing the full
value, verified at block granularity, persisted across a reopen; memory copies indexed; bad rows refused."""
from __future__ import annotations

import crc32c
import pytest
import torch

from tierstore import Store
from tierstore.errors import CorruptionError, TierstoreValueError
from tierstore.tiers.nvme.extents import CRC_BLOCK, BlockCrcs, Extent, block_crcs, crc_combine

ROWS, COLS = 3000, 257  # rows of 1028 bytes, straddling the 256 KiB blocks; 3000 rows: 11.8 blocks


def table() -> torch.Tensor:
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(0))


def bytes_read(store) -> int:
    return store.stats()["nvme"]["bytes_out"]


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "s", host_budget=0)
    s.put("emb", table(), tier="nvme")
    s.flush()
    yield s
    s.close()


def ext_of(store, name) -> Extent:
    return store._res.lookup(name).copies["nvme"]


def test_block_crcs_combine_to_the_whole_crc():
    for n in (1, CRC_BLOCK - 1, CRC_BLOCK, CRC_BLOCK + 1, 2 * CRC_BLOCK, 3 * CRC_BLOCK + 4097):
        t = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
        data = t.numpy().tobytes()
        whole, blocks = block_crcs(t.data_ptr(), n)
        assert whole == crc32c.crc32c(data)
        assert (blocks is None) == (n <= CRC_BLOCK)
        if blocks:
            assert list(blocks) == [crc32c.crc32c(data[i:i + CRC_BLOCK]) for i in range(0, n, CRC_BLOCK)]
        acc = BlockCrcs()  # fed in uneven pieces: the same
        for a in range(0, n, 300_001):
            acc.feed(t.data_ptr() + a, min(300_001, n - a))
        assert acc.finish() == (whole, blocks)
    assert crc_combine(crc32c.crc32c(b"abc"), crc32c.crc32c(b"defg"), 4) == crc32c.crc32c(b"abcdefg")


@pytest.mark.parametrize("rows", [slice(10, 20), slice(1020, 1021), slice(0, ROWS), slice(2990, 5000),
                                  slice(5, 5), slice(100, 2500, 7), [2999, 0, 5, 5, -1, 1500, 1019, 1020],
                                  torch.tensor([7, 3, 1023, 1024, 1025]), range(0, ROWS, 1000), []])
def test_rows_equal_indexing_the_full_value(store, rows):
    full = table()
    want = full[rows] if not isinstance(rows, (list, range)) else full[torch.as_tensor(list(rows),
                                                                                     dtype=torch.long)]
    got = store.get("emb", rows=rows)
    assert got.shape == want.shape and torch.equal(got, want)


def test_only_the_covering_blocks_are_read(store):
    e = ext_of(store, "emb")
    assert e.blocks is not None and len(e.blocks) == 12
    b0 = bytes_read(store)
    store.get("emb", rows=slice(10, 20))  # inside block 0
    assert bytes_read(store) - b0 == CRC_BLOCK
    b0 = bytes_read(store)
    store.get("emb", rows=[1019, 1020])  # row 1019 in block 3, row 1020 starts in block 3 and ends in 4
    assert bytes_read(store) - b0 == 2 * CRC_BLOCK
    b0 = bytes_read(store)
    store.get("emb", rows=[ROWS - 1])  # the last, short block: its aligned length
    assert bytes_read(store) - b0 == e.alloc - 11 * CRC_BLOCK
    b0 = bytes_read(store)
    store.get("emb")
    assert bytes_read(store) - b0 == e.length


def test_a_damaged_block_fails_only_reads_that_cover_it(store, tmp_path):
    e = ext_of(store, "emb")
    path = tmp_path / "s" / "extents-0000.bin"
    at = e.offset + CRC_BLOCK + 100  # inside block 1
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x40]))
    assert torch.equal(store.get("emb", rows=slice(0, 200)), table()[:200])  # block 0 only
    assert torch.equal(store.get("emb", rows=[2000, 5]), table()[[2000, 5]])
    with pytest.raises(CorruptionError, match="block 1") as ei:
        store.get("emb", rows=[300])
    assert ei.value.offset == e.offset + CRC_BLOCK and ei.value.length == CRC_BLOCK
    with pytest.raises(CorruptionError):
        store.get("emb")  # the whole read's crc32c sees it too


def test_block_crcs_survive_a_reopen_and_old_extents_read_whole(tmp_path):
    s = Store(tmp_path / "s", host_budget=0)
    s.put("emb", table(), tier="nvme")
    s.flush()
    s.close()
    s = Store.open(tmp_path / "s", host_budget=0)
    try:
        assert ext_of(s, "emb").blocks is not None
        b0 = bytes_read(s)
        assert torch.equal(s.get("emb", rows=[3, 4]), table()[3:5])
        assert bytes_read(s) - b0 == CRC_BLOCK
        e = ext_of(s, "emb")
        e.blocks = None  # as a manifest written before block crcs: the whole extent is read and checked
        b0 = bytes_read(s)
        assert torch.equal(s.get("emb", rows=[3, 4]), table()[3:5])
        assert bytes_read(s) - b0 == e.length
    finally:
        s.close()


def test_memory_copies_are_indexed_and_bad_rows_refused(tmp_path):
    with Store(tmp_path / "s") as s:
        s.put("h", table(), tier="host")
        b0 = bytes_read(s)
        assert torch.equal(s.get("h", rows=[5, 1]), table()[[5, 1]])
        assert bytes_read(s) == b0
        s.put("scalar", torch.tensor(1.0))
        for name, rows, match in (("scalar", [0], "0-d tensor has no rows"), ("h", [ROWS], "row 3000 is outside"),
                                  ("h", [-ROWS - 1], "outside its 3000 rows"),
                                  ("h", torch.tensor([1.0]), "integer tensor"), ("h", torch.ones(2, 2).long(), "1-D"),
                                  ("h", "abc", "a slice, a list of int row indices")):
            with pytest.raises(TierstoreValueError, match=match):
                s.get(name, rows=rows)
        with pytest.raises(TierstoreValueError, match="out="):
            s.get("h", rows=[1], out=torch.empty(1, COLS))
        with pytest.raises(KeyError):
            s.get("missing", rows=[1])
