"""The residency layer's one read path: get, get_many and the handles share it, so what
one of them gets right the others do too."""
from __future__ import annotations

import os

import pytest
import torch

from tierstore.errors import CorruptionError
from tierstore.store import Store

N = 16384  # elements: 64 KiB of float32 each


def test_a_refused_read_in_get_many_leaves_no_tensor_pinned(tmp_path):
    """get_many refusing a damaged tensor (its extent past the end of a truncated file) must not leave the
    tensors before it pinned: a pinned tensor can never be spilled, so a later put found no room."""
    d = str(tmp_path / "s")
    with Store(d, budgets={"host": 0}) as s:
        s.put("a", torch.full((N,), 1.0), tier="nvme")
        s.put("b", torch.full((N,), 2.0), tier="nvme")
    path = os.path.join(d, "extents-0000.bin")
    os.truncate(path, os.path.getsize(path) - 4096)  # cuts into b, the last extent written
    with Store.open(d, budgets={"host": N * 4}) as s:
        with pytest.raises(CorruptionError, match="'b'"):
            s.get_many(["a", "b"])
        s.tensor("a").prefetch("host").result()
        s.put("c", torch.full((N,), 3.0), tier="host")  # room is made by dropping a's host copy
        assert s.tensor("a").tiers == {"nvme"} and s.tensor("c").tiers == {"host"}
        assert torch.equal(s.get("a"), torch.full((N,), 1.0))
        with pytest.raises(CorruptionError, match="'b'"):
            s.get("b")
        s.delete("b")


def test_get_many_and_get_return_the_same_values_from_every_tier(tmp_path):
    with Store(tmp_path, budgets={"host": None, "device": None}) as s:
        vals = {f"t{i}": torch.arange(i * 100, dtype=torch.float32) for i in range(6)}
        for i, (k, v) in enumerate(vals.items()):
            s.put(k, v, tier=("device", "host", "nvme")[i % 3])
        many = s.get_many(list(vals) + ["t1"])
        outs = {k: torch.empty_like(v) for k, v in vals.items()}
        into = s.get_many(vals, out=outs)
        for k, v in vals.items():
            assert torch.equal(many[k], v) and torch.equal(s.get(k), v) and into[k] is outs[k]
            assert torch.equal(outs[k], v) and torch.equal(s.tensor(k).get(), v)
