"""Bounded waits: a request that never completes is an IOStalledError naming it, from wait_all(), a
future's result() and close() -- within seconds of the engine's stall bound, never a hang."""
from __future__ import annotations

import time

import pytest
import torch

from tierstore.errors import IOStalledError, TierstoreIOError, TierstoreValueError
from tierstore.io.engine import Engine

BACKENDS = ["threads", "auto"]


def lose_requests(eng: Engine) -> None:
    """The injected fault: the backend accepts pieces and never completes them."""
    # private: a backend that loses every request, to make the engine stall
    eng._backend.submit_many = lambda pieces: None


@pytest.mark.parametrize("backend", BACKENDS)
def test_close_after_a_lost_request_raises_naming_it(tmp_path, backend):
    eng = Engine(backend, stall_timeout=0.5)
    buf = torch.arange(2048, dtype=torch.float32)
    eng.write(tmp_path / "ok.bin", buf).result()  # the engine works
    lose_requests(eng)
    eng.write(tmp_path / "lost.bin", buf, 8192)
    t = time.monotonic()
    with pytest.raises(IOStalledError) as e:
        eng.close()
    assert time.monotonic() - t < 5
    err = e.value
    assert isinstance(err, TierstoreIOError) and isinstance(err, TimeoutError)
    assert err.filename.endswith("lost.bin") and err.offset == 8192 and err.length == buf.numel() * 4
    assert "write of 8192 bytes at offset 8192" in str(err) and "stall_timeout" in str(err)
    eng.close()  # closed: a second close returns at once


@pytest.mark.parametrize("backend", BACKENDS)
def test_result_and_wait_all_are_bounded(tmp_path, backend):
    eng = Engine(backend, stall_timeout=0.3)
    path = tmp_path / "x.bin"
    eng.write(path, torch.zeros(1024)).result()
    lose_requests(eng)
    fut = eng.read(path, torch.empty(1024))
    with pytest.raises(IOStalledError, match="read of 4096 bytes at offset 0"):
        fut.result()
    with pytest.raises(IOStalledError, match="read of 4096 bytes"):
        eng.wait_all()
    assert not fut.done()
    with pytest.raises(IOStalledError):
        eng.close()


def test_slow_progress_is_not_a_stall(tmp_path):
    """The bound is on time without any completion: a queue that keeps completing is waited for."""
    eng = Engine("threads", queue_depth=1, block_size=4096, stall_timeout=0.5)
    # private: a backend slowed down, to make the engine stall
    real = eng._backend._run

    def slow(p):
        time.sleep(0.05)
        real(p)

    # private: a slow backend stands in for a stalled disk (fault injection)
    eng._backend._run = slow
    futs = [eng.write(tmp_path / "s.bin", torch.zeros(1024), i * 4096) for i in range(20)]  # ~1 s in all
    eng.wait_all()
    assert all(f.result() == 4096 for f in futs)
    eng.close()


def test_stall_timeout_is_checked(monkeypatch):
    with pytest.raises(TierstoreValueError, match="stall_timeout=0"):
        Engine("threads", stall_timeout=0)
    monkeypatch.setenv("TIERSTORE_IO_STALL_S", "soon")
    with pytest.raises(TierstoreValueError, match="TIERSTORE_IO_STALL_S='soon'"):
        Engine("threads")



def test_a_pause_without_io_is_not_a_stall(tmp_path):
    """The clock starts when the engine goes from idle to busy: a request after a pause longer than the
    bound, slower than a wait's slice, completes."""
    eng = Engine("threads", stall_timeout=0.3)
    buf = torch.arange(2048, dtype=torch.float32)
    eng.write(tmp_path / "a.bin", buf).result()
    time.sleep(0.5)  # idle for longer than the bound
    # private: a backend slowed down, to make the engine stall
    real = eng._backend.submit_many

    def slow(pieces):
        time.sleep(0.28)  # under the bound, over a wait's 0.25 s slice
        return real(pieces)

    # private: a slow backend stands in for a stalled disk (fault injection)
    eng._backend.submit_many = slow
    eng.write(tmp_path / "a.bin", buf).result()
    eng.close()


def test_the_nvme_tiers_write_waits_are_bounded(tmp_path, monkeypatch):
    """A store's flush waits for its writes through the engine's bound: a lost write is an IOStalledError
    naming it, not a hang."""
    import tierstore
    monkeypatch.setenv("TIERSTORE_IO_STALL_S", "0.5")
    store = tierstore.Store([tmp_path / "s"], budgets={"host": 0})
    store.put("a", torch.arange(1 << 20, dtype=torch.float32))
    store.flush()
    lose_requests(store._engine)  # private: the injected fault needs the store's engine
    store.put("b", torch.arange(1 << 20, dtype=torch.float32))
    t = time.monotonic()
    with pytest.raises(TierstoreIOError) as e:  # the flush says what became of 'b', the stall is its cause
        store.flush()
    assert time.monotonic() - t < 10
    assert isinstance(e.value.__cause__, IOStalledError) and "pending: write" in str(e.value.__cause__)
    assert "'b'" in str(e.value)
    t = time.monotonic()
    store.close(flush=False)  # logs what it could not close, and returns
    assert time.monotonic() - t < 10
