"""Store.get(name, rows=...): a slice or row indices along dim 0, read from the nvme tier as only the
checksummed blocks covering them ([Note: range reads], [Note: block checksums]); equal to indexing the full
value, verified at block granularity, persisted across a reopen; memory copies indexed; bad rows refused."""
from __future__ import annotations

import crc32c
import numpy
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
    s = Store(tmp_path / "s", budgets={"host": 0})
    s.put("emb", table(), tier="nvme")
    s.flush()
    yield s
    s.close()


def ext_of(store, name) -> Extent:
    # private: the extent itself (its blocks) is what these tests examine; no public API shows it
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
    s = Store(tmp_path / "s", budgets={"host": 0})
    s.put("emb", table(), tier="nvme")
    s.flush()
    s.close()
    s = Store.open(tmp_path / "s", budgets={"host": 0})
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


# -- what rows accepts ([Note: what rows accepts] in tierstore/rows.py) ------------------------------------

@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_a_bool_mask_selects_the_rows_where_it_is_true(tmp_path, tier):
    small = table()[:6]
    with Store(tmp_path / "s", budgets={"host": 0 if tier == "nvme" else 64 << 20}) as s:
        s.put("t", small, tier=tier)
        s.flush()
        mask = [True, False, False, True, True, False]
        for rows in (mask, torch.tensor(mask), numpy.array(mask), [numpy.bool_(m) for m in mask]):
            assert torch.equal(s.get("t", rows=rows), small[torch.tensor(mask)])
        assert s.get("t", rows=[False] * 6).shape == (0, COLS)
        assert torch.equal(s.get("t", rows=numpy.array([5, 0], dtype=numpy.int32)), small[[5, 0]])
        assert torch.equal(s.get("t", rows=[numpy.int64(2), torch.tensor(4)]), small[[2, 4]])


@pytest.mark.parametrize("tier", ["host", "nvme"])
@pytest.mark.parametrize("rows, match", [
    ([True, False], "a mask of 2 bools for a tensor of 6 rows"),  # torch would read rows 1 and 0
    (torch.tensor([True, False]), "a mask of 2 bools"),
    ([0.5], r"got 0\.5 \(float\)"),  # torch would read row 0
    ([1, 2.0], r"got 2\.0 \(float\)"),
    (numpy.array([0.5]), "numpy array of float64"),
    ([1, True], "mixing bools and ints"),
    ([None], "got None"),
    ([[1]], r"got \[1\] \(list\)"),
    (3, r"for the one row 3, pass \[3\]"),
    (torch.tensor(3), "not 1-D"),
    ({1, 2}, r"\(set\)"),
    (slice(0.5, 2), "not one of ints"),
    (slice(0, 4, 0), "non-zero step"),
    ([2 ** 70], "is outside its 6 rows"),
    (range(0, 10), "is outside its 6 rows"),
])
def test_what_is_no_row_is_refused_naming_rows(tmp_path, tier, rows, match):
    with Store(tmp_path / "s", budgets={"host": 0 if tier == "nvme" else 64 << 20}) as s:
        s.put("t", table()[:6], tier=tier)
        s.flush()
        with pytest.raises(TierstoreValueError, match=match) as ei:
            s.get("t", rows=rows)
        assert "rows= of 't'" in str(ei.value)
        assert "outside" in str(ei.value) or "pass a slice, a list of int row indices" in str(ei.value)


# -- range reads of an extent without block crcs ([Note: range reads]) -------------------------------------

def test_a_range_read_without_block_crcs_allocates_only_its_rows(tmp_path):
    """A manifest written before block crcs: the extent is streamed through the pool and checked whole, but
    only the rows returned are allocated; the block crcs found on the way serve the next range read."""
    from tests.support.memory import peak_growth

    rows, cols = 8192, 1024  # 32 MiB of 4 KiB rows
    big = torch.arange(rows * cols, dtype=torch.float32).view(rows, cols)
    with Store(tmp_path / "s", budgets={"host": 0, "pinned": 4 << 20}, buffer_bytes=1 << 20) as s:
        s.put("big", big, tier="nvme")
        s.flush()
        e = ext_of(s, "big")
        written_blocks, e.blocks = e.blocks, None
        assert written_blocks is not None
        want = big[[5, 6, 7, 4000]]
        del big
        b0 = bytes_read(s)
        s.get("big", rows=[0])  # warm: the pool's buffers are touched once
        assert bytes_read(s) - b0 == e.length and e.blocks == written_blocks
        e.blocks = None
        grew, got = peak_growth(lambda: s.get("big", rows=[5, 6, 7, 4000]))
        assert torch.equal(got, want)
        assert grew < e.length // 8, f"a 4-row read of a {e.length}-byte tensor raised peak RSS by {grew} bytes"
        assert e.blocks == written_blocks  # verified by the whole crc32c
        b0 = bytes_read(s)
        assert torch.equal(s.get("big", rows=[5, 6, 7, 4000]), want)
        assert bytes_read(s) - b0 == 2 * CRC_BLOCK  # blocks 0 and 15 only


def test_a_streamed_range_read_still_checks_the_whole_crc(store, tmp_path):
    e = ext_of(store, "emb")
    e.blocks = None
    path = tmp_path / "s" / "extents-0000.bin"
    at = e.offset + 5 * CRC_BLOCK + 3  # far from the rows read
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x01]))
    with pytest.raises(CorruptionError, match="checksum mismatch"):
        store.get("emb", rows=[1, 2])
    assert e.blocks is None  # nothing learnt from bytes that did not verify


def test_a_range_read_takes_its_blocks_a_bounded_group_at_a_time(store, monkeypatch):
    """The blocks covering the rows are read, verified and copied out at most RANGE_SCRATCH bytes at a time
    (here two blocks): a read of rows covering every block takes no memory for all of them at once, and a
    range crossing from one group into the next is copied whole."""
    import tierstore.tiers.nvme.reads as reads
    from tests.support.memory import peak_growth

    monkeypatch.setattr(reads, "RANGE_SCRATCH", 2 * CRC_BLOCK, raising=False)
    for rows in (slice(100, 2900), [0, 300, 700, 1019, 1020, 1500, 2999, 5], list(range(0, ROWS, 255)),
                 slice(250, 770)):
        b0 = bytes_read(store)
        assert torch.equal(store.get("emb", rows=rows), table()[rows])
        blocks = {k for r in (range(ROWS)[rows] if isinstance(rows, slice) else rows)
                  for k in range(r * COLS * 4 // CRC_BLOCK, ((r + 1) * COLS * 4 - 1) // CRC_BLOCK + 1)}
        e = ext_of(store, "emb")
        assert bytes_read(store) - b0 == sum(min(CRC_BLOCK, e.alloc - k * CRC_BLOCK) for k in blocks)
    e = ext_of(store, "emb")
    store.get("emb", rows=list(range(0, ROWS, 255)))  # warm: the result's and the scratch's sizes
    grew, _ = peak_growth(lambda: store.get("emb", rows=list(range(0, ROWS, 255))))
    assert grew < e.length // 2, f"a read of 12 rows, one per block, raised peak RSS by {grew} bytes"
