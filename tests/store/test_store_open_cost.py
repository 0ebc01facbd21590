"""Opening a store costs what its tensors need ([Note: opening costs what the tensors need] in
tierstore/manifest.py): the memory the open holds at its peak, traced, stays within a few times the
manifest's size, and the transient part of it (the parse) within about twice. Not timed: memory is what a
machine-independent bound can be put on."""
from __future__ import annotations

import os
import tracemalloc

import torch

from tierstore.store import Store

N = 20_000


def test_open_of_many_tensors_is_bounded_by_the_manifest_size(tmp_path):
    d = tmp_path / "s"
    x = torch.zeros(16)
    with Store(d, budgets={"host": 0, "pinned": 8 << 20}) as s:
        for i in range(N):
            s.put(f"model.layers.{i // 8}.weight{i % 8}", x, "nvme")
    size = os.path.getsize(d / "manifest.json")  # bytes
    Store.open(d, mode="r", budgets={"pinned": 8 << 20}).close()  # imports and caches warmed outside the trace
    tracemalloc.start()
    try:
        s = Store.open(d, mode="r", budgets={"pinned": 8 << 20})
        kept, peak = tracemalloc.get_traced_memory()  # bytes
    finally:
        tracemalloc.stop()
    try:
        assert len(s) == N and torch.equal(s.get("model.layers.7.weight3"), x)
    finally:
        s.close()
    # What stays is the tensors' records (names, shapes, extents, the tables over them); the parse may
    # add the manifest's bytes and the part of its JSON not yet turned into records -- not a second copy of
    # the document, nor a second serialisation of it for the checksum.
    assert kept <= 6 * size, (kept, size)
    assert peak - kept <= 3 * size, (peak, kept, size)
    assert peak <= 8 * size, (peak, size)
