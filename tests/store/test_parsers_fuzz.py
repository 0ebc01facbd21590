"""Parsers of files tierstore reads: the store's manifest (Store.open) and a checkpoint's meta.json and record
index (read_meta, consolidate, load_checkpoint) accept exact data or raise a tierstore error, never another
exception, never allocate huge memory or create files. The mutations are structural with a
recomputed, valid crc32c -- a byte flip is caught by the checksum before any parser runs. Checkpoint cases
that are not fuzzed are in tests/zero/test_ckpt_security.py."""
from __future__ import annotations

import contextlib
import copy
import json
import os
import pickle
import resource
import struct

import crc32c
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.models import batches, loss_fn, make_pair
from tests.support.zero import cfg
from tierstore import Store  # noqa: E402
from tierstore.errors import CorruptionError, TierstoreError  # noqa: E402
from tierstore.zero import Zero3Optimizer, consolidate  # noqa: E402
from tierstore.zero.checkpoint import read_meta  # noqa: E402

SMALL = dict(budgets={"host": 0, "pinned": 1 << 20}, buffer_bytes=256 << 10, lock_memory=False, workers=1)


def fuzz(n: int):
    """Deterministic (derandomized) Hypothesis settings for n cases."""
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))
FOOTER = struct.Struct("<QQI4s")


def _crc(body) -> int:
    return crc32c.crc32c(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


@contextlib.contextmanager
def memory_capped(headroom: int = 2 << 30):  # bytes
    """Private memory beyond `headroom` more than now fails (ENOMEM) instead of being allocated."""
    with open("/proc/self/status") as f:
        data = next(int(line.split()[1]) for line in f if line.startswith("VmData:")) * 1024  # bytes
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (data + headroom, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def listing(*dirs) -> dict:
    return {os.path.join(r, f): os.path.getsize(os.path.join(r, f))
            for d in dirs for r, _ds, fs in os.walk(d) for f in fs}


# -- mutations of a JSON document ----------------------------------------------------------------------------

INTERESTING = [None, True, False, 0, 1, -1, 3, 4096, 1 << 31, 1 << 40, 1 << 46, 1 << 63, 1 << 64, -(1 << 63), 0.5,
               float("nan"), "", "x", "float32", "bytes", "../x", [], [0], [-1], [1 << 40], {}, {"id": "pickle"},
               {"id": "zstd"}, [[0]], "0", "ckpt-1-a"]


def paths(node, at=()):
    """Every path (tuple of keys / indices) into a JSON document, the root excluded."""
    out = []
    if isinstance(node, dict):
        for k, v in node.items():
            out.append(at + (k,))
            out += paths(v, at + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out.append(at + (i,))
            out += paths(v, at + (i,))
    return out


def get_at(doc, path):
    for k in path:
        doc = doc[k]
    return doc


@st.composite
def mutated(draw, doc):
    """`doc` with 1-3 structural mutations: a value replaced, a key deleted or added, a subtree copied over
    another (two tensors sharing an extent), a number nudged."""
    doc = copy.deepcopy(doc)
    for _ in range(draw(st.integers(1, 3))):
        ps = paths(doc)
        if not ps:
            break
        path = draw(st.sampled_from(ps))
        parent, key = get_at(doc, path[:-1]), path[-1]
        op = draw(st.sampled_from(["replace", "replace", "delete", "add", "copy", "nudge"]))
        if op == "replace":
            parent[key] = copy.deepcopy(draw(st.sampled_from(INTERESTING) | st.integers() | st.text(max_size=4)))
        elif op == "delete":
            del parent[key]
        elif op == "add" and isinstance(parent, dict):
            parent[draw(st.text(max_size=3))] = copy.deepcopy(draw(st.sampled_from(INTERESTING)))
        elif op == "add" and isinstance(parent, list):
            parent.append(copy.deepcopy(draw(st.sampled_from(parent + INTERESTING))))
        elif op == "copy":
            src = draw(st.sampled_from(ps))
            parent[key] = copy.deepcopy(get_at(doc, src))
        elif op == "nudge" and type(parent[key]) is int:
            parent[key] += draw(st.sampled_from([-4096, -1, 1, 4096, 1 << 20]))
    return doc


# -- the store's manifest --------------------------------------------------------------------------------------

def make_store(d, ndirs=2):
    dirs = [str(d / f"d{k}") for k in range(ndirs)]
    values = {"a": torch.arange(3000, dtype=torch.float32), "b": torch.arange(10, dtype=torch.int64).reshape(2, 5),
              "c": torch.ones(300000, dtype=torch.float16), "e": torch.empty(0), "s": torch.tensor(7.5)}
    with Store(dirs, stripe_unit=64 << 10, **SMALL) as s:
        for n, v in values.items():
            s.put(n, v, tier="nvme")
    return dirs, values


def write_manifest(dirs, doc, *, keep_crc=False):
    if not keep_crc and isinstance(doc, dict) and "body" in doc:
        with contextlib.suppress(TypeError, ValueError):
            doc["crc32c"] = _crc(doc["body"])
    with open(os.path.join(dirs[0], "manifest.json"), "w") as f:
        f.write(json.dumps(doc))


def open_and_read(dirs, originals: list[bytes]) -> None:
    """Open the store and read every tensor: each read is one of the original tensors' bytes, or a tierstore
    error; nothing else may happen."""
    try:
        s = Store.open(dirs, stripe_unit=64 << 10, **SMALL)
    except TierstoreError:
        return
    try:
        for n in s.keys():
            try:
                v = s.get(n)
            except TierstoreError:
                continue
            got = v.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if v.numel() else b""
            assert got in originals, f"{n!r}: {v.dtype} {tuple(v.shape)} is not data that was stored"
    finally:
        s.close(flush=False)


@pytest.fixture(scope="module")
def store_dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzzstore")
    dirs, values = make_store(d)
    doc = json.load(open(os.path.join(dirs[0], "manifest.json")))
    originals = [v.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for v in values.values()]
    return dirs, doc, originals


def test_manifest_fuzz(store_dirs):
    dirs, doc, originals = store_dirs
    before = listing(*dirs)

    @fuzz(1500)
    @given(st.data())
    def run(data):
        write_manifest(dirs, data.draw(mutated(doc)))
        with memory_capped():
            open_and_read(dirs, originals)
        assert listing(*dirs).keys() == before.keys()  # no file created
    try:
        run()
    finally:
        write_manifest(dirs, doc, keep_crc=True)


def _edit(dirs, doc, fn):
    doc = copy.deepcopy(doc)
    fn(doc)
    write_manifest(dirs, doc)


def _ext(doc, name):
    return doc["body"]["tensors"][name]["extent"]


@pytest.mark.parametrize("case", ["body_list", "no_dtype", "file_-1", "shape", "huge", "file_300", "shared",
                                  "overlap", "version", "unaligned", "ndirs_str"])
def test_manifest_fields_are_checked_before_anything_is_made(tmp_path, case):
    """Crafted manifests, each with a valid crc32c."""
    dirs, values = make_store(tmp_path)
    doc = json.load(open(os.path.join(dirs[0], "manifest.json")))
    before = listing(*dirs)

    def damage(d):
        b = d["body"]
        if case == "body_list":
            d["body"] = [b]
        elif case == "no_dtype":
            del b["tensors"]["a"]["dtype"]
        elif case == "file_-1":
            _ext(d, "a")["file"] = -1
        elif case == "shape":
            b["tensors"]["a"]["shape"] = [10]
        elif case == "huge":
            _ext(d, "a")["length"] = _ext(d, "a")["alloc"] = 1 << 40
            b["tensors"]["a"].update(shape=[1 << 38], nbytes=1 << 40)
        elif case == "file_300":
            _ext(d, "a")["file"] = 300
        elif case == "shared":
            b["tensors"]["a2"] = copy.deepcopy(b["tensors"]["a"])
        elif case == "overlap":
            _ext(d, "b")["offset"] = _ext(d, "a")["offset"]
        elif case == "version":
            d["version"] = 0  # outside the checksum; the body says 1
        elif case == "unaligned":
            _ext(d, "a")["offset"] += 8
        elif case == "ndirs_str":
            b["ndirs"] = "2"
    _edit(dirs, doc, damage)
    with pytest.raises(CorruptionError, match="body is not a dict" if case == "body_list" else "field") as e, \
            memory_capped():
        Store.open(dirs, stripe_unit=64 << 10, **SMALL).close(flush=False)  # refused when opened, not read
    assert e.value.filename and os.path.basename(dirs[0]) in e.value.filename, e.value
    assert listing(*dirs).keys() == before.keys()


def test_an_extent_past_the_end_of_its_file_damages_that_tensor_only(tmp_path):
    """An extent reaching 1 GiB past the end of its file (a truncated file, or a crafted manifest): the store
    opens, that tensor's reads are a CorruptionError naming it -- raised before memory is allocated for it --
    and the other tensors read exactly."""
    dirs, values = make_store(tmp_path)
    doc = json.load(open(os.path.join(dirs[0], "manifest.json")))
    _edit(dirs, doc, lambda d: _ext(d, "c").update(offset=_ext(d, "c")["offset"] + (1 << 30)))
    s = Store.open(dirs, stripe_unit=64 << 10, **SMALL)
    try:
        with memory_capped():
            for read in (lambda: s.get("c"), lambda: s.get_many(["a", "c"])):
                with pytest.raises(CorruptionError, match="tensor 'c'"):
                    read()
        for n in values:
            if n != "c":
                assert torch.equal(s.get(n), values[n]), n
    finally:
        s.close(flush=False)


def test_a_codec_that_unpickles_is_refused(tmp_path):
    marker = str(tmp_path / "ran")

    class Marker:
        def __reduce__(self):
            return (open, (marker, "w"))
    payload = pickle.dumps(Marker())
    dirs = [str(tmp_path / "d")]
    with Store(dirs, **SMALL) as s:
        s.put("p", torch.frombuffer(bytearray(payload), dtype=torch.uint8), tier="nvme")
    doc = json.load(open(os.path.join(dirs[0], "manifest.json")))
    _edit(dirs, doc, lambda d: d["body"]["tensors"]["p"].update(codec={"id": "pickle"}))
    with pytest.raises(CorruptionError, match="field tensors\\['p'\\].codec: codec 'pickle' decodes to Python"):
        s = Store.open(dirs, **SMALL)
        try:
            s.get("p")
        finally:
            s.close(flush=False)
    assert not os.path.exists(marker)


# -- checkpoints ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzzckpt")
    _, m = make_pair()
    m.register_buffer("seen", torch.arange(5.0))
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-2, config=cfg(d / "a"))
    for x, y in batches(2):
        loss_fn(m, x, y).backward()
        opt.step()
        opt.zero_grad()
    sub = opt.save_checkpoint(d / "ck")
    opt.close()
    full = consolidate(d / "ck")
    files = {n: open(os.path.join(sub, n), "rb").read() for n in os.listdir(sub)}
    _, m2 = make_pair(seed=3)
    m2.register_buffer("seen", torch.zeros(5))
    opt2 = Zero3Optimizer(m2, torch.optim.AdamW, lr=1e-2, config=cfg(d / "b"))
    yield d / "ck", sub, files, full, opt2
    opt2.close()


def restore(sub, files):
    for n, data in files.items():
        with open(os.path.join(sub, n), "wb") as f:
            f.write(data)


def check_consolidate(directory, full) -> None:
    """consolidate gives tensors that are the saved ones (any name, shape or dtype the file says), or a tierstore
    error."""
    try:
        read_meta(directory)
        got = consolidate(directory)
    except TierstoreError:
        return
    flat = [v.reshape(-1) for v in full.values()]
    for n, v in got.items():
        v = v.reshape(-1)
        assert any(o.numel() == v.numel() and torch.equal(o.to(v.dtype), v) for o in flat), n


def fuzz_consolidate(checkpoint, examples: int, damage) -> None:
    """`examples` runs of damage(data) -- rewriting some file of the checkpoint from Hypothesis' draws -- each
    followed by consolidate, which must give exact data or a tierstore error and create no file; the files
    are restored afterwards."""
    directory, sub, files, full, _opt = checkpoint
    before = listing(directory)

    @fuzz(examples)
    @given(st.data())
    def run(data):
        damage(data)
        with memory_capped():
            check_consolidate(directory, full)
        assert listing(directory).keys() == before.keys()
    try:
        run()
    finally:
        restore(sub, files)


def test_checkpoint_meta_fuzz(checkpoint):
    _directory, sub, files, _full, _opt = checkpoint
    meta = json.loads(files["meta.json"])

    def damage(data):
        doc = data.draw(mutated(meta))
        if isinstance(doc.get("body"), dict):
            doc["crc32c"] = _crc(doc["body"])
        with open(os.path.join(sub, "meta.json"), "w") as f:
            f.write(json.dumps(doc))
    fuzz_consolidate(checkpoint, 700, damage)


def rewrite_index(sub, files, fname, index) -> None:
    data = files[fname]
    at = FOOTER.unpack(data[-FOOTER.size:])[0]
    raw = json.dumps(index).encode()
    crc = crc32c.crc32c(raw)
    new = data[:at] + raw + FOOTER.pack(at, len(raw), crc, b"TSZI")
    with open(os.path.join(sub, fname), "wb") as f:
        f.write(new)
    meta = json.loads(files["meta.json"])
    meta["body"]["files"][fname] = {"nbytes": len(new), "index_crc32c": crc}
    meta["crc32c"] = _crc(meta["body"])
    with open(os.path.join(sub, "meta.json"), "w") as f:
        f.write(json.dumps(meta))


def _index(files, fname):
    data = files[fname]
    at, n, _c, _m = FOOTER.unpack(data[-FOOTER.size:])
    return json.loads(data[at:at + n])


@pytest.mark.parametrize("fname", ["rank00000.bin", "buffers.bin"])
def test_checkpoint_record_index_fuzz(checkpoint, fname):
    _directory, sub, files, _full, _opt = checkpoint
    index = _index(files, fname)
    fuzz_consolidate(checkpoint, 500, lambda data: rewrite_index(sub, files, fname, data.draw(mutated(index))))


def test_load_checkpoint_fuzz(checkpoint):
    """load_checkpoint over mutated meta.json and rank index: loads or raises a tierstore error."""
    directory, sub, files, _full, opt = checkpoint
    meta, index = json.loads(files["meta.json"]), _index(files, "rank00000.bin")

    @fuzz(150)
    @given(st.data())
    def run(data):
        restore(sub, files)
        if data.draw(st.booleans()):
            doc = data.draw(mutated(meta))
            if isinstance(doc.get("body"), dict):
                doc["crc32c"] = _crc(doc["body"])
            with open(os.path.join(sub, "meta.json"), "w") as f:
                f.write(json.dumps(doc))
        else:
            rewrite_index(sub, files, "rank00000.bin", data.draw(mutated(index)))
        with memory_capped():
            try:
                opt.load_checkpoint(directory)
            except TierstoreError:
                pass
    try:
        run()
    finally:
        restore(sub, files)
