"""What a store directory may hold that tierstore did not put there: a symlink, FIFO or device at one of the
store's own names is refused with an error naming it, never followed, read or written through; its manifest
is read only up to what the format can need ([Note: tierstore's own files] in tierstore/io/files.py,
[Note: how large a manifest can be] in tierstore/manifest.py)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from tierstore.errors import CorruptionError, TierstoreIOError, TierstoreValueError
from tierstore.manifest import manifest_limit, read_manifest, write_manifest
from tierstore.store import Store

NINE = b"outside!!"  # the 9-byte file outside the store a planted link points at


def small_store(paths, budgets=None, **kw) -> Store:
    return Store(paths, budgets={"pinned": 8 << 20, "host": 0, **(budgets or {})}, **kw)


def fill(paths, **kw) -> None:
    with small_store(paths, **kw) as s:
        s.put("w", torch.arange(4096, dtype=torch.float32), "nvme")


@pytest.fixture(params=["to a file outside", "dangling"])
def target(request, tmp_path):
    t = tmp_path / "outside.txt"
    if request.param == "to a file outside":
        t.write_bytes(NINE)
    return t


def untouched(t) -> None:
    if t.name == "outside.txt" and t.exists():
        assert t.read_bytes() == NINE
    else:
        assert not os.path.lexists(t)


def refused(e, where) -> None:
    assert e.value.filename == str(where), e.value
    assert "tierstore never follows one there" in str(e.value)


@pytest.mark.parametrize("name", ["extents-0000.bin", "tierstore.lock", "manifest.json.tmp"])
def test_symlink_planted_in_a_new_store_is_refused(tmp_path, target, name):
    d = tmp_path / "s"
    d.mkdir()
    os.symlink(target, d / name)
    with pytest.raises(TierstoreIOError) as e:
        fill(d)
    refused(e, d / name)
    untouched(target)
    assert os.path.islink(d / name)  # the link stays as the user left it


@pytest.mark.parametrize("mode", ["w", "r"])
@pytest.mark.parametrize("name", ["extents-0000.bin", "manifest.json", "tierstore.lock"])
def test_symlink_planted_in_an_existing_store_is_refused(tmp_path, target, name, mode):
    d = tmp_path / "s"
    fill(d)
    os.replace(d / name, tmp_path / "moved")
    os.symlink(target, d / name)
    with pytest.raises(TierstoreIOError) as e:
        Store.open(d, mode=mode, budgets={"pinned": 8 << 20, "host": 0}).close()
    refused(e, d / name)
    untouched(target)


def test_symlink_in_the_second_directory_is_refused(tmp_path, target):
    a, b = tmp_path / "a", tmp_path / "b"
    b.mkdir()
    os.symlink(target, b / "extents-0000.bin")
    with pytest.raises(TierstoreIOError) as e:
        fill([a, b])
    refused(e, b / "extents-0000.bin")
    untouched(target)


def test_symlink_planted_while_open_is_refused_at_flush(tmp_path, target):
    d = tmp_path / "s"
    with small_store(d) as s:
        s.put("w", torch.ones(4096), "nvme")
        os.symlink(target, d / "manifest.json.tmp")
        with pytest.raises(TierstoreIOError) as e:
            s.flush()
        refused(e, d / "manifest.json.tmp")
        untouched(target)
        assert not os.path.lexists(d / "manifest.json")
        assert os.path.islink(d / "manifest.json.tmp")  # not tierstore's: left alone
        os.unlink(d / "manifest.json.tmp")
        s.flush()  # every value was still held
    assert torch.equal(Store.open(d, mode="r", budgets={"pinned": 8 << 20}).get("w"), torch.ones(4096))


def test_symlink_planted_at_the_next_extent_file_is_refused(tmp_path, target):
    d = tmp_path / "s"
    with small_store(d, extent_file_bytes=1 << 20) as s:
        s.put("a", torch.ones(1 << 18), "nvme")
        s.flush()
        os.symlink(target, d / "extents-0001.bin")
        with pytest.raises(TierstoreIOError) as e:
            for i in range(8):  # 1 MiB each: the next extent file is needed long before the last
                s.put(f"b{i}", torch.ones(1 << 18), "nvme")
            s.flush()
        refused(e, d / "extents-0001.bin")
        untouched(target)


@pytest.mark.timeout(60, method="signal")  # a FIFO read or opened for reading blocks forever
@pytest.mark.parametrize("mode", ["w", "r"])
@pytest.mark.parametrize("name", ["manifest.json", "extents-0000.bin", "tierstore.lock"])
def test_fifo_at_an_own_name_is_refused_without_blocking(tmp_path, name, mode):
    d = tmp_path / "s"
    fill(d)
    os.unlink(d / name)
    os.mkfifo(d / name)
    with pytest.raises(TierstoreIOError, match="not a regular file") as e:
        Store.open(d, mode=mode, budgets={"pinned": 8 << 20, "host": 0}).close()
    assert e.value.filename == str(d / name)


@pytest.mark.timeout(60, method="signal")
@pytest.mark.parametrize("mode", ["w", "r"])
def test_manifest_linked_to_dev_zero_is_not_read(tmp_path, mode):
    d = tmp_path / "s"
    fill(d)
    os.unlink(d / "manifest.json")
    os.symlink("/dev/zero", d / "manifest.json")
    with pytest.raises(TierstoreIOError) as e:
        Store.open(d, mode=mode, budgets={"pinned": 8 << 20, "host": 0}).close()
    refused(e, d / "manifest.json")


@pytest.mark.timeout(60, method="signal")
def test_manifest_larger_than_the_format_can_need_is_refused_unread(tmp_path):
    d = tmp_path / "s"
    fill(d)
    with open(d / "manifest.json", "r+b") as f:
        f.truncate(1 << 30)  # sparse: a 1 GiB file next to 4 KiB of extents
    with pytest.raises(CorruptionError, match="more than a store whose extent files hold what these do") as e:
        Store.open(d, mode="r", budgets={"pinned": 8 << 20, "host": 0})
    assert e.value.filename == str(d / "manifest.json")


def test_a_manifest_laid_out_otherwise_still_opens(tmp_path):
    """The checksum is taken over the body's bytes as written; a manifest laid out otherwise (indented, keys
    in another order) is checked by serialising its body again, and opens as before."""
    d = tmp_path / "s"
    fill(d)
    doc = json.loads((d / "manifest.json").read_bytes())
    (d / "manifest.json").write_text(json.dumps({k: doc[k] for k in reversed(list(doc))}, indent=2))
    with Store.open(d, mode="r", budgets={"pinned": 8 << 20}) as s:
        assert torch.equal(s.get("w"), torch.arange(4096, dtype=torch.float32))
    doc["body"]["generation"] += 1  # same layout, another body: the checksum fails either way
    (d / "manifest.json").write_text(json.dumps(doc, indent=2))
    with pytest.raises(CorruptionError, match="fails its checksum"):
        Store.open(d, mode="r", budgets={"pinned": 8 << 20})


def test_deep_nesting_is_a_corruption_error(tmp_path):
    d = tmp_path / "s"
    fill(d)
    (d / "manifest.json").write_bytes(b"[" * 200_000 + b"]" * 200_000)
    with pytest.raises(CorruptionError, match="is not valid"):
        Store.open(d, mode="r", budgets={"pinned": 8 << 20})


def test_flush_refuses_a_manifest_a_reopen_would_refuse(tmp_path):
    d = tmp_path / "s"
    d.mkdir()
    entry = {"shape": [0], "dtype": "float32", "nbytes": 0, "codec": None,
             "extent": {"file": 0, "offset": 0, "length": 0, "alloc": 0, "crc32c": 0}}
    tensors = {f"t{i}": entry for i in range(100)}
    with pytest.raises(TierstoreValueError, match="more than a reopen accepts"):
        write_manifest(str(d), tensors, generation=1, ndirs=1, stripe_unit=1 << 20, nfiles=0, limit=1000)
    assert os.listdir(d) == []
    write_manifest(str(d), tensors, generation=1, ndirs=1, stripe_unit=1 << 20, nfiles=0,
                   limit=manifest_limit(0))
    assert len(read_manifest(str(d))["tensors"]) == 100
