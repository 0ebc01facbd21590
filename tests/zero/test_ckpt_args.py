"""save_checkpoint, load_checkpoint and consolidate refuse a wrong argument with a TierstoreValueError naming
it and what to pass instead, before anything is read or written."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.support import batches, cfg, loss_fn, make_pair
from tierstore.errors import MisuseError, TierstoreValueError
from tierstore.zero import Zero3Optimizer, consolidate
from tierstore.zero.checkpoint import load_checkpoint, save_checkpoint


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("args")
    _, m = make_pair()
    opt = Zero3Optimizer(m, torch.optim.AdamW, config=cfg(tmp / "run"), lr=1e-2)
    x, y = batches(1)[0]
    loss_fn(m, x, y).backward()
    opt.step()
    opt.zero_grad()
    opt.save_checkpoint(tmp / "ck")
    yield tmp, opt
    opt.close()


BAD_DIRS = [(None, "NoneType"), (123, "int"), (b"/tmp/ck", "str path"), ("", "not a path"),
            ("/tmp/a\0b", "not a path"), (["ck"], "list")]


@pytest.mark.parametrize("bad,said", BAD_DIRS)
def test_a_bad_directory_is_refused_naming_it(trained, monkeypatch, bad, said):
    tmp, opt = trained
    monkeypatch.chdir(tmp)
    before = sorted(os.listdir(tmp))
    for fn, call in [("save_checkpoint", lambda: opt.save_checkpoint(bad)),
                     ("save_checkpoint", lambda: save_checkpoint(opt, bad)),
                     ("load_checkpoint", lambda: opt.load_checkpoint(bad)),
                     ("load_checkpoint", lambda: load_checkpoint(opt, bad)),
                     ("consolidate", lambda: consolidate(bad))]:
        with pytest.raises(TierstoreValueError) as ei:
            call()
        msg = str(ei.value)
        assert msg.startswith(f"{fn}: directory") and said in msg, msg
    assert sorted(os.listdir(tmp)) == before  # nothing written


@pytest.mark.parametrize("bad", ["fp16", "float16", torch.int8, 16, torch.float16.__class__])
def test_a_bad_consolidate_dtype_is_refused_naming_it(trained, bad):
    tmp, _opt = trained
    with pytest.raises(TierstoreValueError, match=r"consolidate: dtype must be a floating torch.dtype"):
        consolidate(tmp / "ck", dtype=bad)
    assert consolidate(tmp / "ck", dtype=torch.float16)["fc1.weight"].dtype == torch.float16


def test_a_bad_or_closed_optimizer_is_refused(trained, tmp_path):
    tmp, _opt = trained
    for fn, call in [("save_checkpoint", lambda: save_checkpoint(None, tmp_path / "x")),
                     ("load_checkpoint", lambda: load_checkpoint(torch.nn.Linear(2, 2), tmp / "ck"))]:
        with pytest.raises(TierstoreValueError, match=f"{fn}: opt must be the Zero3Optimizer"):
            call()
    _, m = make_pair()
    opt = Zero3Optimizer(m, torch.optim.AdamW, config=cfg(tmp_path / "run"), lr=1e-2)
    opt.close()
    for call in (lambda: opt.save_checkpoint(tmp_path / "x"), lambda: opt.load_checkpoint(tmp / "ck")):
        with pytest.raises(MisuseError, match="closed"):
            call()
    assert not (tmp_path / "x").exists()
    assert Path(tmp / "ck").is_dir()
