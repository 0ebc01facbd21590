"""Engine conformance, run against both backends. Results are checked around the engine: files are read
(or written) with numpy, never through the engine under test."""
from __future__ import annotations

import errno
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from tierstore.errors import BackendUnavailableError, MisuseError, TierstoreIOError, TierstoreValueError
from tierstore.io import ALIGN, BufferPool, Engine, io_uring_status
from tierstore.io import engine as engine_mod

URING_OK, URING_WHY = io_uring_status()
BACKENDS = [pytest.param("io_uring", marks=pytest.mark.skipif(not URING_OK, reason=URING_WHY)), "threads"]


@pytest.fixture(params=BACKENDS)
def eng(request):
    e = Engine(backend=request.param, queue_depth=16, block_size=64 << 10)
    assert e.backend == request.param
    yield e
    e.close()


def _rand_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 256, n, dtype=np.uint8)


def _shifted(n: int, shift: int) -> torch.Tensor:
    """A uint8 tensor of n bytes whose address is `shift` bytes past a 4 KiB boundary."""
    base = torch.empty(n + 2 * ALIGN, dtype=torch.uint8)
    start = (-base.data_ptr()) % ALIGN + shift
    return base[start:start + n]


def test_random_writes_then_reads(eng, tmp_path):
    """Random offsets, lengths and buffer alignments, all in flight at once; checked with numpy."""
    rng = np.random.default_rng(1)
    size = 3 << 20
    path = tmp_path / "f.bin"
    f = eng.open(path, "w")
    expect = np.zeros(size, np.uint8)
    # Non-overlapping extents (requests in flight together have no order), some aligned, some not.
    cuts = np.sort(rng.choice(np.arange(1, size // 512), 40, replace=False)) * 512
    cuts[::3] = cuts[::3] // ALIGN * ALIGN + rng.integers(0, 3, len(cuts[::3])) * 7
    bounds = np.unique(np.concatenate([[0], cuts, [size]]))
    futs, bufs = [], []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        data = _rand_bytes(rng, int(hi - lo))
        buf = _shifted(len(data), int(rng.choice([0, 0, 512, 1, 333])))
        buf.copy_(torch.from_numpy(data))
        expect[lo:hi] = data
        bufs.append(buf)
        futs.append(eng.write(f, buf, int(lo)))
    eng.wait_all()
    assert [fu.result() for fu in futs] == [int(hi - lo) for lo, hi in zip(bounds[:-1], bounds[1:])]
    np.testing.assert_array_equal(np.fromfile(path, np.uint8), expect)

    # Reads of random ranges (overlap is fine for reads), into buffers of random alignment.
    reads = []
    for _ in range(60):
        lo = int(rng.integers(0, size - 1))
        n = int(rng.integers(1, min(size - lo, 400_000) + 1))
        if rng.random() < 0.5:
            lo, n = lo // ALIGN * ALIGN, max(ALIGN, n // ALIGN * ALIGN)
            n = min(n, size - lo)
        buf = _shifted(n, int(rng.choice([0, 1, 4095, 2048])))
        reads.append((lo, buf, eng.read(f, buf, lo)))
    for lo, buf, fut in reads:
        assert fut.result() == buf.numel()
        np.testing.assert_array_equal(buf.numpy(), expect[lo:lo + buf.numel()])


def test_file_written_by_numpy_is_read_exactly(eng, tmp_path):
    rng = np.random.default_rng(2)
    data = rng.standard_normal(1_000_003).astype(np.float32)
    path = tmp_path / "np.bin"
    data.tofile(path)
    out = torch.empty(data.size, dtype=torch.float32)
    assert eng.read(path, out, 0).result() == data.nbytes
    np.testing.assert_array_equal(out.numpy(), data)


def test_buffer_kinds(eng, tmp_path):
    """Tensors of any dtype, numpy arrays, bytearrays, memoryviews and pool buffers all work."""
    path = tmp_path / "kinds.bin"
    f = eng.open(path, "w")
    t = torch.arange(1000, dtype=torch.bfloat16)
    a = np.arange(777, dtype=np.int16)
    b = bytearray(os.urandom(5000))
    eng.write(f, t, 0)
    eng.write(f, a, 8192)
    eng.write(f, memoryview(b), 16384)
    eng.wait_all()
    raw = np.fromfile(path, np.uint8)
    assert raw[:2000].tobytes() == t.view(torch.uint8).numpy().tobytes()
    assert raw[8192:8192 + a.nbytes].tobytes() == a.tobytes()
    assert raw[16384:16384 + 5000].tobytes() == bytes(b)
    back = bytearray(5000)
    eng.read(f, back, 16384).result()
    assert back == b
    with BufferPool(64 << 10, 16 << 10, lock=False) as pool, pool.lease() as buf:
        eng.read(f, buf, 0).result()
        assert buf.tensor(torch.uint8, 2000).numpy().tobytes() == raw[:2000].tobytes()


def test_many_threads_at_once(eng, tmp_path):
    rng = np.random.default_rng(3)
    path = tmp_path / "threads.bin"
    f = eng.open(path, "w")
    chunk = 256 << 10
    datas = [_rand_bytes(rng, chunk) for _ in range(32)]

    def worker(k):
        for i in range(k, 32, 4):
            eng.write(f, datas[i], i * chunk).result()
            back = np.empty(chunk, np.uint8)
            eng.read(f, back, i * chunk).result()
            assert np.array_equal(back, datas[i])

    with ThreadPoolExecutor(4) as ex:  # all four at once; result() raises what a worker raised
        for fut in [ex.submit(worker, k) for k in range(4)]:
            fut.result()
    np.testing.assert_array_equal(np.fromfile(path, np.uint8), np.concatenate(datas))


def test_registered_pool_buffers(eng, tmp_path):
    """Pool memory is registered with io_uring (fixed buffers) where the kernel allows it; data is exact."""
    with BufferPool(4 << 20, 1 << 20) as pool:
        registered = eng.register_pool(pool)
        if eng.backend == "io_uring":
            assert registered, "the kernel accepted io_uring_setup; buffer registration should work too"
        path = tmp_path / "pool.bin"
        rng = np.random.default_rng(4)
        data = _rand_bytes(rng, 4 << 20)
        bufs = [pool.lease() for _ in range(4)]
        for i, b in enumerate(bufs):
            b.tensor().copy_(torch.from_numpy(data[i << 20:(i + 1) << 20]))
            eng.write(path, b, i << 20)
        eng.wait_all()
        np.testing.assert_array_equal(np.fromfile(path, np.uint8), data)
        for b in bufs:
            b.tensor().zero_()
            eng.read(path, b, 0)
        eng.wait_all()
        for b in bufs:
            np.testing.assert_array_equal(b.tensor().numpy(), data[:1 << 20])
            b.release()


def test_striped_layout(eng, tmp_path):
    """RAID-0 over 3 directories: stripe k lives in dir k % 3 at (k // 3) * unit. Checked per part file."""
    dirs = [tmp_path / f"d{i}" for i in range(3)]
    for d in dirs:
        d.mkdir()
    unit = 64 << 10
    sf = eng.open_striped(dirs, "s.bin", "w", stripe_unit=unit)
    rng = np.random.default_rng(5)
    data = _rand_bytes(rng, 10 * unit + 1234)
    eng.write(sf, data, 0).result()
    parts = [np.fromfile(d / "s.bin", np.uint8) for d in dirs]
    for k in range(0, (len(data) + unit - 1) // unit):
        chunk = data[k * unit:(k + 1) * unit]
        phys = (k // 3) * unit
        np.testing.assert_array_equal(parts[k % 3][phys:phys + len(chunk)], chunk)
    assert sf.size() == len(data)
    back = np.empty(len(data) - 1000, np.uint8)
    eng.read(sf, back, 1000).result()
    np.testing.assert_array_equal(back, data[1000:])


@pytest.fixture
def ramfs_dir(tmp_path):
    """A ramfs mount: a filesystem that refuses O_DIRECT (tmpfs accepts it since Linux 6.6)."""
    import subprocess

    d = tmp_path / "ramfs"
    d.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting ramfs needs root")
    r = subprocess.run(["mount", "-t", "ramfs", "ramfs", str(d)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"mount -t ramfs refused here: {r.stderr.strip()}")
    yield d
    subprocess.run(["umount", "-l", str(d)], check=True)  # lazy: the engine may still hold files


def _buffered_roundtrip(eng, path):
    f = eng.open(path, "w")
    assert not f.direct
    data = np.arange(100_000, dtype=np.float64)
    eng.write(f, data, 4096).result()
    np.testing.assert_array_equal(np.fromfile(path, np.float64, offset=4096), data)
    back = np.empty_like(data)
    eng.read(f, back, 4096).result()
    np.testing.assert_array_equal(back, data)


def _refusals_logged(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "refuses O_DIRECT" in r.getMessage()]


def test_filesystem_refusing_o_direct(eng, ramfs_dir, caplog):
    """A filesystem that refuses O_DIRECT gets buffered I/O, logged once per filesystem, and exact data."""
    with caplog.at_level(logging.INFO, logger="tierstore.io"):
        _buffered_roundtrip(eng, ramfs_dir / "x.bin")
        _buffered_roundtrip(eng, ramfs_dir / "y.bin")
    logged = _refusals_logged(caplog)
    assert len(logged) == 1 and str(ramfs_dir / "x.bin") in logged[0], logged


def test_o_direct_refusal_simulated(eng, tmp_path, monkeypatch, caplog):
    """Same, wherever ramfs cannot be mounted: the kernel's EINVAL for O_DIRECT, given by a patched open."""
    from tierstore.io import files
    real_open = os.open
    # private: the filesystems already reported, process-wide; tmp_path's may be among them from another test
    monkeypatch.setattr(files, "_no_direct_warned", set())

    def no_direct(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", no_direct)
    with caplog.at_level(logging.INFO, logger="tierstore.io"):
        _buffered_roundtrip(eng, tmp_path / "x.bin")
        _buffered_roundtrip(eng, tmp_path / "y.bin")
    logged = _refusals_logged(caplog)
    assert len(logged) == 1 and str(tmp_path / "x.bin") in logged[0], logged


# ---- errors ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind,code", [("eio", errno.EIO), ("enospc", errno.ENOSPC)])
def test_injected_failure_names_file_offset_length(eng, tmp_path, kind, code):
    path = tmp_path / "fault.bin"
    f = eng.open(path, "w")
    data = np.ones(8 * ALIGN, np.uint8)
    eng.write(f, data, 0).result()
    eng.inject_fault(1, kind)
    fut = eng.write(f, data, 3 * ALIGN)
    with pytest.raises(TierstoreIOError) as ei:
        fut.result()
    e = ei.value
    assert isinstance(e, OSError) and e.errno == code
    assert e.filename == str(path) and e.offset == 3 * ALIGN and e.length == 8 * ALIGN
    assert str(path) in str(e) and "offset 12288" in str(e) and "length 32768" in str(e)
    if code == errno.ENOSPC:
        assert "disk is full" in str(e)
    with pytest.raises(TierstoreIOError):
        eng.wait_all()  # the failure is reported by wait_all too, once
    eng.wait_all()
    # The engine is still usable and what was written before is intact.
    back = np.empty(8 * ALIGN, np.uint8)
    eng.read(f, back, 0).result()
    assert back.all()


@pytest.mark.parametrize("op", ["read", "write"])
def test_short_completion_is_resubmitted(eng, tmp_path, op):
    """A short read/write is not an error: the remainder is resubmitted and the data ends exact."""
    rng = np.random.default_rng(6)
    path = tmp_path / "short.bin"
    data = _rand_bytes(rng, 64 << 10)
    f = eng.open(path, "w")
    if op == "write":
        eng.inject_fault(1, "short")
        assert eng.write(f, data, 0).result() == data.size
        np.testing.assert_array_equal(np.fromfile(path, np.uint8), data)
    else:
        data.tofile(path)
        back = np.zeros_like(data)
        eng.inject_fault(1, "short")
        assert eng.read(f, back, 0).result() == data.size
        np.testing.assert_array_equal(back, data)


def test_read_past_end_of_file(eng, tmp_path):
    path = tmp_path / "small.bin"
    np.ones(5000, np.uint8).tofile(path)
    buf = np.empty(8192, np.uint8)
    with pytest.raises(TierstoreIOError) as ei:
        eng.read(path, buf, 0).result()
    assert "end of file" in str(ei.value) and ei.value.filename == str(path)
    with pytest.raises(TierstoreIOError, match="end of file"):
        eng.wait_all()  # wait_all reports every failure since the last wait_all, seen or not


def test_missing_directory_says_so(eng, tmp_path):
    with pytest.raises(TierstoreIOError) as ei:
        eng.open(tmp_path / "nope" / "x.bin", "c")
    assert ei.value.errno == errno.ENOENT and "does not exist; create it first" in str(ei.value)
    with pytest.raises(TierstoreIOError) as ei:
        eng.open(tmp_path / "missing.bin", "r")
    assert "open it with mode 'c' or 'w'" in str(ei.value)


def test_bad_input_is_named(eng, tmp_path):
    f = eng.open(tmp_path / "b.bin", "w")
    with pytest.raises(TierstoreValueError, match="offset=-1"):
        eng.write(f, np.zeros(10, np.uint8), -1)
    with pytest.raises(TierstoreValueError, match="not contiguous"):
        eng.write(f, torch.zeros(10, 10).t(), 0)
    with pytest.raises(TierstoreValueError, match="read-only"):
        eng.read(f, b"immutable", 0)
    with pytest.raises(TierstoreValueError, match="cannot do I/O into a"):
        eng.write(f, object(), 0)
    with pytest.raises(TierstoreValueError, match="mode="):
        eng.open(tmp_path / "m.bin", "rw")
    eng.close_file(f)
    with pytest.raises(MisuseError, match="closed"):
        eng.write(f, np.zeros(10, np.uint8), 0)


def test_engine_arguments_are_checked():
    with pytest.raises(TierstoreValueError, match="backend="):
        Engine(backend="libaio")
    with pytest.raises(TierstoreValueError, match="queue_depth=0"):
        Engine(queue_depth=0)
    with pytest.raises(TierstoreValueError, match="block_size=1000"):
        Engine(block_size=1000)
    e = Engine(backend="threads")
    e.close()
    with pytest.raises(MisuseError, match="engine is closed"):
        e.open("/tmp/x", "c")


def test_zero_length_request_completes(eng, tmp_path):
    assert eng.write(tmp_path / "z.bin", np.zeros(0, np.uint8), 0).result() == 0
    assert eng.read(tmp_path / "z.bin", np.zeros(0, np.uint8), 0).result() == 0


def test_auto_falls_back_to_threads_and_says_why(monkeypatch, caplog):
    monkeypatch.setattr(engine_mod, "io_uring_status", lambda: (False, "the kernel has no io_uring (ENOSYS)"))
    with caplog.at_level(logging.WARNING, logger="tierstore.io"):
        e = Engine(backend="auto")
    try:
        assert e.backend == "threads"
        assert "no io_uring" in caplog.text and "thread-pool" in caplog.text
    finally:
        e.close()
    with pytest.raises(BackendUnavailableError, match="backend='auto'"):
        Engine(backend="io_uring")


# ---- the GIL -------------------------------------------------------------------------------------

def test_other_threads_run_while_the_engine_waits(eng, tmp_path):
    """A Python thread keeps counting while the engine's I/O is in flight and the caller waits."""
    counts = []
    stop = threading.Event()

    def spin():
        n = 0
        while not stop.is_set():
            n += 1
        counts.append(n)

    data = np.ones(32 << 20, np.uint8)
    path = tmp_path / "gil.bin"
    t = threading.Thread(target=spin)
    t.start()
    t0 = time.perf_counter()
    for _ in range(3):
        eng.write(path, data, 0).result()
        eng.read(path, data, 0).result()
    busy = time.perf_counter() - t0
    stop.set()
    t.join()
    # If a wait held the GIL, the spinner would be stuck for the whole I/O time. A free-running Python
    # loop does ~10^7 iterations per second; ask for a small fraction of that.
    assert counts[0] > 1e5 * busy, (counts[0], busy)


def test_native_wait_releases_the_gil():
    """Block a thread in the native collect (nothing in flight) and check the main thread still runs."""
    if not URING_OK:
        pytest.skip(URING_WHY)
    import ctypes

    from tierstore.io import _uring

    lib = _uring.lib()
    ring = ctypes.c_void_p()
    assert lib.ts_ring_create(4, ctypes.byref(ring)) == 0
    assert lib.ts_reaper_start(ring) == 0
    entered = threading.Event()
    out = {}

    def collect():
        ids = (ctypes.c_uint64 * 4)()
        res = (ctypes.c_int64 * 4)()
        state = ctypes.c_int(0)
        entered.set()
        out["n"] = lib.ts_collect(ring, ids, res, 4, 1, ctypes.byref(state))
        out["stopped"] = state.value

    t = threading.Thread(target=collect)
    t.start()
    entered.wait()
    n = 0
    deadline = time.perf_counter() + 0.2
    while time.perf_counter() < deadline:  # runs only if the blocked thread let go of the GIL
        n += 1
    assert t.is_alive() and n > 1000
    assert lib.ts_reaper_stop(ring) == 0  # stops the completion thread and wakes the collector
    t.join(5)
    assert not t.is_alive() and out == {"n": 0, "stopped": 1}
    lib.ts_ring_destroy(ring)


def test_batches_of_small_requests(eng, tmp_path):
    """write_many/read_many: thousands of small packed requests in one batch, exact; one future for all."""
    rng = np.random.default_rng(7)
    sizes = rng.integers(1, 70, 800) * 512  # some 4 KiB multiples, most not
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    total = int(sizes.sum())
    data = _rand_bytes(rng, total)
    src = torch.from_numpy(data.copy())
    path = tmp_path / "many.bin"
    f = eng.open(path, "w")
    fut = eng.write_many(f, [(src[o:o + s], int(o)) for o, s in zip(offsets, sizes)])
    assert fut.result() == total
    np.testing.assert_array_equal(np.fromfile(path, np.uint8), data)
    dst = torch.zeros(total, dtype=torch.uint8)
    order = rng.permutation(len(sizes))
    assert eng.read_many(f, [(dst[offsets[i]:offsets[i] + sizes[i]], int(offsets[i])) for i in order]).result() == total
    np.testing.assert_array_equal(dst.numpy(), data)
    assert eng.write_many(f, []).result() == 0


def test_batch_failure_names_the_failed_request(eng, tmp_path):
    path = tmp_path / "bf.bin"
    f = eng.open(path, "w")
    bufs = [np.full(ALIGN, i, np.uint8) for i in range(8)]
    eng.write_many(f, [(b, i * ALIGN) for i, b in enumerate(bufs)]).result()
    # Reading 8 pages where the last request runs past the end of the file.
    outs = [np.empty(ALIGN, np.uint8) for _ in range(8)]
    reqs = [(o, i * ALIGN) for i, o in enumerate(outs[:7])] + [(outs[7], 7 * ALIGN + 100)]
    with pytest.raises(TierstoreIOError) as ei:
        eng.read_many(f, reqs).result()
    assert ei.value.offset == 7 * ALIGN + 100 and ei.value.length == ALIGN
    with pytest.raises(TierstoreIOError):
        eng.wait_all()
    for i in range(7):
        assert (outs[i] == i).all()
