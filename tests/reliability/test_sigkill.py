"""SIGKILL campaign: a child process does random put / update / delete / flush (tiny packed tensors, ~600 KiB
ones, multi-MiB streamed ones; raw and numcodecs-compressed; host_budget 0 and > 0) and is SIGKILLed at a
random moment; the parent reopens the store and finds exactly the last completed flush (or the one that
completed as the child died), bit for bit, and the store usable. Each trial kills several children in turn
on the same store. See docs/reliability.md."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from tierstore.store import Store

from . import _children
from ._common import check_reopen, check_store, read_json, seeds, trial, trials

ROUNDS = 3  # children killed per trial, each continuing the store the previous one left


def read_log(path: str) -> list[int]:
    with open(path) as f:
        return [int(x) for x in f.read().split()]


def kill_rounds(ctx, rng, d: str, oracle: str, log: str, host_budget: int, sizes, campaign: str,
                seed: int) -> int:
    prev = 0  # the generation the store holds (checked) before this round
    for rnd in range(ROUNDS):
        open(log, "w").close()
        p = ctx.Process(target=_children.store_child, args=(d, oracle, log, seed * 100 + rnd, host_budget, sizes))
        p.start()
        time.sleep(rng.uniform(0.05, 0.8))
        os.kill(p.pid, signal.SIGKILL)
        p.join(60)
        assert p.exitcode == -signal.SIGKILL, "the child died on its own: see its traceback above"
        prev = check_reopen(d, oracle, read_log(log), prev, campaign, "killed")
    return prev


@pytest.mark.parametrize("host_budget", [0, 2 << 20], ids=["host0", "host2MiB"])
def test_sigkill_during_random_operations(tmp_path, forkserver, host_budget):
    campaign = f"sigkill ({'host_budget 0' if host_budget == 0 else 'host_budget 2 MiB'})"
    for seed in seeds(campaign, trials(2, 35)):
        with trial(campaign, seed) as rng:
            root = tmp_path / str(seed)
            d, oracle, log = str(root / "store"), str(root / "oracle"), str(root / "log")
            os.makedirs(oracle)
            g = kill_rounds(forkserver, rng, d, oracle, log, host_budget, ("tiny", "tiny", "tiny", "mid", "big"),
                            campaign, seed)
            if g == 0:
                continue
            # usable afterwards: a put and a flush, then a reopen finds it next to what was there
            with Store.open(d, lock_memory=False) as s:
                s.put("after", torch.arange(10))
            want = read_json(os.path.join(oracle, f"{g}.json"))
            with Store.open(d, lock_memory=False) as s:
                assert torch.equal(s.get("after"), torch.arange(10))
                s.delete("after")
                check_store(s, want, "after the rounds")
                s.close(flush=False)
