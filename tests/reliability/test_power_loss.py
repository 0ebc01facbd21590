"""Power-loss campaign: a child flushes random changes in a loop to a store on a loop-mounted ext4 (and xfs
where mkfs.xfs exists) image; the parent stops it, shuts the filesystem down with FS_IOC_SHUTDOWN and
NOLOGFLUSH (xfstests' godown: what was not yet durable is lost, as in a power cut), kills it, unmounts and
remounts (the journal replays), reopens the store and finds exactly the last flush whose flush() returned
before the shutdown, or the one in progress. See docs/reliability.md."""
from __future__ import annotations

import os
import signal
import time

import torch

from tierstore.store import Store

from . import _children
from ._common import check_reopen, seeds, trial, trials

NOLOGFLUSH = 2  # EXT4_GOING_FLAGS_NOLOGFLUSH / XFS_FSOP_GOING_FLAGS_NOLOGFLUSH


def test_power_loss_mid_flush(tmp_path, power_fs, forkserver):
    fs = power_fs
    campaign = f"power loss ({fs.fstype})"
    d = os.path.join(fs.mnt, "store")
    oracle, log = str(tmp_path / "oracle"), str(tmp_path / "log")  # on the real disk: they survive the shutdown
    os.makedirs(oracle)
    prev = 0  # the generation the store holds (checked)
    for seed in seeds(campaign, trials(3, 50)):
        with trial(campaign, seed) as rng:
            open(log, "w").close()
            p = forkserver.Process(target=_children.store_child,
                                   args=(d, oracle, log, seed, rng.choice([0, 2 << 20]), ("tiny", "tiny", "mid", "big"),
                                         2))
            p.start()
            time.sleep(rng.uniform(0.1, 0.8))
            # stopped first, so every flush the log names returned before the shutdown; at most one was in progress
            os.kill(p.pid, signal.SIGSTOP)
            with open(log) as f:
                logged = [int(x) for x in f.read().split()]
            fs.shutdown(NOLOGFLUSH)
            os.kill(p.pid, signal.SIGKILL)
            p.join(60)
            assert p.exitcode == -signal.SIGKILL, "the child died on its own: see its traceback above"
            fs.umount()
            fs.mount()
            prev = check_reopen(d, oracle, logged, prev, campaign, "shut down")
    if prev:  # usable afterwards
        with Store.open(d, lock_memory=False) as s:
            s.put("after", torch.arange(10))
        with Store.open(d, lock_memory=False) as s:
            assert torch.equal(s.get("after"), torch.arange(10))
            s.close(flush=False)
