"""save_checkpoint(..., client_state=...): the caller's state (an LR scheduler, every RNG, a data position) is
committed with the checkpoint and returned by load_checkpoint, so a killed run resumes bit for bit; refused
types, damage and checkpoints without it. The SIGKILL campaign (tests/reliability/test_checkpoint_kill.py)
checks a kill during a save leaves the previous checkpoint's client state with it."""
from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch
import torch.nn as nn

from tests.support import cfg
from tierstore.errors import CorruptionError, TierstoreValueError
from tierstore.zero import Zero3Optimizer, rng_state, set_rng_state

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DATA = torch.Generator().manual_seed(7)
X, Y = torch.randn(64, 16, generator=DATA), torch.randn(64, 4, generator=DATA)


class DropNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(16, 64), nn.Dropout(0.2), nn.Linear(64, 4)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def build(tmp_path, name):
    torch.manual_seed(0)
    m = DropNet()
    opt = Zero3Optimizer(m, torch.optim.AdamW, lr=1e-2, weight_decay=0.1,
                         config=cfg(tmp_path / name, "nvme", "nvme", "host", sub_group_bytes=4096))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))  # warmup
    return m, opt, sched


def train_step(m, opt, sched, pos):
    """One step on the batch at data position `pos`: python's RNG picks the rows, numpy's adds noise,
    torch's drives dropout."""
    rows = random.sample(range(64), 8)
    noise = torch.from_numpy(np.random.normal(scale=0.01, size=(8, 16)).astype(np.float32))
    loss = ((m(X[rows] + noise) - Y[rows]) ** 2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    sched.step()
    return loss.item(), pos + 1


def seed_all(s):
    torch.manual_seed(s)
    random.seed(s)
    np.random.seed(s)


def test_killed_and_resumed_run_equals_the_uninterrupted_one_bit_for_bit(tmp_path):
    steps, save_at = 10, 4
    m, opt, sched = build(tmp_path, "a")
    seed_all(1)
    losses, pos = [], 0
    try:
        for _ in range(steps):
            loss, pos = train_step(m, opt, sched, pos)
            losses.append(loss)
            if pos == save_at:
                opt.save_checkpoint(tmp_path / "ck", client_state={
                    "scheduler": sched.state_dict(), "rng": rng_state(), "data_position": pos})
        want = opt.full_state_dict()
    finally:
        opt.close()
    # a new process would start from other RNG states and a fresh scheduler: so does this
    m, opt, sched = build(tmp_path, "b")
    seed_all(12345)
    try:
        client = opt.load_checkpoint(tmp_path / "ck")
        sched.load_state_dict(client["scheduler"])
        set_rng_state(client["rng"])
        pos = client["data_position"]
        assert pos == save_at and opt.param_groups[0]["lr"] == pytest.approx(1e-2)  # warmup over, not restarted
        resumed = []
        while pos < steps:
            loss, pos = train_step(m, opt, sched, pos)
            resumed.append(loss)
        assert resumed == losses[save_at:]  # bit for bit
        got = opt.full_state_dict()
        assert all(torch.equal(got[k], want[k]) for k in want)
    finally:
        opt.close()


class Odd:
    pass


def test_client_state_types_refused_before_anything_commits(tmp_path):
    m, opt, _sched = build(tmp_path, "a")
    try:
        opt.save_checkpoint(tmp_path / "ck", client_state={"epoch": 1, "t": torch.arange(3)})
        numpy_rng = r"client_state\['rng'\]\[1\] is a numpy.ndarray.*rng_state"
        for bad, match in ((Odd(), "client_state is a .*Odd"), ({"rng": np.random.get_state()}, numpy_rng)):
            with pytest.raises(TierstoreValueError, match=match):
                opt.save_checkpoint(tmp_path / "ck", client_state=bad)
        got = opt.load_checkpoint(tmp_path / "ck")
        assert got["epoch"] == 1 and torch.equal(got["t"], torch.arange(3))  # the previous one, intact
        assert len([d for d in os.listdir(tmp_path / "ck") if d.startswith("ckpt-")]) == 1
        opt.save_checkpoint(tmp_path / "ck2")
        assert opt.load_checkpoint(tmp_path / "ck2") is None  # none given: None
    finally:
        opt.close()


def test_damaged_client_state_is_refused(tmp_path):
    m, opt, _sched = build(tmp_path, "a")
    try:
        sub = opt.save_checkpoint(tmp_path / "ck", client_state={"t": torch.arange(1000)})
        path = os.path.join(sub, "rank00000.bin")
        with open(path, "rb") as f:
            raw = f.read()
        # the index is JSON before the 24-byte footer: find the record and flip a byte inside it
        import struct
        at, n, _crc, _m = struct.unpack("<QQI4s", raw[-24:])
        rec = json.loads(raw[at:at + n])["records"]["client.0"]
        with open(path, "r+b") as f:
            f.seek(rec["offset"] + 100)
            f.write(bytes([raw[rec["offset"] + 100] ^ 0xFF]))
        with pytest.raises(CorruptionError, match="client.0.*crc32c"):
            opt.load_checkpoint(tmp_path / "ck")
    finally:
        opt.close()
