"""Read-fault campaign: a read of the store (get, get_many, get(rows=...) with and without block crcs) whose
nth I/O completion fails (EIO) or comes back short, sometimes on a filesystem that then answers fstat with
EIO too (as xfs and ext4 do once shut down after an error). Every read either returns exactly the right data
or raises a TierstoreIOError naming file, offset and length -- never a bare OSError -- and the same read
without the fault returns the right data ([Note: read errors] in tierstore/tiers/nvme/reads.py). See
docs/reliability.md."""
from __future__ import annotations

import errno
import os
import random

import pytest

from tierstore.errors import TierstoreIOError
from tierstore.store import Store

from ._common import codec_of, random_spec, record, same_bits, seeds, trial, trials, value_of

ROW = 64  # elements per row of the row reads


@pytest.fixture(scope="module")
def read_store(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("reads") / "store")
    rng = random.Random(11)
    want = {}
    with Store(d, budgets={"host": 0, "pinned": 4 << 20}, buffer_bytes=1 << 20, lock_memory=False) as s:
        for i, size in enumerate(["tiny"] * 4 + ["mid"] * 2 + ["big"] * 2):
            spec = random_spec(rng, (size,))
            spec["n"] = max(ROW, spec["n"] - spec["n"] % ROW)  # stored as rows of ROW elements
            if i % 3:
                spec["codec"] = None  # mostly raw: those have range reads
            s.put(f"t{i}", value_of(spec).view(-1, ROW), codec=codec_of(spec["codec"]))
            want[f"t{i}"] = spec
    return d, want


def _read(s: Store, want: dict, rng: random.Random):
    """One random read: (what it was, a function doing it, the function giving the right answer)."""
    names = sorted(want)
    name = rng.choice(names)
    full = value_of(want[name]).view(-1, ROW)
    op = rng.choice(["get", "get_many", "rows", "rows, no block crcs"])
    if op == "get_many":
        pick = rng.sample(names, rng.randint(2, len(names)))
        return op, lambda: s.get_many(pick), lambda: {n: value_of(want[n]).view(-1, ROW) for n in pick}
    if op == "get":
        return op, lambda: s.get(name), lambda: full
    rows = sorted(rng.sample(range(len(full)), min(len(full), rng.randint(1, 6))))
    if op == "rows, no block crcs":
        p = s._res.lookup(name)  # an old manifest's record, made by hand: no public way writes one
        e = p.copies.get("nvme")
        if e is not None:
            e.blocks = None  # as a manifest written before block crcs: streamed through the pool
    return f"{op} {rows}", lambda: s.get(name, rows=rows), lambda: full[rows]


def _same(got, right) -> bool:
    if isinstance(right, dict):
        return sorted(got) == sorted(right) and all(same_bits(got[n], right[n]) for n in right)
    return same_bits(got, right)


def test_read_faults(read_store, tmp_path, monkeypatch):
    d, want = read_store
    campaign = "read faults (EIO, short reads, fstat failing)"
    real_fstat = os.fstat
    for seed in seeds(campaign, trials(12, 300)):
        with trial(campaign, seed) as rng, Store.open(d, budgets={"host": 0, "pinned": 4 << 20},
                                                      buffer_bytes=1 << 20, lock_memory=False) as s:
            what, read, right = _read(s, want, rng)
            kind = rng.choice(["eio", "eio", "short"])
            fstat_fails = rng.random() < 0.5

            def failing(fd, _real=real_fstat):
                raise OSError(errno.EIO, "Input/output error")
            s._engine.inject_fault(rng.choice([1, 1, 2, 3]), kind)  # the engine's fault seam; tests only
            if fstat_fails:
                monkeypatch.setattr(os, "fstat", failing)
            try:
                got = read()
            except TierstoreIOError as e:
                got = e
            except Exception as e:  # anything else is the finding
                raise AssertionError(f"{what} with {kind} (fstat failing: {fstat_fails}) raised "
                                     f"{type(e).__name__}: {e}") from e
            finally:
                monkeypatch.setattr(os, "fstat", real_fstat)
                s._engine.inject_fault(0, kind)  # disarm a fault the read did not reach
            if isinstance(got, TierstoreIOError):
                assert got.filename and got.offset is not None and got.length is not None, \
                    f"{what}: {got!r} does not name file, offset and length"
                record(campaign, f"raised {type(got).__name__}" + (" (fstat failing)" if fstat_fails else ""))
            else:
                assert _same(got, right()), f"{what} with a {kind} fault returned wrong data"
                record(campaign, "exact (the fault missed the read)")
            assert _same(read(), right()), f"{what}: the read without the fault differs"
            s.close(flush=False)
