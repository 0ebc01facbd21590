"""Store() checks every argument before it creates anything: a refused Store leaves the disk as it was, and
each refusal is a tierstore error naming the argument and what to pass ([Note: a refused Store leaves the
disk as it was] in tierstore/store_args.py)."""
from __future__ import annotations

import pathlib

import pytest
import torch

from tierstore.errors import TierstoreError, TierstoreValueError
from tierstore.store import Store

BAD = {  # keyword arguments -> the argument the error must name
    "backend='spdk'": ({"backend": "spdk"}, "backend"),
    "device='tpu:0'": ({"device": "tpu:0"}, "device"),
    "device=5": ({"device": 5}, "device"),
    "device='meta'": ({"device": "meta"}, "device"),
    "budgets device 2**70": ({"budgets": {"pinned": 8 << 20, "device": 2 ** 70}}, "device"),
    "budgets pinned 2**60": ({"budgets": {"pinned": 2 ** 60}}, "pinned"),
    "budgets host 2**70": ({"budgets": {"pinned": 8 << 20, "host": 2 ** 70}}, "host"),
    "budgets nvme 2**70": ({"budgets": {"pinned": 8 << 20, "nvme": 2 ** 70}}, "nvme"),
    "budgets key 'disk'": ({"budgets": {"pinned": 8 << 20, "disk": 0}}, "disk"),
    "budgets a list": ({"budgets": [1, 2]}, "budgets"),
    "stripe_unit=1000": ({"stripe_unit": 1000}, "stripe_unit"),
    "extent_file_bytes=2**70": ({"extent_file_bytes": 2 ** 70}, "extent_file_bytes"),
    "workers=10**6": ({"workers": 10 ** 6}, "workers"),
    "lock_memory='yes'": ({"lock_memory": "yes"}, "lock_memory"),
    "queue_depth=0": ({"queue_depth": 0}, "queue_depth"),
}


def listing(root: pathlib.Path) -> dict:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("case", sorted(BAD))
@pytest.mark.parametrize("where", ["missing", "empty", "a store"])
def test_a_refused_store_creates_nothing(tmp_path, case, where):
    kwargs, names = BAD[case]
    d = tmp_path / "s"
    if where == "empty":
        d.mkdir()
    elif where == "a store":
        with Store(d, budgets={"pinned": 8 << 20, "host": 0}) as s:
            s.put("w", torch.ones(16), "nvme")
    before = listing(tmp_path)
    with pytest.raises(TierstoreError, match=names):
        Store(d, **{"budgets": {"pinned": 8 << 20}, **kwargs})
    assert listing(tmp_path) == before


@pytest.mark.parametrize("paths, names", [
    (None, "paths=None"), (5, "paths=5"), (b"bytes-dir", "paths=b'bytes-dir' is bytes"), ("nul\0dir", "NUL"),
    ("", "empty path"), ([], "paths is empty"), (["ok-dir", None], r"paths\[1\]=None"),
    ([b"bytes-dir"], r"paths\[0\]=b"),
])
def test_bad_paths_get_a_tierstore_error_naming_them(tmp_path, monkeypatch, paths, names):
    monkeypatch.chdir(tmp_path)  # relative paths: whatever is created lands here
    with pytest.raises(TierstoreValueError, match=names) as e:
        Store(paths, budgets={"pinned": 8 << 20})
    assert "pass the path of a directory" in str(e.value) or "give at least one" in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_device_budget_up_to_the_device_memory_is_accepted(tmp_path):
    with Store(tmp_path / "s", budgets={"device": None, "pinned": 8 << 20}) as s:
        s.put("w", torch.ones(4), "device")
    with pytest.raises(TierstoreValueError, match="pass at most .* bytes, or None for no limit"):
        Store(tmp_path / "t", budgets={"device": 2 ** 70, "pinned": 8 << 20})
