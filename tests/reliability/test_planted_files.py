"""Planted-file campaign: something tierstore did not make stands at one of a flushed store's own names (a
symlink to a file outside the store, a dangling symlink, a symlink to /dev/zero, a FIFO, a directory), and
the store is opened for writing or reading and used. Every trial either gives exactly the stored data or
raises a TierstoreIOError naming the planted path -- and never follows the link (the file outside keeps
its 9 bytes, nothing is created outside the store), never blocks on the FIFO, never reads /dev/zero. See
docs/reliability.md ("The store") and [Note: tierstore's own files] in tierstore/io/files.py."""
from __future__ import annotations

import os
import random
import shutil

import pytest
import torch

from tierstore.errors import TierstoreIOError
from tierstore.store import Store

from ._common import random_spec, record, same_bits, seeds, trial, trials, value_of

NINE = b"outside!!"
NAMES = ["extents-0000.bin", "extents-0001.bin", "tierstore.lock", "manifest.json", "manifest.json.tmp"]
KINDS = ["symlink outside", "dangling symlink", "symlink to /dev/zero", "fifo", "directory"]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("pristine") / "store")
    rng = random.Random(11)
    want = {}
    with Store(d, budgets={"host": 0, "pinned": 4 << 20}, buffer_bytes=1 << 20, lock_memory=False) as s:
        for i in range(6):
            spec = random_spec(rng, ("tiny", "tiny", "mid"))
            spec["codec"] = None
            s.put(f"t{i}", value_of(spec))
            want[f"t{i}"] = spec
    return d, want


def plant(path: str, kind: str, outside: str) -> None:
    if os.path.lexists(path):
        os.unlink(path)
    if kind == "symlink outside":
        os.symlink(os.path.join(outside, "nine.txt"), path)
    elif kind == "dangling symlink":
        os.symlink(os.path.join(outside, "made-through-the-link"), path)
    elif kind == "symlink to /dev/zero":
        os.symlink("/dev/zero", path)
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        os.mkdir(path)


@pytest.mark.timeout(600, method="signal")  # a FIFO followed or read would block: the run fails, not hangs
def test_planted_files(tmp_path, pristine):
    src, want = pristine
    campaign = "planted files (store)"
    for seed in seeds(campaign, trials(12, 200)):
        with trial(campaign, seed) as rng:
            d, outside = str(tmp_path / "store"), str(tmp_path / "outside")
            for p in (d, outside):
                shutil.rmtree(p, ignore_errors=True)
            shutil.copytree(src, d)
            os.mkdir(outside)
            with open(os.path.join(outside, "nine.txt"), "wb") as f:
                f.write(NINE)
            name, kind, mode = rng.choice(NAMES), rng.choice(KINDS), rng.choice(["w", "r"])
            where = os.path.join(d, name)
            plant(where, kind, outside)
            what = f"{kind} at {name}, open mode {mode!r}"
            print(what)
            try:
                s = Store.open(d, mode=mode, budgets={"host": 0, "pinned": 4 << 20}, lock_memory=False)
                try:
                    for n, spec in want.items():
                        assert same_bits(s.get(n), value_of(spec)), f"get({n!r}) wrong after {what}"
                    if mode == "w":
                        s.put("new", torch.arange(3000, dtype=torch.float32), "nvme")
                        s.flush()
                finally:
                    s.close(flush=False)
                result = "exact"
            except TierstoreIOError as e:
                assert e.filename == where, f"{what}: the error names {e.filename!r}, not the planted path: {e}"
                result = "refused, naming it"
            with open(os.path.join(outside, "nine.txt"), "rb") as f:
                assert f.read() == NINE, f"{what}: the file outside the store was written"
            assert sorted(os.listdir(outside)) == ["nine.txt"], f"{what}: a file was created outside the store"
            record(campaign, f"{kind}: {result}")
