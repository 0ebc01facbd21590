"""save_checkpoint on a full or failing disk: a TierstoreIOError naming the file (and the rank) on every rank,
the new checkpoint directory removed, `latest` and the previous checkpoint intact and loadable -- at world
size 1 with injected faults and on a really full loop-mounted ext4 (root only), and at world size 2 (gloo)
with one rank failing while the other must not hang."""
from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from tests.support.dist import run_ranks
from tests.support.models import batches, loss_fn, make_pair
from tests.support.zero import cfg
from tierstore.errors import TierstoreError, TierstoreIOError  # noqa: E402
from tierstore.zero import Zero3Optimizer, consolidate
from tierstore.zero.checkpoint import meta as ckpt_meta  # noqa: E402
from tierstore.zero.checkpoint import records as ckpt_records
from tierstore.zero.checkpoint.directory import LOCK  # noqa: E402


def train(m, opt, data):
    for x, y in data:
        loss_fn(m, x, y).backward()
        opt.step()
        opt.zero_grad()


def first_saved(tmp_path, root):
    """An optimizer trained 3 steps with one good checkpoint in `root`, then 2 more steps."""
    data = batches(5)
    _, m = make_pair()
    opt = Zero3Optimizer(m, torch.optim.AdamW, config=cfg(tmp_path / "run", "host", "nvme", "host"), lr=1e-2)
    train(m, opt, data[:3])
    good = opt.save_checkpoint(root)
    saved = opt.full_state_dict()
    train(m, opt, data[3:])
    return opt, good, saved


def check_previous_stands(tmp_path, root, good, saved):
    # nothing new left behind (but the lock file of the directory's writer)
    assert sorted(os.listdir(root)) == sorted([os.path.basename(good), "latest", LOCK])
    with open(os.path.join(root, "latest")) as f:
        assert f.read() == os.path.basename(good)
    full = consolidate(root)
    assert all(torch.equal(full[k], saved[k]) for k in saved)
    _, m2 = make_pair(seed=3)
    opt2 = Zero3Optimizer(m2, torch.optim.AdamW, config=cfg(tmp_path / "load", "host", "host", "host"), lr=1e-2)
    opt2.load_checkpoint(root)
    assert opt2.steps == 3
    got = opt2.full_state_dict()
    assert all(torch.equal(got[k], saved[k]) for k in saved)
    opt2.close()


def _fail_writes_after(monkeypatch, nbytes: int, code: int = errno.ENOSPC, only: str = ".bin.tmp"):
    """Record-file writes to files ending in `only` raise `code` once `nbytes` have been written to one."""
    # the writer's one write call, patched: no public hook makes a write fail part-way through a file
    real = ckpt_records.RecordWriter._write

    def write(self, mv):
        if self.tmp.endswith(only) and self.at + len(mv) > nbytes:
            raise OSError(code, os.strerror(code))
        return real(self, mv)
    monkeypatch.setattr(ckpt_records.RecordWriter, "_write", write)


@pytest.mark.parametrize("code,want", [(errno.ENOSPC, "free space"), (errno.EIO, "dmesg")])
def test_rank_file_write_fails(tmp_path, monkeypatch, code, want):
    """Not a bare OSError, and no partial ckpt-* directory left behind."""
    root = tmp_path / "ck"
    opt, good, saved = first_saved(tmp_path, root)
    _fail_writes_after(monkeypatch, 4096, code, "rank00000.bin.tmp")
    with pytest.raises(TierstoreIOError) as ei:
        opt.save_checkpoint(root)
    monkeypatch.undo()
    msg = str(ei.value)
    assert ei.value.errno == code and "rank00000.bin" in ei.value.filename and want in msg
    assert (code == errno.ENOSPC) == ("free space" in msg)
    check_previous_stands(tmp_path, root, good, saved)
    opt.save_checkpoint(root)  # space again: the same call works
    opt.close()


@pytest.mark.parametrize("step", ["buffers", "meta"])
def test_rank0_files_fail(tmp_path, monkeypatch, step):
    root = tmp_path / "ck"
    opt, good, saved = first_saved(tmp_path, root)
    if step == "buffers":
        _fail_writes_after(monkeypatch, 0, only="buffers.bin.tmp")
    else:
        real = ckpt_meta.write_atomic

        def write_atomic(path, data):
            if path.endswith("meta.json"):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(path, data)
        monkeypatch.setattr(ckpt_meta, "write_atomic", write_atomic)
    with pytest.raises(TierstoreIOError, match="free space") as ei:
        opt.save_checkpoint(root)
    monkeypatch.undo()
    want = "buffers.bin" if step == "buffers" else "meta.json"
    assert ei.value.errno == errno.ENOSPC and ei.value.filename.endswith(want)
    check_previous_stands(tmp_path, root, good, saved)
    opt.close()


def test_latest_renamed_but_not_durable_keeps_both(tmp_path, monkeypatch):
    """`latest` replaced, then the directory fsync fails: a crash may leave either name, so neither
    checkpoint is deleted, and the error says so."""
    root = tmp_path / "ck"
    opt, good, saved = first_saved(tmp_path, root)
    real = ckpt_meta.fsync_dir  # what write_atomic calls after the rename of `latest`

    def fsync_dir(path):
        if os.path.exists(os.path.join(path, "latest")) and os.path.abspath(path) == str(root):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(path)
    monkeypatch.setattr(ckpt_meta, "fsync_dir", fsync_dir)
    with pytest.raises(TierstoreIOError, match="both are kept") as ei:
        opt.save_checkpoint(root, keep=0)
    monkeypatch.undo()
    assert ei.value.errno == errno.EIO and "free space" not in str(ei.value)
    names = sorted(d for d in os.listdir(root) if d.startswith("ckpt-"))
    assert len(names) == 2 and os.path.basename(good) in names and not os.path.exists(root / "latest.tmp")
    with open(root / "latest") as f:
        latest = f.read()
    assert latest in names and latest != os.path.basename(good)
    full = consolidate(root)  # the new one, complete
    assert all(torch.equal(full[k], v) for k, v in opt.full_state_dict().items() if k in full)
    opt.close()


def test_full_real_disk(tmp_path, ext4):  # noqa: F811
    root = os.path.join(ext4.mnt, "ck")
    opt, good, saved = first_saved(tmp_path, root)
    filler = ext4.fill()
    with pytest.raises(TierstoreIOError, match="free space") as ei:
        opt.save_checkpoint(root)
    assert ei.value.errno == errno.ENOSPC and ei.value.filename.startswith(root)
    check_previous_stands(tmp_path, root, good, saved)
    os.unlink(filler)
    opt.save_checkpoint(root)
    opt.close()


# -- world size 2: one rank fails, both raise, neither hangs ---------------------------------------------

def _rank1_fails(rank, world, root):
    import torch.distributed as dist
    out = {}
    _, m = make_pair()
    opt = Zero3Optimizer(m, torch.optim.AdamW, config=cfg(Path(root) / f"r{rank}", "host", "nvme", "host"), lr=1e-2)
    train(m, opt, batches(2))
    ck = os.path.join(root, "ck")
    good = opt.save_checkpoint(ck)
    train(m, opt, batches(1, seed=5))
    if rank == 1:
        real = ckpt_records.RecordWriter._write  # as in _fail_writes_after: no public hook fails a write

        def write(self, mv):
            if self.at + len(mv) > 4096:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(self, mv)
        ckpt_records.RecordWriter._write = write
    try:
        opt.save_checkpoint(ck)
        out["raised"] = None
    except TierstoreError as e:
        out["raised"] = (type(e).__name__, getattr(e, "errno", None), str(e))
    dist.barrier()
    out["left"] = sorted(os.listdir(ck))
    out["good"] = os.path.basename(good)
    opt.close()
    return out


def test_one_rank_fails_every_rank_raises(tmp_path):
    results = run_ranks(_rank1_fails, 2, str(tmp_path))
    for r, res in enumerate(results):
        kind, code, msg = res["raised"]
        assert kind == "TierstoreIOError" and code == errno.ENOSPC and "rank00001.bin" in msg, (r, msg)
        assert ("this rank" if r == 1 else "rank 1") in msg
        assert res["left"] == sorted([res["good"], "latest", LOCK])
