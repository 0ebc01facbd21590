"""Store and TieredTensor: a conformance class run against every tier, checked around the store (the
extent files are read with numpy at the manifest's offsets), plus spill, misuse, corruption, disk full,
zarr and threads."""
from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import threading

import crc32c
import numpy as np
import pytest
import torch

import tierstore
from tierstore.errors import CorruptionError, MisuseError, TierFullError, TierstoreIOError, TierstoreValueError
from tierstore.store import Store

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64, torch.bool, torch.complex64, torch.float8_e4m3fn]


def sample(dtype: torch.dtype, shape=(37, 11), seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 4).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=g, dtype=dtype)


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def manifest(d) -> dict:
    with open(os.path.join(d, "manifest.json")) as f:
        return json.load(f)["body"]


def read_around(dirs: list, entry: dict, stripe_unit: int = 1 << 20) -> bytes:
    """Read a tensor's bytes straight from the extent part files with numpy, undoing the RAID-0 striping."""
    ext = entry["extent"]
    n = len(dirs)
    name = f"extents-{ext['file']:04d}.bin"
    out = bytearray()
    pos, end = ext["offset"], ext["offset"] + ext["length"]
    while pos < end:
        k, within = divmod(pos, stripe_unit)
        take = min(stripe_unit - within, end - pos)
        phys = (k // n) * stripe_unit + within
        arr = np.fromfile(os.path.join(dirs[k % n], name), dtype=np.uint8, count=take, offset=phys)
        out += arr.tobytes()
        pos += take
    return bytes(out)


class StoreConformance:
    """Every tier must keep exactly what was put, through flush and reopen. Subclasses set `tier`."""

    tier: str | None = None

    @pytest.fixture
    def dirs(self, tmp_path):
        return [str(tmp_path / "d0")]

    def open(self, dirs, budgets=None, **kw):
        kw.setdefault("buffer_bytes", 1 << 20)
        return Store(dirs, budgets={"host": 64 << 20, "device": 64 << 20, "pinned": 8 << 20, **(budgets or {})}, **kw)

    @pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
    def test_roundtrip_every_dtype(self, dirs, dtype):
        x = sample(dtype)
        with self.open(dirs) as s:
            t = s.put("x", x, self.tier)
            if self.tier:
                assert self.tier in t.tiers
            assert t.shape == x.shape and t.dtype == dtype and t.nbytes == len(raw(x)) and t.dirty
            assert torch.equal(s.get("x").view(torch.uint8), x.view(torch.uint8))
            s.flush()
            assert not t.dirty
        body = manifest(dirs[0])
        e = body["tensors"]["x"]
        assert e["dtype"] == str(dtype).removeprefix("torch.") and e["shape"] == list(x.shape)
        assert e["extent"]["offset"] % 4096 == 0
        got = read_around(dirs, e)
        assert got == raw(x)
        assert crc32c.crc32c(got) == e["extent"]["crc32c"]
        with Store.open(dirs) as s:
            y = s.get("x")
            assert y.dtype == dtype and y.shape == x.shape and raw(y) == raw(x)

    @pytest.mark.parametrize("shape", [(0,), (0, 5), (), (1,), (3, 0, 2)])
    def test_zero_size_and_scalar(self, dirs, shape):
        x = torch.arange(int(np.prod(shape)), dtype=torch.float32).reshape(shape)
        with self.open(dirs) as s:
            s.put("x", x, self.tier)
            assert torch.equal(s.get("x"), x)
        with Store.open(dirs) as s:
            assert torch.equal(s.get("x"), x) and s.get("x").shape == x.shape

    def test_non_contiguous(self, dirs):
        base = torch.arange(600, dtype=torch.float32).reshape(20, 30)
        views = {"t": base.t(), "step": base[::3, 1::2], "exp": torch.ones(1, 5).expand(4, 5)}
        with self.open(dirs) as s:
            for k, v in views.items():
                s.put(k, v, self.tier)
            for k, v in views.items():
                assert torch.equal(s.get(k), v)
        body = manifest(dirs[0])
        for k, v in views.items():
            assert read_around(dirs, body["tensors"][k]) == raw(v)

    def test_copy_taken_at_put(self, dirs):
        x = torch.zeros(1000)
        with self.open(dirs) as s:
            s.put("x", x, self.tier)
            x += 1
            assert torch.equal(s.get("x"), torch.zeros(1000))

    def test_large_tensor_streams_through_pool(self, dirs):
        x = torch.randn(5 << 20 >> 2)  # 5 MiB through 1 MiB pool buffers
        with self.open(dirs, budgets={"pinned": 2 << 20}) as s:
            s.put("big", x, self.tier)
            s.flush()
            assert torch.equal(s.get("big"), x)
        assert read_around(dirs, manifest(dirs[0])["tensors"]["big"]) == raw(x)

    def test_get_into_out(self, dirs):
        small = sample(torch.float32, (37, 11))
        big = torch.randn(((2 << 20) + 4096) >> 2)  # 2 MiB + 4 KiB: 3 chunks of 1 MiB, read through pool
        # buffers or straight in
        with self.open(dirs, budgets={"pinned": 2 << 20}) as s:
            s.put("small", small, self.tier)
            s.put("big", big, self.tier)
            s.flush()
        from tierstore.tiers.host import aligned_empty
        with self.open(dirs, budgets={"pinned": 2 << 20}) as s:  # reopened: the nvme copy only
            for _ in range(2):
                outs = {
                    "plain": torch.empty_like(big),  # torch's allocator: not 4 KiB aligned
                    "aligned": aligned_empty(big.numel() * 4, lock=False).view(torch.float32),  # O_DIRECT into it
                    "strided": torch.empty(2, big.numel()).t()[:, 0],  # non-contiguous
                }
                for o in outs.values():
                    assert s.get("big", out=o) is o and torch.equal(o, big)
                o = torch.empty_like(small)
                assert s.get("small", out=o) is o and torch.equal(o, small)
                got = s.get_many(["small", "big"], out=[torch.zeros_like(small), outs["plain"].zero_()])
                assert torch.equal(got["small"], small) and got["big"] is outs["plain"] and torch.equal(got["big"], big)
                got = s.get_many(["big"], out={"big": outs["strided"].zero_()})
                assert got["big"] is outs["strided"] and torch.equal(outs["strided"], big)
                s.tensor("big").prefetch("host").result()  # a memory copy now: out= is filled from it
            with pytest.raises(TierstoreValueError, match=r"out= for 'small' needs shape \(37, 11\)"):
                s.get("small", out=torch.empty(11, 37))
            with pytest.raises(TierstoreValueError, match="dtype torch.float32"):
                s.get("small", out=torch.empty(37, 11, dtype=torch.float64))
            with pytest.raises(TierstoreValueError, match="one per name"):
                s.get_many(["small", "big"], out=[torch.empty(37, 11)])

    def test_move_between_tiers(self, dirs):
        x = sample(torch.float32, (256, 64))
        with self.open(dirs) as s:
            t = s.put("x", x, self.tier)
            t.offload("nvme").result()
            assert t.tiers == {"nvme"}
            t.prefetch("host").result()
            assert t.tiers == {"host", "nvme"}
            t.prefetch("device").result()
            assert "device" in t.tiers
            t.drop("device")
            t.drop("nvme")
            assert t.tiers == {"host"} and t.dirty
            with pytest.raises(MisuseError, match="only one"):
                t.drop("host")
            with t.resident() as v:
                assert torch.equal(v, x)
            assert torch.equal(t.get(), x)

    def test_update_and_writeback(self, dirs):
        x = sample(torch.float32, (64, 64))
        with self.open(dirs) as s:
            t = s.put("x", x, self.tier)
            s.flush()
            t.update(x * 2)
            assert t.dirty and torch.equal(s.get("x"), x * 2)
            with t.resident("host", writeback=True) as v:
                v += 1
            assert torch.equal(s.get("x"), x * 2 + 1)
            t.offload("nvme").result()
            assert torch.equal(s.get("x"), x * 2 + 1)
        with Store.open(dirs) as s:
            assert torch.equal(s.get("x"), x * 2 + 1)

    def test_replace_delete_reuse_space(self, dirs):
        with self.open(dirs) as s:
            for i in range(4):
                s.put("x", torch.full((100_000,), float(i)), self.tier)
                s.flush()
            s.delete("x")
            assert "x" not in s and s.keys() == []
            s.flush()
            s.put("y", torch.ones(100_000), self.tier)
            s.flush()
        files = [f for f in os.listdir(dirs[0]) if f.startswith("extents-")]
        assert files == ["extents-0000.bin"]
        assert os.path.getsize(os.path.join(dirs[0], files[0])) <= 3 * (1 << 20)  # space was reused


class TestDeviceTier(StoreConformance):
    tier = "device"


class TestHostTier(StoreConformance):
    tier = "host"


class TestNvmeTier(StoreConformance):
    tier = "nvme"


class TestAutoTier(StoreConformance):
    tier = None


class TestStriped(StoreConformance):
    tier = "nvme"

    @pytest.fixture
    def dirs(self, tmp_path):
        return [str(tmp_path / f"d{i}") for i in range(3)]

    def test_every_directory_gets_data(self, dirs):
        x = torch.randn(6 << 20 >> 2)
        with self.open(dirs) as s:
            s.put("x", x, "nvme")
        for d in dirs:
            assert os.path.getsize(os.path.join(d, "extents-0000.bin")) >= 1 << 20
        with pytest.raises(TierstoreValueError, match="same directories"):
            Store.open(dirs[:2])


# -- store behaviour ----------------------------------------------------------------------------------

def test_small_tensors_are_packed_into_few_large_writes(tmp_path):
    with Store(tmp_path, budgets={"pinned": 8 << 20}, buffer_bytes=4 << 20) as s:
        for i in range(300):
            s.put(f"t{i}", torch.full((1000 + i,), i, dtype=torch.float32), "nvme")
        s.flush()
        st = s.stats()["nvme"]
        assert st["bytes_in"] == sum((1000 + i) * 4 for i in range(300))
    offs = sorted(e["extent"]["offset"] for e in manifest(tmp_path)["tensors"].values())
    # packed back to back at 4 KiB boundaries in buffer-sized regions: no gaps inside a region
    assert len(set(o // (4 << 20) for o in offs)) <= 2
    with Store.open(tmp_path) as s:
        got = s.get_many([f"t{i}" for i in range(300)])
        for i in range(300):
            assert torch.equal(got[f"t{i}"], torch.full((1000 + i,), i, dtype=torch.float32))


def test_one_buffer_pool_never_waits_on_the_open_staging_buffer(tmp_path):
    """pinned_budget == buffer_bytes: the staging buffer of small writes holds the pool's only buffer; a large
    write or read must seal it (its write frees the buffer) instead of waiting forever for a release."""
    s = Store(tmp_path, budgets={"host": 0, "pinned": 1 << 20}, buffer_bytes=1 << 20)
    small = torch.arange(100, dtype=torch.float32)
    big = torch.randn(700_000)  # 2.8 MB: streamed through the one buffer in three chunks
    done = threading.Event()

    def work():
        s.put("small", small, tier="nvme")
        s.put("big", big, tier="nvme")
        s.put("small2", small + 1, tier="nvme")
        assert torch.equal(s.get("big"), big)
        assert torch.equal(s.get("small"), small) and torch.equal(s.get("small2"), small + 1)
        done.set()
    t = threading.Thread(target=work, daemon=True)
    t.start()
    t.join(60)
    # a stuck store is left to the daemon thread (closing it would wait on the same buffer)
    assert done.is_set(), "the store waited for a pool buffer held by its own staging buffer"
    # the same with two threads: small writes keep reopening the staging buffer while big reads want it
    stop, errors = threading.Event(), []

    def writer():
        try:
            for i in range(200):
                s.put(f"w{i % 4}", small + i, tier="nvme")
        except BaseException as e:  # reported below
            errors.append(e)
        finally:
            stop.set()
    def reader():
        try:
            for _ in range(20):
                if not torch.equal(s.get("big"), big):
                    errors.append("bad read")
        except BaseException as e:  # reported below
            errors.append(e)
    w = threading.Thread(target=writer, daemon=True)
    reads = threading.Thread(target=reader, daemon=True)
    w.start()
    reads.start()
    w.join(60)
    reads.join(60)
    assert stop.is_set() and not reads.is_alive(), "a big read waited on a staging buffer reopened by a writer"
    assert not errors
    s.close()


def test_spill_lru_to_next_tier_with_debug_log(tmp_path, caplog):
    mib = 1 << 20
    with Store(tmp_path, budgets={"device": 3 * mib, "host": 2 * mib}) as s, \
            caplog.at_level(logging.DEBUG, logger="tierstore.store"):
        xs = {f"t{i}": torch.full((mib // 4,), float(i)) for i in range(6)}
        for k, v in xs.items():
            s.put(k, v)
        tiers = {k: s.tensor(k).tiers for k in xs}
        assert tiers["t5"] == {"device"} and tiers["t3"] == {"device"} and tiers["t4"] == {"device"}
        assert tiers["t1"] == {"host"} and tiers["t2"] == {"host"}
        assert tiers["t0"] == {"nvme"}  # least recently used went all the way down
        assert any("spilled 't0'" in r.message for r in caplog.records)
        st = s.stats()
        assert st["device"]["used"] <= 3 * mib and st["host"]["used"] <= 2 * mib
        s.get("t0")  # touching t1 makes t2 the next victim
        s.tensor("t1").prefetch("host").result()
        s.put("t6", torch.zeros(mib // 4), "host")
        assert s.tensor("t1").tiers == {"host"} and s.tensor("t2").tiers == {"nvme"}
        for k, v in xs.items():
            assert torch.equal(s.get(k), v)


def test_pinned_tensors_are_not_spilled_and_full_error_names_budgets(tmp_path):
    mib = 1 << 20
    with Store(tmp_path, budgets={"device": mib, "host": mib, "nvme": 4 * mib}) as s:
        s.put("a", torch.zeros(mib // 4), "device")
        with s.tensor("a").resident():
            s.put("b", torch.zeros(mib // 4))  # device is held: goes to host
            assert s.tensor("b").tiers == {"host"}
            with pytest.raises(TierFullError, match="budgets=.'device': 1048576"):
                s.put("c", torch.zeros(mib // 4), "device")
        with pytest.raises(MemoryError, match="budgets..nvme.."):
            s.put("huge", torch.zeros(2 * mib), None)
        s.put("c", torch.zeros(mib // 4), "device")  # now a can be spilled
        assert s.tensor("a").tiers != {"device"}


def test_misuse_errors_say_what_to_do(tmp_path):
    s = Store(tmp_path)
    t = s.put("x", torch.zeros(3, 4))
    with pytest.raises(TierstoreValueError, match="needs shape"):
        t.update(torch.zeros(4, 3))
    with pytest.raises(TierstoreValueError, match="dtype"):
        t.update(torch.zeros(3, 4, dtype=torch.float64))
    with pytest.raises(TierstoreValueError, match="tier='gpu'"):
        s.put("y", torch.zeros(1), "gpu")
    with pytest.raises(TierstoreValueError, match="offload"):
        t.prefetch("nvme").result()
    s.delete("x")
    with pytest.raises(MisuseError, match="put it again"):
        t.get()
    with pytest.raises(KeyError):
        s.get("x")
    with pytest.raises(MisuseError, match="another Store"):
        Store(tmp_path)
    s.close()
    with pytest.raises(MisuseError, match="Store.open"):
        s.put("x", torch.zeros(1))
    with pytest.raises(TierstoreValueError, match="no tierstore"):
        Store.open(tmp_path / "nothing")


def test_numpy_and_dlpack_inputs(tmp_path):
    with Store(tmp_path) as s:
        s.put("np", np.arange(10, dtype=np.int16))
        assert torch.equal(s.get("np"), torch.arange(10, dtype=torch.int16))

        class Producer:  # any DLPack producer (cupy, jax) is accepted the same way
            def __init__(self, t):
                self.t = t

            def __dlpack__(self, **kw):
                return self.t.__dlpack__(**kw)

            def __dlpack_device__(self):
                return self.t.__dlpack_device__()
        s.put("dl", Producer(torch.ones(3)))
        assert torch.equal(s.get("dl"), torch.ones(3))


def test_codec_config_goes_to_manifest(tmp_path):
    numcodecs = pytest.importorskip("numcodecs")
    x = torch.randn(1000).to(torch.bfloat16)
    y = torch.zeros(50_000)
    with Store(tmp_path) as s:
        s.put("x", x, "nvme", codec=numcodecs.Zstd(level=3))
        s.put("y", y, "nvme", codec=numcodecs.Zlib(level=1))
        assert s.tensor("y").encoded_nbytes < 2000  # zeros compress
        assert torch.equal(s.get("x"), x)
    body = manifest(tmp_path)
    assert body["tensors"]["x"]["codec"]["id"] == "zstd"
    with Store.open(tmp_path) as s:
        assert torch.equal(s.get("x"), x) and torch.equal(s.get("y"), y)


def test_corruption_is_detected_and_others_still_read(tmp_path):
    xs = {f"t{i}": torch.full((3000,), float(i)) for i in range(5)}
    with Store(tmp_path) as s:
        for k, v in xs.items():
            s.put(k, v, "nvme")
    e = manifest(tmp_path)["tensors"]["t2"]["extent"]
    path = tmp_path / "extents-0000.bin"
    with open(path, "r+b") as f:
        f.seek(e["offset"] + 777)
        b = f.read(1)
        f.seek(e["offset"] + 777)
        f.write(bytes([b[0] ^ 0x40]))
    with Store.open(tmp_path) as s:
        with pytest.raises(CorruptionError, match=r"tensor 't2'.*extents-0000\.bin"):
            s.get("t2")
        with pytest.raises(CorruptionError, match="'t2'"):
            s.get_many(list(xs))
        for k, v in xs.items():
            if k != "t2":
                assert torch.equal(s.get(k), v)
        s.put("t2", xs["t2"])  # repairing it works
        s.flush()
    with Store.open(tmp_path) as s:
        assert all(torch.equal(s.get(k), v) for k, v in xs.items())


@pytest.mark.parametrize("aligned", [True, False], ids=["direct", "bounce"])
def test_corruption_in_a_chunked_large_read(tmp_path, aligned):
    """A flipped byte in the 3rd of 4 chunks of a large tensor is caught whether the chunks are read
    straight into the result or through pool buffers; the other tensor still reads."""
    from tierstore.tiers.host import aligned_empty
    x, y = torch.randn(4 << 20 >> 2), torch.randn(3 << 20 >> 2)
    with Store(tmp_path, budgets={"pinned": 2 << 20}, buffer_bytes=1 << 20) as s:
        s.put("x", x, "nvme")
        s.put("y", y, "nvme")
    e = manifest(tmp_path)["tensors"]["x"]["extent"]
    with open(tmp_path / "extents-0000.bin", "r+b") as f:
        f.seek(e["offset"] + (2 << 20) + 12345)
        b = f.read(1)
        f.seek(e["offset"] + (2 << 20) + 12345)
        f.write(bytes([b[0] ^ 0x01]))
    with Store.open(tmp_path, budgets={"pinned": 2 << 20}, buffer_bytes=1 << 20) as s:
        out = aligned_empty(x.numel() * 4, lock=False).view(torch.float32) if aligned else torch.empty_like(x)
        assert (out.data_ptr() % 4096 == 0) == aligned
        with pytest.raises(CorruptionError, match=r"tensor 'x'.*4194304 bytes at offset"):
            s.get("x", out=out)
        with pytest.raises(CorruptionError, match="'x'"):
            s.get_many(["y", "x"], out=[torch.empty_like(y), out])
        assert torch.equal(s.get("y"), y)


def test_extent_files_are_preallocated_best_effort(tmp_path, monkeypatch):
    """Beyond PREALLOC_FROM an extent file's space is reserved ahead of the writes (see
    [Note: extent files are preallocated ahead of the writes]); where fallocate is not supported, writes go on
    (a full disk refusing fallocate is tests/store/test_store_faults.py's)."""
    import tierstore.tiers.nvme.writes as nvme

    monkeypatch.setattr(nvme, "PREALLOC_FROM", 0)
    xs = {f"t{i}": torch.full((300_000,), float(i)) for i in range(4)}  # 4 x 1.2 MB, streamed
    with Store(tmp_path / "a", buffer_bytes=1 << 20, budgets={"pinned": 4 << 20}) as s:
        for k, v in xs.items():
            s.put(k, v, "nvme")
        s.flush()
        used = s.stats()["nvme"]["used"]  # bytes; one extent file, nothing deleted: where its extents end
        st = os.stat(tmp_path / "a" / "extents-0000.bin")
        assert st.st_size >= used + (1 << 20) and st.st_blocks * 512 >= st.st_size  # reserved ahead of use
    with Store.open(tmp_path / "a") as s:
        assert all(torch.equal(s.get(k), v) for k, v in xs.items())

    def refuse(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")
    monkeypatch.setattr(nvme, "_fallocate", refuse)
    with Store(tmp_path / "b", buffer_bytes=1 << 20, budgets={"pinned": 4 << 20}) as s:
        for k, v in xs.items():
            s.put(k, v, "nvme")
        s.flush()
        assert os.path.getsize(tmp_path / "b" / "extents-0000.bin") <= s.stats()["nvme"]["used"]  # nothing reserved
    with Store.open(tmp_path / "b") as s:
        assert all(torch.equal(s.get(k), v) for k, v in xs.items())


def test_corrupt_manifest_is_reported(tmp_path):
    with Store(tmp_path) as s:
        s.put("x", torch.ones(4))
    p = tmp_path / "manifest.json"
    p.write_text(p.read_text().replace('"x"', '"y"'))
    with pytest.raises(CorruptionError, match="checksum"):
        Store.open(tmp_path)


def _check_disk_full_recovery(s: Store, dirs, fill) -> None:
    """`fill()` makes the next writes fail with ENOSPC and returns a function that frees the space."""
    first = {f"a{i}": torch.full((20_000,), float(i)) for i in range(5)}
    for k, v in first.items():
        s.put(k, v, "host")
    s.flush()
    second = {f"b{i}": torch.full((300_000,), float(i)) for i in range(6)}
    free_space = fill()
    for k, v in second.items():
        s.put(k, v, "host")
    s.put("a0", torch.zeros(20_000), "nvme")  # a new value with no other copy: reverts on failure
    with pytest.raises(TierstoreIOError) as ei:
        s.flush()
    assert ei.value.errno == errno.ENOSPC and "free space" in str(ei.value)
    for k, v in first.items():  # nothing flushed before is lost
        assert torch.equal(s.get(k), v)
    free_space()
    s.flush()  # works again
    for k, v in {**first, **second}.items():
        assert torch.equal(s.get(k), v)


def test_disk_full_fault_injection(tmp_path):
    s = Store(tmp_path, budgets={"pinned": 4 << 20}, buffer_bytes=1 << 20)

    def fill():
        s._engine.inject_fault(1, "enospc")  # private: sets up the fault (the engine's next write fails)
        return lambda: None
    _check_disk_full_recovery(s, [tmp_path], fill)
    s.close()
    with Store.open(tmp_path) as s2:
        assert len(s2) == 11


@pytest.fixture
def small_fs(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a size-limited tmpfs needs root (the fault-injection variant covers ENOSPC)")
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"mount refused here ({r.stderr.strip()}); the fault-injection variant covers ENOSPC")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full_small_filesystem(small_fs):
    d = str(small_fs / "store")
    s = Store(d, budgets={"pinned": 4 << 20}, buffer_bytes=1 << 20)
    filler = small_fs / "filler"

    def fill():
        st = os.statvfs(small_fs)
        with open(filler, "wb") as f:  # leave ~1 MiB: the next ~7 MiB of writes cannot all fit
            f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - (1 << 20)))
        return lambda: os.unlink(filler)
    _check_disk_full_recovery(s, [d], fill)
    s.close()
    with Store.open(d) as s2:
        assert len(s2) == 11 and torch.equal(s2.get("b5"), torch.full((300_000,), 5.0))


def test_zarr_export_import(tmp_path):
    zarr = pytest.importorskip("zarr")
    xs = {"layer.0/w": torch.randn(64, 33), "bf": torch.randn(10).to(torch.bfloat16), "i8": sample(torch.int8),
          "flag": sample(torch.bool), "empty": torch.empty(0, 3), "scalar": torch.tensor(2.5),
          "odd name!": torch.ones(2)}
    with Store(tmp_path / "s") as s:
        for k, v in xs.items():
            s.put(k, v)
        s.export_zarr(tmp_path / "plain")
        s.export_zarr(tmp_path / "zstd", compressor="zstd")
        import numcodecs
        s.export_zarr(tmp_path / "nc", compressor=numcodecs.Zstd(level=5))
    g = zarr.open_group(str(tmp_path / "plain"), mode="r")
    assert g.metadata.zarr_format == 3
    np.testing.assert_array_equal(g["layer.0/w"][...], xs["layer.0/w"].numpy())
    assert g["bf"].attrs["torch_dtype"] == "bfloat16"
    for kind in ("plain", "zstd", "nc"):
        with Store.import_zarr(tmp_path / kind, tmp_path / f"back-{kind}") as s:
            assert sorted(s.keys()) == sorted(xs)
            for k, v in xs.items():
                got = s.get(k)
                assert got.dtype == v.dtype and got.shape == v.shape and raw(got) == raw(v), (kind, k)


def test_threads_put_get_prefetch(tmp_path):
    errors = []

    def worker(s, w):
        try:
            for i in range(40):
                k = f"w{w}-{i % 7}"
                v = torch.full((1000 + 500 * (i % 5),), float(w * 1000 + i))
                s.put(k, v, [None, "host", "nvme"][i % 3])
                t = s.tensor(k)
                t.prefetch("host").result()
                assert torch.equal(s.get(k), v)
                if i % 10 == 9:
                    s.flush()
        except BaseException as e:
            errors.append(e)
    with Store(tmp_path, budgets={"host": 40_000, "device": 20_000}) as s:
        ths = [threading.Thread(target=worker, args=(s, w)) for w in range(4)]
        for th in ths:
            th.start()
        for th in ths:
            th.join(60)
        assert not errors, errors
        keys = sorted(s.keys())
    with Store.open(tmp_path) as s:
        assert sorted(s.keys()) == keys


def test_stats_and_profiler_ranges(tmp_path):
    with Store(tmp_path, budgets={"host": 1 << 20}) as s:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            s.put("x", torch.ones(10_000), "host")
            # private: the job offload() runs on a worker thread, run on this one, which the profiler records
            s.tensor("x")._offload_job("nvme", False)
            s.flush()
            s.get("x")
        names = {e.name for e in prof.events()}
        assert {"tierstore::to_host", "tierstore::nvme_write", "tierstore::flush", "tierstore::nvme_read"} <= names
        st = s.stats()
        assert st["nvme"]["bytes_in"] == 40_000 and st["nvme"]["bytes_out"] == 40_000 and st["flushes"] == 1
        assert st["host"]["bytes_in"] == 40_000 and st["nvme"]["seconds_out"] > 0


def test_exports():
    from tierstore.tensor import TieredTensor
    assert tierstore.Store is Store and tierstore.TieredTensor is TieredTensor
