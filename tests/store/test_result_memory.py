"""Recycled result memory (tierstore/tiers/host.py ResultPool, [Note: result memory]): a mapping goes back to
the pool only when nothing refers to its memory any more, is handed out again already faulted in, and at most
idle_limit bytes of it stay idle; a result larger than memory is refused before it is allocated ([Note: memory
for a result])."""
from __future__ import annotations

import threading

import pytest
import torch

from tierstore import Store
from tierstore.errors import TierFullError, TierstoreError
from tierstore.io import ALIGN
from tierstore.tiers.host import RESULT_ALIGNED_MIN, RESULTS, ResultPool, result_empty

MIB = 1 << 20


def test_a_mapping_comes_back_only_when_its_last_view_and_saved_tensor_die():
    pool = ResultPool(idle_limit=64 * MIB)
    t = pool.empty(4 * MIB + 5)
    assert t.numel() == 4 * MIB + 5 and t.data_ptr() % ALIGN == 0 and t.dtype == torch.uint8
    addr = t.data_ptr()
    w = torch.nn.Parameter(t[: 4 * MIB].view(torch.float32).view(1024, 1024))
    del t
    assert pool.idle_bytes == 0  # a view holds it
    x = torch.randn(2, 1024, requires_grad=True)
    y = (x @ w).sum()
    del w
    assert pool.idle_bytes == 0  # autograd saved it for backward
    other = pool.empty(4 * MIB + 5)
    assert other.data_ptr() != addr  # never handed out while in use
    y.backward()
    del y
    assert pool.idle_bytes == 4 * MIB + ALIGN  # page-rounded
    again = pool.empty(4 * MIB + 5)
    assert again.data_ptr() == addr and pool.reused == 1 and pool.mapped == 2
    assert pool.empty(4 * MIB).data_ptr() != addr  # another size: a mapping of its own


def test_idle_memory_stays_within_the_limit_oldest_unmapped_first():
    pool = ResultPool(idle_limit=3 * MIB)
    ts = [pool.empty(MIB) for _ in range(5)]
    addrs = [t.data_ptr() for t in ts]
    while ts:
        ts.pop(0)  # given back in order
    assert pool.idle_bytes == 3 * MIB  # two of the five were unmapped
    kept = [pool.empty(MIB) for _ in range(3)]
    assert {t.data_ptr() for t in kept} == set(addrs[2:])  # the three given back last
    del kept
    pool.trim()
    assert pool.idle_bytes == 0


def test_many_threads_taking_and_dropping_never_share_memory():
    pool = ResultPool(idle_limit=8 * MIB)
    errors: list[str] = []
    live: dict[int, int] = {}  # data_ptr -> owner thread, while held
    guard = threading.Lock()

    def work(k: int) -> None:
        for i in range(200):
            t = pool.empty(MIB if i % 2 else 2 * MIB)
            with guard:
                if t.data_ptr() in live:
                    errors.append(f"{t.data_ptr():#x} handed to thread {k} while thread {live[t.data_ptr()]} holds it")
                live[t.data_ptr()] = k
            t.fill_(k)
            assert bool((t == k).all())
            with guard:
                del live[t.data_ptr()]
            del t

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[:3]
    assert pool.reused > 0 and pool.idle_bytes <= 8 * MIB


def test_a_result_dropped_while_the_pool_is_busy_is_filed_later_and_a_dead_pool_takes_nothing():
    pool = ResultPool(idle_limit=64 * MIB)
    t = pool.empty(MIB)
    with pool._lock:  # as when a garbage collection inside the pool's own code runs the finalizer
        del t
        assert pool.idle_bytes == 0
    assert pool.empty(MIB) is not None and pool.reused == 1  # filed at the next call
    gone = ResultPool(idle_limit=64 * MIB)
    u = gone.empty(MIB)
    del gone
    del u  # the finalizer finds no pool: the mapping is simply unmapped


def test_store_get_reads_large_tensors_into_recycled_memory(tmp_path):
    """Reading the same large tensor again and again (a ZeRO-3 forward's parameter shards) reuses the memory of
    the results dropped since, and each result holds the stored values."""
    small = torch.arange(RESULT_ALIGNED_MIN // 8, dtype=torch.float32)  # half the threshold: torch's memory
    big = torch.randn(3 * MIB // 4 + 3)  # 3 MiB and 12 bytes
    with Store(tmp_path, budgets={"host": 0}) as st:
        st.put("small", small, tier="nvme")
        st.put("big", big, tier="nvme")
        st.flush()
        RESULTS.trim()
        before = RESULTS.reused
        for _ in range(4):
            got = st.get("big")
            assert torch.equal(got, big) and got.data_ptr() % ALIGN == 0
            assert torch.equal(st.get("small"), small)
            del got
        assert RESULTS.reused - before >= 3
        held = [st.get("big") for _ in range(3)]  # held at once: three memories
        assert len({t.data_ptr() for t in held}) == 3 and all(torch.equal(t, big) for t in held)
        rows = st.get("big", rows=slice(1, 3 * MIB // 4 + 1))  # a range read, into result memory too
        assert torch.equal(rows, big[1:3 * MIB // 4 + 1])
    assert result_empty(100).numel() == 100


# -- [Note: memory for a result] ----------------------------------------------------------------------------

def test_a_read_larger_than_memory_is_refused_before_anything_is_allocated(tmp_path, monkeypatch):
    import numcodecs

    import tierstore.io.pool as io_pool

    big = torch.ones(2048, 1024)  # 8 MiB
    with Store(tmp_path / "s", budgets={"host": 0}, lock_memory=False) as s:
        s.put("big", big, tier="nvme")
        s.put("packed", big, tier="nvme", codec=numcodecs.Zlib())  # a few KB on disk, 8 MiB decoded
        s.flush()
        monkeypatch.setattr(io_pool, "physical_memory", lambda: 4 * MIB)
        mapped, read = RESULTS.mapped, s.stats()["nvme"]["bytes_out"]
        for call in (lambda: s.get("big"), lambda: s.get_many(["big"]), lambda: s.get("packed"),
                     lambda: s.get("big", rows=slice(0, 1500)), lambda: s.get("big", rows=list(range(1100)))):
            with pytest.raises(TierFullError) as ei:
                call()
            msg = str(ei.value)
            assert isinstance(ei.value, MemoryError) and isinstance(ei.value, TierstoreError)
            assert "tensor 'big'" in msg or "tensor 'packed'" in msg
            assert str(8 * MIB) in msg or str(1500 * 4096) in msg or str(1100 * 4096) in msg
            assert "rows=slice(start, stop)" in msg and str(4 * MIB) in msg
        assert RESULTS.mapped == mapped and s.stats()["nvme"]["bytes_out"] == read  # nothing allocated or read
        assert torch.equal(s.get("big", rows=slice(0, 10)), big[:10])
        out = torch.empty_like(big)
        assert s.get("big", out=out) is out and torch.equal(out, big)  # the caller's memory: no allocation


_UNDER_A_LIMIT = """
import resource, sys
from tierstore import Store
from tierstore.errors import TierFullError
s = Store.open(sys.argv[1], budgets={"host": 0}, lock_memory=False)
s.get("small")  # the read path's threads and buffers exist before the limit
vm = next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith("VmSize")) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (24 << 20), resource.RLIM_INFINITY))
try:
    s.get("big")
except TierFullError as e:
    print("REFUSED", e, flush=True)
else:
    print("READ", flush=True)
"""


def test_an_allocation_the_kernel_refuses_names_the_tensor_and_its_size(tmp_path):
    """Under an address-space limit (ulimit -v) the result's mapping fails with ENOMEM: the error is
    tierstore's MemoryError naming the tensor and its size, not a bare OSError."""
    import os
    import subprocess
    import sys

    with Store(tmp_path / "s", budgets={"host": 0}, lock_memory=False) as s:
        s.put("big", torch.ones(16 * MIB), tier="nvme")  # 64 MiB
        s.put("small", torch.ones(300_000), tier="nvme")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    r = subprocess.run([sys.executable, "-c", _UNDER_A_LIMIT, str(tmp_path / "s")], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.stdout.startswith("REFUSED"), r.stdout + r.stderr
    assert "tensor 'big'" in r.stdout and str(64 * MIB) in r.stdout and "ulimit -v" in r.stdout
