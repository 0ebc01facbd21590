"""`tierstore tune DIR` on a tiny budget, and its file accepted by Engine, Store and OffloadConfig."""
from __future__ import annotations

import json

import pytest
import torch

from tierstore.cli import main
from tierstore.errors import TierstoreValueError
from tierstore.io import Engine, Tuning
from tierstore.store import Store
from tierstore.zero.config import OffloadConfig


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    d = tmp_path_factory.mktemp("tune")
    out = d / "tuning.json"
    rc = main(["tune", str(d / "disk"), "--budget", "2", "--size", "16M", "--rounds", "1", "--out", str(out),
               "--json", str(d / "report.json")])
    assert rc == 0
    return out, json.loads((d / "report.json").read_text())


def test_tune_writes_a_recommendation_it_measured(tuned):
    out, report = tuned
    t = Tuning.load(out)
    assert t.measured["trials"] == len(report["trials"]) >= 1
    assert t.measured["gib_s_write_then_read"] > 0
    assert any("stripe_unit" in s for s in report["not_tried"])  # one directory: nothing to stripe
    assert all(tr["seconds"] > 0 for tr in report["trials"])


def test_engine_store_and_offload_config_take_it(tuned, tmp_path):
    out, _ = tuned
    t = Tuning.load(out)
    with Engine.from_tuning(out) as eng:
        assert (eng.queue_depth, eng.block_size) == (t.queue_depth, t.block_size)
    with Engine.from_tuning(out, queue_depth=3) as eng:
        assert eng.queue_depth == 3
    with Store(tmp_path / "s", io_tuning=out, lock_memory=False) as s:
        io = s.stats()["io"]
        assert (io["queue_depth"], io["block_size"]) == (t.queue_depth, t.block_size)
        assert (io["buffer_bytes"], io["stripe_unit"], io["workers"]) == (t.buffer_bytes, t.stripe_unit, t.workers)
        s.put("x", torch.arange(10.0), "nvme")
    with Store.open(tmp_path / "s", io_tuning=out, queue_depth=5, lock_memory=False) as s:
        assert s.stats()["io"]["queue_depth"] == 5  # an explicit argument wins
        assert torch.equal(s.get("x"), torch.arange(10.0))
    assert OffloadConfig(io_tuning=str(out)).io_tuning == str(out)


def test_an_existing_store_keeps_its_stripe_unit(tmp_path):
    path = tmp_path / "t.json"
    Tuning(stripe_unit=256 << 10).save(path)
    dirs = [tmp_path / "a", tmp_path / "b"]
    with Store(dirs, lock_memory=False) as s:  # 1 MiB stripes
        s.put("x", torch.arange(1 << 20, dtype=torch.float32), "nvme")
    with Store.open(dirs, io_tuning=path, lock_memory=False) as s:
        assert s.stats()["io"]["stripe_unit"] == 1 << 20
        assert torch.equal(s.get("x"), torch.arange(1 << 20, dtype=torch.float32))
    with Store([tmp_path / "c"], io_tuning=path, lock_memory=False) as s:  # a new store takes it
        assert s.stats()["io"]["stripe_unit"] == 256 << 10


@pytest.mark.parametrize("body,what", [
    ({"format": "other/1"}, "format"),
    ({"format": "tierstore-io-tuning/1", "queue_depth": 0}, "queue_depth=0"),
    ({"format": "tierstore-io-tuning/1", "block_size": 1000}, "block_size=1000"),
    ({"format": "tierstore-io-tuning/1", "backend": "aio"}, "backend='aio'"),
    ({"format": "tierstore-io-tuning/1", "qd": 4}, "unknown keys ['qd']"),
])
def test_a_bad_tuning_file_is_named(tmp_path, body, what):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(body))
    for make in (lambda: Engine.from_tuning(path), lambda: Store(tmp_path / "s", io_tuning=path),
                 lambda: OffloadConfig(io_tuning=str(path))):
        with pytest.raises(TierstoreValueError) as ei:
            make()
        assert str(path) in str(ei.value) and what in str(ei.value)
    path.write_text("{not json")
    with pytest.raises(TierstoreValueError, match="not JSON"):
        Tuning.load(path)
    with pytest.raises(TierstoreValueError, match="cannot read"):
        Tuning.load(tmp_path / "missing.json")
