"""A load_checkpoint that fails leaves the optimizer as it was: every parameter, master, state, aux state,
hyperparameter, the loss scaler, `steps` and the model's buffers equal what they were before the call, and
training goes on from there. A failure where that cannot be kept (the optimizer's own store failing while
records are written into it) leaves the optimizer unusable, saying so, until a load succeeds."""
from __future__ import annotations

import errno
import os

import pytest
import torch

from tests.support import batches, cfg, flip_byte, loss_fn, make_pair
from tierstore.errors import CorruptionError, MisuseError, TierstoreIOError
from tierstore.zero import Zero3Optimizer, consolidate
from tierstore.zero.checkpoint import read_meta
from tierstore.zero.checkpoint.records import RecordFile  # the reader: finds the byte to damage


def train(m, opt, data):
    for x, y in data:
        loss_fn(m, x, y).backward()
        opt.step()
        opt.zero_grad()


def build(path, seed=0, lr=1e-2):
    _, m = make_pair(seed=seed)
    m.register_buffer("seen", torch.arange(6, dtype=torch.float32) * (seed + 1))
    return m, Zero3Optimizer(m, torch.optim.AdamW, config=cfg(path, "host", "nvme", "host"), lr=lr)


def snapshot(opt) -> dict:
    """Everything a load sets, as plain values (CPU tensor copies)."""
    sd = opt.state_dict()
    return {"sd": sd, "full": opt.full_state_dict(), "steps": opt.steps, "hp": opt.hyperparams(),
            "scaler": opt.scaler_state()}


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def _record(root, fname: str, name: str) -> tuple[str, dict]:
    sub, body = read_meta(root)
    path = os.path.join(sub, fname)
    rec = RecordFile(path, body["files"][fname])
    r = rec.records[name]
    rec.close()
    return path, r


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of another run (seed 5, 4 steps, lr 3e-2) to damage copies of."""
    tmp = tmp_path_factory.mktemp("saved")
    m, opt = build(tmp / "run", seed=5, lr=3e-2)
    train(m, opt, batches(4, seed=7))
    opt.save_checkpoint(tmp / "ck")
    last = opt.layout.trainable_gids()[-1]
    opt.close()
    return tmp / "ck", last


def _damage(root, last: int, how: str, fname: str = "rank00000.bin") -> None:
    if how == "buffer":
        path, r = _record(root, "buffers.bin", "seen")
    else:
        path, r = _record(root, fname, f"{last}.{how}")
    flip_byte(path, r["offset"] + r["nbytes"] // 2)


@pytest.mark.parametrize("how", ["master", "state.exp_avg", "state.step", "buffer"])
def test_a_damaged_last_record_leaves_the_optimizer_as_it_was(tmp_path, saved, how):
    """Not the sub-groups before the damaged one imported and `steps` and the hyperparameters not, with an
    error that says nothing about it."""
    import shutil
    root, last = saved
    shutil.copytree(root, tmp_path / "ck")
    _damage(tmp_path / "ck", last, how)
    m, opt = build(tmp_path / "run")
    data = batches(6)
    train(m, opt, data[:2])
    before = snapshot(opt)
    with pytest.raises(CorruptionError) as ei:
        opt.load_checkpoint(tmp_path / "ck")
    assert "optimizer is unchanged" in str(ei.value), str(ei.value)
    assert same(snapshot(opt), before)
    train(m, opt, data[2:])  # trains on from where it was: as a run that never tried the load
    m2, ref = build(tmp_path / "ref")
    train(m2, ref, data)
    assert same(snapshot(opt)["full"], snapshot(ref)["full"]) and opt.steps == ref.steps == 6
    opt.close()
    ref.close()


def test_a_missing_or_truncated_file_leaves_the_optimizer_as_it_was(tmp_path, saved):
    import shutil
    root, last = saved
    m, opt = build(tmp_path / "run")
    train(m, opt, batches(2))
    before = snapshot(opt)
    for i, fname in enumerate(["rank00000.bin", "buffers.bin"]):
        shutil.copytree(root, tmp_path / f"ck{i}")
        sub, _ = read_meta(tmp_path / f"ck{i}")
        path = os.path.join(sub, fname)
        os.truncate(path, os.path.getsize(path) - 100)
        with pytest.raises(CorruptionError):
            opt.load_checkpoint(tmp_path / f"ck{i}")
        assert same(snapshot(opt), before)
    opt.close()


def test_a_store_failing_during_the_import_leaves_the_optimizer_unusable_saying_so(tmp_path, saved, monkeypatch):
    """The records are sound but the optimizer's own store fails while they are written into it: the
    sub-groups already written cannot be put back, so every later use is refused until a load succeeds."""
    root, last = saved
    m, opt = build(tmp_path / "run")
    train(m, opt, batches(2))
    real, calls = opt.store.put, []

    def put(key, value, **kw):  # an injected fault: the third write of the import fails (a full disk)
        calls.append(key)
        if len(calls) == 3:
            raise TierstoreIOError(errno.ENOSPC, "write failed: No space left on device", "/x/extents-0000.bin",
                                   0, 4096)
        return real(key, value, **kw)
    monkeypatch.setattr(opt.store, "put", put)
    with pytest.raises(TierstoreIOError) as ei:
        opt.load_checkpoint(root)
    monkeypatch.undo()
    msg = str(ei.value)
    assert ei.value.errno == errno.ENOSPC and "unusable" in msg and "load_checkpoint" in msg, msg
    x, y = batches(1)[0]
    for what, call in [("step", opt.step), ("save_checkpoint", lambda: opt.save_checkpoint(tmp_path / "other")),
                       ("state_dict", opt.state_dict), ("full_state_dict", opt.full_state_dict)]:
        with pytest.raises(MisuseError, match="unusable after a failed load_checkpoint") as e2:
            loss_fn(m, x, y).backward() if what == "step" else None
            call()
        assert what in str(e2.value)
    assert not os.path.exists(tmp_path / "other")
    opt.zero_grad()
    opt.load_checkpoint(root)  # a load that succeeds makes it whole again
    want = consolidate(root)
    got = opt.full_state_dict()
    assert all(torch.equal(got[k], want[k].to(got[k].dtype)) for k in want) and opt.steps == 4
    train(m, opt, batches(1))
    opt.close()


def _one_rank_damaged(rank, world, root):
    """Rank 0's record of its last sub-group is damaged; rank 1 reads none of rank 0's file (its shards of
    this small model hold no element: it imports only the hyperparameters and `steps`)."""
    from pathlib import Path

    import torch.distributed as dist
    data = batches(4, seed=rank)
    m, opt = build(Path(root) / f"run{rank}")
    train(m, opt, data[:2])
    opt.save_checkpoint(os.path.join(root, "ck"))
    train(m, opt, data[2:])
    if rank == 0:
        _damage(os.path.join(root, "ck"), opt.layout.trainable_gids()[-1], "master")
    dist.barrier()
    before = snapshot(opt)
    try:
        opt.load_checkpoint(os.path.join(root, "ck"))
        err = None
    except Exception as e:
        err = (type(e).__name__, str(e))
    out = {"err": err, "unchanged": same(snapshot(opt), before), "steps": opt.steps}
    opt.close()
    return out


def test_a_record_damaged_on_one_rank_fails_every_rank_before_any_imports(tmp_path):
    """Not rank 1 loading the checkpoint's `steps` and hyperparameters while rank 0 fails, the ranks then
    holding different states of one run."""
    from tests.support import run_ranks
    res = run_ranks(_one_rank_damaged, 2, str(tmp_path))
    assert res[0]["err"][0] == "CorruptionError" and "optimizer is unchanged" in res[0]["err"][1], res[0]
    assert res[1]["err"][0] == "CorruptionError" and "on rank 0" in res[1]["err"][1], res[1]
    assert "unchanged" in res[1]["err"][1], res[1]
    assert res[0]["unchanged"] and res[1]["unchanged"] and res[0]["steps"] == res[1]["steps"] == 4
