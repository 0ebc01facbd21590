"""BufferPool: one page-locked budget, back-pressure instead of assertions, a clear page-lock error."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from tierstore.errors import MisuseError, PinnedMemoryError, StalledError, TierstoreValueError
from tierstore.io import ALIGN, BufferPool


def test_buffers_are_aligned_locked_and_within_budget():
    with BufferPool(10 << 20, 4 << 20) as pool:
        assert pool.count == 2 and pool.nbytes == 8 << 20 and pool.locked
        a, b = pool.lease(), pool.lease()
        assert a.addr % ALIGN == 0 and b.addr % ALIGN == 0 and {a.index, b.index} == {0, 1}
        t = a.tensor(torch.float32)
        assert t.numel() == (4 << 20) // 4 and t.data_ptr() == a.addr
        assert pool.try_lease() is None  # never grows past the budget
        a.release()
        b.release()


def test_pool_memory_asks_for_huge_pages():
    """The mapping starts on a 2 MiB boundary and is advised for transparent huge pages where THP exists."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = f.read()
    except OSError:
        thp = "[never]"
    with BufferPool(8 << 20, 2 << 20) as pool:
        assert pool.base_addr % (2 << 20) == 0
        assert pool.huge_pages == ("[never]" not in thp)
        with pool.lease() as b:  # the views still start where the buffers do
            assert b.tensor().data_ptr() == b.addr
            assert len(b.memoryview()) == b.nbytes


def test_empty_pool_makes_the_caller_wait():
    with BufferPool(1 << 20, 1 << 20, lock=False) as pool:
        held = pool.lease()
        got = []

        def waiter():
            with pool.lease() as buf:
                got.append(buf.index)

        t = threading.Thread(target=waiter)
        t.start()
        time.sleep(0.1)
        assert t.is_alive() and not got  # back-pressure: waiting, not failing
        held.release()
        t.join(5)
        assert got == [held.index] and pool.waits == 1


def test_lease_timeout_and_closed_pool():
    pool = BufferPool(1 << 20, 1 << 20, lock=False)
    b = pool.lease()
    with pytest.raises(TimeoutError, match="raise the budget"):
        pool.lease(timeout=0.05)
    b.release()
    b.release()  # idempotent
    with pytest.raises(MisuseError, match="released"):
        b.tensor()
    pool.close()
    with pytest.raises(MisuseError, match="closed"):
        pool.lease()


def test_closing_wakes_waiters():
    pool = BufferPool(1 << 20, 1 << 20, lock=False)
    held = pool.lease()
    errors = []

    def waiter():
        try:
            pool.lease()
        except MisuseError as e:
            errors.append(e)

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.05)
    pool.close()
    t.join(5)
    assert len(errors) == 1
    held.release()


def test_forgotten_lease_returns_to_the_pool():
    with BufferPool(1 << 20, 1 << 20, lock=False) as pool:
        pool.lease()  # dropped on the floor
        assert pool.lease(timeout=1) is not None


def test_bad_sizes_are_named():
    with pytest.raises(TierstoreValueError, match="buffer_bytes=1000"):
        BufferPool(1 << 20, 1000)
    with pytest.raises(TierstoreValueError, match="smaller than one buffer"):
        BufferPool(4096, 1 << 20)
    with BufferPool(1 << 20, 1 << 20, lock=False) as pool, pool.lease() as b:
        with pytest.raises(TierstoreValueError, match="need"):
            b.tensor(torch.float64, (1 << 20) // 8 + 1)


def test_page_lock_limit_error_says_the_fix():
    """In a child process with a 64 KiB page-lock limit and no CAP_IPC_LOCK, a 16 MiB pool must fail with
    PinnedMemoryError naming `ulimit -l`."""
    code = textwrap.dedent("""
        import ctypes, os, resource, sys
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (64 << 10, 64 << 10))
        if os.geteuid() == 0:   # root ignores the limit through CAP_IPC_LOCK: drop it from every set
            libc = ctypes.CDLL(None, use_errno=True)
            class Hdr(ctypes.Structure):
                _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
            class Data(ctypes.Structure):
                _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                            ("inheritable", ctypes.c_uint32)]
            hdr, data = Hdr(0x20080522, 0), (Data * 2)()
            assert libc.capget(ctypes.byref(hdr), data) == 0
            bit = 1 << 14  # CAP_IPC_LOCK
            for d in data[:1]:
                d.effective &= ~bit; d.permitted &= ~bit; d.inheritable &= ~bit
            assert libc.capset(ctypes.byref(hdr), data) == 0, ctypes.get_errno()
        from tierstore.errors import PinnedMemoryError
        from tierstore.io import BufferPool
        try:
            BufferPool(16 << 20, 4 << 20)
        except PinnedMemoryError as e:
            print("ERR:", e)
            sys.exit(0)
        print("no error")
        sys.exit(1)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ulimit -l" in r.stdout and "64.0 KiB" in r.stdout and "lock=False" in r.stdout
    assert issubclass(PinnedMemoryError, MemoryError)


def _failed_operation_keeps(pool: BufferPool, kept: list) -> None:
    """What a leak looks like: an operation leases a buffer, fails, and the buffer stays referenced."""
    kept.append(pool.lease())


def _lease_in_thread(fn, wait_s: float):
    """fn() on a thread; (finished in time, its result or exception)."""
    out: list = []

    def run():
        try:
            out.append(fn())
        except BaseException as e:
            out.append(e)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(wait_s)
    return not t.is_alive(), (out[0] if out else None)


def test_a_wait_no_release_can_serve_raises_naming_the_holders():
    """Before: a caller waited forever once every buffer was held by operations that had failed."""
    pool = BufferPool(2 << 20, 1 << 20, lock=False)
    kept: list = []
    t = threading.Thread(target=lambda: [_failed_operation_keeps(pool, kept) for _ in range(2)], name="stepper")
    t.start()
    t.join()
    pool.stall_s = 0.3
    t0 = time.monotonic()
    done, got = _lease_in_thread(pool.lease, 10)
    pool.close()  # wakes a waiter the old pool would have kept
    assert done and isinstance(got, StalledError), got
    assert isinstance(got, TimeoutError) and 0.3 <= time.monotonic() - t0 < 5
    msg = str(got)
    assert "2 x 1.0 MiB" in msg and "2 by test_io_pool.py:_failed_operation_keeps on thread 'stepper'" in msg, msg


def test_a_buffer_given_back_restarts_the_clock():
    """A slow disk that still completes requests never trips the bound."""
    pool = BufferPool(1 << 20, 1 << 20, lock=False)
    pool.stall_s = 0.4
    held = [pool.lease()]

    def slow_io():
        for _ in range(3):  # each "request" takes 0.25 s: longer in all than stall_s, never quiet that long
            time.sleep(0.25)
            held.pop().release()
            held.append(pool.lease())
        held.pop().release()
    t = threading.Thread(target=slow_io)
    t.start()
    buf = pool.lease()  # waits ~1 s in all, never 0.4 s without a buffer back
    t.join()
    buf.release()
    pool.close()


def test_a_store_whose_buffers_are_all_held_raises_instead_of_blocking(tmp_path):
    """A streamed write (a tensor larger than a buffer) whose lease fails: before, its extent's future never
    settled, so the put went through and the next flush() (and close()) waited forever."""
    from tierstore.errors import TierstoreError
    from tierstore.store import Store
    s = Store(tmp_path / "s", budgets={"host": 0, "pinned": 2 << 20}, buffer_bytes=1 << 20, lock_memory=False)
    pool = s._pool  # private: the fault is set up by holding every buffer of the store's own pool
    pool.stall_s = 0.3
    kept: list = []
    for _ in range(pool.count):
        _failed_operation_keeps(pool, kept)
    value = torch.arange(3 << 18, dtype=torch.float32)[1:]  # 3 MiB, not 4 KiB-aligned: streamed through buffers
    try:
        done, got = _lease_in_thread(lambda: s.put("x", value, "nvme"), 10)
        assert done, "put blocked"
        done, flushed = _lease_in_thread(s.flush, 10)
        assert done, "flush blocked"
        failures = [r for r in (got, flushed) if isinstance(r, BaseException)]
        assert failures and all(isinstance(r, TierstoreError) for r in failures), (got, flushed)
        assert any("pinned buffer pool" in str(r) for r in failures), failures
    finally:
        for b in kept:
            b.release()
    s.put("x", value, "nvme")  # the buffers back: the store works
    s.flush()
    assert torch.equal(s.get("x"), value)
    s.close()
