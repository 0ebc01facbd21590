"""Unaligned memory, offsets and lengths go through the engine's O_DIRECT bounce buffers, never the buffered
descriptor of an O_DIRECT file (see [Note: bounce buffers] in tierstore/io/engine.py). Both backends; the
bytes are checked around the engine, with numpy."""
from __future__ import annotations

import errno
import logging

import numpy as np
import pytest
import torch

from tierstore.errors import TierstoreIOError
from tierstore.io import ALIGN, Engine, io_uring_status

URING_OK, URING_WHY = io_uring_status()
BACKENDS = [pytest.param("io_uring", marks=pytest.mark.skipif(not URING_OK, reason=URING_WHY)), "threads"]
BLOCK = 64 << 10  # bytes: the engines' block size here (small, so requests have many blocks)


@pytest.fixture(params=BACKENDS)
def eng(request):
    e = Engine(backend=request.param, queue_depth=8, block_size=BLOCK, bounce_bytes=4 * BLOCK)
    yield e
    e.close()


@pytest.fixture
def fds(eng, monkeypatch):
    """The descriptor of every piece the engine hands its backend."""
    seen: list[tuple[int, bool]] = []  # (fd, bounced)
    # private: a spy on the pieces the engine hands its backend (which descriptor, bounced or not)
    real = eng._backend.submit_many

    def spy(pieces):
        seen.extend((p.fd, p.bounce is not None) for p in pieces)
        return real(pieces)

    # private: a spy on the backend counts the batches; nothing public counts them
    monkeypatch.setattr(eng._backend, "submit_many", spy)
    return seen


def _shifted(n: int, shift: int) -> torch.Tensor:
    """n bytes at an address `shift` bytes past a 4 KiB boundary (torch's own allocation, 64-byte aligned)."""
    base = torch.empty(n + 2 * ALIGN, dtype=torch.uint8)
    start = (-base.data_ptr()) % ALIGN + shift
    return base[start:start + n]


def _data(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_plain_tensor_goes_through_o_direct_bounce(eng, fds, tmp_path, caplog):
    """A 64-byte aligned tensor (an ordinary torch allocation) at aligned offsets: every piece goes to the
    O_DIRECT descriptor, most of them through a bounce buffer; nothing buffered; logged once, saying why."""
    n = 20 * BLOCK + 3 * ALIGN  # more blocks than bounce buffers: they are reused while the request runs
    path = tmp_path / "plain.bin"
    data = _data(n, 1)
    src = _shifted(n, 64)
    src.copy_(torch.from_numpy(data))
    f = eng.open(path, "w")
    assert f.direct_fd is not None
    with caplog.at_level(logging.INFO, logger="tierstore.io"):
        assert eng.write(f, src, 0).result() == n
        dst = _shifted(n, 64 * 3)
        assert eng.read(f, dst, 0).result() == n
        assert eng.read(f, dst, 0).result() == n
    np.testing.assert_array_equal(np.fromfile(path, np.uint8), data)
    np.testing.assert_array_equal(dst.numpy(), data)
    assert fds and all(fd == f.direct_fd for fd, _ in fds), (f.direct_fd, set(fds))
    assert all(bounced for _, bounced in fds)
    st = eng.stats()
    assert st["bounced"] == 3 * n and st["buffered"] == 0 and st["direct"] == 0, st
    # private: which thread copies bounced reads out is not in stats()
    assert (eng._copier is not None) == (eng.backend == "io_uring")  # reads copied out off the collector
    logged = [r.getMessage() for r in caplog.records if "bounce" in r.getMessage()]
    assert len(logged) == 1 and "buffer address" in logged[0] and str(path) in logged[0], logged


@pytest.mark.parametrize("offset,length,shift", [
    (100, 3 * BLOCK + 5, 0),        # unaligned start in the file, aligned memory
    (0, 2 * BLOCK + 1234, 0),       # aligned start, unaligned length: the tail is bounced alone
    (ALIGN * 3 + 7, 999, 13),       # inside one block, everything unaligned
    (BLOCK - 10, 40, 0),            # across a block boundary
    (5 * ALIGN, 2 * BLOCK, 4095),   # aligned range, memory one byte short of a page
])
def test_unaligned_reads_never_use_the_buffered_descriptor(eng, fds, tmp_path, offset, length, shift):
    size = 4 * BLOCK + 3 * ALIGN + 17  # the file ends inside a block
    path = tmp_path / "r.bin"
    data = _data(size, 2)
    data.tofile(path)
    f = eng.open(path, "r")
    out = _shifted(length, shift)
    assert eng.read(f, out, offset).result() == length
    np.testing.assert_array_equal(out.numpy(), data[offset:offset + length])
    assert fds and all(fd == f.direct_fd for fd, _ in fds)
    assert eng.stats()["buffered"] == 0


def test_read_of_the_tail_block_up_to_end_of_file(eng, tmp_path):
    """The bounce read of the last partial block asks for the whole block; the file ending inside it is fine."""
    path = tmp_path / "tail.bin"
    data = _data(3 * ALIGN + 100, 3)
    data.tofile(path)
    out = np.empty(data.size, np.uint8)
    assert eng.read(path, out, 0).result() == data.size
    np.testing.assert_array_equal(out, data)


def test_unaligned_write_buffers_only_its_partial_end_blocks(eng, fds, tmp_path):
    """A write whose file range is not 4 KiB aligned: its partial first and last blocks use the buffered
    descriptor (an O_DIRECT read-modify-write could race a neighbouring request), everything between
    O_DIRECT; neighbours written at the same time stay intact."""
    size = 6 * BLOCK
    path = tmp_path / "w.bin"
    base = _data(size, 4)
    base.tofile(path)
    f = eng.open(path, "r+")
    offset, length = 1000, 3 * BLOCK + 77
    new = _data(length, 5)
    src = _shifted(length, 64)
    src.copy_(torch.from_numpy(new))
    left = _shifted(200, 0)  # a neighbour in the same first block, written concurrently
    left.copy_(torch.from_numpy(_data(200, 6)))
    futs = [eng.write(f, src, offset), eng.write(f, left, offset - 200)]
    for fu in futs:
        fu.result()
    expect = base.copy()
    expect[offset:offset + length] = new
    expect[offset - 200:offset] = left.numpy()
    np.testing.assert_array_equal(np.fromfile(path, np.uint8), expect)
    st = eng.stats()
    head, tail = ALIGN - offset % ALIGN, (offset + length) % ALIGN
    assert st["buffered"] == head + tail + 200, st
    assert st["bounced"] == length - head - tail, st
    assert {fd for fd, bounced in fds if bounced} == {f.direct_fd}
    assert [fd for fd, bounced in fds if not bounced] == [f.fd] * 3  # head, tail, the neighbour


@pytest.mark.parametrize("op", ["read", "write"])
def test_bounced_failure_names_the_callers_range(eng, tmp_path, op):
    """An error of a bounced piece names the file and the caller's offset and length, not the bounce
    buffer's aligned cover."""
    path = tmp_path / "fault.bin"
    _data(8 * BLOCK, 7).tofile(path)
    f = eng.open(path, "r+")
    offset = 3 * BLOCK + (0 if op == "write" else 100)
    buf = _shifted(BLOCK // 2, 64)
    eng.inject_fault(1, "eio")
    fut = eng.read(f, buf, offset) if op == "read" else eng.write(f, buf, offset)
    with pytest.raises(TierstoreIOError) as ei:
        fut.result()
    e = ei.value
    assert e.errno == errno.EIO and e.filename == str(path)
    assert e.offset == offset and e.length == BLOCK // 2, (e.offset, e.length)
    with pytest.raises(TierstoreIOError):
        eng.wait_all()
    assert eng.stats()["bounce_buffers_free"] == eng.stats()["bounce_buffers"]  # every bounce buffer given back
    # still usable
    assert eng.read(f, buf, offset).result() == BLOCK // 2


def test_bounced_read_past_end_of_file(eng, tmp_path):
    path = tmp_path / "short.bin"
    _data(5000, 8).tofile(path)
    buf = _shifted(3000, 64)
    with pytest.raises(TierstoreIOError, match="end of file") as ei:
        eng.read(path, buf, 4000).result()
    assert ei.value.offset == 4000 and ei.value.length == 3000 and "got 1000 of 3000" in str(ei.value)
    with pytest.raises(TierstoreIOError):
        eng.wait_all()
    assert eng.stats()["bounce_buffers_free"] == eng.stats()["bounce_buffers"]


def test_filesystem_without_o_direct_is_buffered_and_counted(eng, tmp_path, monkeypatch):
    """Where O_DIRECT is refused, everything is buffered (the only case besides partial write blocks)."""
    import os

    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", no_direct)
    f = eng.open(tmp_path / "b.bin", "w")
    assert f.direct_fd is None
    src = _shifted(2 * BLOCK, 64)
    src.copy_(torch.from_numpy(_data(2 * BLOCK, 9)))
    eng.write(f, src, 0).result()
    assert eng.stats()["buffered"] == 2 * BLOCK and eng.stats()["bounced"] == 0


def test_many_concurrent_unaligned_requests(eng, tmp_path):
    """More bounced requests in flight than bounce buffers, from several threads: all complete exactly."""
    from concurrent.futures import ThreadPoolExecutor

    n = 3 * BLOCK
    path = tmp_path / "many.bin"
    f = eng.open(path, "w")
    datas = [_data(n, 10 + i) for i in range(6)]

    def worker(i):
        src = _shifted(n, 64 * (i + 1))
        src.copy_(torch.from_numpy(datas[i]))
        eng.write(f, src, i * n).result()
        back = _shifted(n, 32 * (i + 1))
        eng.read(f, back, i * n).result()
        np.testing.assert_array_equal(back.numpy(), datas[i])

    with ThreadPoolExecutor(6) as ex:  # all six at once; result() raises what a worker raised
        for fut in [ex.submit(worker, i) for i in range(6)]:
            fut.result()
    np.testing.assert_array_equal(np.fromfile(path, np.uint8), np.concatenate(datas))
