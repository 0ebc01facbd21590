"""The store's fault paths: a directory fsync that fails after the manifest rename (both generations stay
intact), a full disk found by the call that asked for the space (nothing reverts later), write errors that
flush() reports tensor by tensor with advice that follows the errno, and a truncated extent file read as
corruption. Faults are injected (monkeypatched syscalls, the engine's fault injector) and, where root may
loop-mount a small ext4, met for real: a full disk and a filesystem shut down with FS_IOC_SHUTDOWN."""
from __future__ import annotations

import errno
import json
import os
import shutil

import pytest
import torch

import tierstore.store as store_mod
import tierstore.tiers.nvme.writes as nvme_writes
from tierstore.errors import CorruptionError, TierstoreIOError
from tierstore.store import Store

MiB = 1 << 20  # bytes
BIG = 300_000  # elements of float32: 1.2 MB, more than one 1 MiB pool buffer, so streamed into its own extent
SMALL = 2_000  # elements: packed into a staging buffer


def opts(budgets=None, **kw) -> dict:
    return {"budgets": {"pinned": 4 * MiB, **(budgets or {})}, "buffer_bytes": MiB, "lock_memory": False, **kw}


def val(i: float, n: int = BIG) -> torch.Tensor:
    return torch.full((n,), float(i))


def generation(d) -> int:
    with open(os.path.join(d, "manifest.json")) as f:
        return json.load(f)["body"]["generation"]


def reopen_values(d, names) -> dict:
    s = Store.open(d, **opts())
    try:
        return {n: s.get(n) for n in names if n in s}
    finally:
        s.close(flush=False)


# -- item 1: the directory fsync after the manifest rename fails ------------------------------------------

def test_dir_fsync_failing_after_the_rename_keeps_both_generations(tmp_path, monkeypatch):
    """The renamed manifest may or may not be durable: neither its extents nor the previous manifest's may
    be reused until a later flush succeeds. Before: the new extents were freed as if never named, the next
    updates overwrote them, and a reopen found the renamed manifest pointing at other data (CorruptionError)."""
    d = str(tmp_path / "s")
    s = Store(d, **opts(budgets={"host": 0}))
    s.put("y", val(0), "nvme")
    s.put("z", val(10, SMALL), "nvme")
    s.flush()
    gen1 = open(os.path.join(d, "manifest.json"), "rb").read()

    s.tensor("y").update(val(1))
    s.tensor("z").update(val(11, SMALL))
    real = store_mod.fsync_dir
    calls = []

    def failing(path):
        calls.append(path)
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(store_mod, "fsync_dir", failing)
    with pytest.raises(TierstoreIOError) as ei:
        s.flush()
    monkeypatch.setattr(store_mod, "fsync_dir", real)
    assert calls, "the fault was not reached"
    assert generation(d) == 2  # renamed: a reopen without a crash finds it

    for i in range(2, 6):  # new values must go to space neither manifest names
        s.tensor("y").update(val(i))
        s.tensor("z").update(val(10 + i, SMALL))
        s.put(f"n{i}", val(20 + i), "nvme")
    s._nvme.sync()  # private: the staged writes reach the files and are fsynced, with no manifest written
    s.close(flush=False)  # the crash: no further flush

    lost = str(tmp_path / "rename-lost")
    shutil.copytree(d, lost)
    with open(os.path.join(lost, "manifest.json"), "wb") as f:  # the rename did not survive the crash
        f.write(gen1)
    got = reopen_values(d, ["y", "z"])  # the rename did survive
    assert torch.equal(got["y"], val(1)) and torch.equal(got["z"], val(11, SMALL))
    got = reopen_values(lost, ["y", "z"])
    assert torch.equal(got["y"], val(0)) and torch.equal(got["z"], val(10, SMALL))
    msg = str(ei.value)
    assert ei.value.errno == errno.EIO and "either this flush or the previous one" in msg
    assert "free space" not in msg.lower() and "dmesg" in msg


def test_space_of_both_generations_comes_back_after_a_flush_succeeds(tmp_path, monkeypatch):
    d = str(tmp_path / "s")
    with Store(d, **opts(budgets={"host": 0})) as s:
        s.put("y", val(0), "nvme")
        s.flush()
        one = s.stats()["nvme"]["used"]  # bytes of one version of y
        s.tensor("y").update(val(1))
        monkeypatch.setattr(store_mod, "fsync_dir", lambda p: (_ for _ in ()).throw(OSError(errno.EIO, "EIO")))
        with pytest.raises(TierstoreIOError):
            s.flush()
        monkeypatch.undo()
        s.tensor("y").update(val(2))
        assert s.stats()["nvme"]["used"] == 3 * one  # generations 1 and 2 kept, plus the new value
        s.flush()
        assert s.stats()["nvme"]["used"] == one
    assert torch.equal(reopen_values(d, ["y"])["y"], val(2))


@pytest.mark.parametrize("code,want,never", [
    (errno.ENOSPC, "free space", "dmesg"),
    (errno.EIO, "dmesg", "free space"),
    (errno.EROFS, "read-only", "free space"),
])
def test_manifest_write_error_advice_follows_the_errno(tmp_path, monkeypatch, code, want, never):
    d = str(tmp_path / "s")
    s = Store(d, **opts())
    s.put("a", val(1, SMALL))
    s.flush()
    s.tensor("a").update(val(2, SMALL))
    real = os.replace

    def failing(src, dst, *a, **k):
        if str(dst).endswith("manifest.json"):
            raise OSError(code, os.strerror(code))
        return real(src, dst, *a, **k)
    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(TierstoreIOError) as ei:
        s.flush()
    monkeypatch.undo()
    msg = str(ei.value).lower()
    assert ei.value.errno == code and want in msg and never not in msg and "previous flush stands" in msg
    assert not os.path.exists(os.path.join(d, "manifest.json.tmp"))
    s.flush()  # the advice "call flush() again" holds: every value was still held
    s.close()
    assert torch.equal(reopen_values(d, ["a"])["a"], val(2, SMALL))


def test_filesystem_shutdown_after_the_rename(ext4, monkeypatch):
    """A real filesystem shut down (like a power cut) between the manifest rename and the directory fsync:
    the error says the flush may or may not have landed, with EIO advice; after a remount the store holds
    exactly one of the two flushes."""
    d = os.path.join(ext4.mnt, "store")
    s = Store(d, **opts(budgets={"host": 0}))
    s.put("y", val(0), "nvme")
    s.put("z", val(10, SMALL), "nvme")
    s.flush()
    s.tensor("y").update(val(1))
    s.tensor("z").update(val(11, SMALL))
    real = os.replace

    def replace_then_shutdown(src, dst, *a, **k):
        real(src, dst, *a, **k)
        if str(dst).endswith("manifest.json"):
            ext4.shutdown()
    monkeypatch.setattr(os, "replace", replace_then_shutdown)
    with pytest.raises(TierstoreIOError) as ei:
        s.flush()
    monkeypatch.undo()
    msg = str(ei.value)
    assert ei.value.errno == errno.EIO and "either this flush or the previous one" in msg
    assert "free space" not in msg.lower()
    with pytest.raises(TierstoreIOError, match="'y'") as ei:  # a dead disk fails the call that needs it
        s.tensor("y").update(val(2))
    assert "free space" not in str(ei.value).lower()
    s.close(flush=False)
    ext4.umount()
    ext4.mount()
    g = generation(d)
    got = reopen_values(d, ["y", "z"])
    want = {1: (val(0), val(10, SMALL)), 2: (val(1), val(11, SMALL))}[g]
    assert torch.equal(got["y"], want[0]) and torch.equal(got["z"], want[1])


# -- item 3: a full disk and values with no other copy --------------------------------------------------

def _refuse_fallocate(monkeypatch, code=errno.ENOSPC):
    def refuse(fd, offset, length):
        raise OSError(code, os.strerror(code))
    monkeypatch.setattr(nvme_writes, "_fallocate", refuse)


@pytest.mark.parametrize("n", [BIG, SMALL], ids=["streamed", "packed"])
@pytest.mark.parametrize("how", ["host_budget0", "reopened"])
def test_full_disk_is_raised_by_the_call_that_cannot_keep_the_value(tmp_path, monkeypatch, n, how):
    """put/update of a value with no memory copy on a full disk raise at once, naming the tensor; the
    previous value stays; nothing is reverted later. Before: they returned, the next flush reverted the
    update and removed the new name, and told the user to free space and flush again."""
    d = str(tmp_path / "s")
    s = Store(d, **opts(budgets={"host": 0}))
    s.put("a", val(0, n), "nvme")
    s.flush()
    if how == "reopened":  # an nvme-only tensor after reopen, with plenty of host budget
        s.close()
        s = Store.open(d, **opts(budgets={"host": 32 * MiB}))
    _refuse_fallocate(monkeypatch)
    with pytest.raises(TierstoreIOError) as ei:
        s.tensor("a").update(val(1, n))
    assert ei.value.errno == errno.ENOSPC and "'a'" in str(ei.value) and "free space" in str(ei.value)
    assert "keeps its previous" in str(ei.value)
    with pytest.raises(TierstoreIOError, match="put\\('b'\\) did not store"):
        s.put("b", val(2, n), "nvme")
    assert "b" not in s and torch.equal(s.get("a"), val(0, n))
    s.flush()  # nothing left to fail
    monkeypatch.undo()
    s.tensor("a").update(val(3, n))  # space again: the same calls work
    s.put("b", val(4, n), "nvme")
    s.close()
    got = reopen_values(d, ["a", "b"])
    assert torch.equal(got["a"], val(3, n)) and torch.equal(got["b"], val(4, n))


def test_full_disk_with_memory_copies_flush_retry_stores_them(tmp_path, monkeypatch):
    d = str(tmp_path / "s")
    s = Store(d, **opts(budgets={"host": 32 * MiB}))
    s.put("a", val(0), "host")
    s.flush()
    _refuse_fallocate(monkeypatch)
    s.tensor("a").update(val(1))
    s.put("b", val(2, SMALL), "host")
    with pytest.raises(TierstoreIOError) as ei:
        s.flush()
    msg = str(ei.value)
    assert ei.value.errno == errno.ENOSPC and "'a'" in msg and "'b'" in msg and "call flush() again" in msg
    assert "gone" not in msg  # nothing was lost
    monkeypatch.undo()
    s.flush()
    s.close()
    got = reopen_values(d, ["a", "b"])
    assert torch.equal(got["a"], val(1)) and torch.equal(got["b"], val(2, SMALL))


def test_writeback_without_room_keeps_the_memory_copy(tmp_path, monkeypatch):
    """resident(writeback=True) whose nvme rewrite finds no room: the stale nvme copy is dropped (a spill
    would otherwise bring the old value back) and the next flush writes the new one."""
    d = str(tmp_path / "s")
    s = Store(d, **opts(budgets={"host": 32 * MiB}))
    s.put("a", val(0), "host")
    s.tensor("a").offload("nvme", keep=True).result()
    s.flush()
    _refuse_fallocate(monkeypatch)
    with s.tensor("a").resident("host", writeback=True) as x:
        x.fill_(5.0)
    assert s.tensor("a").tiers == {"host"} and torch.equal(s.get("a"), val(5))
    with pytest.raises(TierstoreIOError, match="'a'"):
        s.flush()
    monkeypatch.undo()
    s.close()
    assert torch.equal(reopen_values(d, ["a"])["a"], val(5))


def test_write_error_flush_names_lost_and_kept_tensors(tmp_path):
    """An EIO no reservation foresees: flush() names the values that existed only in the failed write (back
    at their last flushed value, or removed) without telling to retry, and those a retry stores; the
    advice is the disk's, not free space."""
    d = str(tmp_path / "s")
    s = Store(d, **opts(budgets={"host": 32 * MiB}))
    s.put("a", val(0, SMALL), "nvme")
    s.flush()
    s.tensor("a").update(val(1, SMALL))  # these three share one packed write
    s.put("b", val(2, SMALL), "nvme")
    s.put("c", val(3, SMALL), "host")
    # private: the fault is injected in the store's own engine (test-only, no public hook)
    s._engine.inject_fault(1, "eio")
    with pytest.raises(TierstoreIOError) as ei:
        s.flush()
    msg = str(ei.value)
    assert ei.value.errno == errno.EIO and "free space" not in msg.lower() and "dmesg" in msg
    lost, kept = msg.split("Still held")
    assert "'a'" in lost and "last flushed value" in lost and "'b'" in lost and "removed" in lost
    assert "'c'" in kept and "call flush() again" in kept and "flush() again" not in lost
    assert torch.equal(s.get("a"), val(0, SMALL)) and "b" not in s
    s.flush()
    s.close()
    got = reopen_values(d, ["a", "b", "c"])
    assert set(got) == {"a", "c"} and torch.equal(got["a"], val(0, SMALL)) and torch.equal(got["c"], val(3, SMALL))


@pytest.mark.parametrize("n", [BIG, SMALL], ids=["streamed", "packed"])
def test_a_failed_fsync_trusts_none_of_the_writes_since_the_last_flush(tmp_path, monkeypatch, n):
    """An fsync of the extent files fails: the kernel may have dropped the pages it could not write back,
    and a retried fsync would succeed without them. So every value written since the last flush that
    succeeded is treated as a failed write -- kept when a memory copy holds it, else back at its last
    flushed value or removed -- also when a read had already waited for its write; the error names the
    fsync's file. Before: the retried flush declared them durable."""
    d = str(tmp_path / "s")
    s = Store(d, **opts(budgets={"host": 32 * MiB}))
    s.put("a", val(0, n), "nvme")
    s.flush()
    s.tensor("a").update(val(1, n))
    s.put("b", val(2, n), "nvme")
    s.put("c", val(3, n), "host")
    assert torch.equal(s.get("a"), val(1, n)) and torch.equal(s.get("b"), val(2, n))  # reads wait for the writes
    real = os.fsync

    def failing(fd):
        if "extents-" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EIO, "Input/output error")
        real(fd)
    monkeypatch.setattr(os, "fsync", failing)
    with pytest.raises(TierstoreIOError) as ei:
        s.flush()
    msg = str(ei.value)
    assert ei.value.errno == errno.EIO and "fsync of" in msg and "extents-" in msg, msg
    lost, kept = msg.split("Still held")
    assert "'a'" in lost and "last flushed value" in lost and "'b'" in lost and "removed" in lost
    assert "'c'" in kept and "call flush() again" in kept
    assert torch.equal(s.get("a"), val(0, n)) and "b" not in s and torch.equal(s.get("c"), val(3, n))
    monkeypatch.setattr(os, "fsync", real)
    s.flush()
    s.close()
    got = reopen_values(d, ["a", "b", "c"])
    assert set(got) == {"a", "c"} and torch.equal(got["a"], val(0, n)) and torch.equal(got["c"], val(3, n))


def test_filesystem_shutdown_before_the_fsync(ext4):
    """A real filesystem shut down (like a power cut) after the new values' writes and before the flush's
    fsync: the flush names them lost (back at their last flushed value) with EIO advice, and after a
    remount the store holds the last flush that succeeded."""
    d = os.path.join(ext4.mnt, "store")
    s = Store(d, **opts(budgets={"host": 0}))
    s.put("y", val(0), "nvme")
    s.flush()
    s.tensor("y").update(val(1))  # streamed: written now, not yet fsynced
    s.synchronize()  # the write reached the file (not fsynced)
    ext4.shutdown()
    with pytest.raises(TierstoreIOError) as ei:
        s.flush()
    msg = str(ei.value)
    assert ei.value.errno == errno.EIO and "'y'" in msg and "last flushed value" in msg, msg
    assert "free space" not in msg.lower()
    s.close(flush=False)
    ext4.umount()
    ext4.mount()
    assert generation(d) == 1
    assert torch.equal(reopen_values(d, ["y"])["y"], val(0))


@pytest.mark.parametrize("n", [BIG, SMALL], ids=["streamed", "packed"])
def test_full_real_disk(ext4, n):
    """A small ext4 filled up: an update and a put with no memory copy fail at the call, the flushed value
    stays, and after space is freed the same calls and a reopen work."""
    d = os.path.join(ext4.mnt, "store")
    s = Store(d, **opts(budgets={"host": 0}))
    s.put("a", val(0, n), "nvme")
    s.flush()
    filler = ext4.fill()
    with pytest.raises(TierstoreIOError) as ei:
        s.tensor("a").update(val(1, n))
    assert ei.value.errno == errno.ENOSPC and "'a'" in str(ei.value) and "free space" in str(ei.value)
    with pytest.raises(TierstoreIOError, match="'b'"):
        s.put("b", val(2, n), "nvme")
    assert "b" not in s and torch.equal(s.get("a"), val(0, n))
    with pytest.raises(TierstoreIOError, match="previous flush stands") as ei:  # no room for a manifest either
        s.flush()
    assert ei.value.errno == errno.ENOSPC
    os.unlink(filler)
    s.tensor("a").update(val(1, n))
    s.flush()
    s.close()
    assert torch.equal(reopen_values(d, ["a"])["a"], val(1, n))


# -- item 10: a truncated extent file --------------------------------------------------------------------

@pytest.mark.parametrize("n", [BIG, SMALL], ids=["streamed", "packed"])
def test_truncated_extent_file_is_corruption_naming_the_tensor(tmp_path, n):
    """Before: a TierstoreIOError "read past end of file". Now a CorruptionError naming the tensor, the file,
    offset and length; a tensor before the cut still reads."""
    d = str(tmp_path / "s")
    with Store(d, **opts(budgets={"host": 0})) as s:
        s.put("first", val(1, n), "nvme")
        s.put("cut", val(2, n), "nvme")
    with open(os.path.join(d, "manifest.json")) as f:
        ext = json.load(f)["body"]["tensors"]["cut"]["extent"]
    path = os.path.join(d, "extents-0000.bin")
    os.truncate(path, ext["offset"] + ext["length"] // 2)
    s = Store.open(d, **opts())
    try:
        with pytest.raises(CorruptionError) as ei:
            s.get("cut")
        msg = str(ei.value)
        assert "'cut'" in msg and "truncated" in msg and path in msg
        assert ei.value.offset == ext["offset"] and ei.value.length == ext["length"]
        assert torch.equal(s.get("first"), val(1, n))
        got = s.get_many(["first"])
        assert torch.equal(got["first"], val(1, n))
        with pytest.raises(CorruptionError, match="'cut'"):
            s.get_many(["first", "cut"])
    finally:
        s.close(flush=False)


@pytest.mark.parametrize("codec", [None, "zlib"])
def test_failed_replacement_reverts_to_the_flushed_tensor_whole(tmp_path, codec):
    """A put() replacing a flushed tensor with one of another dtype and shape (or codec), whose write then
    fails with an error no reservation foresees (EIO): the name is back at the flushed tensor -- its bytes
    with its own shape, dtype and codec, never the old bytes read as the new dtype."""
    import numcodecs

    d = str(tmp_path / "s")
    s = Store(d, **opts(budgets={"host": 0}))
    old = torch.arange(300, dtype=torch.float32)
    s.put("x", old, "nvme")
    s.flush()
    s.put("x", torch.full((7, 50), 7, dtype=torch.int32), "nvme",
          codec=numcodecs.Zlib() if codec else None)
    # private: the fault is injected in the store's own engine (test-only, no public hook)
    s._engine.inject_fault(1, "eio")
    with pytest.raises(TierstoreIOError, match="last flushed value"):
        s.flush()
    got = s.get("x")
    assert got.dtype == torch.float32 and torch.equal(got, old)
    assert not s.tensor("x").dirty
    s.put("y", old, "nvme")  # the store goes on working
    s.close()
    assert torch.equal(reopen_values(d, ["x"])["x"], old)


def test_a_writable_open_makes_the_manifest_durable_first(tmp_path, monkeypatch):
    """A manifest renamed by a flush whose directory fsync failed may not survive a crash; a later writable
    open in the same boot would reuse the other generation's space on its word. So the open fsyncs the
    manifest's directory entry before trusting it, and refuses (naming the file, no "free space") when that
    fails; a read-only open needs no such step."""
    d = str(tmp_path / "s")
    with Store(d, **opts(budgets={"host": 0})) as s:
        s.put("a", val(0, SMALL), "nvme")
    real, calls = store_mod.fsync_dir, []

    def record(path):
        calls.append(path)
        return real(path)
    monkeypatch.setattr(store_mod, "fsync_dir", record)
    Store.open(d, **opts()).close(flush=False)
    assert calls == [d]

    def failing(path):
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(store_mod, "fsync_dir", failing)
    with pytest.raises(TierstoreIOError) as ei:
        Store.open(d, **opts())
    assert ei.value.errno == errno.EIO and "manifest.json" in str(ei.value) and "mode='r'" in str(ei.value)
    assert "free space" not in str(ei.value).lower()
    with Store.open(d, mode="r", **opts()) as s:  # reading needs no durability step
        assert torch.equal(s.get("a"), val(0, SMALL))
    monkeypatch.setattr(store_mod, "fsync_dir", real)
    with Store.open(d, **opts()) as s:  # and the failed open left nothing held
        assert torch.equal(s.get("a"), val(0, SMALL))
