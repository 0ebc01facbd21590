"""The nvme read planner's runs, on plain extents (tierstore/tiers/nvme/reads.py, [Note: how reads are issued])."""
from __future__ import annotations

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
