"""Zero3Optimizer checkpoints at world size 1: exact resume (also on other tiers), consolidate, corruption
detection, and kill -9 during save_checkpoint leaving the previous checkpoint loadable. Resharding across
world sizes is tested in test_zero_dist.py."""
from __future__ import annotations

import os
import random
import signal
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from test_zero import Net, batches, cfg, loss_fn, make_pair  # noqa: E402

from tierstore.errors import CorruptionError, TierstoreValueError  # noqa: E402
from tierstore.zero import Zero3Optimizer, consolidate  # noqa: E402


def train(m, opt, data):
    for x, y in data:
        loss_fn(m, x, y).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("opt_cls,kw", [(torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
                                        (torch.optim.SGD, dict(lr=1e-2, momentum=0.9))])
def test_resume_is_exact_and_tiers_may_change(tmp_path, opt_cls, kw):
    data = batches(20)
    _, m = make_pair()
    opt = Zero3Optimizer(m, opt_cls, config=cfg(tmp_path / "a", "host", "nvme", "host"), **kw)
    train(m, opt, data[:10])
    ck = opt.save_checkpoint(tmp_path / "ckpt")
    assert os.path.basename(ck).startswith("ckpt-00000010")
    saved = opt.full_state_dict()
    train(m, opt, data[10:])
    want = opt.full_state_dict()
    opt.close()
    full = consolidate(tmp_path / "ckpt")
    assert set(full) == set(Net().state_dict()) and all(torch.equal(full[k], saved[k]) for k in saved)
    for tiers in (("nvme", "host", "nvme"), ("device", "device", "device")):
        _, m2 = make_pair(seed=3)
        opt2 = Zero3Optimizer(m2, opt_cls, config=cfg(tmp_path / "-".join(tiers), *tiers), **{**kw, "lr": 5.0})
        opt2.load_checkpoint(tmp_path / "ckpt")
        assert opt2.param_groups[0]["lr"] == kw["lr"] and opt2.steps == 10
        train(m2, opt2, data[10:])
        got = opt2.full_state_dict()
        assert all(torch.equal(got[k], want[k]) for k in want), tiers
        opt2.close()


def test_corruption_and_missing_checkpoint_are_reported(tmp_path):
    _, m = make_pair()
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-2, config=cfg(tmp_path / "a"))
    with pytest.raises(TierstoreValueError, match="no checkpoint"):
        opt.load_checkpoint(tmp_path / "nothing")
    train(m, opt, batches(2))
    ck = opt.save_checkpoint(tmp_path / "ckpt")
    path = os.path.join(ck, "rank00000.pt")
    raw = bytearray(open(path, "rb").read())
    raw[len(raw) // 2] ^= 0x40
    open(path, "wb").write(bytes(raw))
    with pytest.raises(CorruptionError, match="crc32c"):
        opt.load_checkpoint(tmp_path / "ckpt")
    meta = os.path.join(ck, "meta.json")
    text = open(meta).read().replace('"steps": 2', '"steps": 3')
    open(meta, "w").write(text)
    with pytest.raises(CorruptionError, match="metadata"):
        consolidate(tmp_path / "ckpt")
    opt.close()


def test_previous_checkpoints_are_pruned_after_the_new_one_is_complete(tmp_path):
    _, m = make_pair()
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-2, config=cfg(tmp_path / "a"))
    for _ in range(3):
        train(m, opt, batches(1))
        opt.save_checkpoint(tmp_path / "ckpt", keep=1)
    dirs = sorted(d for d in os.listdir(tmp_path / "ckpt") if d.startswith("ckpt-"))
    assert [d[:13] for d in dirs] == ["ckpt-00000002", "ckpt-00000003"]
    assert open(tmp_path / "ckpt" / "latest").read().startswith("ckpt-00000003")
    opt.close()


def _child(root: str) -> None:
    """Train and checkpoint after every step until killed."""
    import pathlib
    root = pathlib.Path(root)
    torch.set_num_threads(1)
    _, m = make_pair(h=512)
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-3, config=cfg(root / "work", "host", "nvme", "host",
                                                                   sub_group_bytes=1 << 20, min_io_bytes=1 << 18))
    if (root / "ckpt" / "latest").exists():
        opt.load_checkpoint(root / "ckpt")
    (root / "started").write_text(str(opt.steps))
    for x, y in batches(400, seed=11)[opt.steps:]:
        loss_fn(m, x, y).backward()
        opt.step()
        opt.zero_grad()
        opt.save_checkpoint(root / "ckpt")


def _latest_step(d) -> int:
    try:
        return int(open(os.path.join(d, "latest")).read().split("-")[1])
    except (OSError, IndexError, ValueError):
        return -1


def test_kill_9_during_save_leaves_a_loadable_checkpoint(tmp_path):
    import multiprocessing as mp
    ctx = mp.get_context("forkserver")  # torch and the optimizer preloaded once: each child starts at once
    ctx.set_forkserver_preload(["torch", "torch._dynamo", "tierstore.zero", "test_zero"])
    rng = random.Random(1234)
    seen = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the child: the recomputed run must do the same float operations
    try:
        _kill_rounds(tmp_path, ctx, rng, seen)
    finally:
        torch.set_num_threads(threads)
    print("killed at steps", seen)
    assert seen == sorted(seen)


def _kill_rounds(tmp_path, ctx, rng, seen):
    for _round in range(3):
        marker = tmp_path / "started"
        if marker.exists():
            marker.unlink()
        p = ctx.Process(target=_child, args=(str(tmp_path),), daemon=True)
        p.start()
        try:
            deadline = time.monotonic() + 60
            while not marker.exists() and p.is_alive() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert marker.exists(), f"child did not start (exit code {p.exitcode})"
            start = int(marker.read_text())
            while _latest_step(tmp_path / "ckpt") <= start and time.monotonic() < deadline:
                time.sleep(0.01)  # this round's first save completed: the child now loops step + save
            time.sleep(rng.uniform(0.05, 0.5))
        finally:
            os.kill(p.pid, signal.SIGKILL)
            p.join(30)
        # the parent loads whatever `latest` names and checks it against a recomputed run
        _, m = make_pair(h=512)
        opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-3, config=cfg(tmp_path / "check", "host", "host", "host", sub_group_bytes=1 << 20))
        opt.load_checkpoint(tmp_path / "ckpt")
        got = opt.full_state_dict()
        steps = opt.steps
        opt.close()
        assert steps >= 1
        torch.manual_seed(0)
        _, r = make_pair(h=512)
        ropt = Zero3Optimizer(r, torch.optim.AdamW, lr=1e-3, config=cfg(tmp_path / "ref", "host", "host", "host", sub_group_bytes=1 << 20))
        train(r, ropt, batches(400, seed=11)[:steps])
        want = ropt.full_state_dict()
        ropt.close()
        assert all(torch.equal(got[k], want[k]) for k in want), f"checkpoint at step {steps} differs"
        seen.append(steps)
        leftovers = [d for d in os.listdir(tmp_path / "ckpt") if d.startswith("ckpt-")]
        assert len(leftovers) <= 3  # the current one, the kept one, at most one interrupted save
