"""No file a checkpoint load reads may run code, and every malformed field is a tierstore error naming the file
(see [Note: checkpoints are untrusted input] in tierstore/zero/checkpoint/records.py). The fuzz
test over the same readers is tests/store/test_parsers_fuzz.py."""
from __future__ import annotations

import json
import math
import os
import struct

import crc32c
import pytest
import torch

from tests.support.models import batches, loss_fn, make_pair
from tests.support.zero import cfg
from tierstore.errors import CorruptionError, TierstoreValueError  # noqa: E402
from tierstore.zero import Zero3Optimizer, consolidate  # noqa: E402

FOOTER = struct.Struct("<QQI4s")


def _body_crc(body: dict) -> int:
    return crc32c.crc32c(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


class _Marker:
    """Unpickling it creates the file `path`: proof that a load ran code from the checkpoint."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def train(m, opt, n=2):
    for x, y in batches(n):
        loss_fn(m, x, y).backward()
        opt.step()
        opt.zero_grad()


def saved(tmp_path, opt_cls=torch.optim.AdamW, **kw):
    """A checkpoint of a small trained model in tmp_path/ck: (its subdirectory, a fresh optimizer to load into)."""
    _, m = make_pair()
    opt = Zero3Optimizer(m, opt_cls, lr=1e-2, config=cfg(tmp_path / "a"), **kw)
    train(m, opt)
    sub = opt.save_checkpoint(tmp_path / "ck")
    opt.close()
    _, m2 = make_pair(seed=3)
    return sub, Zero3Optimizer(m2, opt_cls, lr=1e-2, config=cfg(tmp_path / "b"), **kw)


def parse(path: str) -> tuple[bytes, dict]:
    data = open(path, "rb").read()
    at, n, _crc, _magic = FOOTER.unpack(data[-FOOTER.size:])
    return data, json.loads(data[at:at + n])


def write_records(path: str, head: bytes, index: dict) -> tuple[int, int]:
    """`head` (magic and records) then `index` and its footer; returns (file size, index crc32c)."""
    raw = json.dumps(index).encode()
    crc = crc32c.crc32c(raw)
    with open(path, "wb") as f:
        f.write(head + raw + FOOTER.pack(len(head), len(raw), crc, b"TSZI"))
    return len(head) + len(raw) + FOOTER.size, crc


def edit_meta(sub: str, fn, *, keep_crc: bool = False) -> None:
    path = os.path.join(sub, "meta.json")
    doc = json.load(open(path))
    fn(doc)
    if not keep_crc:
        doc["crc32c"] = _body_crc(doc["body"])
    open(path, "w").write(json.dumps(doc))


def edit_index(sub: str, fname: str, fn) -> None:
    """Apply fn to the index of record file `fname`, rewrite it with valid crc32c everywhere."""
    path = os.path.join(sub, fname)
    data, index = parse(path)
    at = FOOTER.unpack(data[-FOOTER.size:])[0]
    fn(index)
    size, crc = write_records(path, data[:at], index)
    edit_meta(sub, lambda d: d["body"]["files"].__setitem__(fname, {"nbytes": size, "index_crc32c": crc}))


# -- item 4: no code runs ------------------------------------------------------------------------------------

def test_a_pickled_aux_record_of_format_2_is_refused_and_never_unpickled(tmp_path):
    sub, opt2 = saved(tmp_path)
    marker = str(tmp_path / "ran")
    # the rank file as format 2 wrote it for non-JSON aux state: a torch.save'd record "<gid>.aux"
    path = os.path.join(sub, "rank00000.bin")
    data, index = parse(path)
    at = FOOTER.unpack(data[-FOOTER.size:])[0]
    import io
    buf = io.BytesIO()
    torch.save({"x": _Marker(marker)}, buf)
    blob = buf.getvalue()
    gid = opt2.layout.trainable_gids()[0]
    index["records"][f"{gid}.aux"] = {"dtype": "bytes", "shape": [len(blob)], "offset": at, "nbytes": len(blob),
                                      "crc32c": crc32c.crc32c(blob)}
    index["version"] = 2
    index["aux"] = {}
    size, crc = write_records(path, data[:at] + blob, index)

    def as_v2(doc):
        doc["version"] = 2
        doc["body"].pop("version", None)
        doc["body"]["files"]["rank00000.bin"] = {"nbytes": size, "index_crc32c": crc}
    edit_meta(sub, as_v2)
    edit_index(sub, "buffers.bin", lambda ix: ix.__setitem__("version", 2))  # its index said 3
    with pytest.raises(TierstoreValueError, match=f"record '{gid}.aux'.*unpickling can run code"):
        opt2.load_checkpoint(tmp_path / "ck")
    assert not os.path.exists(marker)
    opt2.close()
    consolidate(tmp_path / "ck")  # the parameters of that checkpoint are still readable: no aux needed
    assert not os.path.exists(marker)


def test_a_version_1_checkpoint_is_refused_and_never_unpickled(tmp_path):
    import io
    marker = str(tmp_path / "ran")
    sub, opt2 = saved(tmp_path)
    opt2.close()
    buf = io.BytesIO()
    torch.save({0: {"master": torch.zeros(4), "aux": {"x": _Marker(marker)}}}, buf)
    data = buf.getvalue()
    for name in ("rank00000.pt", "buffers.pt"):
        open(os.path.join(sub, name), "wb").write(data)

    def as_v1(doc):
        doc["version"] = 1
        doc["body"].pop("version", None)
        doc["body"]["files"] = {n: {"nbytes": len(data), "crc32c": crc32c.crc32c(data)}
                                for n in ("rank00000.pt", "buffers.pt")}
    edit_meta(sub, as_v1)
    with pytest.raises(TierstoreValueError, match="version 1 .*can run code.*save_checkpoint writes version 3"):
        consolidate(tmp_path / "ck")
    assert not os.path.exists(marker)


class Counting(torch.optim.Optimizer):
    """SGD that keeps non-tensor state of every type a checkpoint stores (and nothing else)."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                st["n"] = st.get("n", 0) + 1
                st["info"] = {"t": (1, 2.5, None), 3: [True, "x", float("nan"), torch.arange(3.0)],
                              "low": float("-inf"), None: "none"} if type(self) is Counting else {"seen": {1, 2}}
                p.add_(p.grad, alpha=-g["lr"])


class SetState(Counting):
    """Keeps a set in its state: not storable without pickling."""


def _same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return a == b


def test_non_tensor_optimizer_state_round_trips_in_tagged_json(tmp_path):
    _, m = make_pair()
    opt = Zero3Optimizer(m, Counting, lr=1e-2, config=cfg(tmp_path / "a"), elementwise_ok=True)
    train(m, opt, 3)
    want = {g: opt.export_subgroup(g)["aux"] for g in opt.layout.trainable_gids()}
    assert want and all(a["n"] == 3 for a in want.values())
    opt.save_checkpoint(tmp_path / "ck")
    opt.close()
    _, m2 = make_pair(seed=3)
    opt2 = Zero3Optimizer(m2, Counting, lr=1e-2, config=cfg(tmp_path / "b"), elementwise_ok=True)
    opt2.load_checkpoint(tmp_path / "ck")
    got = {g: opt2.export_subgroup(g)["aux"] for g in opt2.layout.trainable_gids()}
    assert all(_same(want[g], got[g]) for g in want), (want, got)
    opt2.close()


def test_state_a_checkpoint_cannot_store_safely_is_refused_when_saving(tmp_path):
    _, m = make_pair()
    opt = Zero3Optimizer(m, SetState, lr=1e-2, config=cfg(tmp_path / "a"), elementwise_ok=True)
    train(m, opt)
    with pytest.raises(TierstoreValueError, match="optimizer state .* is a builtins.set; checkpoints store"):
        opt.save_checkpoint(tmp_path / "ck")
    assert not os.path.exists(tmp_path / "ck" / "latest")
    opt.close()


# -- item 5: `latest` and the directory ------------------------------------------------------------------------

@pytest.mark.parametrize("content", [b"../other/NAME", b"ABS", b"\xff\xfe\x00garbage", b"", b"ckpt-1-xyz",
                                     b"ckpt-00000002-ab/../../other/NAME"])
def test_latest_must_name_a_checkpoint_inside_the_directory(tmp_path, content):
    other, opt2 = saved(tmp_path / "o")  # a complete checkpoint elsewhere: `latest` must not reach it
    opt2.close()
    os.makedirs(tmp_path / "ck")
    content = content.replace(b"NAME", os.path.basename(other).encode()).replace(b"ABS", other.encode())
    latest = tmp_path / "ck" / "latest"
    latest.write_bytes(content)
    with pytest.raises(CorruptionError, match="not the name of a checkpoint in this directory") as e:
        consolidate(tmp_path / "ck")
    assert e.value.filename == str(latest)


def test_a_file_or_a_directory_without_checkpoint_says_what_to_pass(tmp_path):
    sub, opt2 = saved(tmp_path)
    opt2.close()
    with pytest.raises(TierstoreValueError, match="is a file, not a checkpoint directory: pass the directory"):
        consolidate(os.path.join(sub, "meta.json"))
    with pytest.raises(TierstoreValueError, match="one checkpoint's own directory; pass the directory that holds"):
        consolidate(sub)
    os.makedirs(tmp_path / "empty")
    with pytest.raises(TierstoreValueError, match="no checkpoint in .*save_checkpoint"):
        consolidate(tmp_path / "empty")


# -- item 6: every field checked, with a valid crc32c ------------------------------------------------------------

def _first_master(index: dict) -> dict:
    return next(r for n, r in index["records"].items() if n.endswith(".master"))


@pytest.mark.parametrize("case,field", [
    ("huge", "offset"), ("dtype", "dtype"), ("past_index", "offset"), ("overlap", "offset"), ("shape", "shape"),
    ("aux", "aux")])
def test_record_index_fields_are_checked_before_use(tmp_path, case, field):
    sub, opt2 = saved(tmp_path)

    def damage(ix):
        r = _first_master(ix)
        if case == "huge":  # 2**46 bytes: torch would be asked for 64 TiB
            r["shape"], r["nbytes"] = [1 << 44], 1 << 46
        elif case == "dtype":
            r["dtype"] = "no_such_dtype"
        elif case == "past_index":
            r["offset"] = r["offset"] + 10 ** 6
        elif case == "overlap":
            others = [x for x in ix["records"].values() if x is not r and x["nbytes"]]
            r["offset"] = others[0]["offset"] + 4
        elif case == "shape":
            r["shape"] = [-1]
        elif case == "aux":
            ix["aux"] = {"0": {"dict": [["k", {"pickle": "x"}]]}}
    edit_index(sub, "rank00000.bin", damage)
    loads = [lambda: opt2.load_checkpoint(tmp_path / "ck")]
    if case != "aux":  # consolidate reads no aux state
        loads.append(lambda: consolidate(tmp_path / "ck"))
    for load in loads:
        with pytest.raises(CorruptionError, match=rf"field (records\['[^']+'\]\.)?{field}") as e:
            load()
        assert e.value.filename.endswith("rank00000.bin")
    opt2.close()


def test_a_record_of_another_size_than_the_layout_says_is_refused(tmp_path):
    sub, opt2 = saved(tmp_path)

    def shrink(ix):
        r = _first_master(ix)
        r["shape"], r["nbytes"] = [r["shape"][0] - 1], r["nbytes"] - 4
    edit_index(sub, "rank00000.bin", shrink)
    with pytest.raises(CorruptionError, match="the checkpoint's layout says"):
        consolidate(tmp_path / "ck")
    with pytest.raises(CorruptionError, match="the checkpoint's layout says"):
        opt2.load_checkpoint(tmp_path / "ck")
    opt2.close()


@pytest.mark.parametrize("field,value", [("world_size", "1"), ("world_size", 0), ("steps", -1), ("files", {}),
                                         ("compute_dtype", "no_such"), ("layout", {"groups": [{}]}),
                                         ("aliases", {"x": "no_such_param"}), ("scaler", None),
                                         ("param_groups", [])])
def test_meta_fields_are_checked(tmp_path, field, value):
    sub, opt2 = saved(tmp_path)
    opt2.close()
    edit_meta(sub, lambda d: d["body"].__setitem__(field, value))
    with pytest.raises(CorruptionError, match=f"field {field}") as e:
        consolidate(tmp_path / "ck")
    assert e.value.filename == os.path.join(sub, "meta.json")


def test_the_version_is_under_the_crc32c(tmp_path):
    sub, opt2 = saved(tmp_path)
    opt2.close()
    edit_meta(sub, lambda d: d.__setitem__("version", 2), keep_crc=True)  # 3 -> 2 outside the checksummed body
    with pytest.raises(CorruptionError, match="version 2 outside its checksummed body and 3 inside"):
        consolidate(tmp_path / "ck")

