"""Microbenchmarks of the engine, the store and the quantizers under pytest-benchmark: `make bench-micro`.

Not part of `make test` (pytest's testpaths is tests/). Each run is saved under bench/results/micro and compared
with the latest saved run of this machine (pytest-benchmark's --benchmark-autosave / --benchmark-compare), so a
change that slows one of these paths shows as a regression against the baseline; `make bench-micro
BENCH_FAIL=mean:25%` also fails the run on such a regression. Each benchmark checks what it computed, so a fast
wrong path cannot pass as a fast path. What they cover, 8 MiB each unless said:

  engine  O_DIRECT write (+fsync) and read of 8 x 1 MiB from page-aligned buffers, and of one plain torch tensor
  store   put(tier="nvme") + flush, get(out=) from the nvme tier, get() into fresh memory
  quant   quantize and dequantize, 4M fp32 elements, for every registered scheme
  crc     crc32c of 1 MiB (in cache) and 128 MiB (out of cache): what tierstore uses here (native/crc.c where the
          CPU has VPCLMULQDQ) against the crc32c package, in the same run (group crc32c-<size>)
"""
from __future__ import annotations

import os

import crc32c
import pytest
import torch

from tierstore import Store
from tierstore.bench._common import drop_page_cache
from tierstore.io import Engine
from tierstore.io.checksum import crc_at, memory_at
from tierstore.quant import DEFAULT_BLOCK, SCHEMES, dequantize, empty_quantized, error_bound, quantize
from tierstore.tiers.host import aligned_empty

MIB = 1 << 20  # bytes
SIZE = 8 * MIB  # bytes per transfer


@pytest.fixture(scope="module")
def engine():
    eng = Engine()
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def aligned_bufs():
    bufs = [aligned_empty(MIB) for _ in range(SIZE // MIB)]
    for i, b in enumerate(bufs):
        b.fill_(i + 1)
    return bufs


def _write(eng, path, pieces):
    f = eng.open(path, "w")
    for t, off in pieces:
        eng.write(f, t, off)
    eng.wait_all()
    eng.fsync(f)
    eng.close_file(f)


def _read(eng, path, pieces):
    drop_page_cache([path])
    f = eng.open(path, "r")
    for t, off in pieces:
        eng.read(f, t, off)
    eng.wait_all()
    eng.close_file(f)


def test_engine_write_aligned(benchmark, engine, aligned_bufs, tmp_path):
    path = str(tmp_path / "w.bin")
    pieces = [(b, i * MIB) for i, b in enumerate(aligned_bufs)]
    benchmark(_write, engine, path, pieces)
    assert os.path.getsize(path) == SIZE


def test_engine_read_aligned(benchmark, engine, aligned_bufs, tmp_path):
    path = str(tmp_path / "r.bin")
    _write(engine, path, [(b, i * MIB) for i, b in enumerate(aligned_bufs)])
    outs = [aligned_empty(MIB) for _ in aligned_bufs]
    benchmark(_read, engine, path, [(o, i * MIB) for i, o in enumerate(outs)])
    assert all(torch.equal(o, b) for o, b in zip(outs, aligned_bufs))


def test_engine_write_plain_tensor(benchmark, engine, tmp_path):
    # an ordinary torch tensor, as the README's first example writes one: the goal is >= 0.9x the aligned path
    t = torch.arange(SIZE // 4, dtype=torch.float32)
    path = str(tmp_path / "plain.bin")
    benchmark(_write, engine, path, [(t, 0)])
    back = torch.empty_like(t)
    _read(engine, path, [(back, 0)])
    assert torch.equal(back, t)


def test_engine_read_plain_tensor(benchmark, engine, tmp_path):
    t = torch.arange(SIZE // 4, dtype=torch.float32)
    path = str(tmp_path / "plain.bin")
    _write(engine, path, [(t, 0)])
    back = torch.empty_like(t)
    benchmark(_read, engine, path, [(back, 0)])
    assert torch.equal(back, t)


@pytest.fixture
def store(tmp_path):
    s = Store(str(tmp_path / "store"), budgets={"host": 0})
    yield s
    s.close()


def test_store_put_flush_nvme(benchmark, store):
    t = torch.randn(SIZE // 4)

    def put_flush():
        store.put("x", t, tier="nvme")
        store.flush()
    benchmark(put_flush)
    assert torch.equal(store.get("x"), t)


def test_store_get_out(benchmark, store):
    t = torch.randn(SIZE // 4)
    store.put("x", t, tier="nvme")
    store.flush()
    out = torch.empty_like(t)
    benchmark(store.get, "x", out=out)
    assert torch.equal(out, t)


def test_store_get_fresh(benchmark, store):
    t = torch.randn(SIZE // 4)
    store.put("x", t, tier="nvme")
    store.flush()
    got = benchmark(store.get, "x")
    assert torch.equal(got, t)


NUMEL = 4 << 20  # elements


def _data(scheme: str) -> torch.Tensor:
    x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(0))
    return x.abs() if not SCHEMES[scheme].signed else x  # second-moment schemes take non-negative values


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_quantize(benchmark, scheme):
    x = _data(scheme)
    out = empty_quantized(NUMEL, scheme)
    q = benchmark(quantize, x, scheme, out=out)
    err = (dequantize(q) - x).abs().view(-1, DEFAULT_BLOCK).amax(1)
    absmax = x.abs().view(-1, DEFAULT_BLOCK).amax(1)
    assert bool((err <= (error_bound(scheme) + 2 ** -21) * absmax).all()), f"{scheme}: error above its bound"  # + ulps


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_dequantize(benchmark, scheme):
    x = _data(scheme)
    q = quantize(x, scheme)
    out = torch.empty(NUMEL)
    benchmark(dequantize, q, out=out)
    assert torch.equal(out, dequantize(q))


@pytest.mark.parametrize("nbytes", [MIB, 128 * MIB], ids=["1MiB", "128MiB"])
@pytest.mark.parametrize("impl", ["tierstore", "crc32c-package"])
def test_crc32c(benchmark, impl, nbytes):
    t = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    benchmark.group = f"crc32c-{nbytes // MIB}MiB"
    if impl == "tierstore":
        got = benchmark(crc_at, t.data_ptr(), nbytes)
    else:
        got = benchmark(crc32c.crc32c, memory_at(t.data_ptr(), nbytes))
    assert got == crc32c.crc32c(t.numpy())
