"""Store edges: every directory locked, read-only opens (also on a really
read-only filesystem), zero-size tensors under codecs, by-name reads racing puts, and bad input refused
with a tierstore error that says what to do."""
from __future__ import annotations

import os
import pathlib
import threading
import warnings

import numcodecs
import pytest
import torch

from tierstore.errors import (
    MisuseError,
    PinnedMemoryError,
    TierFullError,
    TierstoreError,
    TierstoreIOError,
    TierstoreTypeError,
    TierstoreValueError,
)
from tierstore.io import BufferPool
from tierstore.store import Store


def small_store(paths, budgets=None, **kw) -> Store:
    return Store(paths, budgets={"pinned": 8 << 20, "host": 0, **(budgets or {})}, **kw)


class TinyNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 2)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def zero_config(nvme_dir, **kw):
    from tierstore.zero import OffloadConfig

    return OffloadConfig(params="host", optimizer_states="nvme", gradients="host", nvme_paths=[str(nvme_dir)],
                         min_io_bytes=1024, sub_group_bytes=4096, pinned_bytes=8 << 20, **kw)


# -- item 2: every directory of a store is locked --------------------------------------------------------
def test_a_store_over_a_directory_of_an_open_store_is_refused_and_changes_nothing(tmp_path):
    a, b, c = (str(tmp_path / n) for n in "abc")
    x = torch.arange(3 << 18, dtype=torch.float32)  # 3 MiB: stripes in both directories
    with small_store([a, b]) as s:
        s.put("x", x, "nvme")
        s.flush()
        for other in ([b], [c, b], [b, a]):
            with pytest.raises(MisuseError, match=f"another Store has {b}|another Store has {a}"):
                small_store(other)
        assert not os.path.exists(os.path.join(c, "extents-0000.bin"))
    with Store.open([a, b], budgets={"pinned": 8 << 20}) as s:
        assert torch.equal(s.get("x"), x)  # its extents were never written by another store


def test_a_failed_open_releases_the_locks_it_took(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")  # a sorts first: taken, then b fails
    with small_store([b]):
        with pytest.raises(MisuseError, match=f"another Store has {b}"):
            small_store([a, b])
        small_store([a]).close()  # a was released


def test_the_same_directory_through_a_symlink_is_the_same_lock(tmp_path):
    a = tmp_path / "a"
    a.mkdir()
    (tmp_path / "link").symlink_to(a)
    with small_store([str(a)]):
        with pytest.raises(MisuseError, match="another Store"):
            small_store([str(tmp_path / "link")])
    with pytest.raises(TierstoreValueError, match="twice"):
        small_store([str(a), str(tmp_path / "link")])


def test_a_second_optimizer_on_the_same_rank_directory_touches_nothing(tmp_path):
    from tierstore.zero import Zero3Optimizer

    opt = Zero3Optimizer(TinyNet(), torch.optim.AdamW, config=zero_config(tmp_path / "nvme"), lr=1e-2)
    try:
        opt.store.flush()
        rank_dir = os.path.join(tmp_path, "nvme", "rank0")
        manifest = os.path.join(rank_dir, "manifest.json")
        with open(manifest, "rb") as f:
            before = f.read()
        with pytest.raises(MisuseError, match=f"another Store has {rank_dir}"):
            Zero3Optimizer(TinyNet(), torch.optim.AdamW, config=zero_config(tmp_path / "nvme"), lr=1e-2)
        with open(manifest, "rb") as f:
            assert f.read() == before  # the live optimizer's manifest was not wiped
    finally:
        opt.close()
    assert os.path.exists(manifest)
    # once it is closed, a new run on the same directories starts empty (a previous run's states are not its own)
    opt2 = Zero3Optimizer(TinyNet(), torch.optim.AdamW, config=zero_config(tmp_path / "nvme"), lr=1e-2)
    try:
        assert opt2.store.stats()["flushes"] == 0 and not os.path.exists(manifest)
    finally:
        opt2.close()


def test_a_second_zero_init_on_the_same_directory_touches_nothing(tmp_path):
    from tierstore.zero import Init

    first = Init(zero_config(tmp_path / "nvme"))
    with first:
        TinyNet()
        first.store.flush()
        init_dir = os.path.join(tmp_path, "nvme", "init-rank0")
        manifest = os.path.join(init_dir, "manifest.json")
        before = open(manifest, "rb").read()
        with pytest.raises(MisuseError, match=f"another Store has {init_dir}"):
            Init(zero_config(tmp_path / "nvme")).__enter__()
        assert open(manifest, "rb").read() == before


# -- item 7: zero-size tensors under every codec -------------------------------------------------------
@pytest.mark.parametrize("codec", [None, numcodecs.Zstd(), numcodecs.Blosc(), numcodecs.Zlib()],
                         ids=["identity", "zstd", "blosc", "zlib"])
@pytest.mark.parametrize("shape", [(0,), (0, 3), (4, 0, 2)])
def test_zero_size_tensor_round_trips_through_nvme_with_a_codec(tmp_path, codec, shape):
    d = str(tmp_path / "s")
    with small_store(d) as s:
        s.put("z", torch.empty(shape, dtype=torch.float32), "nvme", codec=codec)
        assert s.get("z").shape == shape  # before the flush too
    with Store.open(d, budgets={"pinned": 8 << 20, "host": 1 << 20}) as s:
        for got in (s.get("z"), s.get_many(["z"])["z"], s.get("z", out=torch.empty(shape))):
            assert got.shape == shape and got.dtype == torch.float32
        s.tensor("z").prefetch("host").result()
        assert s.get("z").shape == shape


# -- item 8: a read by name racing a put of that name ------------------------------------------------
@pytest.mark.parametrize("reader", ["get", "get_many", "get_out"])
def test_get_by_name_racing_put_returns_the_old_or_the_new_value(tmp_path, reader):
    n = 4096  # elements: a staged (small) tensor, read through the nvme tier (host_budget=0)
    s = small_store(str(tmp_path / "s"))
    s.put("r", torch.zeros(n), "nvme")
    done = threading.Event()
    errors: list[BaseException] = []
    seen: set[float] = set()
    puts = [0]

    def writer():
        i = 0
        while not done.is_set():
            i += 1
            s.put("r", torch.full((n,), float(i)), "nvme")
            puts[0] = i

    def read_all():
        out = torch.empty(n)
        try:
            for _ in range(400):
                if reader == "get":
                    v = s.get("r")
                elif reader == "get_many":
                    v = s.get_many(["r"])["r"]
                else:
                    v = s.get("r", out=out)
                assert bool((v == v[0]).all()), "a torn read mixed two values"
                seen.add(float(v[0]))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    w = threading.Thread(target=writer)
    readers = [threading.Thread(target=read_all) for _ in range(2)]
    w.start()
    for t in readers:
        t.start()
    for t in readers:
        t.join()
    done.set()
    w.join()
    s.close(flush=False)
    assert not errors, errors[0]
    assert puts[0] > 0 and seen <= set(map(float, range(puts[0] + 1)))


def test_get_of_a_name_deleted_meanwhile_is_a_key_error_and_a_replaced_handle_still_refuses(tmp_path):
    with small_store(str(tmp_path / "s")) as s:
        s.put("a", torch.ones(4), "nvme")
        h = s.tensor("a")
        s.put("a", torch.zeros(4), "nvme")
        with pytest.raises(MisuseError, match="replaced"):
            h.get()  # the documented contract for handles
        assert torch.equal(s.get("a"), torch.zeros(4))
        s.delete("a")
        with pytest.raises(KeyError):
            s.get("a")


# -- item 11: read-only opens ------------------------------------------------------------------------------
def make_store(d, **tensors) -> None:
    with small_store(d) as s:
        for k, v in tensors.items():
            s.put(k, v, "nvme")


def test_read_only_open_reads_and_refuses_every_write(tmp_path):
    d = str(tmp_path / "s")
    x, y = torch.randn(100, 7), torch.arange(10)
    make_store(d, x=x, y=y)
    names = sorted(os.listdir(d))
    manifest = open(os.path.join(d, "manifest.json"), "rb").read()
    s = Store.open(d, mode="r", budgets={"pinned": 8 << 20, "host": 1 << 20})
    assert s.read_only and sorted(s.keys()) == ["x", "y"] and len(s) == 2 and "x" in s
    assert torch.equal(s.get("x"), x) and torch.equal(s.get_many(["y"])["y"], y)
    s.tensor("x").prefetch("host").result()  # moving a copy up writes nothing
    with s.tensor("x").resident("host") as xx:
        assert torch.equal(xx, x)
    writes = {
        "put": lambda: s.put("z", torch.ones(2)),
        "update": lambda: s.tensor("y").update(torch.zeros(10, dtype=torch.int64)),
        "delete": lambda: s.delete("x"),
        "flush": s.flush,
        "offload": lambda: s.tensor("x").offload("nvme"),
        "writeback": lambda: s.tensor("x").resident("host", writeback=True).__enter__(),
        "export into itself": lambda: s.export_zarr(os.path.join(d, "copy.zarr")),
    }
    for fn in writes.values():
        with pytest.raises(MisuseError, match="opened read-only"):
            fn()
    export = str(tmp_path / "out.zarr")
    s.export_zarr(export)  # elsewhere is fine: the store is only read
    s.close()  # must not flush
    assert sorted(os.listdir(d)) == names
    assert open(os.path.join(d, "manifest.json"), "rb").read() == manifest
    with Store.open(d, budgets={"pinned": 8 << 20}) as s:
        assert torch.equal(s.get("x"), x) and torch.equal(s.get("y"), y)


def test_read_only_opens_share_and_exclude_writers(tmp_path):
    d = str(tmp_path / "s")
    make_store(d, x=torch.ones(3))
    r1 = Store.open(d, mode="r", budgets={"pinned": 8 << 20})
    r2 = Store.open(d, mode="r", budgets={"pinned": 8 << 20})
    with pytest.raises(MisuseError, match="another Store"):
        Store.open(d, budgets={"pinned": 8 << 20})
    r1.close()
    r2.close()
    with Store.open(d, budgets={"pinned": 8 << 20}):
        with pytest.raises(MisuseError, match="open for writing"):
            Store.open(d, mode="r", budgets={"pinned": 8 << 20})
    with pytest.raises(TierstoreValueError, match="mode="):
        Store.open(d, mode="a")


@pytest.mark.parametrize("lock_file", [True, False], ids=["with-lock-file", "copied-without-lock-file"])
def test_read_only_open_on_a_read_only_filesystem(ext4, lock_file):
    mnt, remount_ro = pathlib.Path(ext4.mnt), ext4.remount_ro
    d = str(mnt / "store")
    x = torch.randn(3 << 18)  # 3 MiB: streamed, not staged
    make_store(d, x=x, z=torch.empty(0, 2))
    if not lock_file:
        os.unlink(os.path.join(d, "tierstore.lock"))
    remount_ro()
    with pytest.raises(TierstoreIOError, match="mode='r'"):
        Store.open(d, budgets={"pinned": 8 << 20})
    with Store.open(d, mode="r", budgets={"pinned": 8 << 20, "host": 0}) as s:
        assert torch.equal(s.get("x"), x) and s.get("z").shape == (0, 2)
        with pytest.raises(MisuseError, match="read-only"):
            s.put("y", torch.ones(1))


def test_consolidate_reads_a_checkpoint_on_a_read_only_filesystem(ext4, tmp_path):
    from tierstore.zero import Zero3Optimizer, consolidate

    mnt, remount_ro = pathlib.Path(ext4.mnt), ext4.remount_ro
    torch.manual_seed(0)
    m = TinyNet()
    opt = Zero3Optimizer(m, torch.optim.AdamW, config=zero_config(tmp_path / "nvme"), lr=1e-2)
    try:
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            x = torch.randn(4, 8, generator=g)
            m(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        opt.save_checkpoint(mnt / "ckpt")
        want = opt.full_state_dict()
    finally:
        opt.close()
    remount_ro()
    full = consolidate(mnt / "ckpt", dtype=torch.float32)
    assert set(want) <= set(full) and all(torch.equal(full[k], want[k]) for k in want)


# -- item 12: bad input gets a tierstore error that says what to do -----------------------------------------
def _quantized():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)


BAD_VALUES = {
    "sparse_coo": (lambda: torch.eye(3).to_sparse(), "to_dense"),
    "sparse_csr": (lambda: torch.eye(3).to_sparse_csr(), "to_dense"),
    "meta": (lambda: torch.empty(3, device="meta"), "no data"),
    "qint8": (_quantized, "scale and zero point"),
    "nested": (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "unbind"),
}


@pytest.mark.parametrize("tier", [None, "host", "nvme"])
@pytest.mark.parametrize("kind", sorted(BAD_VALUES))
def test_put_refuses_tensors_whose_bytes_are_not_their_value(tmp_path, kind, tier):
    make, advice = BAD_VALUES[kind]
    with small_store(str(tmp_path / "s"), budgets={"host": 1 << 20}) as s:
        with pytest.raises(TierstoreValueError, match=advice):
            s.put("x", make(), tier)
        assert "x" not in s


def test_update_refuses_a_meta_tensor(tmp_path):
    with small_store(str(tmp_path / "s")) as s:
        s.put("x", torch.ones(3), "nvme")
        with pytest.raises(TierstoreValueError, match="no data"):
            s.tensor("x").update(torch.empty(3, device="meta"))
        assert torch.equal(s.get("x"), torch.ones(3))


@pytest.mark.parametrize("tier", [None, "host", "nvme"])
def test_an_expanded_view_larger_than_memory_is_refused_before_any_copy(tmp_path, tier):
    with small_store(str(tmp_path / "s"), budgets={"host": None}) as s:
        with pytest.raises(TierFullError, match="more than this machine has.*expanded"):
            s.put("x", torch.zeros(1).expand(2 ** 40), tier)
        s.put("small", torch.zeros(1).expand(1000), tier)  # an expanded view that fits is stored
        assert torch.equal(s.get("small"), torch.zeros(1000))


@pytest.mark.parametrize("kw,err,advice", [
    (dict(budgets={"pinned": 2 ** 50}), PinnedMemoryError, "lower the pinned budget"),
    (dict(workers=0), TierstoreValueError, "workers=0 must be >= 1"),
    (dict(workers="2"), TierstoreValueError, "workers='2' must be an int"),
    (dict(budgets={"host": "1G"}), TierstoreTypeError,
     r"budgets\['host'\]='1G' must be an int number of bytes \(e.g. 1 << 30"),
    (dict(budgets={"host": 1.5e9}), TierstoreTypeError, r"budgets\['host'\]=1500000000.0 must be an int"),
    (dict(budgets={"device": True}), TierstoreTypeError, r"budgets\['device'\]=True must be an int"),
    (dict(budgets={"nvme": -1}), TierstoreValueError, r"budgets\['nvme'\]=-1 must be >= 0 bytes"),
    (dict(budgets={"pinned": None}), TierstoreValueError, r"budgets\['pinned'\]=None: the pinned pool is allocated"),
    (dict(queue_depth=0), TierstoreValueError, "queue_depth=0 must be >= 1"),
])
def test_bad_store_arguments(tmp_path, kw, err, advice):
    d = tmp_path / "s"
    with pytest.raises(err, match=advice):
        Store(str(d), **kw)
    Store(str(d), budgets={"pinned": 8 << 20}).close()  # a failed open holds no lock


def test_pool_larger_than_memory_is_a_pinned_memory_error():
    with pytest.raises(PinnedMemoryError, match="lower the pinned budget"):
        BufferPool(2 ** 50, 4 << 20)
    with pytest.raises(TierstoreValueError, match="must be an int"):
        BufferPool("64M", 4 << 20)


def test_a_path_that_is_a_file_is_refused(tmp_path):
    f = tmp_path / "file"
    f.write_bytes(b"not a directory")
    for paths in (str(f), [str(tmp_path / "d"), str(f)]):
        with pytest.raises(TierstoreValueError, match="is a file, not a directory"):
            Store(paths, budgets={"pinned": 8 << 20})
    assert f.read_bytes() == b"not a directory"


@pytest.mark.parametrize("op", ["keys", "len", "iter", "contains"])
def test_a_closed_store_refuses_to_list(tmp_path, op):
    s = small_store(str(tmp_path / "s"))
    s.put("x", torch.ones(1))
    s.close()
    fn = {"keys": s.keys, "len": lambda: len(s), "iter": lambda: list(s), "contains": lambda: "x" in s}[op]
    with pytest.raises(MisuseError, match="closed.*Store.open"):
        fn()
    assert isinstance(MisuseError("x"), TierstoreError)


def test_export_zarr_refuses_a_file_and_a_foreign_directory_before_writing(tmp_path):
    """export_zarr writes a new group at `path`, deleting what a directory there held: an existing file, a
    path under a file, or a directory holding other things is refused naming the path, and left as it
    was; a new path, an empty directory or an earlier zarr group is written."""
    f = tmp_path / "notes.txt"
    f.write_text("mine")
    other = tmp_path / "photos"
    other.mkdir()
    (other / "a.jpg").write_text("jpeg")
    with small_store(tmp_path / "s") as s:
        s.put("w", torch.ones(4), tier="nvme")
        for path, match in ((f, "an existing file"), (f / "sub", "is a file, so nothing can be made under it"),
                            (other, "holds other files and is no zarr group"), (None, "not a path"),
                            (b"/tmp/x", "a path is a str"), ("a\0b", "NUL")):
            with pytest.raises(TierstoreValueError, match=match) as ei:
                s.export_zarr(path)
            assert "export_zarr(path=" in str(ei.value) and "pass the path of a new or empty directory" in str(ei.value)
        assert f.read_text() == "mine" and os.listdir(other) == ["a.jpg"]
        s.export_zarr(tmp_path / "new" / "w.zarr")
        s.export_zarr(tmp_path / "new" / "w.zarr")  # an earlier group: replaced
        (tmp_path / "empty").mkdir()
        s.export_zarr(tmp_path / "empty")
    for group in (tmp_path / "new" / "w.zarr", tmp_path / "empty"):
        with Store.import_zarr(group, tmp_path / f"back-{group.name}") as back:
            assert torch.equal(back.get("w"), torch.ones(4))
