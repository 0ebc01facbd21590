"""The nvme read planner's runs, on plain extents (tierstore/tiers/nvme/reads.py, [Note: how reads are issued]);
failed reads raise a TierstoreIOError whatever else fails while finding out why ([Note: read errors])."""
from __future__ import annotations

import errno
import os

import pytest
import torch

from tierstore import Store
from tierstore.errors import CorruptionError, TierstoreIOError
from tierstore.io import ALIGN
from tierstore.tiers.nvme.extents import Extent
from tierstore.tiers.nvme.reads import RUN_GAP, plan_runs

P = ALIGN  # bytes


def ext(f: int, page: int, pages: int = 1) -> Extent:
    return Extent(f, page * P, pages * P - 7, pages * P, 0)


def test_neighbours_are_coalesced_in_file_order():
    es = [ext(0, 4), ext(1, 0), ext(0, 0), ext(0, 1, 2)]
    assert plan_runs(es, 64 * P) == [[2, 3, 0], [1]]  # file 0 by offset (a one-page hole), then file 1


def test_a_run_stops_at_a_wide_gap_and_at_the_buffer_size():
    gap = RUN_GAP // P  # pages
    es = [ext(0, 0), ext(0, 1 + gap), ext(0, 3 + 2 * gap)]  # holes of RUN_GAP, then RUN_GAP + a page
    assert plan_runs(es, 1 << 30) == [[0, 1], [2]]
    es = [ext(0, 0, 2), ext(0, 2, 2), ext(0, 4, 1)]
    assert plan_runs(es, 4 * P) == [[0, 1], [2]]  # a third extent would make a 5-page read
    assert plan_runs([], 4 * P) == []


# -- [Note: read errors]: every way out of a failed read is a TierstoreIOError -----------------------------

def _fstat_fails(monkeypatch):
    """os.fstat answers EIO, as on a filesystem shut down after an error (xfs, ext4)."""
    def failing(fd):
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(os, "fstat", failing)


@pytest.mark.parametrize("case", ["streamed", "packed", "rows-blocks", "rows-whole"])
def test_a_failed_read_whose_file_cannot_be_sized_raises_a_tierstore_io_error(tmp_path, monkeypatch, case):
    """The read fails with EIO and looking for a truncated file fails too (fstat: EIO): the read's error is
    raised, naming the file, offset and length -- never the bare OSError of the fstat."""
    n = 300_000 if case != "packed" else 2_000  # float32: 1.2 MB (its own extent) or 8 KB (packed)
    with Store(tmp_path / "s", budgets={"host": 0, "pinned": 4 << 20}, buffer_bytes=1 << 20,
               lock_memory=False) as s:
        s.put("t", torch.arange(n, dtype=torch.float32).view(-1, 100), tier="nvme")
        s.flush()
        if case == "rows-whole":
            # private: the extent's block checksums dropped / the fault injected: no public hook
            s._res.lookup("t").copies["nvme"].blocks = None
        s._engine.inject_fault(1, "eio")
        _fstat_fails(monkeypatch)
        with pytest.raises(TierstoreIOError) as ei:
            s.get("t", rows=[1, 2]) if case.startswith("rows") else s.get("t")
        monkeypatch.undo()
        err = ei.value
        assert err.errno == errno.EIO and "extents-0000.bin" in err.filename
        assert err.offset is not None and err.length is not None
        assert torch.equal(s.get("t", rows=[1, 2]), torch.arange(n, dtype=torch.float32).view(-1, 100)[1:3])


def test_a_damaged_extent_whose_file_cannot_be_sized_is_still_refused_as_corrupt(tmp_path, monkeypatch):
    with Store(tmp_path / "s", budgets={"host": 0}, lock_memory=False) as s:
        s.put("t", torch.ones(300_000), tier="nvme")
        s.flush()
        # private: the extent marked as an open finds a truncated file
        s._res.lookup("t").copies["nvme"].damaged = True  # as found truncated when opened
        _fstat_fails(monkeypatch)
        with pytest.raises(CorruptionError, match="past the end of its extent file"):
            s.get("t")
        monkeypatch.undo()


def test_a_plain_oserror_inside_a_read_names_the_extent(tmp_path, monkeypatch):
    """An OSError raised by anything the read path calls (here the engine's submission) comes out as a
    TierstoreIOError naming the extent file, offset and length."""
    with Store(tmp_path / "s", budgets={"host": 0}, lock_memory=False) as s:
        s.put("t", torch.ones(300_000), tier="nvme")
        s.flush()
        # private: the extent and the engine are where the read fails
        e = s._res.lookup("t").copies["nvme"]

        def failing(*a, **k):
            raise OSError(errno.EIO, "Input/output error")
        # private: the store's engine, patched to inject a fault
        monkeypatch.setattr(s._engine, "read", failing)
        with pytest.raises(TierstoreIOError) as ei:
            s.get("t")
        assert ei.value.errno == errno.EIO and ei.value.offset == e.offset and ei.value.length == e.length
        assert "extents-0000.bin" in ei.value.filename and "tensor 't'" in str(ei.value)
