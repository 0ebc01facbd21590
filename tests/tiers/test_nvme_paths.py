"""The nvme tier's fast paths: a large aligned tensor is written from its own memory with its crc computed
alongside ([Note: large aligned tensors are written in place] in tiers/nvme/writes.py), and get() into fresh
memory faults it in ahead of the reads ([Note: fresh memory] in tiers/nvme/reads.py)."""
from __future__ import annotations

import errno

import pytest
import torch

import tierstore.tiers.nvme.reads as nvme_reads
from tierstore.errors import MisuseError, TierstoreIOError, TierstoreValueError
from tierstore.io import ALIGN
from tierstore.store import Store
from tierstore.tiers.host import aligned_empty

MiB = 1 << 20  # bytes


def opts(budgets=None, **kw) -> dict:
    return {"budgets": {"pinned": 4 * MiB, "host": 0, **(budgets or {})}, "buffer_bytes": MiB, "lock_memory": False,
            **kw}


def aligned_values(nbytes: int, seed: int) -> torch.Tensor:
    """A float32 tensor of `nbytes` (a multiple of 4) at a 4 KiB-aligned address."""
    t = aligned_empty(nbytes, lock=False).view(torch.float32)
    t.copy_(torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(seed)))
    return t


def spy_writes(s: Store, monkeypatch) -> list[tuple[int, int]]:
    """(address, bytes) of every buffer the store's engine writes from."""
    seen: list[tuple[int, int]] = []
    # private: a spy on the store's engine, to see which path each write takes
    real = s._engine.write

    def write(f, buf, offset=0):
        if isinstance(buf, torch.Tensor):
            seen.append((buf.data_ptr(), buf.numel() * buf.element_size()))
        else:
            seen.append((buf.addr, buf.nbytes))
        return real(f, buf, offset)

    # private: the store's engine, patched to inject a fault
    monkeypatch.setattr(s._engine, "write", write)
    return seen


@pytest.mark.parametrize("nbytes", [6 * MiB, 6 * MiB + 1000 * 4], ids=["whole-blocks", "partial-tail"])
def test_large_aligned_put_is_written_in_place(tmp_path, monkeypatch, nbytes):
    d = str(tmp_path / "s")
    x = aligned_values(nbytes, 1)
    keep = x.clone()
    with Store(d, **opts()) as s:
        seen = spy_writes(s, monkeypatch)
        s.put("x", x, "nvme")
        lo, hi = x.data_ptr(), x.data_ptr() + nbytes
        from_tensor = sum(n for a, n in seen if lo <= a < hi)
        assert from_tensor == nbytes - nbytes % ALIGN, (seen, lo)  # no copy but the partial last block
        assert len(seen) - sum(1 for a, _ in seen if lo <= a < hi) == (1 if nbytes % ALIGN else 0)
        x.fill_(-1)  # the call returned: the tensor is the caller's again; the store kept the old value
        s.flush()
        assert torch.equal(s.get("x"), keep)
    with Store.open(d, **opts()) as s:  # its crc32c, computed alongside the writes, checks on read
        assert torch.equal(s.get("x"), keep)
        # ... and its block crcs too ([Note: block checksums]): a range read reads only the blocks it needs
        before = s.stats()["nvme"]["bytes_out"]
        assert torch.equal(s.get("x", rows=slice(700_000, 710_000)), keep[700_000:710_000])  # 1-D: rows are elements
        assert s.stats()["nvme"]["bytes_out"] - before < nbytes // 4


def test_smaller_or_unaligned_tensors_are_copied(tmp_path, monkeypatch):
    """Below the pool's size, or at an unaligned address, a put copies as before (returns before the write)."""
    with Store(str(tmp_path / "s"), **opts()) as s:
        seen = spy_writes(s, monkeypatch)
        small = aligned_values(2 * MiB, 2)  # half the pool
        plain = torch.empty(6 * MiB // 4 + 16)[16:]  # an ordinary allocation, not 4 KiB aligned
        plain.copy_(torch.randn(plain.numel()))
        assert plain.data_ptr() % ALIGN
        s.put("small", small, "nvme")
        s.put("plain", plain, "nvme")
        for t in (small, plain):
            assert not any(t.data_ptr() <= a < t.data_ptr() + t.numel() * 4 for a, _ in seen)
        s.flush()
        assert torch.equal(s.get("small"), small) and torch.equal(s.get("plain"), plain)


@pytest.mark.parametrize("nbytes,lent", [(6 * MiB, False), (3 * MiB, True)], ids=["in-place", "lent"])
def test_direct_write_failure_is_reported_by_flush(tmp_path, nbytes, lent):
    """A write from the tensor's own memory that fails (in place, as large as the pool; or lent, larger than a
    buffer: [Note: lent tensors]) is reported by flush(), the lent memory given back; the last flushed value
    stands."""
    d = str(tmp_path / "s")
    s = Store(d, **opts())
    s.put("x", aligned_values(nbytes, 3), "nvme")
    s.flush()
    # private: the fault is injected in the store's own engine (test-only, no public hook)
    s._engine.inject_fault(2, "eio")
    lend = Lend() if lent else None
    s.put("x", aligned_values(nbytes, 4), "nvme", lend=lend)
    with pytest.raises(TierstoreIOError) as ei:
        s.flush()
    assert lend is None or lend.calls == 1
    assert ei.value.errno == errno.EIO and "'x'" in str(ei.value)
    s.close(flush=False)
    with Store.open(d, **opts()) as s2:
        assert torch.equal(s2.get("x"), aligned_values(nbytes, 3))


@pytest.mark.parametrize("populate_works", [True, False])
def test_get_faults_fresh_memory_in_ahead(tmp_path, monkeypatch, populate_works):
    """get() of a large tensor populates its result chunk by chunk ahead of the reads; where the kernel has
    no MADV_POPULATE_WRITE the reads fault the pages themselves and nothing waits forever."""
    calls: list[tuple[int, int]] = []
    real = nvme_reads.populate

    def populate(addr, nbytes):
        calls.append((addr, nbytes))
        return real(addr, nbytes) if populate_works else False

    monkeypatch.setattr(nvme_reads, "populate", populate)
    x = torch.randn((24 * MiB + 4096) // 4)
    with Store(str(tmp_path / "s"), **opts()) as s:
        s.put("x", x, "nvme")
        s.flush()
        got = s.get("x")
        assert torch.equal(got, x)
        assert got.data_ptr() % ALIGN == 0
        if populate_works:
            assert sum(n for _a, n in calls) == x.numel() * 4
            assert all(got.data_ptr() <= a < got.data_ptr() + x.numel() * 4 for a, _n in calls)
        else:
            assert len(calls) == 1  # refused once, then left to the reads
        calls.clear()
        out = torch.empty(x.numel() + 16)[16:]  # not 4 KiB aligned: read through pool buffers, nothing populated
        assert out.data_ptr() % ALIGN
        s.get("x", out=out)
        assert torch.equal(out, x) and not calls


# Lent tensors ([Note: lent tensors] in tierstore/tiers/nvme/writes.py): put(..., lend=) writes an aligned
# tensor larger than a pool buffer from its own memory and returns before the disk has it; lend() is called
# exactly once, when the memory is the caller's again.

class Lend:
    def __init__(self, ios: list | None = None):
        self.calls = 0
        self.ios = ios  # the engine's write futures so far
        self.all_done_then: bool | None = None  # whether every one had finished when lend() ran

    def __call__(self) -> None:
        self.calls += 1
        if self.ios is not None:
            self.all_done_then = all(f.done() for f in self.ios)


def test_wait_written_raises_a_failed_writes_error_as_a_read_would(tmp_path):
    """TieredTensor.wait_written(): None once a lent write is on disk; for a failed one, the write's error,
    after the same fallback a read would take (the name back at its last flushed value)."""
    d = str(tmp_path / "s")
    with Store(d, **opts()) as s:
        s.put("x", aligned_values(3 * MiB, 1), "nvme")
        s.flush()
        lend = Lend()
        s.put("x", aligned_values(3 * MiB, 2), "nvme", lend=lend)
        s.tensor("x").wait_written()
        assert lend.calls == 1 and torch.equal(s.get("x"), aligned_values(3 * MiB, 2))
        s.flush()
        s._engine.inject_fault(2, "eio")  # set up the fault: the new value's write fails
        s.put("x", aligned_values(3 * MiB, 3), "nvme", lend=Lend())
        with pytest.raises(TierstoreIOError) as ei:
            s.tensor("x").wait_written()
        assert ei.value.errno == errno.EIO
        assert torch.equal(s.get("x"), aligned_values(3 * MiB, 2))  # reverted, as after a failed read


def spy_write_futures(s: Store, monkeypatch) -> list:
    ios: list = []
    # private: a spy on the store's engine, to see which path each write takes
    real = s._engine.write

    def write(f, buf, offset=0):
        fut = real(f, buf, offset)
        ios.append(fut)
        return fut
    # private: the store's engine, patched to inject a fault
    monkeypatch.setattr(s._engine, "write", write)
    return ios


@pytest.mark.parametrize("nbytes", [MiB // 2 + 4096, MiB, 2 * MiB + 1000 * 4],
                         ids=["over-half-a-buffer", "a-buffer", "partial-tail"])
def test_lent_put_writes_from_the_tensor_and_gives_it_back_when_written(tmp_path, monkeypatch, nbytes):
    d = str(tmp_path / "s")
    x = aligned_values(nbytes, 5)  # larger than half a buffer (1 MiB), smaller than the pool (4 MiB)
    keep = x.clone()
    with Store(d, **opts()) as s:
        seen = spy_writes(s, monkeypatch)
        ios = spy_write_futures(s, monkeypatch)
        lend = Lend(ios)
        s.put("x", x, "nvme", lend=lend)
        lo, hi = x.data_ptr(), x.data_ptr() + nbytes
        assert sum(n for a, n in seen if lo <= a < hi) == nbytes - nbytes % ALIGN  # no copy but the partial tail
        s.synchronize()  # every write submitted has finished: the lent tensor is back
        assert all(f.done() for f in ios)
        assert lend.calls == 1 and lend.all_done_then  # called once, after the last request finished
        s.flush()
        assert lend.calls == 1
        assert torch.equal(s.get("x"), keep)
    with Store.open(d, **opts()) as s:  # crc32c computed on the lent memory alongside the writes
        assert torch.equal(s.get("x"), keep)


@pytest.mark.parametrize("case", ["small", "unaligned", "host-tier", "codec"])
def test_lend_of_a_copied_value_is_called_before_put_returns(tmp_path, monkeypatch, case):
    import numcodecs
    with Store(str(tmp_path / "s"), **opts(budgets={"host": 64 * MiB})) as s:
        seen = spy_writes(s, monkeypatch)
        if case == "small":  # half a buffer: packed with others
            x, kw = aligned_values(MiB // 2, 7), {"tier": "nvme"}
        elif case == "unaligned":
            x = aligned_values(3 * MiB + 64, 7)[16:]  # 64 bytes past a 4 KiB boundary
            kw = {"tier": "nvme"}
        elif case == "host-tier":
            x, kw = aligned_values(3 * MiB, 8), {"tier": "host"}
        else:
            x, kw = aligned_values(3 * MiB, 9), {"tier": "nvme", "codec": numcodecs.Zstd(level=1)}
        keep = x.clone()
        lend = Lend()
        s.put("x", x, lend=lend, **kw)
        assert lend.calls == 1  # copied: the tensor is the caller's again at once
        assert not any(x.data_ptr() <= a < x.data_ptr() + x.numel() * 4 for a, _ in seen)
        x.fill_(-1)
        s.flush()
        assert torch.equal(s.get("x"), keep)


def test_lend_is_called_when_put_refuses(tmp_path):
    x = aligned_values(3 * MiB, 10)
    d = str(tmp_path / "s")
    with Store(d, **opts()) as s:
        s.put("y", x, "nvme")
    lend = Lend()
    with Store.open(d, mode="r", **opts()) as s:
        with pytest.raises(MisuseError):
            s.put("x", x, "nvme", lend=lend)
    assert lend.calls == 1
    with Store(str(tmp_path / "t"), **opts()) as s:
        for bad in ({"name": ""}, {"tier": "tape"}):
            lend = Lend()
            with pytest.raises(TierstoreValueError):
                s.put(bad.get("name", "x"), x, bad.get("tier", "nvme"), lend=lend)
            assert lend.calls == 1
        with pytest.raises(TierstoreValueError, match="lend"):
            s.put("x", x, "nvme", lend=3)


def test_a_get_result_is_read_through_the_pool_and_aligned_memory_of_the_callers_straight_into(tmp_path,
                                                                                                monkeypatch):
    """[Note: results are read through the pool]: a get() result (RESULTS holds it) is read into pool buffers
    and copied out; an aligned out= of the caller's (not a result) is read straight into, no pool buffer."""
    x = torch.randn((24 * MiB + 4096) // 4)
    with Store(str(tmp_path / "s"), **opts()) as s:
        s.put("x", x, "nvme")
        s.flush()
        seen: list[int] = []  # addresses the store's engine reads into
        real = s._engine.read  # private: a spy on the store's engine, to see which memory each read lands in

        def read(f, buf, offset=0):
            seen.append(buf.data_ptr())
            return real(f, buf, offset)

        monkeypatch.setattr(s._engine, "read", read)
        pool_lo = s._pool.base_addr  # private: where the store's pool buffers lie
        pool_hi = pool_lo + s._pool.nbytes
        got = s.get("x")
        assert torch.equal(got, x) and got.data_ptr() % ALIGN == 0
        assert seen and all(pool_lo <= a < pool_hi for a in seen)  # every chunk through a pool buffer
        nbytes = x.numel() * 4
        assert not any(got.data_ptr() <= a < got.data_ptr() + nbytes for a in seen)
        seen.clear()
        mine = aligned_values(nbytes, 9)
        assert s.get("x", out=mine.view(torch.float32)) is not None and torch.equal(mine, x)
        assert seen and all(mine.data_ptr() <= a < mine.data_ptr() + nbytes for a in seen)  # straight into it


def test_results_pool_holds_only_results_in_use():
    from tierstore.tiers.host import ResultPool

    pool = ResultPool(idle_limit=64 * MiB)
    t = pool.empty(3 * MiB)
    addr = t.data_ptr()
    assert pool.holds(addr)
    assert not pool.holds(addr + ALIGN) and not pool.holds(aligned_empty(MiB, lock=False).data_ptr())
    del t
    pool.trim(64 * MiB)  # files what was given back
    assert not pool.holds(addr)
    again = pool.empty(3 * MiB)
    assert again.data_ptr() == addr and pool.holds(addr)  # handed out again: a result again
