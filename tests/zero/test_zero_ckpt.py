"""Zero3Optimizer checkpoints at world size 1: exact resume (also on other tiers), consolidate, corruption
detection, and kill -9 during save_checkpoint leaving the previous checkpoint loadable. Resharding across
world sizes is tested in test_zero_dist.py."""
from __future__ import annotations

import os
import random
import signal
import time

import pytest
import torch

from tests.support import (
    Deep,
    Net,
    batches,
    cfg,
    flip_byte,
    loss_fn,
    make_pair,
    peak_growth,
    rss_follows_live_memory,
    run_isolated,
)
from tests.support.dist import context
from tierstore.errors import CorruptionError, TierstoreValueError
from tierstore.zero import Zero3Optimizer, consolidate


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


class Late(torch.nn.Module):
    """A module unused for the first steps (`late`), placed first or last in the layout."""

    def __init__(self, late_first: bool):
        super().__init__()
        if late_first:
            self.late = torch.nn.Linear(16, 16)
        self.fc1 = torch.nn.Linear(16, 32)
        self.head = torch.nn.Linear(32, 4)
        if not late_first:
            self.late = torch.nn.Linear(4, 4)
        self.first = late_first
        self.use_late = False

    def forward(self, x):
        if self.use_late and self.first:
            x = self.late(x)
        y = self.head(torch.tanh(self.fc1(x)))
        return self.late(y) if self.use_late and not self.first else y


@pytest.mark.parametrize("late_first", [True, False])
def test_resume_after_sub_groups_were_skipped(tmp_path, late_first):
    """Sub-groups whose parameters got no gradient yet have no states, others their own step counts: a
    checkpoint taken then resumes exactly, and loads onto another sub-group layout."""
    def run(m, opt, data, start):
        for i, (x, y) in enumerate(data):
            m.use_late = start + i >= 3
            loss_fn(m, x, y).backward()
            opt.step()
            opt.zero_grad()
    data = batches(6)
    kw = dict(lr=1e-2, weight_decay=0.1)
    results = {}
    for name in ("straight", "resumed", "relaid"):
        torch.manual_seed(0)
        m = Late(late_first)
        c = cfg(tmp_path / name, min_io_bytes=0)
        opt = Zero3Optimizer(m, torch.optim.AdamW, config=c, **kw)
        if name == "straight":
            run(m, opt, data, 0)
        else:
            if name == "resumed":
                run(m, opt, data[:3], 0)
                opt.save_checkpoint(tmp_path / "ck")
                opt.close()
                torch.manual_seed(0)
                m = Late(late_first)
            else:  # another layout: every parameter in one sub-group
                opt.close()
                torch.manual_seed(0)
                m = Late(late_first)
                c = cfg(tmp_path / "relaid2", min_io_bytes=1 << 20, sub_group_bytes=1 << 20)
            opt = Zero3Optimizer(m, torch.optim.AdamW, config=c, **kw)
            opt.load_checkpoint(tmp_path / "ck")
            run(m, opt, data[3:], 3)
        results[name] = opt.full_state_dict()
        opt.close()
    for n, v in results["straight"].items():
        assert torch.equal(results["resumed"][n], v), n
        # one sub-group takes the step count of the first stepped source: close, not equal
        assert torch.allclose(results["relaid"][n], v, rtol=0, atol=0.02), n


def test_corruption_and_missing_checkpoint_are_reported(tmp_path):
    _, m = make_pair()
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-2, config=cfg(tmp_path / "a"))
    with pytest.raises(TierstoreValueError, match="no checkpoint"):
        opt.load_checkpoint(tmp_path / "nothing")
    train(m, opt, batches(2))
    ck = opt.save_checkpoint(tmp_path / "ckpt")
    path = os.path.join(ck, "rank00000.bin")
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
    (root / "started.tmp").write_text(str(opt.steps))
    os.replace(root / "started.tmp", root / "started")  # whole: the parent reads it as soon as it exists
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
    ctx = context()  # torch and the optimizer preloaded once in a fork server: each child starts at once
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
        opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-3,
                             config=cfg(tmp_path / "check", "host", "host", "host", sub_group_bytes=1 << 20))
        opt.load_checkpoint(tmp_path / "ckpt")
        got = opt.full_state_dict()
        steps = opt.steps
        opt.close()
        assert steps >= 1
        torch.manual_seed(0)
        _, r = make_pair(h=512)
        ropt = Zero3Optimizer(r, torch.optim.AdamW, lr=1e-3,
                              config=cfg(tmp_path / "ref", "host", "host", "host", sub_group_bytes=1 << 20))
        train(r, ropt, batches(400, seed=11)[:steps])
        want = ropt.full_state_dict()
        ropt.close()
        assert all(torch.equal(got[k], want[k]) for k in want), f"checkpoint at step {steps} differs"
        seen.append(steps)
        leftovers = [d for d in os.listdir(tmp_path / "ckpt") if d.startswith("ckpt-")]
        assert len(leftovers) <= 3  # the current one, the kept one, at most one interrupted save


def test_damaged_record_index_or_size_is_reported_with_file_and_offset(tmp_path):
    from tierstore.zero.checkpoint import read_meta
    from tierstore.zero.checkpoint.records import RecordFile  # the reader: finds the byte to damage
    _, m = make_pair()
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-2, config=cfg(tmp_path / "a"))
    train(m, opt, batches(2))
    gid = opt.layout.trainable_gids()[-1]
    cks = [opt.save_checkpoint(tmp_path / f"ck{i}") for i in range(3)]
    # a byte inside one state record: that record's crc32c fails; the error names file, record and offset
    path = os.path.join(cks[0], "rank00000.bin")
    rec = RecordFile(path, read_meta(tmp_path / "ck0")[1]["files"]["rank00000.bin"])
    r = rec.records[f"{gid}.state.exp_avg"]
    rec.close()
    flip_byte(path, r["offset"] + r["nbytes"] // 2)
    with pytest.raises(CorruptionError) as e:
        opt.load_checkpoint(tmp_path / "ck0")
    msg = str(e.value)
    assert f"'{gid}.state.exp_avg' fails its crc32c" in msg and path in msg, msg
    assert f"offset {r['offset']}" in msg and f"length {r['nbytes']}" in msg, msg
    assert e.value.filename == path and e.value.offset == r["offset"]
    # a byte of the index (just before the 24-byte footer): refused before any record is used
    path = os.path.join(cks[1], "rank00000.bin")
    flip_byte(path, os.path.getsize(path) - 24 - 10)
    with pytest.raises(CorruptionError, match="index fails its crc32c"):
        opt.load_checkpoint(tmp_path / "ck1")
    # a truncated file
    path = os.path.join(cks[2], "rank00000.bin")
    os.truncate(path, os.path.getsize(path) - 100)
    with pytest.raises(CorruptionError, match="bytes; meta.json says"):
        consolidate(tmp_path / "ck2")
    opt.close()


def test_unknown_versions_are_refused_naming_them(tmp_path):
    """Version 1 (pickles) is refused too: see tests/zero/test_ckpt_security.py."""
    import json

    from tierstore.zero import checkpoint as ckpt
    from tierstore.zero.checkpoint.meta import body_crc
    _, m = make_pair()
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-2, config=cfg(tmp_path / "a", "host", "nvme", "host"))
    train(m, opt, batches(2))
    sub = opt.save_checkpoint(tmp_path / "ck")
    opt.close()
    doc = json.load(open(os.path.join(sub, "meta.json")))
    doc["version"] = doc["body"]["version"] = 7
    doc["crc32c"] = body_crc(doc["body"])
    open(os.path.join(sub, "meta.json"), "w").write(json.dumps(doc))
    with pytest.raises(TierstoreValueError, match="format version 7; this tierstore reads versions 2, 3"):
        consolidate(tmp_path / "ck")
    assert ckpt.VERSION == 3


def _measure_save_load(root: str) -> dict:
    """In a fresh process: peak RSS growth during save_checkpoint and load_checkpoint of a 17 sub-group model
    whose states live on nvme (so the shard is not already in memory)."""
    import pathlib
    rss_follows_live_memory()
    root = pathlib.Path(root)
    kw = dict(sub_group_bytes=1 << 20, min_io_bytes=256 << 10)
    torch.manual_seed(0)
    m = Deep(layers=16, width=512)
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-3, config=cfg(root / "a", "host", "nvme", "nvme", **kw))
    x = torch.randn(4, 512)
    m(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    opt.save_checkpoint(root / "warm")  # one-time costs (first file writes, lazy imports) are not measured
    saved, _ = peak_growth(lambda: opt.save_checkpoint(root / "ckpt"))
    gids = opt.layout.trainable_gids()
    sub = max(opt.layout.shard_numel(g) for g in gids) * 4 * 3  # bytes: master + exp_avg + exp_avg_sq
    shard = sum(opt.layout.shard_numel(g) for g in gids) * 4 * 3  # bytes
    want = opt.full_state_dict()
    opt.close()
    torch.manual_seed(1)
    m2 = Deep(layers=16, width=512)
    opt2 = Zero3Optimizer(m2, torch.optim.AdamW, lr=1e-3, config=cfg(root / "b", "device", "nvme", "nvme", **kw))
    opt2.load_checkpoint(root / "warm")
    loaded, _ = peak_growth(lambda: opt2.load_checkpoint(root / "ckpt"))
    got = opt2.full_state_dict()
    opt2.close()
    return {"saved": saved, "loaded": loaded, "sub": sub, "shard": shard, "subgroups": len(gids),
            "equal": all(torch.equal(got[k], want[k]) for k in want)}


def test_save_and_load_stream_one_sub_group_at_a_time(tmp_path):
    r = run_isolated(_measure_save_load, str(tmp_path), timeout=120)  # torch threads: 1, as in _child
    mib = 2 ** 20
    print(f"{r['subgroups']} sub-groups of <= {r['sub'] / mib:.1f} MiB (master + 2 states), shard "
          f"{r['shard'] / mib:.1f} MiB: peak RSS +{r['saved'] / mib:.1f} MiB during save, +{r['loaded'] / mib:.1f} "
          f"MiB during load")
    assert r["equal"]
    assert r["shard"] >= 15 * r["sub"]  # the shard is many sub-groups: the bounds below mean something
    assert r["saved"] <= 2 * r["sub"], r["saved"]  # about one sub-group, not the shard
    assert r["loaded"] <= 3 * r["sub"], r["loaded"]  # one source + one destination sub-group (+ staging)


def test_frozen_and_trained_parameters_load_under_another_compute_dtype(tmp_path):
    """Saved with bf16 compute, loaded with fp32 compute: both reshard over fp32 twins (the plans' dtypes
    differ), frozen parameters (stored in the compute dtype) included."""
    _, m = make_pair()
    m.fc1.weight.requires_grad_(False)
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-2, config=cfg(tmp_path / "a", compute_dtype=torch.bfloat16))
    train(m, opt, [(x.bfloat16(), y.bfloat16()) for x, y in batches(3)])
    opt.save_checkpoint(tmp_path / "ck")
    saved = opt.full_state_dict()
    opt.close()
    _, m2 = make_pair(seed=3)
    m2.fc1.weight.requires_grad_(False)
    opt2 = Zero3Optimizer(m2, torch.optim.AdamW, lr=1e-2, config=cfg(tmp_path / "b", min_io_bytes=4096))
    opt2.load_checkpoint(tmp_path / "ck")
    got = opt2.full_state_dict()
    assert got["fc1.weight"].dtype == torch.float32 and torch.equal(got["fc1.weight"], saved["fc1.weight"].float())
    full = consolidate(tmp_path / "ck", dtype=torch.float32)  # the fp32 masters of the bf16 run
    assert all(torch.equal(got[k], full[k]) for k in got)
    opt2.close()
