"""BufferPool: one page-locked budget, back-pressure instead of assertions, a clear page-lock error."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from tierstore.errors import MisuseError, PinnedMemoryError, TierstoreValueError
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
